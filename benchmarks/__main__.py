"""``python -m benchmarks``: batchlayers against a Python loop, torch.func and a hand-written reference.

Examples::

    python -m benchmarks --quick                      # docs/benchmarks.md's table, about 3.5 minutes on 2 CPU cores
    python -m benchmarks --workloads mlp-tiny --num-models 1 64 1024 4096 --iters 30
    python -m benchmarks --device cuda --dtype bfloat16 --format json
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys
import warnings
from collections.abc import Sequence

import torch

from .contenders import CONTENDERS, MODEL_BY_MODEL, OPTIMIZER_IMPLS, Runner, Unavailable, build_runner
from .measure import (
    MEMORY_METHOD,
    can_keep_freed_memory,
    gemm_gflops,
    held_bytes,
    keep_freed_memory,
    median,
    peak_step_bytes,
    time_interleaved,
)
from .report import markdown_table, plot, summary_table, target_table, write_results
from .workloads import WORKLOADS, Workload

__all__ = ["main", "parse_args", "run"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECK_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default: cuda if any")
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES), help="parameters and data (default float32)"
    )
    parser.add_argument("--num-models", type=int, nargs="+", help="numbers of models M (default: per workload)")
    parser.add_argument("--batch-size", type=int, help="samples per model and step (default: per workload)")
    parser.add_argument(
        "--warmup", type=int, help="untimed rounds after the agreement check's steps (default 2, quick 1)"
    )
    parser.add_argument("--iters", type=int, help="timed rounds per configuration (default 30, quick 10)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="seconds of timed rounds per configuration before they are cut (min 3 rounds; default 8, quick 2)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each contender's forward")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZER_IMPLS,
        default="default",
        help="torch.optim.Adam implementation, the same for every contender (default: torch's own choice)",
    )
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    parser.add_argument("--modes", nargs="+", choices=["train", "infer"], default=["train", "infer"])
    parser.add_argument("--loop-max-models", type=int, default=1024, help="skip the Python loop above this many models")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc: keep freed memory in the process (mallopt) so large tensors do not page-fault every step",
    )
    parser.add_argument(
        "--compare-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the steps in a second, fresh process with --keep-freed-memory and report both "
        "(default: on for CPU runs without --keep-freed-memory where glibc's mallopt exists)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time each workload in a fresh process (default: on when more than one workload runs): after other "
        "workloads in the same process the loop's step on the transformer and GPT-mini took 1.4-1.5x as long, "
        "batchlayers' 1.01-1.05x (the heap those workloads left behind)",
    )
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="measure peak memory")
    parser.add_argument("--results-file", type=pathlib.Path, help="default: results/<setup>.<format>")
    parser.add_argument("--format", choices=["csv", "json"], default="csv")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="write a PNG plot")
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and rounds: about three and a half minutes on 2 CPU cores"
    )
    parser.add_argument(
        "--per-model-optimizers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time one batchlayers.optim.Adam step against torch's fused Adam (python -m benchmarks.optimizers "
        "on the 10-20-2 MLP at M=64 and the small ResNet at M=16; on CPU 1 thread, its CPU time) for the "
        "optimizer targets (default: on unless --num-models or --workloads narrow the run)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.iters = args.iters if args.iters is not None else (10 if args.quick else 30)
    args.budget_s = args.budget_s if args.budget_s is not None else (2.0 if args.quick else 8.0)
    if args.per_model_optimizers is None:
        args.per_model_optimizers = args.num_models is None and args.workloads == list(WORKLOADS)
    if args.compare_freed_memory is None:
        args.compare_freed_memory = args.device == "cpu" and not args.keep_freed_memory and can_keep_freed_memory()
    if args.isolate is None:
        args.isolate = len(args.workloads) > 1
    return args


def _child_run(
    args: argparse.Namespace, workloads: Sequence[str], flags: Sequence[str] = ()
) -> tuple[dict, list[dict]]:
    """The setup and rows of ``workloads`` timed in a fresh process with this run's settings and ``flags``."""
    import json
    import tempfile

    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "child.json"
        argv = [sys.executable, "-m", "benchmarks", "--device", args.device, "--dtype", args.dtype]
        argv += ["--warmup", str(args.warmup), "--iters", str(args.iters), "--budget-s", str(args.budget_s)]
        argv += ["--optimizer", args.optimizer, "--loop-max-models", str(args.loop_max_models)]
        argv += ["--seed", str(args.seed), "--workloads", *workloads, "--contenders", *args.contenders]
        argv += ["--num-models", *map(str, args.num_models)] if args.num_models else []
        argv += ["--batch-size", str(args.batch_size)] if args.batch_size else []
        argv += ["--quick"] if args.quick else []
        argv += ["--compile"] if args.compile else []
        argv += ["--memory" if args.memory else "--no-memory"]
        argv += ["--keep-freed-memory"] if args.keep_freed_memory else []
        argv += ["--modes", *args.modes, "--no-isolate", "--no-compare-freed-memory", "--no-plot", *flags]
        argv += ["--no-progress"] if args.no_progress else []  # (the child's progress bar goes to stderr)
        argv += ["--no-per-model-optimizers", "--format", "json", "--results-file", str(path)]
        subprocess.run(argv, check=True, cwd=root, stdout=subprocess.DEVNULL)
        result = json.loads(path.read_text())
        return result["setup"], result["rows"]


