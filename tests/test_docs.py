"""The docs' Python code runs, and the API reference covers every public name.

Every ```python block of a page under docs/ runs, the blocks of one page in order in one namespace (a guide
builds its program block by block). A line ``NAME = value  # tests: quick`` runs with ``quick`` here, so a
guide shows the sizes its numbers were measured with while the test runs a short form of it; every page
with code asserts something.

Run one page at its full size (the sizes the guide's numbers come from)::

    python tests/test_docs.py docs/guides/rl-critics.md
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_tools" not in p.parts)
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
# NAME = value  # tests: quick value
QUICK = re.compile(r"^(?P<head>\s*[A-Za-z_][\w, ]*=\s*)(?P<full>[^#\n]+?)\s*#\s*tests:\s*(?P<quick>[^#\n]+?)\s*$", re.M)


def page_code(page: pathlib.Path, quick: bool = True) -> str:
    """The page's Python blocks joined in order; with ``quick``, each ``# tests:`` value replaces its line's."""
    code = "\n".join(BLOCK.findall(page.read_text()))
    if quick:
        code = QUICK.sub(lambda m: m["head"] + m["quick"], code)
    return code


def run_page(page: pathlib.Path, quick: bool = True) -> dict:
    """Run a page's code as a module ``__main__`` would run it and return its namespace."""
    # classes defined by the page need a module to live in (dataclasses and pickling look them up)
    module = types.ModuleType(f"docs_{page.parent.name}_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    try:
        exec(compile(page_code(page, quick), str(page.relative_to(ROOT)), "exec"), namespace)
    finally:
        sys.modules.pop(module.__name__, None)
    return namespace


CODE_PAGES = [p for p in PAGES if BLOCK.search(p.read_text())]


def test_pages_have_code() -> None:
    names = {str(p.relative_to(DOCS)) for p in CODE_PAGES}
    assert {"index.md", "shapes.md", "conversion.md", "training.md", "reliability.md", "mixed-precision.md"} <= names
    assert {f"guides/{g}.md" for g in ("torch-func", "rl-critics", "checkpoints", "sweeps-pbt")} <= names


def test_quick_values_replace_full_ones() -> None:
    code = QUICK.sub(lambda m: m["head"] + m["quick"], "STEPS = 10_000        # tests: 250\nA, B = 1, 2  # tests: 3, 4")
    assert code == "STEPS = 250\nA, B = 3, 4"


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_runs(page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = page_code(page)
    assert "assert" in code, f"{page.relative_to(ROOT)}: its code asserts nothing"
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        run_page(page)
    finally:
        torch.set_num_threads(threads)  # a page that sets it changes no later test


# The public submodules the API reference documents whole, whichever of them exist.
SUBMODULES = ["functional", "losses", "optim", "optim.lr_scheduler", "backends", "checkpoint", "data", "population"]
SUBMODULES += ["distributed", "amp"]


def _directives() -> set[str]:
    return {m for p in (DOCS / "api").glob("*.md") for m in re.findall(r"^::: ([\w.]+)", p.read_text(), re.M)}


def test_api_reference_covers_every_public_name() -> None:
    import batchlayers

    documented = _directives()
    missing = []
    for name in SUBMODULES:
        try:
            importlib.import_module(f"batchlayers.{name}")
        except ImportError:
            continue
        if f"batchlayers.{name}" not in documented:
            missing.append(f"batchlayers.{name} (a '::: batchlayers.{name}' page in docs/api/)")
    for name in batchlayers.__all__:
        obj = getattr(batchlayers, name)
        if isinstance(obj, types.ModuleType):
            if obj.__name__ not in documented:
                missing.append(f"{obj.__name__} (a '::: {obj.__name__}' page in docs/api/)")
            continue
        home = getattr(obj, "__module__", "")
        in_module_page = home in documented and name in getattr(sys.modules.get(home), "__all__", ())
        if f"batchlayers.{name}" not in documented and not in_module_page:
            missing.append(f"batchlayers.{name} (add '::: batchlayers.{name}' to a page in docs/api/)")
    assert not missing, "not in the API reference: " + "; ".join(missing)


def test_docstring_rewrite_for_the_docs_build() -> None:
    spec = importlib.util.spec_from_file_location("griffe_torch_style", DOCS / "_tools" / "griffe_torch_style.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rewrite = module.torch_style_to_google
    assert rewrite("see :func:`~batchlayers.keep_models_` and :class:`ModelShard`") == (
        "see `keep_models_` and `ModelShard`"
    )
    assert rewrite(":meth:`the state <state_dict>` of :math:`k = 1/n`") == "`the state` of `k = 1/n`"
    assert rewrite("    Examples::\n\n        >>> 1\n") == "    Examples:\n        >>> 1\n"


def test_benchmark_speedup_chart(tmp_path: pathlib.Path) -> None:
    """The docs' benchmark picture: a quick run's results file in, a bar chart with the target lines out."""
    pytest.importorskip("matplotlib")
    import csv

    from benchmarks.plot_quick import load_results, plot_speedups

    rows = [
        {"workload": "mlp-tiny", "mode": "train", "num_models": 64, "contender": "batchlayers", "median_ms": 0.8,
         "speedup_vs_loop": 24.0, "speedup_vs_torch_func": 1.4, "threads": 2, "torch": "2.13.0+cpu"},
        {"workload": "lstm", "mode": "infer", "num_models": 8, "contender": "batchlayers", "median_ms": 131.0,
         "speedup_vs_loop": 0.7, "speedup_vs_torch_func": "", "threads": 2, "torch": "2.13.0+cpu"},
        {"workload": "lstm", "mode": "infer", "num_models": 8, "contender": "loop", "median_ms": 91.6,
         "speedup_vs_loop": 1.0, "speedup_vs_torch_func": "", "threads": 2, "torch": "2.13.0+cpu"},
    ]  # fmt: skip
    results = tmp_path / "quick.csv"
    with results.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    loaded, setup = load_results(results)
    assert loaded[0]["num_models"] == 64 and loaded[1]["speedup_vs_torch_func"] == ""
    assert setup["torch"] == "2.13.0+cpu"
    assert plot_speedups(loaded, tmp_path / "chart.png", "title")
    assert (tmp_path / "chart.png").stat().st_size > 10_000
    assert not plot_speedups([r for r in loaded if r["contender"] == "loop"], tmp_path / "none.png")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        run_page(pathlib.Path(arg).resolve(), quick=False)
