"""Large scratch tensors of batchlayers' own hand-written kernels, kept between calls on the CPU.

PyTorch's CPU allocator does not cache, and glibc gives a large freed block back to the system, so a tensor
of a few MiB allocated every training step is page-faulted in afresh every step (see
:class:`batchlayers.backends.CpuSettings`). The recurrent kernels (``batchlayers/functional/_recurrent.py``)
allocate such buffers for every step's gates and cell states, the fused linear chain
(``batchlayers/functional/_mlp.py``) for its hidden activations and their gradients; :func:`empty` hands them a
buffer that an earlier call allocated and nobody holds any more, so the pages stay mapped; the fused chain's
weight gradients, which autograd keeps as the parameters' ``.grad``, come from :func:`returned`, and the
per-model convolution loops and LSTM kernels stack their models' results (and, in backward, their input and
weight gradients) with :func:`stack` and :func:`unbind`, into the smallest free buffer that fits, and a stacked
model's own ReLU and max pooling (``batchlayers/functional/_kept.py``) write their results and input gradients
into one through :func:`returned_like`.

A kept buffer is handed out only when the pool holds the one reference to it and to its storage: a buffer
saved for a backward that has not run, viewed, or held by a gradient is never reused. Buffers are kept per
thread, and only on the CPU (CUDA's caching allocator reuses memory itself). When no kept buffer fits (the
first calls, or another sequence length), free buffers are dropped while they add up to more than the most
ever in use at once, and a miss for a flat buffer (``fits``) drops the free ones too small for it; the pool
never holds more than :data:`MAX_KEPT`.
``batchlayers.backends.cpu.reuse_workspace = False`` turns this off,
``batchlayers.backends.cpu.release_workspace()`` drops the calling thread's buffers.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from ._utils import no_function_transforms, stride_order

__all__ = [
    "AVAILABLE",
    "MAX_KEPT",
    "MIN_BYTES",
    "MMAP_BYTES",
    "applies",
    "empty",
    "release",
    "returned",
    "returned_like",
    "stack",
    "take",
    "unbind",
]

# Smaller buffers are allocated as usual: glibc reuses blocks this small from its heap (its mmap threshold
# starts at 128 KiB and rises to the largest block freed), so keeping them saves no page faults and costs the
# check. Measured (interleaved medians, 2-core CPU): the 10-20-2 MLP's hidden layer at M=64 (327 KB a buffer)
# trained 2-3% slower kept; at M=1024 (5.2 MB) 5-10% faster in a two-contender script (no difference in the
# quick benchmark's processes); the LSTM policies' (1-4 MB) 20-30% faster.
MIN_BYTES = 1 << 20
# From this size glibc always maps a block afresh from the OS and unmaps it when freed (its mmap threshold
# rises with the blocks freed, to at most 32 MiB on 64-bit systems): results a caller uses up at once are kept
# from here on only.
MMAP_BYTES = 32 << 20
# Buffers kept per thread at most: the recurrent kernels take up to seven a layer, forward and backward together.
MAX_KEPT = 32

_local = threading.local()
# Whether this torch has the reference counts that tell a free buffer (both torch's own, private); off if not.
AVAILABLE = hasattr(Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")
enabled = AVAILABLE


def _pool() -> list[Tensor]:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = []
        _local.peak = 0
    return pool


def _references(pool: list[Tensor], i: int) -> int:
    return sys.getrefcount(pool[i])


# What _references counts for a tensor that only a list holds (the list, and the call's own references):
# measured, not assumed, as the interpreter's way of passing arguments decides it.
_ONLY_THE_POOL = _references([torch.empty(0)], 0)


def _free(pool: list[Tensor], i: int) -> bool:
    """Only the pool holds its ``i``-th buffer: no Python name, nothing in C++ (a backward's saved tensors, a
    view's base) and no other tensor on its storage (``untyped_storage()`` itself adds one reference)."""
    t = pool[i]
    return (
        _references(pool, i) == _ONLY_THE_POOL + 1  # (+1: the name t)
        and t._use_count() == 1  # type: ignore[attr-defined]  # (torch's own, private)
        and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2
    )


def applies(like: Tensor, *shape: int, min_bytes: int | None = None) -> bool:
    """Whether :func:`empty` keeps a buffer of ``shape`` like ``like`` (else it is ``like.new_empty(shape)``): a
    plain CPU tensor (no subclass: a fake tensor of a tracer, a transform's wrapper) of at least
    :data:`MIN_BYTES` (or ``min_bytes``)."""
    return (  # (the size before the device: most calls are small, and is_cpu is the cheaper test)
        enabled
        and type(like) is Tensor
        and math.prod(shape) * like.element_size() >= (MIN_BYTES if min_bytes is None else min_bytes)
        and like.is_cpu
    )


def empty(like: Tensor, *shape: int) -> Tensor:
    """``like.new_empty(shape)``, a kept buffer where one is free (see the module docstring)."""
    return take(like, *shape) if applies(like, *shape) else like.new_empty(shape)


def returned(like: Tensor, *shape: int) -> Tensor:
    """:func:`empty` for a result the caller hands out, such as a gradient autograd keeps as a parameter's
    ``.grad``: a new tensor of its own on a kept buffer's memory. Autograd takes a gradient that nothing else
    references as the ``.grad`` itself (it copies one the pool would hold); the buffer's memory is then in use
    while that tensor, or anything on its memory, lives (after ``zero_grad()`` it is free again), so a
    gradient the caller still holds is never written. A 784-256-256-10 MLP's first weight gradient at M=64 is
    51 MB: glibc maps it afresh every backward (12.5k page faults a step) where it is not kept."""
    return take(like, *shape).detach() if applies(like, *shape) else like.new_empty(shape)


def take(like: Tensor, *shape: int, fits: bool = False) -> Tensor:
    """A kept buffer of ``shape`` like ``like``, one that is free or a new one, where :func:`applies` holds.

    With ``fits``, ``shape`` is one size and the smallest free flat buffer of at least that many elements
    serves: for a result that only borrows a buffer's memory (:func:`stack`), so that results of different
    sizes that are never alive at once (a convolution's output that its activation consumes, a later layer's,
    an input gradient in backward) share one buffer instead of each keeping its own."""
    pool = _pool()
    inference = torch.is_inference_mode_enabled()  # (a buffer made under inference mode is written only there)
    found = None
    for i in range(len(pool)):  # (pool[i], never a name: _free counts the references to it)
        if pool[i].dtype != like.dtype or not (inference or not pool[i].is_inference()):
            continue
        if fits:
            if pool[i].dim() != 1 or pool[i].numel() < shape[0]:
                continue
            if found is not None and pool[i].numel() >= pool[found].numel():
                continue
        elif pool[i].shape != shape:
            continue
        if _free(pool, i):
            found = i
            if not fits:
                break
    if found is not None:
        pool.append(pool.pop(found))  # (most recently used last)
        return pool[-1]
    # A miss: the first calls, more buffers in use at once than before, or other shapes (another sequence
    # length). Free buffers are dropped, least recently used first, while they add up to more than the most
    # ever in use at once: a steady run keeps its buffers, a run of changing shapes holds about one step's
    # worth beyond those in use.
    t = like.new_empty(shape)
    free = [i for i in range(len(pool)) if _free(pool, i)]
    free_bytes = sum(pool[i].nbytes for i in free)
    _local.peak = max(_local.peak, sum(u.nbytes for u in pool) - free_bytes + t.nbytes)  # (in use now)
    excess = free_bytes - _local.peak
    dropped = set()
    if fits:
        # A free flat buffer too small for this request goes: the new one (of its dtype, made in or out of
        # inference mode as it was) serves its requests too. The small CNN's first step otherwise left a 16 MiB
        # buffer beside three of 32 MiB that serve every step (its held memory plus step peak 1.11x
        # torch.func's, 1.00x without it).
        dropped = {
            i
            for i in free
            if pool[i].dim() == 1
            and pool[i].numel() < shape[0]
            and pool[i].dtype == t.dtype
            and pool[i].is_inference() == t.is_inference()
        }
        excess -= sum(pool[i].nbytes for i in dropped)
    for i in free:
        if excess <= 0:
            break
        if i not in dropped:
            dropped.add(i)
            excess -= pool[i].nbytes
    pool[:] = [pool[i] for i in range(len(pool)) if i not in dropped][-(MAX_KEPT - 1) :]
    pool.append(t)
    return t


def _dense(first: Tensor) -> bool:
    """Whether ``first`` fills its ``numel()`` elements of memory in some order of its dimensions (a contiguous
    or channels-last tensor); not with gaps, overlaps or a size-1 dimension's free stride."""
    strides = first.stride()
    expected = 1
    for d in reversed(stride_order(first)):  # (from the smallest stride up)
        if strides[d] != expected:
            return False
        expected *= first.shape[d]
    return True


def _own_functions_run() -> bool:
    """Outside compile, a torch.func transform and forward AD: :class:`_Stack` and :class:`_Unbind` (Functions
    without their rules) may run."""
    return not torch.compiler.is_compiling() and no_function_transforms()


def _stacks(tensors: Sequence[Tensor]) -> bool:
    """Whether :func:`stack` keeps the result: one dense layout (see :func:`_dense`) of a size that
    :func:`applies`, where :func:`_own_functions_run`."""
    first = tensors[0]
    return (
        _dense(first)
        and applies(first, len(tensors), first.numel())
        and all(
            t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype and type(t) is Tensor
            for t in tensors
        )
        and _own_functions_run()
    )


def _on_kept_memory(like: Tensor, shape: Sequence[int], strides: Sequence[int]) -> Tensor:
    """A new tensor of ``shape`` and ``strides`` (dense) on a kept buffer's memory, the smallest free one that
    fits: as :func:`returned`, its own tensor and not a view, so that autograd treats it as a fresh result."""
    buffer = take(like, math.prod(shape), fits=True)
    return like.new_empty(0).set_(buffer.untyped_storage(), 0, tuple(shape), tuple(strides))


def returned_like(x: Tensor) -> Tensor:
    """``torch.empty_like(x)`` of a dense ``x`` (see :func:`_dense`: the same shape and strides, contiguous or
    channels-last), on kept memory where :func:`applies`; a result the caller hands out, as :func:`returned`."""
    if not applies(x, x.numel()):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return _on_kept_memory(x, x.shape, x.stride())


def _stacked_empty(first: Tensor, count: int) -> Tensor:
    """A new ``(count, *first.shape)`` tensor whose slices are laid out as ``first``, on a kept buffer's memory
    (first is dense: checked by :func:`_stacks`)."""
    return _on_kept_memory(first, (count, *first.shape), (first.numel(), *first.stride()))


def _stacked_copy(tensors: Sequence[Tensor]) -> Tensor:
    out = _stacked_empty(tensors[0], len(tensors))
    for part, t in zip(out.unbind(0), tensors):
        part.copy_(t)
    return out


class _Stack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors: Tensor) -> Tensor:
        return _stacked_copy(tensors)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, ...]:
        return grad.unbind(0)  # (as torch.stack's backward: views)


