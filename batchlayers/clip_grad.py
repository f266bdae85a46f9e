"""Per-model gradient clipping, and finding the models whose numbers went non-finite.

``torch.nn.utils.clip_grad_norm_`` on a batched model computes one norm over every model's gradients
together: one model with huge gradients would shrink every other model's step, and one NaN would turn
every model's gradients into NaN. The functions here treat each model on its own: model ``m``'s gradients
are exactly what ``torch.nn.utils`` gives when run on model ``m`` alone.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn

from ._fold import root_shared_buffers

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm", "nonfinite_models"]

TensorOrTensors = Tensor | Iterable[Tensor]


def _as_list(tensors: TensorOrTensors, what: str, caller: str) -> list[Tensor]:
    if isinstance(tensors, Tensor):
        return [tensors]
    if isinstance(tensors, nn.Module) or not isinstance(tensors, Iterable):
        hint = "; pass model.parameters()" if isinstance(tensors, nn.Module) else ""
        raise TypeError(
            f"{caller}: expected a tensor or an iterable of tensors ({what}), got {type(tensors).__name__}{hint}"
        )
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: {what}[{i}] is a {type(t).__name__}, not a tensor")
    return tensors


def _num_models(tensors: list[Tensor], what: str, caller: str) -> int:
    if not tensors:
        raise ValueError(f"{caller}: got no {what}; the number of models M comes from their first dimension")
    sizes = {t.shape[0] if t.dim() > 0 else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        shapes = sorted({tuple(t.shape) for t in tensors})
        raise ValueError(
            f"{caller}: every {what[:-1]} needs the model dimension first, the same size M in all of them, "
            f"got shapes {shapes}"
        )
    return cast(int, sizes.pop())  # (None refused above)


def _per_model_scalar(value: float | Tensor, num_models: int, name: str, caller: str) -> float | Tensor:
    """A float or an ``(M,)`` tensor, every value >= 0 (a negative bound would flip or pin the gradients)."""
    if isinstance(value, Tensor) and value.dim() > 0:
        if value.shape != (num_models,):
            raise ValueError(
                f"{caller}: {name} must be a float or a tensor of shape (M,) = ({num_models},), "
                f"got shape {tuple(value.shape)}"
            )
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{caller}: {name} must be a real tensor, got {value.dtype}")
        # (checked where it costs no device synchronisation: called every step, on CUDA it would)
        if value.device.type == "cpu" and not torch.compiler.is_compiling():
            negative = value < 0
            if bool(negative.any()):
                raise ValueError(
                    f"{caller}: {name} must be >= 0 for every model, got {value[negative].tolist()} for models "
                    f"{negative.nonzero().flatten().tolist()}"
                )
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        got = f"a {type(value).__name__} of {len(value)} values" if isinstance(value, (list, tuple)) else repr(value)
        raise TypeError(
            f"{caller}: {name} must be a float or a tensor of shape (M,) = ({num_models},), one value per model, "
            f"got {got}"
        )
    if float(value) < 0:
        raise ValueError(f"{caller}: {name} must be >= 0, got {float(value)}")
    return float(value)


def _norm_type(norm_type: float | str, caller: str) -> float:
    try:
        return float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"{caller}: norm_type must be a number or 'inf', got {norm_type!r}") from None


def _view_per_model(values: Tensor, like: Tensor) -> Tensor:
    """``(M,)`` as ``(M, 1, ..., 1)`` on ``like``'s device, to scale model ``m``'s slice of ``like``."""
    return values.to(like.device).view(-1, *([1] * (like.dim() - 1)))


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        by_device_dtype.setdefault((t.device, t.dtype), []).append(t)
    return list(by_device_dtype.values())


@torch.no_grad()
def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""Each model's norm over all of its slices of ``tensors``, as if they were concatenated.

    The per-model version of :func:`torch.nn.utils.get_total_norm`.

    Args:
        tensors: tensors shaped ``(M, *)`` (usually gradients).
        norm_type: order of the p-norm; ``inf`` (or ``"inf"``) for the largest absolute value.
        error_if_nonfinite: raise if a model's norm is ``nan`` or ``inf``, naming the models.
        foreach: accepted for compatibility with torch; the norms are always computed per tensor.

    Returns:
        ``(M,)`` tensor, entry ``m`` the total norm of model ``m``.
    """
    tensors = _as_list(tensors, "tensors", "get_total_norm")
    num_models = _num_models(tensors, "tensors", "get_total_norm")
    norm_type = _norm_type(norm_type, "get_total_norm")
    first_device = tensors[0].device
    # (M, -1) per tensor: a view for contiguous tensors; each row is one model's slice.
    norms = [torch.linalg.vector_norm(t.reshape(num_models, -1), norm_type, dim=1).to(first_device) for t in tensors]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type, dim=0)
    if error_if_nonfinite and not bool(total.isfinite().all()):
        bad = (~total.isfinite()).nonzero().flatten().tolist()
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients of models {bad} is non-finite, so it cannot be "
            "clipped. To disable this error and scale those models' gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: TensorOrTensors,
    max_norm: float | Tensor,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    r"""Scale each model's gradients by ``min(max_norm / (total_norm + 1e-6), 1)``, model by model.

    The per-model version of :func:`torch.nn.utils.clip_grads_with_norm_`; ``total_norm`` is the ``(M,)``
    result of :func:`get_total_norm`, ``max_norm`` a float or an ``(M,)`` tensor.
    """
    parameters = _as_list(parameters, "parameters", "clip_grads_with_norm_")
    num_models = _num_models(parameters, "parameters", "clip_grads_with_norm_")
    max_norm = _per_model_scalar(max_norm, num_models, "max_norm", "clip_grads_with_norm_")
    if not isinstance(total_norm, Tensor) or total_norm.shape != (num_models,):
        got = tuple(total_norm.shape) if isinstance(total_norm, Tensor) else type(total_norm).__name__
        raise ValueError(f"clip_grads_with_norm_: total_norm must have shape (M,) = ({num_models},), got {got}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    if isinstance(max_norm, Tensor):
        max_norm = max_norm.to(device=total_norm.device, dtype=total_norm.dtype)
    # No `if clip_coef < 1` (a device sync); a NaN norm only reaches its own model's gradients.
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for bucket in _buckets(grads):
        scales = [_view_per_model(clip_coef, g) for g in bucket]
        if foreach is False:
            for g, scale in zip(bucket, scales):
                g.mul_(scale)
        else:
            torch._foreach_mul_(bucket, scales)


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float | Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""Clip each model's gradient norm on its own; the per-model :func:`torch.nn.utils.clip_grad_norm_`.

    Model ``m``'s gradients (its slices of every parameter's ``.grad``) are scaled exactly as
    ``torch.nn.utils.clip_grad_norm_`` would scale them for model ``m`` alone. A model with a non-finite
    norm only affects its own gradients.

    Args:
        parameters: parameters shaped ``(M, *)``, e.g. ``model.parameters()`` of a batched model.
        max_norm: the largest norm a model's gradients may have: a float, or an ``(M,)`` tensor.
        norm_type: order of the p-norm; ``inf`` for the largest absolute value. Default: ``2.0``.
        error_if_nonfinite: raise if some model's norm is ``nan`` or ``inf`` (nothing is clipped then).
        foreach: ``False`` scales one gradient at a time; otherwise foreach kernels are used.

    Returns:
        ``(M,)`` tensor: each model's total gradient norm before clipping.

    Examples::

        >>> batchlayers.losses.cross_entropy(model(x), y).sum().backward()
        >>> norms = batchlayers.clip_grad_norm_(model.parameters(), max_norm=1.0)   # (M,)
    """
    parameters = _as_list(parameters, "parameters", "clip_grad_norm_")
    num_models = _num_models(parameters, "parameters", "clip_grad_norm_")
    _per_model_scalar(max_norm, num_models, "max_norm", "clip_grad_norm_")
    _norm_type(norm_type, "clip_grad_norm_")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(num_models, device=parameters[0].device)
    total_norm = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


@torch.no_grad()
def clip_grad_value_(parameters: TensorOrTensors, clip_value: float | Tensor, foreach: bool | None = None) -> None:
    r"""Clamp every gradient to ``[-clip_value, clip_value]``; the per-model :func:`torch.nn.utils.clip_grad_value_`.

    Args:
        parameters: parameters shaped ``(M, *)``.
        clip_value: a float (the same for every model) or an ``(M,)`` tensor, one value per model.
        foreach: ``False`` clamps one gradient at a time; otherwise foreach kernels are used for a float.
    """
    parameters = _as_list(parameters, "parameters", "clip_grad_value_")
    num_models = _num_models(parameters, "parameters", "clip_grad_value_")
    clip_value = _per_model_scalar(clip_value, num_models, "clip_value", "clip_grad_value_")
    grads = [p.grad for p in parameters if p.grad is not None]
    if isinstance(clip_value, float):
        for bucket in _buckets(grads):
            if foreach is False:
                for g in bucket:
                    g.clamp_(min=-clip_value, max=clip_value)
            else:
                torch._foreach_clamp_min_(bucket, -clip_value)
                torch._foreach_clamp_max_(bucket, clip_value)
        return
    for g in grads:
        limit = _view_per_model(clip_value.to(g.dtype), g)
        g.clamp_(min=-limit, max=limit)


@torch.no_grad()
def nonfinite_models(
    losses: Tensor | None = None,
    parameters: nn.Module | Iterable[Tensor] | None = None,
    *,
    grads: bool = True,
) -> Tensor:
    r"""Which models have a ``nan`` or ``inf`` anywhere: in their loss, parameters or gradients.

    Models never contaminate each other in batchlayers (per-model losses, per-model clipping, per-model
    optimizer updates), so one diverging model can simply be frozen or dropped::

        losses = batchlayers.losses.cross_entropy(model(x), y)      # (M,)
        losses.sum().backward()
        bad = batchlayers.nonfinite_models(losses, model)            # (M,) bool
        batchlayers.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(active=~bad)                                  # bad models do not change

    Args:
        losses: ``(M,)`` per-model losses, or any ``(M, *)`` tensor (e.g. outputs).
        parameters: a batched module (its parameters and buffers are checked, except a stacked model's
            shared buffers, which hold no model dimension) or tensors shaped ``(M, *)``.
        grads: also check the parameters' ``.grad``. Default: ``True``.

    Returns:
        ``(M,)`` bool tensor, ``True`` for every model with a non-finite value.
    """
    tensors: list[Tensor] = []
    if losses is not None:
        if not isinstance(losses, Tensor):
            raise TypeError(f"nonfinite_models: expected losses to be an (M,) tensor, got {type(losses).__name__}")
        tensors.append(losses)
    if isinstance(parameters, nn.Module):
        params: list[Tensor] = list(parameters.parameters())
        # A stacked model's shared buffers (one copy for all models, e.g. a causal mask) hold no model dimension.
        shared = set(root_shared_buffers(parameters))
        tensors += params + [
            b
            for name, b in parameters.named_buffers()
            if name not in shared and (b.is_floating_point() or b.is_complex())
        ]
    elif parameters is not None:
        params = _as_list(parameters, "parameters", "nonfinite_models")
        tensors += params
    else:
        params = []
    if grads:
        tensors += [p.grad for p in params if p.grad is not None]
    num_models = _num_models(tensors, "tensors", "nonfinite_models")
    bad = torch.zeros(num_models, dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            bad |= ~t.reshape(num_models, -1).isfinite().all(dim=1).to(bad.device)
    return bad
