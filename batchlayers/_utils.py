"""Validation and initialisation helpers shared by every batched layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "check_num_models",
    "check_input",
    "init_per_model_",
    "is_shared",
    "layer_name",
    "model_count_holders",
    "set_num_models_",
]


def layer_name(module: nn.Module, name: str | None = None) -> str:
    """The name used in error messages: ``name`` (default: the class name), with the module path when the
    layer knows it."""
    path = getattr(module, "_batchlayers_path", None)
    name = type(module).__name__ if name is None else name
    return f"{name} at '{path}'" if path else name


def check_num_models(num_models: int, cls: type) -> int:
    if isinstance(num_models, bool) or not isinstance(num_models, int):
        raise TypeError(f"{cls.__name__}: num_models must be an int, got {type(num_models).__name__}")
    if num_models < 1:
        raise ValueError(f"{cls.__name__}: num_models must be at least 1, got {num_models}")
    return num_models


def _fmt(shape: Sequence[object]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def check_input(
    module: nn.Module,
    x: Tensor,
    *,
    channels: tuple[str, int] | None = None,
    trailing: Sequence[tuple[str, int]] = (),
    ndims: Sequence[int] | None = None,
    min_ndim: int = 2,
    what: str = "input",
    layout: str = "(M, B, *)",
) -> None:
    """Check that ``x`` is ``(M, ...)`` with the given sizes; raise naming the layer otherwise.

    ``channels`` is the ``(name, size)`` of dimension 2, the channel dimension of ``(M, B, C, *)`` inputs
    (e.g. ``("C_in", 3)``); ``trailing`` lists ``(name, size)`` pairs for the last dimensions (e.g.
    ``[("in_features", 20)]``); ``ndims`` the allowed total numbers of dimensions (``None``: any number
    >= ``min_ndim``).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer_name(module)}: expected the {what} to be a Tensor, got {type(x).__name__}")
    num_models = module.num_models
    named = [channels, *trailing] if channels is not None else list(trailing)
    expected = f"{layout} with M={num_models}" + "".join(f", {n}={s}" for n, s in named)
    if ndims is not None and x.dim() not in ndims:
        allowed = " or ".join(str(n) for n in ndims)
        raise ValueError(
            f"{layer_name(module)}: expected a {allowed}-D {what} {expected}, got {x.dim()}-D shape {_fmt(x.shape)}"
        )
    if x.dim() < max(min_ndim, 1 + len(trailing), 3 if channels is not None else 0):
        raise ValueError(
            f"{layer_name(module)}: expected {what} {expected}, got too few dimensions: shape {_fmt(x.shape)}"
        )
    if x.shape[0] != num_models:
        raise ValueError(
            f"{layer_name(module)}: expected {what} {expected}, but dimension 0 (models) is "
            f"{x.shape[0]}, not {num_models}: shape {_fmt(x.shape)}"
        )
    if channels is not None and x.shape[2] != channels[1]:
        raise ValueError(
            f"{layer_name(module)}: expected {what} {expected}, but dimension 2 (channels) is "
            f"{x.shape[2]}: shape {_fmt(x.shape)}"
        )
    for k, (name, size) in enumerate(reversed(trailing)):
        dim = x.dim() - 1 - k
        if x.shape[dim] != size:
            raise ValueError(
                f"{layer_name(module)}: expected {what} {expected}, but dimension {dim} ({name}) is "
                f"{x.shape[dim]}: shape {_fmt(x.shape)}"
            )


def is_shared(x: Tensor) -> bool:
    """True when ``x`` is one batch shared by every model, passed as ``batch.expand(M, *batch.shape)``."""
    return x.dim() > 0 and x.shape[0] > 1 and x.stride(0) == 0


@torch.no_grad()
def init_per_model_(tensor: Tensor, init_fn: Callable[[Tensor], object]) -> Tensor:
    """Apply a ``torch.nn.init``-style function to each model's slice on its own.

    Calling ``torch.nn.init`` on the stacked ``(M, *shape)`` tensor would compute the fan from the wrong
    dimensions; a slice per model has exactly the shape the torch.nn layer initialises.
    """
    for model_slice in tensor.unbind(0):
        init_fn(model_slice)
    return tensor


def model_count_holders(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules that record how many models they hold (an int ``num_models``)."""
    return [
        m
        for m in module.modules()
        if isinstance(getattr(m, "num_models", None), int) and not isinstance(m.num_models, bool)
    ]


def set_num_models_(module: nn.Module, num_models: int) -> None:
    """Record a new number of models on every submodule that keeps one, after its tensors were indexed."""
    for m in model_count_holders(module):
        m.num_models = num_models
