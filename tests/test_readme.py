"""The README's Python code blocks run as they are, and each asserts what it claims."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, tmp_path, monkeypatch) -> None:
    code = BLOCKS[index]
    assert "assert" in code, f"README block {index} asserts nothing"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md[block {index}]", "exec"), {"__name__": f"readme_block_{index}"})