class _Unbind(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> tuple[Tensor, ...]:
        return x.unbind(0)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> Tensor:
        # (an unused slice's gradient comes as zeros: a Function's gradients are materialized by default)
        if torch.is_grad_enabled() or not _stacks(grads):  # (create_graph: a result autograd records)
            return torch.stack(grads)
        return _stacked_copy(grads)


def stack(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.stack(tensors)`` of tensors of one shape and dense layout (the models' results of a per-model
    loop), each slice in their layout, into kept memory where it is large enough (:func:`applies`): a
    convolution loop's stacked output is as large as a layer's activations, which glibc maps afresh every step
    otherwise. The backward gives the gradient's slices, as ``torch.stack``'s. Small, strided or mixed
    tensors, and compiled or transformed code, take ``torch.stack``."""
    return _Stack.apply(*tensors) if _stacks(tensors) else torch.stack(tuple(tensors))


def unbind(x: Tensor) -> tuple[Tensor, ...]:
    """``x.unbind(0)``, whose backward stacks the slices' gradients as :func:`stack` does (autograd's own stacks
    them into fresh memory). Only where gradients are recorded into ``x`` and no transform or compile needs
    torch's op; else ``x.unbind(0)``."""
    if x.requires_grad and torch.is_grad_enabled() and _own_functions_run():
        return _Unbind.apply(x)
    return x.unbind(0)


def release() -> None:
    """Drop the calling thread's kept buffers."""
    _pool().clear()
    _local.peak = 0
