"""Batched convolution: M models' ``torch.nn.Conv*d`` (and ``ConvTranspose*d``) at once, by one of several
strategies.

Every strategy computes what a loop over ``torch.nn.Conv*d`` modules computes; they differ in speed, which
depends on the device and the shapes. :func:`conv` and :func:`conv_transpose` pick one through
:mod:`batchlayers.backends`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _workspace, backends
from .._utils import (
    _fmt,
    check_call_input,
    check_parameter,
    function_transform_active,
    in_order,
    is_shared,
    stride_order,
)

__all__ = ["conv", "conv_transpose", "heuristic_strategy", "heuristic_transpose_strategy", "padding_for_pad"]

_DENSE_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_DENSE_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# PyTorch has channels-last formats for 4-D and 5-D tensors only, i.e. 2-D and 3-D convolutions.
_CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}

_IntOrTuple = int | Sequence[int]


def _tuple(value: _IntOrTuple, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,) * n


def padding_for_pad(padding: str | _IntOrTuple, kernel_size: Sequence[int], dilation: _IntOrTuple) -> list[int]:
    """``torch.nn.Conv*``'s ``_reversed_padding_repeated_twice``: the ``F.pad`` argument (last dimension
    first, left then right) that gives the same padding; for ``'same'`` the extra pixel of an even
    effective kernel goes to the right, as in torch."""
    n = len(kernel_size)
    if padding == "valid":
        return [0, 0] * n
    if padding == "same":
        pads = []
        for d, k in zip(reversed(_tuple(dilation, n)), reversed(kernel_size), strict=True):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return pads
    return [p for p in reversed(_tuple(cast(_IntOrTuple, padding), n)) for _ in range(2)]  # the strings: above


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


class _Options(NamedTuple):
    """The per-call convolution arguments, hashable so they can be part of a cache key."""

    stride: _IntOrTuple
    padding: str | _IntOrTuple
    dilation: _IntOrTuple
    groups: int
    padding_mode: str
    memory_format: torch.memory_format | None = None


def _prepare(x: Tensor, kernel_size: Sequence[int], opts: _Options) -> tuple[Tensor, str | _IntOrTuple]:
    """Explicit padding where the convolution cannot pad by itself, and the memory format: returns the input
    and the padding left for the convolution (as ``torch.nn.Conv*._conv_forward`` does)."""
    padding = opts.padding
    if opts.padding_mode != "zeros" or padding == "same":
        pads = padding_for_pad(padding, kernel_size, opts.dilation)
        if opts.padding_mode == "zeros" and pads[::2] == pads[1::2]:
            padding = tuple(reversed(pads[::2]))  # symmetric 'same': the convolution pads, no copy
        else:
            # Asymmetric 'same' (an even effective kernel) gets the same zero-padded copy torch makes inside
            # F.conv*, made here once, without its warning about the copy.
            mode = "constant" if opts.padding_mode == "zeros" else opts.padding_mode
            x = F.pad(x, pads, mode=mode)
            padding = 0
    if opts.memory_format is not None:
        x = x.contiguous(memory_format=opts.memory_format)
    return x, padding


def _dense(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options, groups: int) -> Tensor:
    """One ``torch.nn.Conv*``-style convolution of a torch-layout ``(N, C, *)`` batch."""
    x, padding = _prepare(x, weight.shape[2:], opts)
    if opts.memory_format is not None:
        weight = weight.contiguous(memory_format=opts.memory_format)
    return _DENSE_CONV[weight.dim() - 2](x, weight, bias, opts.stride, padding, opts.dilation, groups)


def _pack_models(x: Tensor, memory_format: torch.memory_format | None) -> Tensor:
    """(M, B, C, *) -> (B, M*C, *): model m's channels form groups [m*groups, (m+1)*groups). A view when x is
    the output of another grouped convolution in the same layout, else one copy, made straight into the
    channels-last layout when that is wanted: (B, *, M*C) contiguous."""
    batch, spatial = x.shape[1], x.shape[3:]
    channels = x.shape[0] * x.shape[2]  # explicit, not -1: an empty batch (B = 0) has no size to infer it from
    if memory_format is None:
        return x.transpose(0, 1).reshape(batch, channels, *spatial)
    return x.permute(1, *range(3, x.dim()), 0, 2).reshape(batch, *spatial, channels).movedim(-1, 1)


def _grouped(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options) -> Tensor:
    num_models, out_channels = weight.shape[:2]
    flat_weight = weight.reshape(num_models * out_channels, *weight.shape[2:])
    flat_bias = None if bias is None else bias.reshape(-1)
    if not is_shared(x):
        y = _dense(_pack_models(x, opts.memory_format), flat_weight, flat_bias, opts, opts.groups * num_models)
        return y.unflatten(1, (num_models, out_channels)).transpose(0, 1)
    # A shared batch: one convolution of the batch itself against every model's filters, no M-fold copy.
    if opts.groups == 1:
        y = _dense(x[0], flat_weight, flat_bias, opts, 1)
        return y.unflatten(1, (num_models, out_channels)).transpose(0, 1)
    # With groups, output channels must stay grouped by input group: order them (groups, M, out/groups).
    groups, per_group = opts.groups, out_channels // opts.groups
    group_major = weight.unflatten(1, (groups, per_group)).transpose(0, 1).reshape(flat_weight.shape)
    group_major_bias = None if bias is None else bias.unflatten(1, (groups, per_group)).transpose(0, 1).reshape(-1)
    y = _dense(x[0], group_major, group_major_bias, opts, groups)
    return y.unflatten(1, (groups, num_models, per_group)).movedim(2, 0).flatten(2, 3)


class _GradientInInputLayout(torch.autograd.Function):
    """The identity, whose backward gives the gradient the input's memory format.

    A channels-last convolution of a contiguous input returns its input gradient channels-last; the
    elementwise backward before it (ReLU's ``threshold_backward``, a residual add) then mixes layouts, which
    is slow: ``threshold_backward`` with a channels-last gradient and a contiguous saved output took 7.8 ms
    instead of 0.54 ms (128x16x32x32, 2 threads). One copy of the gradient into the input's layout is cheaper.
    """

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.contiguous = inputs[0].is_contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        if not ctx.contiguous or grad.is_contiguous():
            return grad
        if torch.is_grad_enabled():  # (create_graph: a copy autograd records)
            return grad.contiguous()
        return _workspace.returned(grad, *grad.shape).copy_(grad)  # (kept memory where large, as the loops' stacks)


def _loop(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options) -> Tensor:
    num_models = weight.shape[0]
    if (
        opts.memory_format is not None
        and x.requires_grad
        and x.is_contiguous()
        and not torch.compiler.is_compiling()  # inductor plans its own layouts
    ):
        x = _GradientInInputLayout.apply(x)
    if is_shared(x):
        # Pad and convert the shared batch once, not once per model; what is left is a zero-padded conv.
        x0, padding = _prepare(x[0], weight.shape[3:], opts)
        inputs: Sequence[Tensor] = [x0] * num_models
        opts = opts._replace(padding=padding, padding_mode="zeros")
    else:
        inputs = _workspace.unbind(x)
    biases = [None] * num_models if bias is None else bias.unbind(0)
    # kept memory: the stacked result is a whole layer's activations, which glibc would map afresh every step
    return _workspace.stack(
        [_dense(xm, wm, bm, opts, opts.groups) for xm, wm, bm in zip(inputs, weight.unbind(0), biases)]
    )


_STRATEGIES = {
    "grouped": (_grouped, False),
    "grouped_channels_last": (_grouped, True),
    "loop": (_loop, False),
    "loop_channels_last": (_loop, True),
}


class _TransposeOptions(NamedTuple):
    """The per-call transposed-convolution arguments, in ``F.conv_transpose*d``'s order, hashable."""

    stride: _IntOrTuple
    padding: _IntOrTuple
    output_padding: _IntOrTuple
    groups: int
    dilation: _IntOrTuple
    memory_format: torch.memory_format | None = None


def _dense_transpose(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _TransposeOptions, groups: int) -> Tensor:
    """One ``torch.nn.ConvTranspose*``-style transposed convolution of a torch-layout ``(N, C, *)`` batch."""
    if opts.memory_format is not None:
        x = x.contiguous(memory_format=opts.memory_format)
        weight = weight.contiguous(memory_format=opts.memory_format)
    conv_transpose_nd = _DENSE_CONV_TRANSPOSE[weight.dim() - 2]
    return conv_transpose_nd(x, weight, bias, opts.stride, opts.padding, opts.output_padding, groups, opts.dilation)


def _grouped_transpose(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _TransposeOptions) -> Tensor:
    num_models, in_channels, per_group = weight.shape[:3]
    groups, kernel_size = opts.groups, weight.shape[3:]
    if not is_shared(x):
        # Models packed along channels, (B, M*C_in, *), one transposed convolution with M*groups groups:
        # group m*groups + j is model m's group j, in its input channels, weight rows and output channels.
        flat_weight = weight.reshape(num_models * in_channels, per_group, *kernel_size)
        flat_bias = None if bias is None else bias.reshape(-1)
        y = _dense_transpose(_pack_models(x, opts.memory_format), flat_weight, flat_bias, opts, groups * num_models)
        return y.unflatten(1, (num_models, groups * per_group)).transpose(0, 1)
    # A shared batch: one transposed convolution of the batch itself, every model's filters stacked along the
    # output channels of each group, ordered (groups, M, out/groups); no M-fold copy of the batch.
    stacked_weight = weight.transpose(0, 1).reshape(in_channels, num_models * per_group, *kernel_size)
    stacked_bias = None if bias is None else bias.unflatten(1, (groups, per_group)).transpose(0, 1).reshape(-1)
    y = _dense_transpose(x[0], stacked_weight, stacked_bias, opts, groups)
    return y.unflatten(1, (groups, num_models, per_group)).movedim(2, 0).flatten(2, 3)


def _loop_transpose(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _TransposeOptions) -> Tensor:
    num_models = weight.shape[0]
    if is_shared(x):
        x0 = x[0] if opts.memory_format is None else x[0].contiguous(memory_format=opts.memory_format)
        inputs: Sequence[Tensor] = [x0] * num_models  # converted once, not once per model
    else:
        inputs = _workspace.unbind(x)
    biases = [None] * num_models if bias is None else bias.unbind(0)
    return _workspace.stack(
        [_dense_transpose(xm, wm, bm, opts, opts.groups) for xm, wm, bm in zip(inputs, weight.unbind(0), biases)]
    )


_TRANSPOSE_STRATEGIES = {
    "grouped": (_grouped_transpose, False),
    "grouped_channels_last": (_grouped_transpose, True),
    "loop": (_loop_transpose, False),
    "loop_channels_last": (_loop_transpose, True),
}


def heuristic_strategy(x: Tensor, weight: Tensor) -> str:
    """The strategy ``"auto"`` uses when nothing is cached and benchmarking is off.

    - CUDA: ``"grouped"``, one kernel for all models instead of M launches (not measured by us yet).
    - CPU, a shared batch: ``"grouped_channels_last"``, one convolution of the batch against all models'
      filters: fastest or within 8% of the fastest in every shape measured, 1.3-1.5x faster than the
      plain-layout ``"grouped"``.
    - CPU, a batch per model: ``"loop_channels_last"``: forward+backward, fastest or within 12% of the
      fastest in every shape measured (forward only, one exception: 3->16 at M=4, 2x slower than
      ``"grouped_channels_last"``); the packed ``"grouped"`` was 1.4-2.9x slower than the best (worst with
      3 input channels). ``backends.conv.tune(step)`` finds the exceptions.

    Measured with torch 2.13 on a 2-core CPU shared with other work, so as single-thread CPU time
    (medians of interleaved repeats): conv 3->16 and 16->32, 3x3, 32x32 images, B=32, M in {4, 16},
    forward+backward and forward only, and a two-layer chain of both. Checked inside whole training steps
    (every convolution forced to one strategy, 2 threads, ms): stacked ResNet M=4 ``loop_channels_last`` 120,
    ``loop`` 117, ``grouped_channels_last`` 160, ``grouped`` 163; small CNN M=16: 100, 117, 149, 137.

    For 1-D convolutions the channels-last strategies are the plain ones (PyTorch has no 3-D channels-last
    format).
    """
    if x.device.type == "cuda":
        return "grouped"
    return "grouped_channels_last" if is_shared(x) else "loop_channels_last"


def heuristic_transpose_strategy(x: Tensor, weight: Tensor) -> str:
    """The strategy ``"auto"`` uses for a transposed convolution when nothing is cached and benchmarking is
    off, measured for transposed convolutions on their own (it differs from :func:`heuristic_strategy` in 1-D
    and for a shared batch with gradients).

    - CUDA: ``"grouped"``, one kernel for all models (not measured by us yet).
    - CPU, 1-D: ``"grouped"``, 1.4-3x faster than ``"loop"`` in every case measured.
    - CPU, 2-D/3-D, a batch per model: ``"loop_channels_last"``: forward+backward the fastest in 21 of 31
      cases, within 1.11x in 26 and within 1.37x in all (the exceptions: 3-D with 4 output channels and a
      1x1 -> 4x4 generator input, where a grouped strategy won); forward only within 1.5x of the fastest
      (``"grouped_channels_last"`` with few channels). The grouped strategies were up to 2x
      (``"grouped_channels_last"``) and 4.4x (``"grouped"``) slower than the fastest.
    - CPU, 2-D/3-D, a shared batch, forward only: ``"grouped_channels_last"``, the fastest in every case
      measured (1.5-10x faster than the loops).
    - CPU, 2-D/3-D, a shared batch, with gradients: no strategy was always close to the fastest
      (``"grouped_channels_last"`` up to 1.7x slower, ``"loop_channels_last"`` 2.8x, ``"grouped"`` 2x). The
      loops mostly won with 16 or more output channels (per group), the grouped ones with fewer, so:
      ``"loop_channels_last"`` from 16 output channels (within 1.36x of the fastest in those 15 cases, mean
      1.10x, where ``"grouped_channels_last"`` was within 1.7x, mean 1.26x), else ``"grouped_channels_last"``
      (within 1.68x, mean 1.13x, in those 16 cases, where ``"loop_channels_last"`` was up to 2.8x slower).

    ``backends.conv.tune(step)`` finds the exceptions. Measured with torch 2.13 on a 2-core CPU shared with other
    work, so as single-thread CPU time (medians of 9-11 interleaved repeats, float32): 2-D decoder layers
    k4 s2 p1 32->16, 16->8 on 16x16 and 8->4, 16->3 on 32x32, 64->32 k2 s2 on 8x8, 3->16 k3 p1 on 16x16 (all
    B=16), a 64->32 k4 generator input on 1x1 (B=64); 1-D 16->8 k4 s2 p1 on L=64 (B=16); 3-D 8->4 and
    16->16 k2 s2 on 6^3 (B=8); M in {4, 8, 16}, forward+backward and forward only, shared and per-model.
    """
    if x.device.type == "cuda":
        return "grouped"
    if weight.dim() - 3 not in _CHANNELS_LAST:
        return "grouped"
    if not is_shared(x):
        return "loop_channels_last"
    grad_needed = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    out_per_group = weight.shape[2]  # weight: (M, C_in, C_out // groups, *k)
    return "loop_channels_last" if grad_needed and out_per_group >= 16 else "grouped_channels_last"


def _resolve(
    strategy: str, x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options | _TransposeOptions
) -> tuple[str, tuple[int, ...] | None]:
    """The strategy to run and the layout (dimension order, outermost first) to give its result: ``None``
    (the strategy's own) unless ``benchmark`` chose it over the heuristic (see :func:`_measure`)."""
    if strategy == "auto":
        strategy = backends.conv.strategy
    if strategy != "auto":
        return strategy, None
    transposed = isinstance(opts, _TransposeOptions)
    grad_needed = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    shape_key = (str(x.device), x.dtype, tuple(x.shape), tuple(weight.shape), bias is not None)
    # ``transposed`` in the key: the two option tuples are different types but compare as plain tuples.
    key = (*shape_key, opts, is_shared(x), grad_needed, *(("transposed",) if transposed else ()))
    table = _TRANSPOSE_STRATEGIES if transposed else _STRATEGIES
    names = [s for s in table if weight.dim() - 3 in _CHANNELS_LAST or not s.endswith("_channels_last")]
    recording = backends.conv.recording
    if recording is not None and key not in recording:
        recording[key] = names  # backends.conv.tune() times these inside the whole step
    cached = backends.conv.cache.get(key)
    if cached is not None:
        return cached, backends.conv.layouts.get(key)
    heuristic = (heuristic_transpose_strategy if transposed else heuristic_strategy)(x, weight)
    if not backends.conv.benchmark or torch.compiler.is_compiling():
        return heuristic, None
    # (1-D: the channels-last strategies are the plain ones, and only those are candidates)
    plain = heuristic if heuristic in names else heuristic.removesuffix("_channels_last")
    winner, layout = _measure(names, plain, (x, weight, bias), grad_needed, opts)
    backends.conv.cache[key] = winner
    if layout is not None:
        backends.conv.layouts[key] = layout
    return winner, layout


def _measure(
    names: list[str],
    heuristic: str,
    tensors: tuple[Tensor, Tensor, Tensor | None],
    grad_needed: bool,
    opts: _Options | _TransposeOptions,
) -> tuple[str, tuple[int, ...] | None]:
    """``benchmark = True``'s choice: the fastest strategy with its result copied into the heuristic's layout
    (timed with the copy), and that layout where it is another strategy's.

    Every strategy leaves its result in a layout of its own, and the layers after a convolution (batch norm,
    activations, a residual add, the next convolution, and their backward) run on it: timed alone, a
    strategy whose layout slows all of them won, and the stacked small ResNet trained 1.2x slower on a
    2-core CPU (91 -> 109 ms a step). With the copy, the rest of the model runs as with the heuristic."""
    with torch.no_grad():
        layout = _dense_order(_apply(heuristic, *tensors, opts))
    candidates = {name: partial(_timed_run, name, tensors, grad_needed, opts, layout) for name in names}
    winner = backends.fastest(candidates, tensors[0].device, backends.conv.benchmark_repeats)
    return winner, (None if winner == heuristic else layout)


def _dense_order(t: Tensor) -> tuple[int, ...] | None:
    """``t``'s dimensions from outermost to innermost where ``t`` is dense in that order, else None."""
    order = stride_order(t)
    return order if t.permute(order).is_contiguous() else None


def _in_layout(y: Tensor, layout: tuple[int, ...] | None) -> Tensor:
    """``y`` copied into ``layout`` (see :func:`_dense_order`) where it is not so already (autograd records
    the copy); as it is without a layout and under torch.func transforms (which copy into their own)."""
    return y if layout is None or function_transform_active() else in_order(y, layout)


def _timed_run(
    strategy: str,
    tensors: tuple[Tensor, Tensor, Tensor | None],
    grad_needed: bool,
    opts: _Options | _TransposeOptions,
    layout: tuple[int, ...] | None = None,
) -> None:
    """One forward (and backward when training) on detached copies, the result in ``layout``: the layer's
    gradients stay untouched."""
    with torch.enable_grad() if grad_needed else torch.no_grad():
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors]
        x, weight, bias = leaves
        y = _in_layout(_apply(strategy, cast(Tensor, x), cast(Tensor, weight), bias, opts), layout)
        if grad_needed:
            torch.autograd.grad(y, [t for t in leaves if t is not None and t.requires_grad], torch.ones_like(y))


