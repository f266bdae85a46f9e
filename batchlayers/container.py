"""Running ordinary, parameter-free torch.nn modules between batched layers."""

from __future__ import annotations

from torch import Tensor, nn

from ._utils import is_shared

__all__ = ["Folded"]


def _has_randomness(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.training for m in module.modules())


class Folded(nn.Module):
    r"""Apply an ordinary module to ``(M, B, *)`` tensors by folding the models into the batch.

    Pooling, flattening, upsampling, dropout, activations and any other module that treats the samples of
    a batch independently and holds no per-model state see one batch of ``M * B`` samples; the output is
    unfolded back to ``(M, B, *)``. This is how torch.nn building blocks go between batched layers
    without reshapes by hand.

    A shared batch (a stride-0 expand) is computed once and expanded again, so it stays one copy, unless
    the module draws random numbers in training mode (dropout), where every model needs its own mask.

    Args:
        module: the module to apply, e.g. ``nn.MaxPool2d(2)`` or ``nn.Flatten()``. It must map a batch of
            ``N`` samples to a batch of ``N`` samples.

    Shape:
        - Input: ``(M, B, *)``.
        - Output: ``(M, B, *')`` where ``(B, *')`` is ``module``'s output for a ``(B, *)`` input.

    Examples::

        >>> net = nn.Sequential(
        ...     BatchedConv2d(4, 3, 8, 3), Folded(nn.MaxPool2d(2)), Folded(nn.Flatten()),
        ...     BatchedLinear(4, 8 * 15 * 15, 10))
        >>> net(torch.randn(4, 16, 3, 32, 32)).shape
        torch.Size([4, 16, 10])
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, Tensor):
            raise TypeError(f"Folded({type(self.module).__name__}): expected a Tensor, got {type(input).__name__}")
        if input.dim() < 2:
            raise ValueError(
                f"Folded({type(self.module).__name__}): expected input (M, B, *), got shape {tuple(input.shape)}"
            )
        num_models, batch = input.shape[:2]
        if is_shared(input) and not _has_randomness(self.module):
            out = self.module(input[0])
            return out.expand(num_models, *out.shape)
        out = self.module(input.reshape(num_models * batch, *input.shape[2:]))
        if out.dim() == 0 or out.shape[0] != num_models * batch:
            raise ValueError(
                f"Folded({type(self.module).__name__}): the wrapped module must keep the batch dimension "
                f"({num_models} models x {batch} samples = {num_models * batch}), but its output has shape "
                f"{tuple(out.shape)}"
            )
        return out.view(num_models, batch, *out.shape[1:])
