"""Smoke test of the benchmark CLI in a tiny configuration: it runs, writes its files, and every contender
computes the same first training steps and inference as the loop over torch.nn models. No timing is
asserted."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from batchlayers import _workspace
from benchmarks.__main__ import _merge_kept, main
from benchmarks.contenders import build_runner
from benchmarks.measure import held_bytes, peak_step_bytes
from benchmarks.workloads import WORKLOADS

BUILT_FROM_LAYERS = [name for name, w in WORKLOADS.items() if w.batched == "layers"]


def _run(tmp_path, *argv, compare="--no-compare-freed-memory"):
    main(["--num-models", "2", "--batch-size", "2", "--iters", "1", "--warmup", "0", "--no-progress", compare, *argv])


def test_every_workload_runs_and_contenders_agree(tmp_path, capsys):
    results = tmp_path / "bench.json"
    _run(tmp_path, "--results-file", str(results), "--format", "json", "--no-isolate")
    printed = capsys.readouterr().out
    assert "| workload |" in printed and "Summary" in printed and "Targets" in printed
    assert results.with_suffix(".png").stat().st_size > 0

    data = json.loads(results.read_text())
    assert data["setup"]["gemm_gflops"] > 0
    rows = data["rows"]
    timed = [r for r in rows if r.get("median_ms") is not None]
    assert {(r["workload"], r["mode"]) for r in timed} == {(w, m) for w in WORKLOADS for m in ("train", "infer")}
    for row in timed:
        where = f"{row['workload']} {row['mode']} {row['contender']}"
        # one timed call per contender here: a fresh-clone CI run once read 0.0 ms for one of them (a VM clock
        # step), so only that it was timed is asserted
        assert row["median_ms"] >= 0 and row["rounds"] >= 1, where
        # torch.func's recipe has no BatchNorm running statistics, so its eval outputs differ by design.
        no_running_stats = "BatchNorm without running stats" in (row.get("note") or "")
        if not (row["contender"] == "torch.func" and no_running_stats and row["mode"] == "infer"):
            assert row["check_rel_diff"] < 1e-3, where
        if row["mode"] == "train":
            assert row["peak_step_mb"] > 0 and row["held_mb"] > 0, where
        assert row["faults_per_step"] >= 0, where  # (Linux CI: getrusage exists)
    for name in BUILT_FROM_LAYERS:
        for contender in ("single", "loop", "torch.func", "batchlayers", "reference"):
            assert any(r["workload"] == name and r["contender"] == contender for r in timed), (name, contender)
    shared = [r for r in timed if r["workload"].endswith("-shared")]
    assert {"batchlayers", "batchlayers-copies"} <= {r["contender"] for r in shared}


def test_isolate_times_each_workload_in_a_fresh_process(tmp_path, capsys):
    """With more than one workload, each runs in a process of its own, the kept-memory pass too; the rows are
    the same rows, with the contenders agreeing."""
    import os

    results = tmp_path / "bench.csv"
    workloads = ["mlp-tiny", "mlp-tiny-shared"]
    argv = ("--workloads", *workloads, "--modes", "infer", "--no-memory", "--no-plot", "--results-file", str(results))
    _run(tmp_path, *argv, compare="--compare-freed-memory")
    assert "(each workload in a fresh process)" in capsys.readouterr().out
    with results.open() as f:
        timed = [r for r in csv.DictReader(f) if r["median_ms"]]
    assert all(r["isolated"] == "True" for r in timed)
    processes = {w: {r["process"] for r in timed if r["workload"] == w} for w in workloads}
    assert all(len(p) == 1 for p in processes.values()), processes
    assert len(set.union(*processes.values()) | {str(os.getpid())}) == len(workloads) + 1, processes
    assert all(float(r["check_rel_diff"]) < 1e-3 and r["median_ms_kept"] and r["faults_per_step_kept"] for r in timed)


@pytest.mark.parametrize("free_first", [True, False])
def test_peak_step_memory_counts_what_the_step_frees(free_first):
    """A step that replaces a tensor allocated before the measurement (as zero_grad and backward replace the
    last step's gradients) and makes a temporary: its peak above the start is the temporary (plus the new
    tensor when it is made before the old one goes), the same on every call."""
    held = [torch.ones(1_000_000)]
    temporary = 250_000

    def step():
        if free_first:
            held[0] = None
        new = torch.ones(1_000_000)
        scratch = torch.ones(temporary)
        held[0] = new
        del scratch

    expected = 4 * temporary + (0 if free_first else 4 * 1_000_000)
    assert [peak_step_bytes(step, torch.device("cpu")) for _ in range(3)] == [expected] * 3


def test_held_memory_counts_the_buffers_batchlayers_keeps(monkeypatch):
    """The kept buffers (here every size: a small CNN's stacked convolution outputs and gradients) are memory
    batchlayers holds between steps; allocated before a measured step, they are in no step's peak, so the
    contender's held memory counts them, its own only (the pool is shared by the process's contenders)."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    workload = WORKLOADS["cnn"]
    torch.manual_seed(0)
    models = [workload.make_model() for _ in range(2)]
    x, y = workload.make_data((2, 4), torch.Generator().manual_seed(0))
    runner = build_runner("batchlayers", workload, models, x, y, train=True)
    runner.step()
    _workspace.take(x, 1 << 20)  # (a buffer another contender of the process left: not this one's)
    held = runner.holds()
    kept = list(_workspace._pool())
    assert kept and all(t.numel() != 1 << 20 for t in kept)
    others = [t for t in held if all(t is not k for k in kept)]
    assert held_bytes(held) == held_bytes(others + kept) > held_bytes(others)
    _workspace.release()


