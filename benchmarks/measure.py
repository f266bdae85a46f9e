"""Timing, memory and machine-rate measurements."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import Tensor

__all__ = ["gemm_gflops", "held_bytes", "keep_freed_memory", "peak_step_bytes", "time_interleaved", "MEMORY_METHOD"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    steps: Sequence[Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    budget_s: float,
    block_s: float = 0.01,
    tick: Callable[[], None] = lambda: None,
    faults: list[list[float]] | None = None,
) -> list[list[float]]:
    """Seconds per call of every step, measured round-robin in blocks.

    Each round runs every step for a block of consecutive calls (each call timed on its own), starting
    with a different step each round, so slow drifts of a shared machine hit all contenders alike. A block
    lasts about ``block_s`` (at least one call): a step of a few microseconds right after another
    contender's large step would otherwise be timed with cold caches every time, which no user running it
    in a loop sees. The warm-up rounds estimate each step's time; the number of timed rounds is then cut
    (to no fewer than 3) when ``iters`` rounds would exceed ``budget_s``.

    A ``faults`` list receives, per step, the process's minor page faults per call of each timed block (no
    entries where the platform has no ``getrusage``): a step that faults in fresh pages every call shows it.
    """
    count = len(steps)
    estimate = [float("inf")] * count
    for _ in range(warmup):
        for i, step in enumerate(steps):
            estimate[i] = min(estimate[i], _timed(step, device))
        tick()
    if warmup:
        blocks = [max(1, min(50, int(block_s / max(e, 1e-9)))) for e in estimate]
        round_s = sum(b * e for b, e in zip(blocks, estimate))
        rounds = max(3, min(iters, int(budget_s / max(round_s, 1e-9))))
    else:
        blocks, rounds = [1] * count, iters
    times: list[list[float]] = [[] for _ in steps]
    if faults is not None:
        faults[:] = [[] for _ in steps]
    for r in range(rounds):
        for k in range(count):
            i = (r + k) % count
            before = _minor_faults()
            times[i] += [_timed(steps[i], device) for _ in range(blocks[i])]
            if faults is not None and before is not None:
                faults[i].append((cast(int, _minor_faults()) - before) / blocks[i])
        tick()
    return times


def _minor_faults() -> int | None:
    """The process's minor page faults so far (all threads), or None without ``resource`` (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(step: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - t0


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ start/stop lines, written straight to file descriptor 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


MEMORY_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated during one step, above the memory allocated before it",
    "cpu": "torch.profiler allocation events (CPU tensor allocator) during one step: peak above the start",
}


def peak_step_bytes(step: Callable[[], object], device: torch.device) -> int | None:
    """Peak tensor memory one call of ``step`` allocates above what was live when it started."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile, record_function

        # The profiler reports no event when a tensor allocated before it started is freed (the last step's
        # gradients, freed by zero_grad), so a step profiled alone counts them as still held and its peak
        # depends on what ran before (measured: 6.0 MB for a step whose peak is 2.0 MB). Two steps are
        # profiled and the second measured: what it frees, the first step or itself allocated.
        # A profiled step now and then comes back without any allocation event (seen once in a test run, a
        # transformer training step, which always allocates): profiled once more, then no number, never 0.
        for _ in range(2):
            with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
                with record_function(_MEASURED):
                    step()
            marks, events = [], []
            pending = list(prof.profiler.kineto_results.experimental_event_tree())
            while pending:
                event = pending.pop()
                if event.tag == _EventType.Allocation and event.extra_fields.device.type == device.type:
                    events.append((event.start_time_ns, event.extra_fields.alloc_size))
                elif event.name == _MEASURED:
                    marks.append((event.start_time_ns, event.end_time_ns))
                pending.extend(event.children)
            if len(marks) != 1:
                return None
            start, end = marks[0]
            events = sorted(e for e in events if start <= e[0] <= end)
            if events:
                break
        if not events:
            return None
        live = peak = 0
        for _, size in events:  # frees are negative sizes
            live += size
            peak = max(peak, live)
        return peak
    except Exception:  # a private profiler API changed: report no number rather than a wrong one
        return None


_MEASURED = "benchmarks.measured_step"


def held_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a stride-0 expand counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def keep_freed_memory() -> bool:
    """``batchlayers.backends.cpu.keep_freed_memory()``: glibc keeps freed memory for reuse, so large tensors do
    not page-fault every step. Returns whether it was applied (glibc only)."""
    import batchlayers

    return batchlayers.backends.cpu.keep_freed_memory()


def can_keep_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` can apply here (glibc's ``mallopt`` exists), without applying it."""
    from batchlayers.backends import _glibc_mallopt

    return _glibc_mallopt() is not None


def gemm_gflops(device: torch.device, dtype: torch.dtype, size: int = 1024, reps: int = 10) -> float:
    """The machine's dense GEMM rate: median time of a ``size``-cubed matrix multiply, in GFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / median(times) / 1e9