def _apply(strategy: str, x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options | _TransposeOptions) -> Tensor:
    table = _TRANSPOSE_STRATEGIES if isinstance(opts, _TransposeOptions) else _STRATEGIES
    fn, channels_last = cast("tuple[Callable[..., Tensor], bool]", table[strategy])  # takes opts of its kind
    # (Not under a torch.func transform: vmap copies into no memory format but the contiguous one.)
    channels_last = channels_last and not function_transform_active()
    memory_format = _CHANNELS_LAST.get(weight.dim() - 3) if channels_last else None  # weight: (M, out, in, *k)
    return fn(x, weight, bias, opts._replace(memory_format=memory_format))


def _check_conv_arguments(
    function: str, input: object, weight: object, bias: object, groups: object, transposed: bool
) -> None:
    """Refuse, naming ``function``, a weight that is not ``(M, C_out, C_in // groups, *k)`` (transposed:
    ``(M, C_in, C_out // groups, *k)``) or an input and bias that do not fit it: torch's messages name the
    folded shapes, and an input of another number of models would silently run that many models."""
    layout = "(M, C_in, C_out // groups, *kernel_size)" if transposed else "(M, C_out, C_in // groups, *kernel_size)"
    if not isinstance(weight, Tensor):
        raise TypeError(f"{function}: expected weight {layout} to be a Tensor, got {type(weight).__name__}")
    if weight.dim() not in (4, 5, 6):
        raise ValueError(
            f"{function}: expected a 4-, 5- or 6-D weight {layout} (1-, 2- or 3-D convolutions), got shape "
            f"{_fmt(weight.shape)}"
        )
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{function}: groups must be a positive int, got {groups!r}")
    num_models, first, second = weight.shape[:3]
    if first % groups:
        what = "C_in" if transposed else "C_out"
        raise ValueError(f"{function}: {what}={first} (weight dimension 1) must be divisible by groups={groups}")
    in_channels, out_channels = (first, second * groups) if transposed else (second * groups, first)
    spatial = ", ".join("LHW"[:1] if weight.dim() == 4 else ("HW" if weight.dim() == 5 else "DHW"))
    check_call_input(
        function,
        input,
        num_models,
        channels=("C_in", in_channels),
        ndims=[weight.dim()],
        layout=f"(M, B, C_in, {spatial})",
    )
    check_parameter(function, "bias", bias, (num_models, out_channels), "(M, C_out)")


