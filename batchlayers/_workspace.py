"""Large scratch tensors of batchlayers' own hand-written kernels, kept between calls on the CPU.

PyTorch's CPU allocator does not cache, and glibc gives a large freed block back to the system, so a tensor
of a few MiB allocated every training step is page-faulted in afresh every step (see
:class:`batchlayers.backends.CpuSettings`). The recurrent kernels (``batchlayers/functional/_recurrent.py``)
allocate such buffers for every step's gates and cell states; :func:`empty` hands them a buffer that an earlier
call allocated and nobody holds any more, so the pages stay mapped.

A kept buffer is handed out only when the pool holds the one reference to it and to its storage: a buffer
saved for a backward that has not run, viewed, or held by a gradient is never reused. Buffers are kept per
thread, and only on the CPU (CUDA's caching allocator reuses memory itself). When no kept buffer fits (the
first call, or another sequence length), the free ones are dropped: the pool holds the buffers in use and at
most one call's worth beyond them, never more than :data:`MAX_KEPT`.
``batchlayers.backends.cpu.reuse_workspace = False`` turns this off,
``batchlayers.backends.cpu.release_workspace()`` drops the calling thread's buffers.
"""

from __future__ import annotations

import math
import sys
import threading

import torch
from torch import Tensor

__all__ = ["MAX_KEPT", "MIN_BYTES", "empty", "release"]

# Below this size glibc serves a block from its heap and reuses it anyway (its initial mmap threshold).
MIN_BYTES = 1 << 17
# Buffers kept per thread at most: the recurrent kernels take up to seven a layer, forward and backward together.
MAX_KEPT = 32

_local = threading.local()
enabled = True


def _pool() -> list[Tensor]:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = []
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


def empty(like: Tensor, *shape: int) -> Tensor:
    """``like.new_empty(shape)``, a kept buffer where one is free (see the module docstring)."""
    if not enabled or like.device.type != "cpu" or math.prod(shape) * like.element_size() < MIN_BYTES:
        return like.new_empty(shape)
    pool = _pool()
    for i in range(len(pool)):
        if pool[i].shape == shape and pool[i].dtype == like.dtype and _free(pool, i):
            pool.append(pool.pop(i))  # (most recently used last)
            return pool[-1]
    # A miss: the shapes changed (another sequence length) or more buffers are in use at once than before. The
    # free ones are dropped, so that the pool holds no more than one call's buffers beyond those in use.
    pool[:] = [pool[i] for i in range(len(pool)) if not _free(pool, i)][-(MAX_KEPT - 1) :]
    pool.append(like.new_empty(shape))
    return pool[-1]


def release() -> None:
    """Drop the calling thread's kept buffers."""
    _pool().clear()
