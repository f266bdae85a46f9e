"""Batched counterparts of ``torch.nn.Linear`` and ``torch.nn.Bilinear``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import init

from ._utils import check_input, check_num_models, check_size, init_per_model_, layer_name
from .functional._linear import unchecked_linear

__all__ = ["BatchedBilinear", "BatchedLinear"]


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
    _mixes_picked_rows: str | None = None  # each row computed alone (rows picked by a mask: see batchlayers._fold)

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
        self.in_features = check_size(type(self).__name__, "in_features", in_features)
        self.out_features = check_size(type(self).__name__, "out_features", out_features)
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
        return unchecked_linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"num_models={self.num_models}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


class BatchedBilinear(nn.Module):
    r"""``num_models`` independent :class:`torch.nn.Bilinear` layers, computed together.

    Model ``m`` computes :math:`y_m = x_{1,m}^T A_m x_{2,m} + b_m`. All models run in one batched matrix
    multiply, which contracts the longer of the two inputs with the weight, and one broadcast product summed
    over the other input's features; no loop over models.

    Args:
        num_models: number of models ``M``.
        in1_features: size of each first input sample.
        in2_features: size of each second input sample.
        out_features: size of each output sample.
        bias: if ``False``, the layers learn no additive bias. Default: ``True``.

    Shape:
        - Input1: ``(M, *, in1_features)``, usually ``(M, B, in1_features)``.
        - Input2: ``(M, *, in2_features)``, with the same ``*`` as input1.
        - Either input may be a batch shared by all models, passed as ``x.expand(M, *x.shape)``; it is never
          copied.
        - Output: ``(M, *, out_features)``.

    Attributes:
        weight: ``(M, out_features, in1_features, in2_features)``; each model's slice initialised like
            ``torch.nn.Bilinear``: :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`, :math:`k = 1/\text{in1\_features}`.
        bias: ``(M, out_features)``, same distribution.

    Examples::

        >>> layer = BatchedBilinear(8, 20, 30, 40)
        >>> x1, x2 = torch.randn(8, 128, 20), torch.randn(8, 128, 30)
        >>> layer(x1, x2).shape
        torch.Size([8, 128, 40])
    """

    __constants__ = ["num_models", "in1_features", "in2_features", "out_features"]
    torch_module = nn.Bilinear
    # each row is computed on its own (see BatchedLinear)
    _rowwise_trailing_dims = 1
    _mixes_picked_rows: str | None = None  # each row computed alone (rows picked by a mask: see batchlayers._fold)

    def __init__(
        self,
        num_models: int,
        in1_features: int,
        in2_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        self.in1_features = check_size(type(self).__name__, "in1_features", in1_features)
        self.in2_features = check_size(type(self).__name__, "in2_features", in2_features)
        self.out_features = check_size(type(self).__name__, "out_features", out_features)
        self.weight = nn.Parameter(
            torch.empty((num_models, out_features, in1_features, in2_features), **factory_kwargs)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty((num_models, out_features), **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch.nn.Bilinear's init: U(-1/sqrt(in1_features), 1/sqrt(in1_features)) for weight and bias.
        if self.in1_features <= 0:
            raise ValueError(f"{type(self).__name__}: in1_features must be > 0, got {self.in1_features}")
        bound = 1 / math.sqrt(self.in1_features)
        init_per_model_(self.weight, lambda w: init.uniform_(w, -bound, bound))
        if self.bias is not None:
            init_per_model_(self.bias, lambda b: init.uniform_(b, -bound, bound))

    def forward(self, input1: Tensor, input2: Tensor) -> Tensor:
        check_input(
            self, input1, trailing=[("in1_features", self.in1_features)], what="input1", layout="(M, *, in1_features)"
        )
        check_input(
            self, input2, trailing=[("in2_features", self.in2_features)], what="input2", layout="(M, *, in2_features)"
        )
        if input1.shape[:-1] != input2.shape[:-1]:
            raise ValueError(
                f"{layer_name(self)}: expected input1 (M, *, in1_features) and input2 (M, *, in2_features) with the "
                f"same (M, *), got shapes {tuple(input1.shape)} and {tuple(input2.shape)}"
            )
        tensors = {"input1": input1, "input2": input2, "weight": self.weight, "bias": self.bias}
        dtypes = {t.dtype for t in tensors.values() if t is not None}
        if len(dtypes) > 1:
            found = ", ".join(f"{name}: {t.dtype}" for name, t in tensors.items() if t is not None)
            raise RuntimeError(
                f"{layer_name(self)}: all tensors must have the same dtype (as for F.bilinear), got {found}"
            )
        if torch.is_autocast_enabled(input1.device.type):
            # F.bilinear is on no autocast list and returns its inputs' dtype; here the matrix multiplies would
            # autocast and the product promote the result to float32 (a float16 layer's output), so no autocast.
            with torch.autocast(input1.device.type, enabled=False):
                return _bilinear(input1, input2, self.weight, self.bias)
        return _bilinear(input1, input2, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"num_models={self.num_models}, in1_features={self.in1_features}, "
            f"in2_features={self.in2_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def _bilinear(x1: Tensor, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Model ``m``'s ``F.bilinear(x1[m], x2[m], weight[m], bias[m])`` for every model at once.

    The longer input is contracted first, by ``functional.linear`` against the weight viewed as ``(M, out * k, long)``,
    then the ``(M, *, out, k)`` result is multiplied by the other input and summed over its ``k`` features:
    the intermediate is the smaller of the two possible ones. A shared (stride-0) input is never copied:
    ``functional.linear`` multiplies it as it is, the product broadcasts it.

    Measured on a 2-core CPU shared with other work (torch 2.13, float32, 1 thread, medians of 31-41
    interleaved forward+backward runs, (M, B, in1, in2, out) = (8, 64, 16, 16, 8), (16, 128, 32, 24, 16),
    (8, 128, 64, 8, 16), (8, 128, 8, 64, 16), (4, 256, 64, 64, 32)): 4-8x faster than a loop of F.bilinear;
    contracting the shorter input first was up to 5x slower (64 against 8 features); ``torch.einsum(
    "mni,moij,mnj->mno")`` (contracting left to right) was as fast to 6x slower; finishing with ``bmm`` over
    ``M * B`` matrix-vector products instead of the product and sum was within 20% either way. Both of these
    copy a shared input M times (into ``(M * B, in, 1)``); the product and sum does not.
    """
    num_models, out_features, in1_features, in2_features = weight.shape
    if in1_features > in2_features:
        # (M, out, in1, in2) -> (M, out * in2, in1): a copy of the weight, not of the inputs
        first, second = x1, x2
        weight_matrix = weight.transpose(2, 3).reshape(num_models, out_features * in2_features, in1_features)
    else:
        first, second = x2, x1
        weight_matrix = weight.reshape(num_models, out_features * in1_features, in2_features)
    partial = unchecked_linear(first, weight_matrix).unflatten(-1, (out_features, second.shape[-1]))
    y = (partial * second.unsqueeze(-2)).sum(-1)
    if bias is not None:
        y = y + bias.view(num_models, *[1] * (y.dim() - 2), out_features)
    return y
