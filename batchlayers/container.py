"""Running ordinary, parameter-free torch.nn modules between batched layers."""

from __future__ import annotations

from torch import Tensor, nn

from ._utils import is_shared, layer_name

__all__ = ["Folded"]

# Modules that draw random numbers in training mode: each model needs its own draw, like a loop would make.
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)


def _has_randomness(module: nn.Module) -> bool:
    return any(isinstance(m, _RANDOM_MODULES) and m.training for m in module.modules())


def _per_model_state(module: nn.Module) -> str | None:
    """Why ``module`` cannot run folded (one instance for all models), or ``None`` when it can."""
    for name, _ in module.named_parameters():
        return f"it holds the parameter '{name}', which all models would share"
    for name, _ in module.named_buffers():
        return f"it holds the buffer '{name}', which all models would share"
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            where = f" ('{name}')" if name else ""
            return f"batch norm{where} mixes the samples of all models into one set of batch statistics"
    return None


class Folded(nn.Module):
    r"""Apply an ordinary module to ``(M, B, *)`` tensors by folding the models into the batch.

    Pooling, flattening, upsampling, dropout, activations and any other module that treats the samples of
    a batch independently and holds no per-model state see one batch of ``M * B`` samples; the output is
    unfolded back to ``(M, B, *)``. This is how torch.nn building blocks go between batched layers
    without reshapes by hand. The result equals a loop that applies ``module`` to each model's ``(B, *)``.

    A shared batch (a stride-0 expand) is computed once, on ``(B, *)``, and returned as a stride-0 expand
    again, so it stays one copy, unless the module draws random numbers in training mode (dropout, RReLU):
    then the batch is computed per model, so that every model gets its own mask, as in a loop.

    Modules with parameters or buffers are refused (they would be one set of weights shared by all models;
    use the batched layers, or :func:`batchlayers.convert` for whole models), and so is batch norm, whose
    batch statistics would mix the models' samples. Randomness is detected only in torch.nn's own dropout
    and RReLU modules: a custom module that draws random numbers must not be given a shared batch.

    Args:
        module: the module to apply, e.g. ``nn.MaxPool2d(2)`` or ``nn.Flatten()``. It must map a batch of
            ``N`` samples to a single tensor with a batch of ``N`` samples.

    Shape:
        - Input: ``(M, B, *)``.
        - Output: ``(M, B, *')`` where ``(B, *')`` is ``module``'s output for a ``(B, *)`` input.

    Examples::

        >>> net = nn.Sequential(
        ...     Folded(nn.Flatten()), BatchedLinear(4, 28 * 28, 64), Folded(nn.ReLU()),
        ...     Folded(nn.Dropout(0.1)), BatchedLinear(4, 64, 10))
        >>> net(torch.randn(4, 16, 1, 28, 28)).shape
        torch.Size([4, 16, 10])
        >>> pool = Folded(nn.MaxPool2d(2))
        >>> image = torch.randn(16, 3, 32, 32)        # one batch for all 4 models
        >>> pooled = pool(image.expand(4, *image.shape))
        >>> pooled.shape, pooled.stride(0)            # computed once, still a stride-0 expand
        (torch.Size([4, 16, 3, 16, 16]), 0)
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"Folded: expected an nn.Module to wrap, got {type(module).__name__}")
        reason = _per_model_state(module)
        if reason is not None:
            raise ValueError(f"Folded({type(module).__name__}): cannot run one instance for all models: {reason}")
        self.module = module

    def _name(self) -> str:
        return layer_name(self, f"Folded({type(self.module).__name__})")

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, Tensor):
            raise TypeError(f"{self._name()}: expected a Tensor, got {type(input).__name__}")
        if input.dim() < 2:
            raise ValueError(f"{self._name()}: expected input (M, B, *), got shape {tuple(input.shape)}")
        num_models, batch = input.shape[:2]
        if is_shared(input) and not _has_randomness(self.module):
            out = self._checked(self.module(input[0]), batch, f"{batch} samples of the shared batch")
            return out.expand(num_models, *out.shape)
        out = self.module(input.reshape(num_models * batch, *input.shape[2:]))
        out = self._checked(out, num_models * batch, f"{num_models} models x {batch} samples = {num_models * batch}")
        return out.view(num_models, batch, *out.shape[1:])

    def _checked(self, out: object, expected_batch: int, what: str) -> Tensor:
        if not isinstance(out, Tensor):
            raise TypeError(f"{self._name()}: the wrapped module must return one Tensor, got {type(out).__name__}")
        if out.dim() == 0 or out.shape[0] != expected_batch:
            raise ValueError(
                f"{self._name()}: the wrapped module must keep the batch dimension ({what}), but its output has "
                f"shape {tuple(out.shape)}"
            )
        return out
