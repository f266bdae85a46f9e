"""Batched layer, RMS, group and instance normalization: per-sample statistics, per-model affine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .._utils import autocast_enabled, check_call_input, check_norm_dtypes, check_parameter, check_size, is_shared

__all__ = ["group_norm", "instance_norm", "layer_norm", "rms_norm"]

_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def upcast(x: Tensor) -> Tensor:
    """A float16/bfloat16 ``x`` in float32, the precision torch's norm kernels compute it in (a shared batch stays
    one stride-0 expand of one converted batch); other dtypes as they are."""
    if x.dtype not in _REDUCED_FLOATS:
        return x
    if is_shared(x):
        return x[0].float().expand(x.shape)
    return x.float()


def autocast_returns_float32(op: str, x: Tensor) -> bool:
    """Whether autocast, on for ``x``'s device, runs torch's ``op`` on float32 operands and returns float32: ``op``
    has a kernel under that device's autocast key, which for the norms is the float32 list (torch 2.13: CPU none,
    CUDA and XPU ``layer_norm``, ``group_norm``, ``rms_norm``, MPS the first two; read from torch's dispatcher, the
    non-CPU devices not run here)."""
    device = x.device.type
    if device == "cpu" or not autocast_enabled(x):
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", f"Autocast{device.upper()}")
    except (AttributeError, RuntimeError):
        return False


def mixed_result(out: Tensor, x: Tensor, *, autocast_fp32: bool = False) -> Tensor:
    """The float32 result of a mixed-precision call (a float16/bfloat16 ``x``, float32 parameters) rounded once to
    ``x``'s dtype, the dtype torch's kernels return.

    ``autocast_fp32``: the torch op is on CUDA autocast's float32 list (``layer_norm``, ``group_norm``): under it torch
    casts the input up and returns float32, so the float32 result stays. CPU autocast leaves norms alone (checked
    against torch 2.13); the CUDA side is torch's documented policy, not run here.
    """
    if autocast_fp32 and x.device.type != "cpu" and torch.is_autocast_enabled(x.device.type):
        return out
    return out.to(x.dtype)


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


def check_trailing_norm(
    function: str, x: object, normalized_shape: object, weight: Tensor | None, bias: Tensor | None
) -> tuple[int, ...]:
    """Refuse, naming ``function``, arguments of :func:`layer_norm` / :func:`rms_norm` that do not fit together."""
    if not isinstance(normalized_shape, (tuple, list, torch.Size)):
        raise TypeError(
            f"{function}: normalized_shape must be a tuple or list of ints (as for torch.nn.functional), got "
            f"{type(normalized_shape).__name__} {normalized_shape!r}"
        )
    shape = tuple(check_size(function, "normalized_shape", n) for n in normalized_shape)
    num_models = x.shape[0] if isinstance(x, Tensor) and x.dim() > 0 else 0
    names = ["normalized_shape"] if len(shape) == 1 else [f"normalized_shape[{i}]" for i in range(len(shape))]
    check_call_input(function, x, num_models, trailing=list(zip(names, shape)), layout="(M, *, *normalized_shape)")
    for what, p in (("weight", weight), ("bias", bias)):
        check_parameter(function, what, p, (num_models, *shape), "(M, *normalized_shape)", cast(Tensor, x))  # (checked)
    return shape


def check_channel_norm(function: str, x: object, *params: tuple[str, Tensor | None], min_ndim: int = 3) -> int:
    """Refuse, naming ``function``, an input that is not ``(M, B, C, *)`` or per-model parameters (named in
    ``params``) that are not ``(M, C)`` for it; return ``C``."""
    if isinstance(x, Tensor) and x.dim() < min_ndim:
        raise ValueError(f"{function}: expected input (M, B, C, *), got too few dimensions: shape {tuple(x.shape)}")
    num_models, num_channels = (x.shape[0], x.shape[2]) if isinstance(x, Tensor) else (0, 0)
    check_call_input(function, x, num_models, channels=("C", num_channels), min_ndim=min_ndim, layout="(M, B, C, *)")
    for what, p in params:
        check_parameter(function, what, p, (num_models, num_channels), "(M, C)", cast(Tensor, x))  # (checked above)
    return num_channels


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
        weight, bias: ``(M, *normalized_shape)`` or ``None``; as for torch, of ``x``'s dtype, or float32 with a
            float16/bfloat16 ``x`` (computed in float32, the result in ``x``'s dtype).
    """
    normalized_shape = check_trailing_norm("batchlayers.functional.layer_norm", x, normalized_shape, weight, bias)
    mixed = check_norm_dtypes("layer_norm", x, (weight, bias))
    source = upcast(x) if mixed else x
    out = _normalize_trailing(
        source, normalized_shape, lambda s: F.layer_norm(s, list(normalized_shape), eps=eps), weight, bias
    )
    return mixed_result(out, x, autocast_fp32=True) if mixed else out


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
        eps: ``None`` means ``torch.finfo(x.dtype).eps`` (float32's for a float16/bfloat16 ``x``), as in torch.

    As torch's ``rms_norm``: a float16/bfloat16 ``x`` is normalised in float32, multiplied by the weight in the
    promoted dtype, and the result returned in ``x``'s dtype, whatever the weight's dtype; float32 under an
    autocast that runs ``rms_norm`` in float32 (CUDA's, not CPU's).
    """
    normalized_shape = check_trailing_norm("batchlayers.functional.rms_norm", x, normalized_shape, weight, None)
    out = _normalize_trailing(
        upcast(x), normalized_shape, lambda s: F.rms_norm(s, list(normalized_shape), eps=eps), weight, None
    )
    if autocast_returns_float32("rms_norm", x):
        return out  # torch casts the input and weight up and returns float32
    return out.to(x.dtype)  # torch's composite ends with type_as(input)


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
        weight, bias: ``(M, C)`` or ``None``; as for torch, of ``x``'s dtype, or float32 with a float16/bfloat16
            ``x`` (computed in float32, the result in ``x``'s dtype).
    """
    function = "batchlayers.functional.group_norm"
    channels = check_channel_norm(function, x, ("weight", weight), ("bias", bias))
    if check_size(function, "num_groups", num_groups, 1) and channels % num_groups:
        raise ValueError(f"{function}: the C={channels} channels must be divisible by num_groups={num_groups}")
    num_models, batch, num_channels = x.shape[:3]
    spatial = x.shape[3:]
    param_view = channel_view(num_models, x.dim(), num_channels)
    packed_layout = not is_shared(x) and x.stride(0) == num_channels * x.stride(2)
    if check_norm_dtypes("group_norm", x, (weight, bias)) and not packed_layout:
        # The packed layout runs torch's own mixed-precision kernel; the others apply the affine themselves.
        return mixed_result(group_norm(upcast(x), num_groups, weight, bias, eps), x, autocast_fp32=True)
    if is_shared(x):
        normalized = F.group_norm(x[0], num_groups, eps=eps)
        return per_model_affine(normalized, num_models, weight, bias, param_view)
    if packed_layout:
        packed = x.transpose(0, 1).reshape(batch, num_models * num_channels, *spatial)
        flat_weight = None if weight is None else weight.reshape(-1)
        flat_bias = None if bias is None else bias.reshape(-1)
        out = F.group_norm(packed, num_groups * num_models, flat_weight, flat_bias, eps)
        return out.view(batch, num_models, num_channels, *spatial).transpose(0, 1)
    folded = x.reshape(num_models * batch, num_channels, *spatial)
    normalized = F.group_norm(folded, num_groups, eps=eps).view(x.shape)
    return per_model_affine(normalized, num_models, weight, bias, param_view)


def instance_norm(
    x: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Model ``m``'s :func:`torch.nn.functional.instance_norm` on ``x[m]`` with its own parameters and stats.

    With ``use_input_stats`` every (sample, channel) is normalised by its own statistics and, when running
    statistics are given, model ``m``'s are updated as torch does: each sample's statistics blended in with
    ``momentum``, then averaged over the batch (the variance unbiased). Otherwise the running statistics
    normalise, as batch norm's in eval mode.

    Every model runs in one kernel: the model-major ``(M, B, C, *)`` is viewed as ``(1, M*B*C, *)`` (what
    ``F.instance_norm`` does with ``(B, C, *)``), or, when ``x`` is a transposed view of a packed
    ``(B, M*C, *)`` tensor (as a batched convolution returns), that tensor is normalised as it is. A shared
    stride-0 batch is normalised once; only the per-model affine and running statistics fan it out.

    Args:
        x: ``(M, B, C, *)``.
        running_mean, running_var: ``(M, C)`` contiguous, or ``None``.
        weight, bias: ``(M, C)`` or ``None``.
        use_input_stats: normalise with each sample's own statistics (and update the running ones when given);
            ``False`` needs running statistics.
        momentum: factor of the running-statistics update.
        eps: added to the variance.

    Dtypes as in torch: ``weight`` and ``bias`` of ``x``'s dtype, or float32 with a float16/bfloat16 ``x``
    (computed in float32, the result in ``x``'s dtype); the running statistics, of any dtype, are used (and
    updated) in the weight's dtype (``x``'s without a weight) and written back in their own.
    """
    if (running_mean is None) != (running_var is None):
        given, missing = ("running_mean", "running_var") if running_var is None else ("running_var", "running_mean")
        raise ValueError(
            f"instance_norm: {given} was given without {missing}; running_mean and running_var are given together "
            "or not at all"
        )
    num_models, batch, num_channels = x.shape[:3]
    spatial = x.shape[3:]
    param_view = channel_view(num_models, x.dim(), num_channels)
    # An empty shared batch (B = 0 or an empty spatial size) takes the per-model path, which calls torch's kernels
    # as F.instance_norm does and so gives torch's result for it (the statistics as they are for an empty spatial
    # size; NaN statistics, or torch's error with an affine, for B = 0).
    shared = is_shared(x) and x.numel() > 0
    mixed = check_norm_dtypes("instance_norm", x, (weight, bias))
    if not use_input_stats and (running_mean is None or running_var is None):
        raise ValueError("instance_norm: running_mean and running_var are needed when use_input_stats is False")
    stats_dtype = x.dtype if weight is None else weight.dtype
    # (running_var comes with running_mean: checked above)
    if running_mean is not None and (
        running_mean.dtype != stats_dtype or cast(Tensor, running_var).dtype != stats_dtype
    ):
        mean, var = running_mean.to(stats_dtype), cast(Tensor, running_var).to(stats_dtype)
        out = instance_norm(x, mean, var, weight, bias, use_input_stats, momentum, eps)
        if use_input_stats:
            with torch.no_grad():
                running_mean.copy_(mean)
                cast(Tensor, running_var).copy_(var)
        return out
    if not use_input_stats:
        mean, var = cast(Tensor, running_mean), cast(Tensor, running_var)  # (checked above)
        return running_stats_norm(x[0] if shared else x, mean, var, weight, bias, eps, param_view)

    if shared and mixed:
        # The per-model affine below runs outside torch's kernel: normalise in float32, round once.
        return mixed_result(instance_norm(upcast(x), running_mean, running_var, weight, bias, True, momentum, eps), x)
    # Running statistics in float16/bfloat16 are blended by torch's kernel with roundings that a blend written here
    # does not reproduce (off by 1-3 ulps): such a shared batch takes the per-model path, which calls that kernel.
    if shared and (running_mean is None or running_mean.dtype not in _REDUCED_FLOATS):
        source = x[0]
        flat = source.reshape(1, batch * num_channels, *spatial)
        if running_mean is None:
            normalized = F.batch_norm(flat, None, None, training=True, eps=eps)
        else:
            # Every model sees the same per-sample statistics: computed once, into fresh buffers (momentum 1).
            sample_mean, sample_var = flat.new_zeros(flat.shape[1]), flat.new_zeros(flat.shape[1])
            normalized = F.batch_norm(flat, sample_mean, sample_var, training=True, momentum=1.0, eps=eps)
            _blend_running_stats(running_mean, cast(Tensor, running_var), sample_mean, sample_var, batch, momentum)
        return per_model_affine(normalized.view(source.shape), num_models, weight, bias, param_view)

    if x.stride(0) == num_channels * x.stride(2):
        packed = x.transpose(0, 1).reshape(batch, num_models * num_channels, *spatial)
        flat_mean, flat_var, flat_weight, flat_bias = (
            None if t is None else t.view(-1) for t in (running_mean, running_var, weight, bias)
        )
        out = F.instance_norm(
            packed,
            flat_mean,
            flat_var,
            flat_weight,
            flat_bias,
            use_input_stats=True,
            momentum=momentum,
            eps=eps,
        )
        return out.view(batch, num_models, num_channels, *spatial).transpose(0, 1)

    # What F.instance_norm does for one model, with the models folded into the batch: every (model, sample,
    # channel) becomes a channel of one batch_norm, the per-model parameters and statistics repeated per sample.
    # The affine inside the kernel measured 1.0-1.7x faster than F.instance_norm on (M*B, C, *) followed by the
    # per-model affine, and 1.4-3.2x faster than a loop over models (2-core CPU, torch 2.13, float32, 1 thread,
    # forward+backward, (M, B, C, H, W) = (8, 16, 16, 16, 16), (4, 32, 32, 8, 8), (16, 8, 8, 32, 32)).
    def per_instance(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.unsqueeze(1).expand(num_models, batch, num_channels).reshape(-1)

    repeated_mean, repeated_var = per_instance(running_mean), per_instance(running_var)
    flat = x.reshape(1, num_models * batch * num_channels, *spatial)
    out = F.batch_norm(flat, repeated_mean, repeated_var, per_instance(weight), per_instance(bias), True, momentum, eps)
    if running_mean is not None:
        # (repeated from running_mean and running_var, which comes with it)
        repeated_mean, repeated_var = cast(Tensor, repeated_mean), cast(Tensor, repeated_var)
        with torch.no_grad():
            running_mean.copy_(repeated_mean.view(num_models, batch, num_channels).mean(1))
            cast(Tensor, running_var).copy_(repeated_var.view(num_models, batch, num_channels).mean(1))
    return out.view(x.shape)


@torch.no_grad()
def _blend_running_stats(
    running_mean: Tensor, running_var: Tensor, sample_mean: Tensor, sample_var: Tensor, batch: int, momentum: float
) -> None:
    """torch's instance-norm update for a batch shared by every model: each model's running statistics
    blended with every sample's (the formula of torch's batch-norm kernel), then averaged over the samples."""
    for running, sample in ((running_mean, sample_mean), (running_var, sample_var)):
        blended = momentum * sample.view(1, batch, -1) + (1 - momentum) * running.unsqueeze(1)
        running.copy_(blended.mean(1))


def running_stats_norm(
    source: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    param_view: list[int],
) -> Tensor:
    """Normalisation by each model's running statistics, folded with its affine into one per-model scale and
    shift, ``x * scale + shift`` (the form of torch's CPU batch-norm kernel in eval mode); ``source`` is
    ``(M, B, C, *)`` or one shared ``(B, C, *)`` batch, broadcast over the models.

    A float16/bfloat16 ``source`` is computed in float32, as torch's kernel does, and the result rounded once to
    its dtype (also with float32 statistics and affine, torch's mixed precision).
    """
    opmath = torch.float32 if source.dtype in _REDUCED_FLOATS else source.dtype
    scale = torch.rsqrt(running_var.to(opmath) + eps)
    if weight is not None:
        scale = scale * weight.to(opmath)
    shift = -running_mean.to(opmath) * scale
    if bias is not None:
        shift = shift + bias.to(opmath)
    out = torch.addcmul(shift.view(param_view), source, scale.view(param_view))
    return out if out.dtype == source.dtype else mixed_result(out, source)