def _isolated_run(args: argparse.Namespace, flags: Sequence[str] = ()) -> tuple[dict, list[dict]]:
    """:func:`run`, each workload in a fresh process (:func:`_child_run`): one workload's heap does not slow
    the next one's contenders. The setup's GEMM rate is the highest the processes measured."""
    setups, rows = [], []
    for name in args.workloads:
        setup, child_rows = _child_run(args, [name], flags)
        setups.append(setup)
        rows += child_rows
    setup = {**setups[0], "gemm_gflops": max(s["gemm_gflops"] for s in setups), "isolated": True}
    setup["command"] = _command(args)
    return setup, rows


def _kept_memory_run(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """The setup and rows of a second run of the same configurations with ``keep_freed_memory()``, in fresh
    processes (glibc's settings cannot be undone within a process, so both cannot share one): one per
    workload where the first run isolates them."""
    if args.isolate:
        return _isolated_run(args, _KEPT_MEMORY_FLAGS)
    return _child_run(args, args.workloads, _KEPT_MEMORY_FLAGS)


# The kept-memory pass's flags, given after the forwarded ones (argparse keeps the last): no peak-memory
# measurement there (the first pass has it), whatever --memory says.
_KEPT_MEMORY_FLAGS = ("--keep-freed-memory", "--no-memory")


def _merge_kept(rows: list[dict], kept: list[dict]) -> None:
    """Add the kept-memory run's time and ratios to the matching rows (``*_kept`` fields)."""
    key = ("workload", "mode", "num_models", "contender")
    by_key = {tuple(r[k] for k in key): r for r in kept if r.get("median_ms") is not None}
    for row in rows:
        other = by_key.get(tuple(row[k] for k in key))
        if other is None:
            continue
        for field in (
            "median_ms",
            "speedup_vs_loop",
            "speedup_vs_torch_func",
            "cost_vs_single",
            "pct_gemm",
            "faults_per_step",
        ):
            if other.get(field) is not None:
                row[f"{field}_kept"] = other[field]


def _sizes(workload: Workload, args: argparse.Namespace) -> tuple[int, ...]:
    if args.num_models:
        return tuple(args.num_models)
    return workload.quick_num_models if args.quick else workload.num_models


def _as_tensor(result) -> torch.Tensor:
    out = torch.stack(result) if isinstance(result, list) else result
    return out.detach().float()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _check(runners: Sequence[Runner], train: bool) -> dict[str, float]:
    """Run each contender's first steps (two when training, so the optimizer step is compared as well) and
    return each one's largest relative difference from the loop (or the first contender). Warnings raised
    on the way (e.g. an op without a vmap batching rule) are appended to the contender's note."""
    outputs = {}
    for runner in runners:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2 if train else 1):
                outputs[runner.name] = _as_tensor(runner.step())
        for message in dict.fromkeys(str(w.message).split(".")[0] for w in caught):
            runner.note = f"{runner.note}; warns: {message}" if runner.note else f"warns: {message}"
    names = [r.name for r in runners if r.name != "single"]
    if not names:
        return {}
    base = outputs["loop" if "loop" in names else names[0]]
    diffs = {}
    for name, out in outputs.items():
        expected = base[:1] if name == "single" else base
        diffs[name] = _rel_diff(out, expected) if out.shape == expected.shape else float("inf")
    return diffs


