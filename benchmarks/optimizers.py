"""``python -m benchmarks.optimizers``: one optimizer step, ``batchlayers.optim`` against ``torch.optim``.

Every contender steps its own copy of the same stacked parameters ``(M, *shape)`` (gradients set once), and
one ``step()`` is timed: interleaved in one process (rounds of blocks of calls, each round starting with
another contender, as ``benchmarks.measure.time_interleaved``), repeated, medians reported, with the ratio to
torch's fused implementation of the same algorithm (torch has no fused RMSprop: its rows compare with fused
Adam). ``--clock thread`` (with ``--threads 1``) times the CPU time of the one thread doing the work instead
of wall time: on a shared machine the time the thread waits for a core then counts for no contender.

Contenders: ``torch default`` / ``torch foreach`` / ``torch fused`` (a float learning rate over the stacked
parameters, as one model), and ``batchlayers`` with a float learning rate and with an ``(M,)`` one, each on
its foreach path (the default) and its ``fused=True`` path (in float32 with a float learning rate torch's
own fused kernel, but for RMSprop; otherwise a compiled kernel, compiled before timing; the first step's
seconds are reported apart).

Examples::

    python -m benchmarks.optimizers                         # every parameter set and optimizer
    python -m benchmarks.optimizers --quick                 # fewer rounds
    python -m benchmarks.optimizers --sets mlp-tiny-64 --optimizers Adam --repeats 5
    python -m benchmarks.optimizers --threads 1 --clock thread    # a busy shared machine
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import batchlayers as bl

from .measure import keep_freed_memory
from .report import write_results
from .workloads import SmallResNet, mlp

__all__ = ["main", "parse_args", "run"]


def _shapes(module: torch.nn.Module, num_models: int) -> list[tuple[int, ...]]:
    return [(num_models, *p.shape) for p in module.parameters()]


# One model's parameters, stacked M times: the benchmark workloads' models.
PARAMETER_SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "mlp-tiny-64": lambda: _shapes(mlp(10, 20, 2), 64),
    "mlp-tiny-1024": lambda: _shapes(mlp(10, 20, 2), 1024),
    "mlp-wide-64": lambda: _shapes(mlp(784, 256, 256, 10), 64),
    "resnet-16": lambda: _shapes(SmallResNet(), 16),  # 20 tensors: convolutions, BatchNorm, linear
}

# (torch class, batchlayers class, hyperparameters other than lr, lr, torch class the ratio compares with)
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, bl.optim.Adam, {}, 1e-3, torch.optim.Adam),
    "AdamW": (torch.optim.AdamW, bl.optim.AdamW, {"weight_decay": 1e-2}, 1e-3, torch.optim.AdamW),
    "SGD": (torch.optim.SGD, bl.optim.SGD, {"momentum": 0.9}, 1e-2, torch.optim.SGD),
    "RMSprop": (torch.optim.RMSprop, bl.optim.RMSprop, {}, 1e-2, torch.optim.Adam),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.optimizers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default: cuda if any")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--sets", nargs="+", choices=list(PARAMETER_SETS), default=list(PARAMETER_SETS))
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, as python -m benchmarks)")
    parser.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="wall time, or the CPU time of the calling thread"
    )
    parser.add_argument("--repeats", type=int, help="interleaved runs per configuration, pooled (default 3, quick 2)")
    parser.add_argument("--budget-s", type=float, help="seconds of timed rounds per run (default 3, quick 1)")
    parser.add_argument("--no-fused", action="store_true", help="skip the compiled batchlayers paths")
    parser.add_argument(
        "--keep-freed-memory", action="store_true", help="glibc keeps freed memory (as python -m benchmarks)"
    )
    parser.add_argument("--results-file", type=pathlib.Path, help="default: results/optimizers_<setup>.csv")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    args.budget_s = args.budget_s if args.budget_s is not None else (1.0 if args.quick else 3.0)
    if args.clock == "thread" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock thread measures one CPU thread: it needs --threads 1 and --device cpu")
    return args


@dataclass
class Contender:
    name: str
    optimizer: torch.optim.Optimizer
    first_step_s: float = 0.0


def _contenders(
    optimizer_name: str, shapes: list[tuple[int, ...]], device: torch.device, dtype: torch.dtype, fused: bool
) -> list[Contender]:
    torch_cls, batched_cls, kwargs, lr, _ = OPTIMIZERS[optimizer_name]
    num_models = shapes[0][0]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-2).to(device, dtype) for s in shapes]

    def params() -> list[torch.nn.Parameter]:
        out = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(out, grads):
            p.grad = g.clone()
        return out

    per_model_lr = torch.logspace(-1, 1, num_models, dtype=torch.float64) * lr
    specs: list[tuple[str, Callable[[], torch.optim.Optimizer]]] = [
        ("torch default", lambda: torch_cls(params(), lr=lr, **kwargs)),
        ("torch foreach", lambda: torch_cls(params(), lr=lr, foreach=True, **kwargs)),
    ]
    if torch_cls is not torch.optim.RMSprop:
        specs.append(("torch fused", lambda: torch_cls(params(), lr=lr, fused=True, **kwargs)))
    for lr_name, value in (("float lr", lr), ("(M,) lr", per_model_lr)):
        for path in ("foreach", "fused") if fused else ("foreach",):
            specs.append(
                (
                    f"batchlayers {lr_name}" + (" fused" if path == "fused" else ""),
                    lambda v=value, f=path == "fused": batched_cls(params(), lr=v, fused=f, **kwargs),
                )
            )
    contenders = []
    for name, make in specs:
        optimizer = make()
        _sync(device)
        t0 = time.perf_counter()
        optimizer.step()  # creates the state; compiles the fused paths
        _sync(device)
        contenders.append(Contender(name, optimizer, time.perf_counter() - t0))
        for _ in range(2):
            optimizer.step()
    return contenders


def _reference(optimizer_name: str, shapes, device, dtype) -> Contender:
    """torch's fused optimizer the ratios compare with, where the benchmarked one has none (RMSprop)."""
    _, _, _, lr, reference_cls = OPTIMIZERS[optimizer_name]
    ps = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    contender = Contender(f"torch fused {reference_cls.__name__}", reference_cls(ps, lr=lr, fused=True))
    contender.optimizer.step()
    return contender


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _timed(step: Callable[[], object], device: torch.device, clock: Callable[[], float]) -> float:
    _sync(device)
    t0 = clock()
    step()
    _sync(device)
    return clock() - t0


