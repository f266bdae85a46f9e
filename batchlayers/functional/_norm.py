"""Batched layer, RMS and group normalization: per-sample statistics, per-model affine."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._utils import is_shared

__all__ = ["group_norm", "layer_norm", "rms_norm"]


def per_model_affine(
    normalized: Tensor, num_models: int, weight: Tensor | None, bias: Tensor | None, param_view: Sequence[int]
) -> Tensor:
    """``normalized * weight[m] + bias[m]`` for every model, the parameters viewed as ``param_view``.

    ``normalized`` is either ``(M, B, *)`` or, for a shared batch, one ``(B, *)`` normalised once: broadcasting
    against the ``(M, ...)``-shaped parameters makes the per-model outputs without copying the input M times.
    Without parameters a shared result stays one stride-0 expand.
    """
    if weight is None:
        if bias is not None:
            return normalized + bias.view(param_view)
        if normalized.dim() == len(param_view):
            return normalized
        return normalized.expand(num_models, *normalized.shape)
    if bias is None:
        return normalized * weight.view(param_view)
    return torch.addcmul(bias.view(param_view), normalized, weight.view(param_view))


def _normalize_trailing(
    x: Tensor,
    normalized_shape: Sequence[int],
    normalize: Callable[[Tensor], Tensor],
    weight: Tensor | None,
    bias: Tensor | None,
) -> Tensor:
    """``normalize`` (statistics over the trailing dims) on all models at once, or once for a shared batch,
    then the per-model affine."""
    num_models = x.shape[0]
    normalized = normalize(x[0] if is_shared(x) else x)
    param_view = [num_models, *[1] * (x.dim() - 1 - len(normalized_shape)), *normalized_shape]
    return per_model_affine(normalized, num_models, weight, bias, param_view)


def channel_view(num_models: int, ndim: int, num_channels: int) -> list[int]:
    """The view of ``(M, C)`` parameters that broadcasts against an ``ndim``-D ``(M, B, C, *)`` tensor."""
    return [num_models, 1, num_channels, *[1] * (ndim - 3)]


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Model ``m``'s :func:`torch.nn.functional.layer_norm` with ``weight[m]``, ``bias[m]`` on ``x[m]``.

    Args:
        x: ``(M, *, *normalized_shape)``; a shared stride-0 batch is normalised once.
        normalized_shape: the trailing shape normalised over.
        weight, bias: ``(M, *normalized_shape)`` or ``None``.
    """
    return _normalize_trailing(
        x, normalized_shape, lambda s: F.layer_norm(s, list(normalized_shape), eps=eps), weight, bias
    )


def rms_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """Model ``m``'s :func:`torch.nn.functional.rms_norm` with ``weight[m]`` on ``x[m]``.

    Args:
        x: ``(M, *, *normalized_shape)``; a shared stride-0 batch is normalised once.
        normalized_shape: the trailing shape normalised over.
        weight: ``(M, *normalized_shape)`` or ``None``.
        eps: ``None`` means ``torch.finfo(x.dtype).eps``, as in torch.
    """
    return _normalize_trailing(
        x, normalized_shape, lambda s: F.rms_norm(s, list(normalized_shape), eps=eps), weight, None
    )


def group_norm(
    x: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Model ``m``'s :func:`torch.nn.functional.group_norm` with ``weight[m]``, ``bias[m]`` on ``x[m]``.

    Group statistics are per sample, so the models can be folded into either the batch or the channels,
    whichever is a free view of ``x``: channel packing ``(B, M*C, *)`` with ``num_groups * M`` groups (free
    when ``x`` is a transposed view of a packed tensor, as a batched convolution returns; the affine then
    runs inside the one kernel), else model-major ``(M*B, C, *)`` followed by the per-model affine.

    Args:
        x: ``(M, B, C, *)``; a shared stride-0 batch is normalised once.
        num_groups: groups per model.
        weight, bias: ``(M, C)`` or ``None``.
    """
    num_models, batch, num_channels = x.shape[:3]
    spatial = x.shape[3:]
    param_view = channel_view(num_models, x.dim(), num_channels)
    if is_shared(x):
        normalized = F.group_norm(x[0], num_groups, eps=eps)
        return per_model_affine(normalized, num_models, weight, bias, param_view)
    if x.stride(0) == num_channels * x.stride(2):
        packed = x.transpose(0, 1).reshape(batch, num_models * num_channels, *spatial)
        flat_weight = None if weight is None else weight.reshape(-1)
        flat_bias = None if bias is None else bias.reshape(-1)
        out = F.group_norm(packed, num_groups * num_models, flat_weight, flat_bias, eps)
        return out.view(batch, num_models, num_channels, *spatial).transpose(0, 1)
    folded = x.reshape(num_models * batch, num_channels, *spatial)
    normalized = F.group_norm(folded, num_groups, eps=eps).view(x.shape)
    return per_model_affine(normalized, num_models, weight, bias, param_view)
