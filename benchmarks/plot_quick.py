"""A quick run's results at a glance: batchlayers' speed-up over the loop and over torch.func, per workload.

    python -m benchmarks --quick --results-file results/quick.csv
    python -m benchmarks.plot_quick results/quick.csv --out results/quick_speedups.png

One panel per mode (training step, inference), one group of bars per workload and M: batchlayers' speed-up
over the Python loop and over the ``torch.func`` recipe, on a log scale, with parity (1x) marked and each of
the issue's targets (``report.TARGETS``) drawn as a short line across the bar it applies to. The time-vs-M
plot that ``python -m benchmarks`` writes next to its results file is the picture for full runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
from collections.abc import Sequence

from .report import TARGETS

__all__ = ["load_results", "plot_speedups"]

BARS = [("speedup_vs_loop", "x the loop", "tab:blue"), ("speedup_vs_torch_func", "x torch.func", "tab:orange")]
_NUMBERS = {"num_models": int, "median_ms": float, "speedup_vs_loop": float, "speedup_vs_torch_func": float}


def load_results(path: pathlib.Path) -> tuple[list[dict], dict]:
    """The rows of a results file written by ``python -m benchmarks`` (CSV or JSON) and its setup."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return data["rows"], data.get("setup", {})
    with path.open(newline="") as f:
        raw = list(csv.DictReader(f))
    rows = []
    for row in raw:
        rows.append({k: (_NUMBERS[k](v) if k in _NUMBERS and v not in ("", None) else v) for k, v in row.items()})
    setup_keys = ("device", "cpu", "threads", "torch", "dtype", "gemm_gflops", "command")
    return rows, {k: raw[0].get(k, "") for k in setup_keys} if raw else {}


def _title(setup: dict) -> str:
    machine = setup.get("cpu") or setup.get("device", "")
    threads, torch_version = setup.get("threads", "?"), setup.get("torch", "?")
    parts = [machine, f"{threads} threads", f"torch {torch_version}", setup.get("dtype", "")]
    title = ", ".join(p for p in parts if p)
    return title + (f"\n{setup['command']}" if setup.get("command") else "")


def plot_speedups(rows: Sequence[dict], path: pathlib.Path, title: str = "") -> bool:
    """Write the bar chart to ``path``; False when ``rows`` hold no batchlayers timing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["contender"] == "batchlayers" and r.get("median_ms") not in (None, "")]
    modes = list(dict.fromkeys(r["mode"] for r in ours))
    if not ours:
        return False
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.6 * len(modes)), squeeze=False)
    width = 0.38
    for ax, mode in zip(axes[:, 0], modes):
        group = [r for r in ours if r["mode"] == mode]
        targets_drawn = False
        labels = [f"{r['workload']}\nM={r['num_models']}" for r in group]
        for k, (field, label, color) in enumerate(BARS):
            xs = [i + (k - 0.5) * width for i in range(len(group))]
            values = [r.get(field) for r in group]
            heights = [v if isinstance(v, float) else float("nan") for v in values]  # n/a: no bar
            bars = ax.bar(xs, heights, width, label=label, color=color, alpha=0.85)
            for bar, value in zip(bars, values):
                text = f"{value:.2g}" if isinstance(value, float) else "n/a"
                y = value if isinstance(value, float) else 1.0
                ax.annotate(text, (bar.get_x() + width / 2, y), ha="center", va="bottom", fontsize=7)
            for i, r in enumerate(group):
                here = (r["workload"], mode, r["num_models"], field)
                for _, workload, target_mode, num_models, target_field, _, _, threshold in TARGETS:
                    if (workload, target_mode, num_models, target_field) == here:
                        ax.hlines(threshold, xs[i] - width / 2, xs[i] + width / 2, colors="black", linewidth=2.5)
                        targets_drawn = True
        if targets_drawn:  # one legend entry for all the target lines
            ax.plot([], [], color="black", linewidth=2.5, label="target")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xticks(range(len(group)), labels, fontsize=7)
        ax.set_ylabel("batchlayers speed-up")
        ax.set_title(f"{'training step' if mode == 'train' else 'inference'}: above the dashed line is faster")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=pathlib.Path, help="a results file of python -m benchmarks (CSV or JSON)")
    parser.add_argument("--out", type=pathlib.Path, help="the PNG (default: <results>_speedups.png)")
    args = parser.parse_args(argv)
    out = args.out or args.results.with_name(args.results.stem + "_speedups.png")
    rows, setup = load_results(args.results)
    if not plot_speedups(rows, out, _title(setup)):
        raise SystemExit(f"{args.results}: no batchlayers rows to plot")
    print(f"plot: {out}")
    return out


if __name__ == "__main__":
    main()