def test_csv_output_and_loop_cap(tmp_path):
    results = tmp_path / "bench.csv"
    _run(
        tmp_path,
        *("--workloads", "mlp-tiny", "--modes", "train", "--loop-max-models", "1", "--no-memory", "--no-plot"),
        *("--results-file", str(results)),
    )
    with results.open() as f:
        rows = {r["contender"]: r for r in csv.DictReader(f)}
    assert rows["loop"]["median_ms"] == "" and "skipped" in rows["loop"]["note"]
    assert float(rows["batchlayers"]["median_ms"]) > 0
    assert float(rows["batchlayers"]["check_rel_diff"]) < 1e-3
    assert rows["batchlayers"]["device"] == "cpu"
    assert not results.with_suffix(".png").exists()


def test_training_is_timed_again_with_freed_memory_kept(tmp_path, capsys):
    """The comparison run: the training steps and the inferences again in a fresh process with
    keep_freed_memory(), each reported beside the first run's (this process's allocator is left alone)."""
    results = tmp_path / "bench.json"
    argv = ("--workloads", "mlp-tiny", "cnn", "--no-memory", "--no-plot", "--results-file", str(results))
    _run(tmp_path, *argv, "--format", "json", compare="--compare-freed-memory")
    printed = capsys.readouterr().out
    assert "x loop, kept" in printed and "kept memory" in printed
    data = json.loads(results.read_text())
    assert data["setup"]["kept_memory_run"] is True and data["setup"]["keep_freed_memory"] is False
    kept = {}
    for row in data["rows"]:
        where = f"{row['workload']} {row['mode']} {row['contender']}"
        assert row["median_ms_kept"] > 0, where
        if row["contender"] != "loop":
            assert row["speedup_vs_loop_kept"] > 0, where
        kept[row["workload"], row["contender"], row["mode"]] = row["median_ms_kept"]
    assert {mode for (_, _, mode) in kept} == {"train", "infer"}


def test_each_row_takes_the_kept_run_of_its_own_mode():
    """The kept-memory run's rows are matched by workload, mode, models and contender (not by timing: an
    inference row gets the inference's time, a training row the training step's)."""
    key = {"workload": "cnn", "num_models": 16, "contender": "batchlayers"}
    rows = [{**key, "mode": mode, "median_ms": 1.0} for mode in ("train", "infer")]
    kept = [
        {**key, "mode": mode, "median_ms": ms, "speedup_vs_loop": ms / 10}
        for mode, ms in (("infer", 3.0), ("train", 7.0))
    ]
    kept.append({**key, "mode": "train", "num_models": 64, "median_ms": 99.0})
    _merge_kept(rows, kept)
    assert [(r["mode"], r["median_ms_kept"], r["speedup_vs_loop_kept"]) for r in rows] == [
        ("train", 7.0, 0.7),
        ("infer", 3.0, 0.3),
    ]