def run_config(workload: Workload, num_models: int, train: bool, args, device, dtype, progress) -> list[dict]:
    """Build every contender for one (workload, M, mode), check they agree, time them interleaved."""
    mode = "train" if train else "infer"
    batch = args.batch_size or workload.batch_size
    torch.manual_seed(args.seed)
    models = [workload.make_model().to(device=device, dtype=dtype) for _ in range(num_models)]
    generator = torch.Generator().manual_seed(args.seed)
    x, y = workload.make_data((batch,) if workload.shared else (num_models, batch), generator)
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    y = y.to(device)
    base = {"workload": workload.name, "mode": mode, "num_models": num_models, "batch_size": batch}
    rows: dict[str, dict] = {}
    runners: list[Runner] = []
    for name in args.contenders:
        if name == "loop" and num_models > args.loop_max_models:
            rows[name] = {**base, "contender": name, "note": f"skipped: M > --loop-max-models {args.loop_max_models}"}
            continue
        try:
            runner = build_runner(
                name, workload, models, x, y, train=train, compile=args.compile, optim_impl=args.optimizer
            )
        except Unavailable as exc:
            if name not in ("batchlayers-copies", MODEL_BY_MODEL):  # only meaningful for some; no row elsewhere
                rows[name] = {**base, "contender": name, "note": f"unavailable: {exc}"}
            continue
        runners.append(runner)
        rows[name] = {**base, "contender": name, "note": runner.note}
    progress.set_postfix_str(f"{workload.name} {mode} M={num_models}")

    diffs = _check(runners, train)
    tolerance = CHECK_TOLERANCE.get(dtype, 5e-2)
    for runner in runners:
        row = rows[runner.name]
        row["note"] = runner.note
        row["check_rel_diff"] = diffs.get(runner.name)
        if row["check_rel_diff"] is not None and row["check_rel_diff"] > tolerance:
            row["note"] = f"{row['note']}; DIFFERS from the loop" if row["note"] else "DIFFERS from the loop"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # already reported by the check
        faults: list[list[float]] = []
        times = time_interleaved(
            [r.step for r in runners],
            device,
            warmup=args.warmup,
            iters=args.iters,
            budget_s=args.budget_s,
            tick=lambda: progress.update(1),
            faults=faults,
        )
        for runner, ts, fs in zip(runners, times, faults):
            row = rows[runner.name]
            row.update(median_ms=1e3 * median(ts), rounds=len(ts), held_mb=held_bytes(runner.holds()) / 2**20)
            row["faults_per_step"] = median(fs) if fs else None  # minor page faults a step
            # A profiled step of a long loop is slow; --quick skips it (the loop's peak is one model's).
            if args.memory and train and not (args.quick and runner.name == "loop" and num_models > 64):
                peak = peak_step_bytes(runner.step, device)
                row["peak_step_mb"] = None if peak is None else peak / 2**20

    def ms(name):
        return rows.get(name, {}).get("median_ms")

    flops = workload.flops(models[0], batch) if workload.flops else None
    for row in rows.values():
        t = row.get("median_ms")
        if t is None:
            continue
        if ms("loop"):
            row["speedup_vs_loop"] = ms("loop") / t
        if ms("torch.func"):
            row["speedup_vs_torch_func"] = ms("torch.func") / t
        if ms("single"):
            row["cost_vs_single"] = t / ms("single")
        if flops:
            count = (flops[1] if train else flops[0]) * (1 if row["contender"] == "single" else num_models)
            row["gflops"] = count / (t / 1e3) / 1e9
            row["pct_gemm"] = 100 * row["gflops"] / args.gemm_gflops
    return list(rows.values())


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Run the benchmark; returns the setup description and the result rows."""
    from tqdm.auto import tqdm

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    malloc_tuned = keep_freed_memory() if args.keep_freed_memory else False
    gemm_before = gemm_gflops(device, dtype)
    configs = [
        (WORKLOADS[name], m, mode == "train")
        for name in args.workloads
        for m in _sizes(WORKLOADS[name], args)
        for mode in args.modes
    ]
    rows: list[dict] = []
    args.gemm_gflops = gemm_before
    with tqdm(total=len(configs) * (args.warmup + args.iters), disable=args.no_progress, file=sys.stderr) as bar:
        for workload, num_models, train in configs:
            done = bar.n
            rows += run_config(workload, num_models, train, args, device, dtype, bar)
            bar.update(done + args.warmup + args.iters - bar.n)  # rounds cut by the budget still count
    gemm = max(gemm_before, gemm_gflops(device, dtype))
    for row in rows:
        row["process"] = os.getpid()  # which process timed the row (one per workload with --isolate)
        if row.get("gflops") is not None:
            row["pct_gemm"] = 100 * row["gflops"] / gemm
    setup = {
        "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "gemm_gflops": round(gemm, 1),
        "compile": args.compile,
        "optimizer": f"torch.optim.Adam ({args.optimizer})",
        "keep_freed_memory": malloc_tuned,
        "memory_method": MEMORY_METHOD["cuda" if device.type == "cuda" else "cpu"],
        "command": _command(args),
        "isolated": False,
    }
    return setup, rows


def _command(args: argparse.Namespace) -> str:
    return "python -m benchmarks " + " ".join(sys.argv[1:]) if args.argv is None else " ".join(args.argv)


OPTIMIZER_SETS = ("mlp-tiny-64", "resnet-16")


def _optimizer_run(args: argparse.Namespace) -> list[dict]:
    """One Adam step of batchlayers.optim against torch's fused Adam (``benchmarks.optimizers``), on CPU with
    one thread and its CPU time (so that a descheduled OpenMP thread does not count), threads put back."""
    from . import optimizers

    argv = ["--device", args.device, "--dtype", args.dtype, "--sets", *OPTIMIZER_SETS, "--optimizers", "Adam"]
    argv += ["--threads", "1", "--clock", "thread"] if args.device == "cpu" else []
    threads = torch.get_num_threads()
    try:
        if args.device == "cpu":
            torch.set_num_threads(1)
        return optimizers.run(optimizers.parse_args(argv + (["--quick"] if args.quick else [])))
    finally:
        torch.set_num_threads(threads)


def _setup_name(args: argparse.Namespace) -> str:
    parts = ["bench", args.device.replace(":", ""), args.dtype, f"{torch.get_num_threads()}threads"]
    parts += ["quick"] if args.quick else []
    parts += ["compile"] if args.compile else []
    return "-".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = None if argv is None else ["python -m benchmarks", *argv]
    setup, rows = _isolated_run(args) if args.isolate else run(args)
    if args.compare_freed_memory:
        try:
            kept_setup, kept_rows = _kept_memory_run(args)
        except (OSError, subprocess.CalledProcessError, ValueError, KeyError) as error:
            # The first run's results stand on their own: report them, say why the comparison is missing.
            print(
                f"the keep_freed_memory() comparison run failed, reporting the first run only: {error}", file=sys.stderr
            )
            setup["kept_memory_run"] = None
        else:
            _merge_kept(rows, kept_rows)
            setup["kept_memory_run"] = kept_setup["keep_freed_memory"]  # whether glibc took the settings there
    optimizer_rows = _optimizer_run(args) if args.per_model_optimizers and args.dtype in ("float32", "float64") else []
    path = args.results_file or pathlib.Path("results") / f"{_setup_name(args)}.{args.format}"
    write_results(path, args.format, setup, rows)
    if optimizer_rows:
        write_results(path.with_name(f"{path.stem}-optimizers.{args.format}"), args.format, setup, optimizer_rows)
    header = (
        f"{setup['device']} ({setup['cpu']}), {setup['threads']} threads, torch {setup['torch']}, {setup['dtype']}; "
        f"dense GEMM {setup['gemm_gflops']} GFLOP/s"
    )
    isolated = " (each workload in a fresh process)" if setup.get("isolated") else ""
    print(f"\n{header}\n`{setup['command']}`{isolated}\n")
    print(markdown_table(rows))
    print("\nSummary (ms per step; single = one torch.nn model's step):\n")
    if setup.get("kept_memory_run") is not None:
        print(
            "(`kept`: the steps run again, in fresh processes, with `batchlayers.backends.cpu."
            "keep_freed_memory()`, so that large tensors stop page-faulting every step; an opt-in setting)\n"
        )
    print(summary_table(rows))
    print("\nTargets (issue 10, and those of issues 5 and 9 it keeps):\n")
    print(target_table(rows, compiled=args.compile, optimizer_rows=optimizer_rows))
    print("\nWorkloads:\n")
    for name in args.workloads:
        workload = WORKLOADS[name]
        print(f"- {name}: {workload.description}, batch {args.batch_size or workload.batch_size} per model")
    held = "parameters, gradients, optimizer state, data and batchlayers' kept buffers"
    print(f"\nmemory: {setup['memory_method']}; held MB = {held}")
    print(f"results: {path}")
    if args.plot:
        png = path.with_suffix(".png")
        if plot(png, rows, header):
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