def conv(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _IntOrTuple = 1,
    padding: str | _IntOrTuple = 0,
    dilation: _IntOrTuple = 1,
    groups: int = 1,
    *,
    padding_mode: str = "zeros",
    strategy: str = "auto",
) -> Tensor:
    """Apply model ``m``'s convolution to ``input[m]`` for every model at once (1-D, 2-D or 3-D, from the
    weight's shape), exactly like ``torch.nn.Conv*d`` with ``weight[m]`` and ``bias[m]``.

    Args:
        input: ``(M, B, C_in, *spatial)``; a shared batch may be a stride-0 expand, it is never copied.
        weight: ``(M, C_out, C_in // groups, *kernel_size)``.
        bias: ``(M, C_out)`` or ``None``.
        stride, padding, dilation, groups: as in ``torch.nn.functional.conv2d``; ``padding`` may be an int,
            a tuple, ``'same'`` or ``'valid'``.
        padding_mode: ``'zeros'``, ``'reflect'``, ``'replicate'`` or ``'circular'``, as in ``torch.nn.Conv2d``.
        strategy: ``'auto'`` (see :mod:`batchlayers.backends`) or one of
            :data:`batchlayers.backends.CONV_STRATEGIES`.

    Returns:
        ``(M, B, C_out, *spatial_out)``. The ``"grouped"`` strategies return a transposed view of a packed
        ``(B, M*C_out, *spatial_out)`` tensor (except for a shared batch with ``groups > 1``), so a following
        layer that computes in the packed layout gets it back with a free reshape.
    """
    backends.check_conv_strategy(strategy, "batchlayers.functional.conv")
    _check_conv_arguments("batchlayers.functional.conv", input, weight, bias, groups, transposed=False)
    if isinstance(padding, str) and padding not in ("valid", "same"):
        raise ValueError(f"batchlayers.functional.conv: padding must be 'valid', 'same' or ints, got {padding!r}")
    if padding_mode not in _PADDING_MODES:
        raise ValueError(
            f"batchlayers.functional.conv: padding_mode must be one of {_PADDING_MODES}, got {padding_mode!r}"
        )
    hashable: list[Any] = [tuple(a) if isinstance(a, list) else a for a in (stride, padding, dilation)]
    stride, padding, dilation = hashable
    opts = _Options(stride, padding, dilation, groups, padding_mode)
    chosen, layout = _resolve(strategy, input, weight, bias, opts)
    return _in_layout(_apply(chosen, input, weight, bias, opts), layout)


