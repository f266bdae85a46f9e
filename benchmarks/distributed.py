"""``python -m benchmarks.distributed``: a population's training step sharded over processes, 1 vs R ranks.

The same ``M`` models train on one process and on ``R`` processes (``batchlayers.distributed``: each rank
holds ``M / R`` of them, one intra-op thread per process by default); the ratio of models per second is the
scaling of model-dimension sharding on this machine. Also measured, for a projection to more ranks: each
rank's own step time, one process alone with one rank's share of the models (``M / R``), and the costs of
the population's collectives (gathering the ``(M,)`` losses, a PBT exploit copying one model with its Adam
state between the first and the last rank).

Examples::

    python -m benchmarks.distributed --procs 2                      # wide MLP and CNN, about 3 minutes
    python -m benchmarks.distributed --procs 2 --workloads mlp-wide --num-models 64 --rounds 5

Launches of 1 and ``R`` processes alternate for ``--rounds`` rounds (medians over rounds; the best round
too), so load that comes and goes on a shared machine hits all configurations alike; processes fork from
one server that imported torch once, so a launch costs no imports.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import multiprocessing
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import batchlayers as bl
from batchlayers.distributed import ModelShard, build_shard, copy_model_across_ranks_, gather_per_model, replicate_shard

from .workloads import WORKLOADS, Workload

__all__ = ["main", "parse_args"]

DEFAULT_WORKLOADS = ("mlp-wide", "cnn")
LAUNCH_DEADLINE_S = 600.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.distributed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--procs", type=int, default=2, help="ranks R compared with one process (default 2)")
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=sorted(WORKLOADS))
    parser.add_argument("--num-models", type=int, nargs="+", help="total M per workload (default: its --quick M)")
    parser.add_argument("--batch-size", type=int, help="samples per model and step (default: per workload)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default 1)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per timed repeat (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per launch (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per launch (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating launches of 1 and R ranks (default 3)")
    parser.add_argument("--collective-iters", type=int, default=50, help="timed collectives per kind (default 50)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for the JSON")
    args = parser.parse_args(argv)
    if args.procs < 2:
        parser.error("--procs must be at least 2")
    if args.num_models and len(args.num_models) not in (1, len(args.workloads)):
        parser.error("--num-models takes one M, or one per workload")
    return args


def _batched_factory(workload: Workload):
    """``num_models -> batched model`` for the MLP workloads (batched layers, as the main benchmark builds)."""
    template = workload.make_model()

    def factory(num_models: int) -> nn.Module:
        return nn.Sequential(
            *(
                bl.BatchedLinear(num_models, m.in_features, m.out_features)
                if isinstance(m, nn.Linear)
                else copy.deepcopy(m)
                for m in template
            )
        )

    return factory


def _build(workload: Workload, shard: ModelShard) -> nn.Module:
    if workload.batched == "layers":
        return build_shard(_batched_factory(workload), shard, seed=0)
    return replicate_shard(workload.make_model, shard, seed=0)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _rank(rank: int, world_size: int, config: dict, folder: str) -> None:
    """One rank: build its shard, time training steps and (with several ranks) the collectives."""
    torch.set_num_threads(config["threads"])
    path = pathlib.Path(folder)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{path / 'store'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            result = _measure(config)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        (path / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (path / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def _measure(config: dict) -> dict:
    workload = WORKLOADS[config["workload"]]
    shard = ModelShard.from_group(config["num_models"])
    model = _build(workload, shard).train()
    optimizer = bl.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(shard.rank)
    x, y = workload.make_data((shard.num_local, config["batch_size"]), generator)

    def step() -> torch.Tensor:
        losses = bl.losses.cross_entropy(model(x), y)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
        return losses.detach()

    for _ in range(config["warmup"]):
        step()
    own, wall = [], []
    for _ in range(config["repeats"]):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(config["steps"]):
            losses = step()
        own.append((time.perf_counter() - start) / config["steps"])
        dist.barrier()  # the population's step ends when its slowest rank's does
        wall.append((time.perf_counter() - start) / config["steps"])
    result = {"rank_step_s": _median(own), "step_s": _median(wall), "num_local": shard.num_local}
    model_bytes = sum(t[0].numel() * t.element_size() for t in model.state_dict().values())
    state_bytes = sum(
        v[0].numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if v.dim() > 0
    )
    result["model_bytes"] = model_bytes + state_bytes
    if shard.world_size > 1:
        times = []
        for _ in range(config["collective_iters"]):
            dist.barrier()
            start = time.perf_counter()
            gather_per_model(losses, shard)
            times.append(time.perf_counter() - start)
        result["gather_s"] = _median(times)
        times = []
        for _ in range(max(5, config["collective_iters"] // 5)):
            dist.barrier()
            start = time.perf_counter()
            # Model 0 (rank 0) onto the last model (last rank): weights, Adam state, hyperparameters.
            copy_model_across_ranks_(model, optimizer, shard, 0, shard.num_models - 1, schedulers=[])
            times.append(time.perf_counter() - start)
        result["copy_s"] = _median(times)
    return result


def _launch(world_size: int, config: dict) -> list[dict]:
    context = multiprocessing.get_context("forkserver")
    # (Not this module: run with -m it is __main__, which the children import by path.)
    context.set_forkserver_preload(["torch", "batchlayers", "batchlayers.distributed", "benchmarks.workloads"])
    with tempfile.TemporaryDirectory() as folder:
        procs = [context.Process(target=_rank, args=(r, world_size, config, folder)) for r in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        errors = "".join(p.read_text() for p in sorted(pathlib.Path(folder).glob("*.err")))
        if any(proc.exitcode for proc in procs):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"{world_size} ranks of {config['workload']}: exit codes {codes}\n{errors}")
        return [json.loads((pathlib.Path(folder) / f"rank{r}.json").read_text()) for r in range(world_size)]


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for k, name in enumerate(args.workloads):
        workload = WORKLOADS[name]
        num_models = (args.num_models[k % len(args.num_models)]) if args.num_models else workload.quick_num_models[0]
        config = {
            "workload": name,
            "num_models": num_models,
            "batch_size": args.batch_size or workload.batch_size,
            "threads": args.threads,
            "steps": args.steps,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "collective_iters": args.collective_iters,
        }
        # One rank's share on its own (a process alone with M / R models): the per-rank step time a projection
        # to more ranks starts from, and what the R-process run would reach if the ranks did not share the
        # machine's memory bandwidth and caches.
        alone_config = {**config, "num_models": -(-num_models // args.procs)}
        single, sharded, alone = [], [], []
        for _ in range(args.rounds):  # alternate, so that load which comes and goes hits all alike
            single.append(_launch(1, config))
            sharded.append(_launch(args.procs, config))
            alone.append(_launch(1, alone_config))
        new_rows = []
        for world_size, launches, total in (
            (1, single, num_models),
            (args.procs, sharded, num_models),
            (1, alone, alone_config["num_models"]),
        ):
            steps = [ranks[0]["step_s"] for ranks in launches]
            step = _median(steps)
            row = {
                "workload": name,
                "M": total,
                "processes": world_size,
                "models_per_rank": "/".join(str(r["num_local"]) for r in launches[0]),
                "step_ms": 1e3 * step,
                "rank_step_ms": "/".join(
                    f"{1e3 * _median([ranks[r]['rank_step_s'] for ranks in launches]):.3g}" for r in range(world_size)
                ),
                "models_per_s": total / step,
                "best_models_per_s": total / min(steps),  # the launch least disturbed by other load
                "round_step_ms": [1e3 * t for t in steps],
                "model_bytes": launches[0][0]["model_bytes"],
            }
            if world_size > 1:
                row["gather_ms"] = 1e3 * _median([ranks[0]["gather_s"] for ranks in launches])
                row["copy_ms"] = 1e3 * _median([ranks[0]["copy_s"] for ranks in launches])
            new_rows.append(row)
        for row in new_rows:
            row["speedup"] = row["models_per_s"] / new_rows[0]["models_per_s"]
            row["best_speedup"] = row["best_models_per_s"] / new_rows[0]["best_models_per_s"]
        rows += new_rows
        print(_table(new_rows), flush=True)
    return rows


COLUMNS = [
    ("workload", "workload"),
    ("M", "M"),
    ("processes", "processes"),
    ("models_per_rank", "models per rank"),
    ("step_ms", "ms per step"),
    ("rank_step_ms", "each rank's own ms"),
    ("models_per_s", "model-steps/s"),
    ("speedup", "x 1 process"),
    ("best_speedup", "x 1 process, best rounds"),
    ("gather_ms", "gather (M,) ms"),
    ("copy_ms", "copy 1 model ms"),
    ("model_bytes", "model + Adam bytes"),
]


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row.get(key)) for key, _ in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    setup = {
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "threads_per_process": args.threads,
        "backend": "gloo",
        "command": "python -m benchmarks.distributed " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(f"\n{setup['cpu']}, torch {setup['torch']}, {args.threads} thread(s) per process, gloo\n")
    print(_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"distributed-cpu-{args.procs}procs-{args.threads}threads.json"
    path.write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    print(f"\nresults written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
