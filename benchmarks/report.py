"""Turning result rows into the markdown table, the CSV/JSON file, the plot and the target check."""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Sequence

__all__ = ["markdown_table", "plot", "summary_table", "target_table", "write_results"]

COLUMNS = [
    ("workload", "workload"),
    ("mode", "mode"),
    ("num_models", "M"),
    ("contender", "contender"),
    ("median_ms", "ms/step"),
    ("speedup_vs_loop", "x loop"),
    ("speedup_vs_torch_func", "x torch.func"),
    ("cost_vs_single", "/ single"),
    ("pct_gemm", "% GEMM"),
    ("peak_step_mb", "step peak MB"),
    ("held_mb", "held MB"),
    ("faults_per_step", "faults/step"),
    ("check_rel_diff", "diff"),
    ("note", "note"),
]


def _fmt(value: object) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) < 1e-2:
            return f"{value:.0e}"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


SUMMARY_CONTENDERS = ["single", "loop", "torch.func", "batchlayers", "batchlayers-mbm", "reference"]


def summary_table(rows: Sequence[dict]) -> str:
    """One line per (workload, mode, M): each contender's ms per step and batchlayers' speedups."""
    configs = list(dict.fromkeys((r["workload"], r["mode"], r["num_models"]) for r in rows))
    head = ["workload", "mode", "M", *(f"{c} ms" for c in SUMMARY_CONTENDERS), "batchlayers x loop", "x torch.func"]
    kept = any("speedup_vs_loop_kept" in r for r in rows)
    head += ["x loop, kept", "x torch.func, kept"] if kept else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in configs:
        by_name = {r["contender"]: r for r in rows if (r["workload"], r["mode"], r["num_models"]) == key}
        ours = by_name.get("batchlayers", {})
        cells = [*map(str, key), *(_fmt(by_name.get(c, {}).get("median_ms")) for c in SUMMARY_CONTENDERS)]
        cells += [_fmt(ours.get("speedup_vs_loop")), _fmt(ours.get("speedup_vs_torch_func"))]
        cells += [_fmt(ours.get("speedup_vs_loop_kept")), _fmt(ours.get("speedup_vs_torch_func_kept"))] if kept else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(path: pathlib.Path, fmt: str, setup: dict, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path.write_text(json.dumps({"setup": setup, "rows": list(rows)}, indent=1))
        return
    fields = list(dict.fromkeys(k for row in rows for k in row)) + list(setup)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **setup})