def conv_transpose(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _IntOrTuple = 1,
    padding: _IntOrTuple = 0,
    output_padding: _IntOrTuple = 0,
    groups: int = 1,
    dilation: _IntOrTuple = 1,
    *,
    strategy: str = "auto",
) -> Tensor:
    """Apply model ``m``'s transposed convolution to ``input[m]`` for every model at once (1-D, 2-D or 3-D, from
    the weight's shape), exactly like ``torch.nn.functional.conv_transpose*d`` with ``weight[m]`` and
    ``bias[m]``. Arguments in ``F.conv_transpose2d``'s order.

    Args:
        input: ``(M, B, C_in, *spatial)``; a shared batch may be a stride-0 expand, it is never copied.
        weight: ``(M, C_in, C_out // groups, *kernel_size)``.
        bias: ``(M, C_out)`` or ``None``.
        stride, padding, output_padding, groups, dilation: as in ``torch.nn.functional.conv_transpose2d``
            (ints or tuples; ``output_padding`` as computed by ``torch.nn.ConvTranspose2d`` from an
            ``output_size``).
        strategy: ``'auto'`` (see :mod:`batchlayers.backends` and :func:`heuristic_transpose_strategy`) or one
            of :data:`batchlayers.backends.CONV_STRATEGIES`: the same four ways as :func:`conv`.

    Returns:
        ``(M, B, C_out, *spatial_out)``. The ``"grouped"`` strategies with a batch per model return a
        transposed view of a packed ``(B, M*C_out, *spatial_out)`` tensor, as :func:`conv` does.
    """
    backends.check_conv_strategy(strategy, "batchlayers.functional.conv_transpose")
    _check_conv_arguments("batchlayers.functional.conv_transpose", input, weight, bias, groups, transposed=True)
    hashable = [tuple(a) if isinstance(a, list) else a for a in (stride, padding, output_padding, dilation)]
    stride, padding, output_padding, dilation = hashable
    opts = _TransposeOptions(stride, padding, output_padding, groups, dilation)
    chosen, layout = _resolve(strategy, input, weight, bias, opts)
    return _in_layout(_apply(chosen, input, weight, bias, opts), layout)
