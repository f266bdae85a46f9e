"""Batched convolution: M models' ``torch.nn.Conv*d`` at once, by one of several strategies.

Every strategy computes what a loop over ``torch.nn.Conv*d`` modules computes; they differ in speed, which
depends on the device and the shapes. :func:`conv` picks one through :mod:`batchlayers.backends`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends
from .._utils import is_shared

__all__ = ["conv", "heuristic_strategy", "padding_for_pad"]

_DENSE_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
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
    return [p for p in reversed(_tuple(padding, n)) for _ in range(2)]


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


def _grouped(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options) -> Tensor:
    num_models, out_channels = weight.shape[:2]
    flat_weight = weight.reshape(num_models * out_channels, *weight.shape[2:])
    flat_bias = None if bias is None else bias.reshape(-1)
    if not is_shared(x):
        # (M, B, C, *) -> (B, M*C, *): model m's channels form groups [m*groups, (m+1)*groups). A view when
        # x is the output of another grouped convolution in the same layout, else one copy, made straight
        # into the channels-last layout when that is wanted: (B, *, M*C) contiguous.
        batch, spatial = x.shape[1], x.shape[3:]
        if opts.memory_format is None:
            packed = x.transpose(0, 1).reshape(batch, -1, *spatial)
        else:
            packed = x.permute(1, *range(3, x.dim()), 0, 2).reshape(batch, *spatial, -1).movedim(-1, 1)
        y = _dense(packed, flat_weight, flat_bias, opts, opts.groups * num_models)
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


def _loop(x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options) -> Tensor:
    num_models = weight.shape[0]
    if is_shared(x):
        # Pad and convert the shared batch once, not once per model; what is left is a zero-padded conv.
        x0, padding = _prepare(x[0], weight.shape[3:], opts)
        inputs = [x0] * num_models
        opts = opts._replace(padding=padding, padding_mode="zeros")
    else:
        inputs = x.unbind(0)
    biases = [None] * num_models if bias is None else bias.unbind(0)
    return torch.stack([_dense(xm, wm, bm, opts, opts.groups) for xm, wm, bm in zip(inputs, weight.unbind(0), biases)])


_STRATEGIES = {
    "grouped": (_grouped, False),
    "grouped_channels_last": (_grouped, True),
    "loop": (_loop, False),
    "loop_channels_last": (_loop, True),
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
      3 input channels). ``benchmark = True`` finds the exceptions.

    Measured with torch 2.13 on a 2-core CPU shared with other work, so as single-thread CPU time
    (medians of interleaved repeats): conv 3->16 and 16->32, 3x3, 32x32 images, B=32, M in {4, 16},
    forward+backward and forward only, and a two-layer chain of both.

    For 1-D convolutions the channels-last strategies are the plain ones (PyTorch has no 3-D channels-last
    format).
    """
    if x.device.type == "cuda":
        return "grouped"
    return "grouped_channels_last" if is_shared(x) else "loop_channels_last"


def _resolve(strategy: str, x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options) -> str:
    if strategy == "auto":
        strategy = backends.conv.strategy
    if strategy != "auto":
        return strategy
    grad_needed = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    shape_key = (str(x.device), x.dtype, tuple(x.shape), tuple(weight.shape), bias is not None)
    key = (*shape_key, opts, is_shared(x), grad_needed)
    cached = backends.conv.cache.get(key)
    if cached is not None:
        return cached
    if not backends.conv.benchmark or torch.compiler.is_compiling():
        return heuristic_strategy(x, weight)
    names = [s for s in _STRATEGIES if weight.dim() - 3 in _CHANNELS_LAST or not s.endswith("_channels_last")]
    candidates = {name: partial(_timed_run, name, (x, weight, bias), grad_needed, opts) for name in names}
    winner = backends.fastest(candidates, x.device, backends.conv.benchmark_repeats)
    backends.conv.cache[key] = winner
    return winner


def _timed_run(strategy: str, tensors, grad_needed: bool, opts: _Options) -> None:
    """One forward (and backward when training) on detached copies: the layer's gradients stay untouched."""
    with torch.enable_grad() if grad_needed else torch.no_grad():
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors]
        y = _apply(strategy, *leaves, opts)
        if grad_needed:
            torch.autograd.grad(y, [t for t in leaves if t is not None and t.requires_grad], torch.ones_like(y))


def _apply(strategy: str, x: Tensor, weight: Tensor, bias: Tensor | None, opts: _Options) -> Tensor:
    fn, channels_last = _STRATEGIES[strategy]
    memory_format = _CHANNELS_LAST.get(weight.dim() - 3) if channels_last else None  # weight: (M, out, in, *k)
    return fn(x, weight, bias, opts._replace(memory_format=memory_format))


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
    hashable = [tuple(a) if isinstance(a, list) else a for a in (stride, padding, dilation)]
    opts = _Options(*hashable, groups, padding_mode)
    return _apply(_resolve(strategy, input, weight, bias, opts), input, weight, bias, opts)