def time_interleaved(
    steps: Sequence[Callable[[], object]],
    device: torch.device,
    clock: Callable[[], float],
    budget_s: float,
    block_s: float = 0.01,
    max_rounds: int = 200,
) -> list[list[float]]:
    """Seconds per call of every step, round-robin: each round runs every step for a block of about
    ``block_s`` of consecutive calls (each timed alone), starting with a different step each round, so that
    slow drifts of a shared machine hit all steps alike and a small step is not timed with cold caches."""
    estimate = [min(_timed(step, device, clock) for _ in range(2)) for step in steps]
    blocks = [max(1, min(50, int(block_s / max(e, 1e-9)))) for e in estimate]
    round_s = sum(b * e for b, e in zip(blocks, estimate))
    rounds = max(3, min(max_rounds, int(budget_s / max(round_s, 1e-9))))
    times: list[list[float]] = [[] for _ in steps]
    for r in range(rounds):
        for k in range(len(steps)):
            i = (r + k) % len(steps)
            times[i] += [_timed(steps[i], device, clock) for _ in range(blocks[i])]
    return times


def run(args: argparse.Namespace) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for set_name in args.sets:
        shapes = PARAMETER_SETS[set_name]()
        numel = sum(torch.Size(s).numel() for s in shapes)
        for optimizer_name in args.optimizers:
            contenders = _contenders(optimizer_name, shapes, device, dtype, fused=not args.no_fused)
            if not any(c.name == "torch fused" for c in contenders):
                contenders.append(_reference(optimizer_name, shapes, device, dtype))
            samples: list[list[float]] = [[] for _ in contenders]
            run_medians: list[list[float]] = [[] for _ in contenders]
            steps = [c.optimizer.step for c in contenders]
            for _ in range(args.repeats):
                times = time_interleaved(steps, device, CLOCKS[args.clock], args.budget_s)
                for i, t in enumerate(times):
                    samples[i] += t
                    run_medians[i].append(statistics.median(t))
            medians = [statistics.median(s) for s in samples]
            reference = medians[next(i for i, c in enumerate(contenders) if c.name.startswith("torch fused"))]
            for contender, med, per_run, s in zip(contenders, medians, run_medians, samples):
                rows.append(
                    {
                        "set": set_name,
                        "tensors": len(shapes),
                        "numel": numel,
                        "optimizer": optimizer_name,
                        "contender": contender.name,
                        "median_ms": med * 1e3,
                        "vs_torch_fused": med / reference,
                        "run_spread": (max(per_run) - min(per_run)) / med,
                        "samples": len(s),
                        "first_step_s": contender.first_step_s,
                    }
                )
            print(_table([r for r in rows if r["set"] == set_name and r["optimizer"] == optimizer_name]), flush=True)
            del contenders
    return rows


def _table(rows: Sequence[dict]) -> str:
    head = rows[0]
    lines = [
        f"\n{head['set']} ({head['tensors']} tensors, {head['numel']:,} elements), {head['optimizer']}",
        "| contender | median ms | vs torch fused | run spread | first step s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['median_ms']:.3f} | {r['vs_torch_fused']:.2f} | {r['run_spread']:.0%} "
            f"| {r['first_step_s']:.2f} |"
        )
    return "\n".join(lines)


def summary(rows: Sequence[dict]) -> str:
    """One line per parameter set and optimizer: median ms (ratio to torch fused) of each contender."""
    names = list(dict.fromkeys(r["contender"] for r in rows if not r["contender"].startswith("torch fused ")))
    lines = ["| set | optimizer | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for key in dict.fromkeys((r["set"], r["optimizer"]) for r in rows):
        by_name = {r["contender"]: r for r in rows if (r["set"], r["optimizer"]) == key}
        cells = [
            f"{by_name[n]['median_ms']:.3g} ({by_name[n]['vs_torch_fused']:.2f}x)" if n in by_name else "-"
            for n in names
        ]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        keep_freed_memory()
    setup = {
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "clock": args.clock,
    }
    print(f"{setup}; one step() per sample, medians of {args.repeats} interleaved runs")
    rows = run(args)
    print("\nmedian ms per step (ratio to torch's fused step; RMSprop: to fused Adam)\n")
    print(summary(rows))
    name = f"optimizers_{args.device.replace(':', '')}_{args.dtype}_{setup['threads']}threads.csv"
    path = args.results_file or pathlib.Path("results") / name
    write_results(path, "csv", setup, rows)
    print(f"\nresults: {path}")
    return rows


if __name__ == "__main__":
    main()