def plot(path: pathlib.Path, rows: Sequence[dict], title: str) -> bool:
    """Time per training step against M, one panel per workload, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("median_ms") is not None and r["contender"] != "single"]
    workloads = list(dict.fromkeys(r["workload"] for r in timed))
    if not workloads:
        return False
    modes = list(dict.fromkeys(r["mode"] for r in timed))
    fig, axes = plt.subplots(
        len(modes), len(workloads), figsize=(3.6 * len(workloads), 3.2 * len(modes)), squeeze=False
    )
    for i, mode in enumerate(modes):
        for j, workload in enumerate(workloads):
            ax = axes[i][j]
            sub = [r for r in timed if r["workload"] == workload and r["mode"] == mode]
            for contender in dict.fromkeys(r["contender"] for r in sub):
                points = sorted((r["num_models"], r["median_ms"]) for r in sub if r["contender"] == contender)
                ax.plot(*zip(*points), marker="o", label=contender)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{workload} ({mode})", fontsize=9)
            ax.set_xlabel("models M")
            ax.set_ylabel("ms per step")
            ax.grid(True, which="both", alpha=0.3)
            if sub:
                ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


MBM = "batchlayers-mbm"
# (description, workload, mode, M, row field, contender, comparison, threshold): issue 10's targets, and
# those of earlier issues (5, 9) that it does not replace.
TARGETS = [
    ("small MLP M=64: >= 40x the loop", "mlp-tiny", "train", 64, "speedup_vs_loop", "batchlayers", ">=", 40),
    ("small MLP M=64: >= 2x torch.func", "mlp-tiny", "train", 64, "speedup_vs_torch_func", "batchlayers", ">=", 2),
    ("small MLP M=1024: <= 8x one model's step", "mlp-tiny", "train", 1024, "cost_vs_single", "batchlayers", "<=", 8),
    ("784-256-256-10 M=64: >= 1x the loop", "mlp-wide", "train", 64, "speedup_vs_loop", "batchlayers", ">=", 1),
    (
        "784-256-256-10 M=64: >= 1.25x torch.func",
        "mlp-wide",
        "train",
        64,
        "speedup_vs_torch_func",
        "batchlayers",
        ">=",
        1.25,
    ),
    ("784-256-256-10 M=64: >= 65% of dense GEMM", "mlp-wide", "train", 64, "pct_gemm", "batchlayers", ">=", 65),
    ("(same, inference only: >= 70%)", "mlp-wide", "infer", 64, "pct_gemm", "batchlayers", ">=", 70),
    ("small CNN M=16: >= 1.3x the loop", "cnn", "train", 16, "speedup_vs_loop", "batchlayers", ">=", 1.3),
    ("small CNN M=16: >= 1.5x torch.func", "cnn", "train", 16, "speedup_vs_torch_func", "batchlayers", ">=", 1.5),
    ("ResNet M=4: >= 1.2x the loop", "resnet", "train", 4, "speedup_vs_loop", "batchlayers", ">=", 1.2),
    ("U-Net M=8: >= 1x the loop", "unet", "train", 8, "speedup_vs_loop", "batchlayers", ">=", 1),
    # The same convolutional targets, stacked with execution="model_by_model" (the batchlayers-mbm contender)
    ("small CNN M=16, model by model: >= 1.3x the loop", "cnn", "train", 16, "speedup_vs_loop", MBM, ">=", 1.3),
    ("small CNN M=16, model by model: >= 1.5x torch.func", "cnn", "train", 16, "speedup_vs_torch_func", MBM, ">=", 1.5),
    ("ResNet M=4, model by model: >= 1.2x the loop", "resnet", "train", 4, "speedup_vs_loop", MBM, ">=", 1.2),
    ("U-Net M=8, model by model: >= 1x the loop", "unet", "train", 8, "speedup_vs_loop", MBM, ">=", 1),
    ("LSTM policy M=32: >= 3x the loop", "lstm-policy", "train", 32, "speedup_vs_loop", "batchlayers", ">=", 3),
    ("LSTM 2x256 M=8: >= 0.9x the loop", "lstm", "train", 8, "speedup_vs_loop", "batchlayers", ">=", 0.9),
    (
        "TransformerEncoder M=8: >= 1.5x the loop",
        "transformer",
        "train",
        8,
        "speedup_vs_loop",
        "batchlayers",
        ">=",
        1.5,
    ),
    (
        "TransformerEncoder M=8: >= 1.2x torch.func",
        "transformer",
        "train",
        8,
        "speedup_vs_torch_func",
        "batchlayers",
        ">=",
        1.2,
    ),
    ("GPT-mini M=8: >= 1.5x the loop", "gpt", "train", 8, "speedup_vs_loop", "batchlayers", ">=", 1.5),
    ("GPT-mini M=8: >= 1.2x torch.func", "gpt", "train", 8, "speedup_vs_torch_func", "batchlayers", ">=", 1.2),
]
# With --compile (every contender compiled), issue 10 asks compiled batchlayers for >= 1.1x compiled torch.func.
COMPILED_TARGETS = [
    (
        "compiled GPT-mini M=8: >= 1.1x compiled torch.func",
        "gpt",
        "train",
        8,
        "speedup_vs_torch_func",
        "batchlayers",
        ">=",
        1.1,
    ),
]


def _find(rows, workload, mode, num_models, contender):
    for r in rows:
        if (r["workload"], r["mode"], r["num_models"], r["contender"]) == (workload, mode, num_models, contender):
            return r
    return None


NOISE = 0.05  # ratios within 5% of the threshold are reported as parity, not as a miss


def target_table(rows: Sequence[dict], compiled: bool = False, optimizer_rows: Sequence[dict] = ()) -> str:
    """The issues' performance targets against this run (only those whose rows were measured): the eager
    ones, or with ``compiled`` (a ``--compile`` run) the compiled ones; with ``optimizer_rows``
    (``benchmarks.optimizers``), per-model Adam against torch's fused Adam."""
    kept = any(f"{t[4]}_kept" in r for t in TARGETS for r in rows)
    head = ["target", "measured", "met"] + (["kept memory", "met"] if kept else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def verdict(value, op, threshold):
        met = value >= threshold if op == ">=" else value <= threshold
        near = abs(value / threshold - 1) <= NOISE
        return "yes" if met else ("within 5%" if near else "NO")

    def add(description, value, op, threshold, kept_value=None):
        cells = [description, _fmt(value), verdict(value, op, threshold)]
        if kept:
            cells += ["", ""] if kept_value is None else [_fmt(kept_value), verdict(kept_value, op, threshold)]
        lines.append("| " + " | ".join(cells) + " |")

    for description, workload, mode, num_models, field, contender, op, threshold in (
        COMPILED_TARGETS if compiled else TARGETS
    ):
        row = _find(rows, workload, mode, num_models, contender)
        if row is not None and row.get(field) is not None:
            add(description, row[field], op, threshold, row.get(f"{field}_kept"))
    # Shared batch: never slower than per-model copies; memory: a batched step's peak within torch.func's.
    for r in rows:
        if r["contender"] != "batchlayers" or r.get("median_ms") is None or r["num_models"] == 1:
            continue
        key = (r["workload"], r["mode"], r["num_models"])
        copies = _find(rows, *key, "batchlayers-copies")
        if copies and copies.get("median_ms"):
            both = copies.get("median_ms_kept") and r.get("median_ms_kept")
            kept_ratio = copies["median_ms_kept"] / r["median_ms_kept"] if both else None
            description = f"{key[0]} {key[1]} M={key[2]}: shared >= copies' speed"
            add(description, copies["median_ms"] / r["median_ms"], ">=", 1, kept_ratio)
        vmap = _find(rows, *key, "torch.func")
        if r["mode"] == "train" and vmap and r.get("peak_step_mb") is not None and vmap.get("peak_step_mb"):
            ours = r["peak_step_mb"] + r["held_mb"]
            theirs = vmap["peak_step_mb"] + vmap["held_mb"]
            add(f"{key[0]} train M={key[2]}: memory (held + step peak) / torch.func's <= 1", ours / theirs, "<=", 1)
    # Per-model optimizers: no slower than torch's fused Adam (one float lr over the stacked parameters).
    for r in optimizer_rows:
        if r["optimizer"] == "Adam" and r["contender"] in ("batchlayers float lr fused", "batchlayers (M,) lr fused"):
            lr = r["contender"].split()[1]
            add(f"Adam fused=True, {lr} lr, {r['set']}: <= 1x torch's fused Adam", r["vs_torch_fused"], "<=", 1)
    return "\n".join(lines)