def test_a_failed_comparison_run_leaves_the_first_run_reported(tmp_path, capsys, monkeypatch):
    import subprocess

    def fail(*args, **kwargs):
        raise subprocess.CalledProcessError(1, args[0])

    monkeypatch.setattr(subprocess, "run", fail)
    results = tmp_path / "bench.json"
    argv = ("--workloads", "mlp-tiny", "--modes", "train", "--no-memory", "--no-plot", "--results-file", str(results))
    _run(tmp_path, *argv, "--format", "json", compare="--compare-freed-memory")
    captured = capsys.readouterr()
    assert "comparison run failed" in captured.err and "x loop, kept" not in captured.out
    data = json.loads(results.read_text())
    assert data["setup"]["kept_memory_run"] is None
    assert all(
        r["median_ms"] >= 0 and not any(k.endswith("_kept") for k in r) for r in data["rows"] if "median_ms" in r
    )


def test_moe_benchmark_runs_and_contenders_agree(capsys):
    """``python -m benchmarks.moe``: every contender timed, the stacked ones' logits the originals'."""
    from benchmarks.moe import main as moe

    moe(["--experts", "grouped_mm", "eager", "--num-models", "2", "--iters", "1", "--budget-s", "0"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert {(r[0].strip(), r[2].strip()) for r in rows} == {
        (e, m) for e in ("grouped_mm", "eager") for m in ("train", "infer")
    }
    for row in rows:
        assert all(float(cell) > 0 for cell in row[3:6]), row
        assert float(row[-1]) < 1e-4, row


def test_optimizer_targets_come_from_the_optimizer_benchmark(tmp_path) -> None:
    """The quick benchmark's per-model optimizer targets: each fused batchlayers Adam's ratio to torch's fused
    Adam, from a run of ``benchmarks.optimizers`` (timed, so only the rows are checked, not the verdicts)."""
    from benchmarks.optimizers import main as optimizers
    from benchmarks.report import target_table

    argv = ["--sets", "mlp-tiny-64", "--optimizers", "Adam", "--threads", "1", "--clock", "thread"]
    threads = torch.get_num_threads()
    try:
        rows = optimizers([*argv, "--repeats", "1", "--budget-s", "0", "--results-file", str(tmp_path / "o.csv")])
    finally:
        torch.set_num_threads(threads)
    by_name = {r["contender"]: r for r in rows}
    assert by_name["torch fused"]["vs_torch_fused"] == 1
    table = target_table([], optimizer_rows=rows)
    for lr in ("float", "(M,)"):
        ratio = by_name[f"batchlayers {lr} lr fused"]["vs_torch_fused"]
        line = f"| Adam fused=True, {lr} lr, mlp-tiny-64: <= 1x torch's fused Adam | {ratio:.3g} |"
        assert line in table, table


# (inductor's first compile in a process imports torch code that calls the deprecated torch.jit.script_method)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_stacked_contender_is_one_graph_and_matches_the_loop():
    """``--compile`` checks a stacked model once and compiles a function that calls it, so the root's folding
    hooks and its forward are one graph (torch compiles a module's hooks as frames of their own under
    ``model.compile()``); its training steps are the loop's."""
    from benchmarks.contenders import build_runner

    workload = WORKLOADS["cnn"]
    models = [workload.make_model() for _ in range(2)]
    x, y = workload.make_data((2, 3), torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = build_runner("batchlayers", workload, models, x, y, train=True, compile=True)
    loop = build_runner("loop", workload, models, x, y, train=True)
    for _ in range(2):
        torch.testing.assert_close(compiled.step(), torch.stack(loop.step()), rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
