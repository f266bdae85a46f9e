"""Batched counterpart of ``torch.nn.Linear``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import init

from . import functional as BF
from ._utils import check_input, check_num_models, init_per_model_

__all__ = ["BatchedLinear"]


class BatchedLinear(nn.Module):
    r"""``num_models`` independent :class:`torch.nn.Linear` layers, computed together.

    Model ``m`` computes :math:`y_m = x_m W_m^T + b_m` with one batched matrix multiply for all models.

    Args:
        num_models: number of models ``M``.
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: if ``False``, the layers learn no additive bias. Default: ``True``.

    Shape:
        - Input: ``(M, *, in_features)``, usually ``(M, B, in_features)``. A batch shared by all models
          is passed as ``x.expand(M, *x.shape)`` and is never copied.
        - Output: ``(M, *, out_features)``.

    Attributes:
        weight: ``(M, out_features, in_features)``; each model's slice initialised like
            ``torch.nn.Linear``: :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`, :math:`k = 1/\text{in\_features}`.
        bias: ``(M, out_features)``, same distribution.

    Examples::

        >>> layer = BatchedLinear(8, 20, 30)
        >>> x = torch.randn(8, 128, 20)        # a minibatch per model
        >>> layer(x).shape
        torch.Size([8, 128, 30])
        >>> shared = torch.randn(128, 20)      # one minibatch for all models
        >>> layer(shared.expand(8, 128, 20)).shape
        torch.Size([8, 128, 30])
    """

    __constants__ = ["num_models", "in_features", "out_features"]
    torch_module = nn.Linear
    # In a stacked model, each row is computed on its own: the models' samples may sit on any dimension
    # but the last (batchlayers._fold).
    _rowwise_trailing_dims = 1

    def __init__(
        self,
        num_models: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((num_models, out_features, in_features), **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty((num_models, out_features), **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same as torch.nn.Linear.reset_parameters, one model's slice at a time (fan-in per model).
        init_per_model_(self.weight, lambda w: init.kaiming_uniform_(w, a=math.sqrt(5)))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init_per_model_(self.bias, lambda b: init.uniform_(b, -bound, bound))

    def forward(self, input: Tensor) -> Tensor:
        check_input(self, input, trailing=[("in_features", self.in_features)], layout="(M, *, in_features)")
        return BF.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"num_models={self.num_models}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
