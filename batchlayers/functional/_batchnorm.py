"""Batched batch normalization: per-model batch statistics and running statistics in one kernel."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .._utils import check_norm_dtypes, in_order, is_shared, stride_order
from ._norm import channel_view, check_channel_norm, mixed_result, per_model_affine, running_stats_norm, upcast

__all__ = ["batch_norm"]


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | Tensor = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Model ``m``'s :func:`torch.nn.functional.batch_norm` on ``x[m]`` with its own parameters and stats.

    Channel packing turns all models into one ``F.batch_norm`` over ``M*C`` channels: ``(M, B, C, *)`` is
    viewed as ``(B, M*C, *)`` (free when ``x`` is a transposed view of a packed tensor, as a batched
    convolution returns; otherwise one copy) and the ``(M, C)`` running statistics are viewed flat, so the
    kernel updates them in place. The output is the transposed view of the packed result. A large input whose
    models are each channels-last (as the per-model convolution loops return it) is instead normalised model by
    model in its own layout (see :data:`PER_MODEL_MIN_NUMEL`), where packing would copy it. Normalising by the
    running statistics (eval mode) needs no packing: one per-model scale and shift, ``x * scale + shift`` as
    torch's kernel computes it, in ``x``'s own memory format.

    A shared stride-0 batch has the same statistics for every model: it is normalised once and only the
    per-model affine (and, in eval mode, the per-model running statistics) fan it out to ``M`` outputs.

    Args:
        x: ``(M, B, C, *)``.
        running_mean, running_var: ``(M, C)`` contiguous, or ``None`` to use batch statistics only.
        weight, bias: ``(M, C)`` or ``None``.
        training: normalise with batch statistics and update the running ones (when given).
        momentum: factor of the running-statistics update, a float for every model or an ``(M,)`` tensor
            with one factor per model (``torch.nn`` BatchNorm's cumulative average, ``momentum=None``, is
            ``1 / num_batches_tracked``, which differs between models that have seen different numbers of
            batches).
        eps: added to the variance.

    Dtypes as in torch: parameters and running statistics of ``x``'s dtype, or all float32 with a
    float16/bfloat16 ``x`` (computed in float32, the result in ``x``'s dtype).

    An empty batch (``B = 0`` or an empty spatial size) leaves the running statistics as they are, as torch's
    kernel does (it returns before updating them); the output is empty.
    """
    function = "batchlayers.functional.batch_norm"
    params = ("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)
    check_channel_norm(function, x, *params)
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{function}: running_mean and running_var are given together or not at all")
    if isinstance(momentum, Tensor) and tuple(momentum.shape) != (x.shape[0],):
        raise ValueError(
            f"{function}: momentum must be a float or an (M,) = ({x.shape[0]},) tensor, one factor per model, "
            f"got shape {tuple(momentum.shape)}"
        )
    num_models, batch, num_channels = x.shape[:3]
    spatial = x.shape[3:]
    param_view = channel_view(num_models, x.dim(), num_channels)
    mixed = check_norm_dtypes("batch_norm", x, (weight, bias, running_mean, running_var))
    if training and x.numel() == 0:
        running_mean = running_var = None  # nothing to learn from: torch leaves the statistics untouched
    use_batch_stats = training or running_mean is None
    update_stats = training and running_mean is not None
    per_model_momentum = isinstance(momentum, Tensor)
    # mean, var below: running_mean and running_var, given (both, checked above) wherever update_stats is true
    # or use_batch_stats is false

    if is_shared(x):
        source = x[0]
        if not use_batch_stats:
            mean, var = cast(Tensor, running_mean), cast(Tensor, running_var)
            return running_stats_norm(source, mean, var, weight, bias, eps, param_view)
        if mixed:
            # The per-model affine below runs outside torch's kernel: normalise in float32, round once.
            out = batch_norm(upcast(x), running_mean, running_var, weight, bias, training, momentum, eps)
            return mixed_result(out, x)
        if not update_stats:
            normalized = F.batch_norm(source, None, None, training=True, eps=eps)
            return per_model_affine(normalized, num_models, weight, bias, param_view)
        mean, var = cast(Tensor, running_mean), cast(Tensor, running_var)
        batch_mean, batch_var = _fresh_stats(mean, num_channels)
        normalized = F.batch_norm(source, batch_mean, batch_var, training=True, momentum=1.0, eps=eps)
        _update_running_stats(mean, var, batch_mean, batch_var, momentum)
        return per_model_affine(normalized, num_models, weight, bias, param_view)

    if not use_batch_stats:
        # Eval mode: each model's statistics and affine as one scale and shift, in x's own memory format (a
        # per-model channels-last convolution output stays so; packing into (B, M*C, *) and back would copy twice).
        stats = cast(Tensor, running_mean), cast(Tensor, running_var)  # (use_batch_stats is False: both given)
        return running_stats_norm(x, *stats, weight, bias, eps, param_view)
    if not per_model_momentum and _runs_per_model(x):
        momentum = cast(float, momentum)  # (not a tensor: checked above)
        return _per_model_batch_norm(x, running_mean, running_var, weight, bias, use_batch_stats, momentum, eps)
    packed = x.transpose(0, 1).reshape(batch, num_models * num_channels, *spatial)
    flat_weight = None if weight is None else weight.view(-1)
    flat_bias = None if bias is None else bias.view(-1)
    if update_stats and per_model_momentum:
        # F.batch_norm takes one momentum for all channels: let it write this batch's statistics into fresh
        # buffers (momentum 1), then blend them into each model's running statistics with its own factor.
        mean, var = cast(Tensor, running_mean), cast(Tensor, running_var)
        batch_mean, batch_var = _fresh_stats(mean, num_models * num_channels)
        out = F.batch_norm(packed, batch_mean, batch_var, flat_weight, flat_bias, True, 1.0, eps)
        batch_mean, batch_var = batch_mean.view(num_models, num_channels), batch_var.view(num_models, num_channels)
        _update_running_stats(mean, var, batch_mean, batch_var, momentum)
    else:
        flat_mean = None if running_mean is None else running_mean.view(-1)
        flat_var = None if running_var is None else running_var.view(-1)
        # a tensor only matters when updating; else a float
        scalar_momentum = 0.0 if per_model_momentum else cast(float, momentum)
        out = F.batch_norm(packed, flat_mean, flat_var, flat_weight, flat_bias, use_batch_stats, scalar_momentum, eps)
    out = out.view(batch, num_models, num_channels, *spatial).transpose(0, 1)
    if not (torch.compiler.is_compiling() or x.is_contiguous() or _packs_as_view(x)) and x.numel() > 0:
        # Packing copied x, which is in another memory format than torch's default (a per-model channels-last
        # convolution output): give the output that format too (the copy the fold would make anyway), so that
        # the activation, residual add and convolution after it, and their backward, see one layout. Stacked
        # small ResNet training step, interleaved in one process: 98.0 -> 91.7 ms (2 threads), 167 -> 161 ms
        # (1 thread). (Compiled, inductor plans the layouts.)
        out = in_order(out, stride_order(x))
    return out


# From this many elements per model on, a per-model channels-last input (what the per-model convolution loops
# return) is normalised model by model (torch's channels-last kernel on each model's own (B, C, *) slice, no
# layout change) instead of packed into (B, M*C, *), which copies it into another layout and the output and the
# gradients back. BatchNorm2d forward+backward alone, 2-core CPU, float32, interleaved medians (packed ->
# per model): 8k elements a model 0.55x (M=16), 32k 0.83x (M=64) and 1.02x (M=8), 65k 1.40-2.37x (M=4-64),
# 131k-524k 1.48-1.96x; the stacked small ResNet's training step (M=4) 124 -> 96 ms against the loop's 87.
PER_MODEL_MIN_NUMEL = 1 << 16


def _runs_per_model(x: Tensor) -> bool:
    """Whether ``(M, B, C, H, W)`` or ``(M, B, C, D, H, W)`` ``x`` is normalised model by model: each model's
    slice is channels-last, ``x`` stored as ``(M, B, *, C)``, with at least :data:`PER_MODEL_MIN_NUMEL` elements a
    model (eager only: compiled, inductor plans the layouts). Not 1-D: torch has no channels-last format for
    ``(B, C, L)``, its kernel would copy each slice. CPU only: measured there; on a GPU M kernel launches each way
    against two cheap copies are unmeasured (no GPU was available), so packing stays."""
    return (
        x.device.type == "cpu"
        and x.dim() in (5, 6)
        and x[0].numel() >= PER_MODEL_MIN_NUMEL
        and not x.is_contiguous()
        and x.movedim(2, -1).is_contiguous()
        and not torch.compiler.is_compiling()
    )


def _per_model_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Tensor:
    """``F.batch_norm`` on each model's slice with its own parameters and running statistics (rows of the
    ``(M, C)`` buffers, which the kernel updates in place), the outputs stacked in ``x``'s layout."""
    rows = [[None] * x.shape[0] if t is None else t.unbind(0) for t in (running_mean, running_var, weight, bias)]
    return torch.stack(
        [F.batch_norm(xm, mean, var, w, b, training, momentum, eps) for xm, mean, var, w, b in zip(x.unbind(0), *rows)]
    )


def _packs_as_view(x: Tensor) -> bool:
    """Whether ``(M, B, C, *)`` ``x`` packs into ``(B, M*C, *)`` without a copy: its models and channels merge."""
    num_models, num_channels = x.shape[0], x.shape[2]
    return num_models == 1 or num_channels == 1 or x.stride(0) == num_channels * x.stride(2)


def _fresh_stats(like: Tensor, size: int) -> tuple[Tensor, Tensor]:
    # Finite start values: with momentum 1 the kernel computes 0 * start + 1 * batch statistic.
    return like.new_zeros(size), like.new_zeros(size)


@torch.no_grad()
def _update_running_stats(
    running_mean: Tensor, running_var: Tensor, batch_mean: Tensor, batch_var: Tensor, momentum: float | Tensor
) -> None:
    """``running = (1 - momentum) * running + momentum * batch`` in place, the formula of torch's kernel;
    ``batch_var`` is the unbiased variance, as torch uses for the running variance."""
    if isinstance(momentum, Tensor):
        momentum = momentum.to(running_mean.dtype).unsqueeze(1)
    running_mean.mul_(1 - momentum).add_(momentum * batch_mean)
    running_var.mul_(1 - momentum).add_(momentum * batch_var)
