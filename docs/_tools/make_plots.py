"""Draw the pictures the docs show, into docs/ (run from the repository root; a few minutes on 2 CPU cores).

    python docs/_tools/make_plots.py                                  # the guides' plots
    python docs/_tools/make_plots.py --benchmark-results quick.csv --benchmark-sweep sweep.csv

- ``sweep_digits.png``: ``examples/sweep_digits.py`` at its full size (64 models);
- ``pbt_digits.png``: the code of docs/guides/sweeps-pbt.md at the sizes the page shows;
- ``benchmark_quick_speedups.png``: from the results file of a quick run,
  ``python -m benchmarks --quick --no-progress --results-file quick.csv``;
- ``benchmark_time_vs_m.png``: the time-vs-M plot a run over several M writes next to its results file, e.g.
  ``python -m benchmarks --quick --no-progress --workloads mlp-tiny gpt --num-models 1 4 16 64 256
  --results-file sweep.csv``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _test_docs():
    spec = importlib.util.spec_from_file_location("test_docs", ROOT / "tests" / "test_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guide_plots() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, str(ROOT / "examples" / "sweep_digits.py"), "--out", scratch], check=True)
        shutil.copy(pathlib.Path(scratch) / "sweep_digits.png", DOCS / "sweep_digits.png")
        here = os.getcwd()
        os.chdir(scratch)
        try:
            _test_docs().run_page(DOCS / "guides" / "sweeps-pbt.md", quick=False)
        finally:
            os.chdir(here)
        shutil.copy(pathlib.Path(scratch) / "pbt_digits.png", DOCS / "pbt_digits.png")
    print("written: docs/sweep_digits.png, docs/pbt_digits.png")


def benchmark_plots(results: pathlib.Path | None, sweep: pathlib.Path | None) -> None:
    if results is not None:
        sys.path.insert(0, str(ROOT))
        from benchmarks.plot_quick import main as plot_quick

        plot_quick([str(results), "--out", str(DOCS / "benchmark_quick_speedups.png")])
    if sweep is not None:
        time_plot = sweep.with_suffix(".png")
        if not time_plot.exists():
            raise SystemExit(f"{time_plot} not found: run the benchmark with --plot (the default)")
        shutil.copy(time_plot, DOCS / "benchmark_time_vs_m.png")
        print("written: docs/benchmark_time_vs_m.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--benchmark-results", type=pathlib.Path, help="a quick run's results file (CSV or JSON)")
    parser.add_argument("--benchmark-sweep", type=pathlib.Path, help="the results file of a run over several M")
    parser.add_argument("--no-guides", action="store_true", help="only the benchmark pictures")
    args = parser.parse_args()
    if not args.no_guides:
        guide_plots()
    if args.benchmark_results or args.benchmark_sweep:
        resolve = lambda path: path.resolve() if path else None  # noqa: E731
        benchmark_plots(resolve(args.benchmark_results), resolve(args.benchmark_sweep))


if __name__ == "__main__":
    main()
