"""A griffe extension for the docs build: torch-style docstrings read as Google-style ones.

batchlayers' docstrings are written the way torch.nn's are: Google sections (``Args:``, ``Returns:``,
``Raises:``, ``Attributes:``) plus Sphinx roles (``:func:`keep_models_```) and ``Examples::`` literal
blocks. mkdocstrings' Google parser knows neither of the last two, so before parsing:

- a Sphinx role becomes inline code of the name (``~a.b.c`` shows ``c``, as Sphinx does; ``:math:`` shows
  the TeX source);
- ``Examples::`` / ``Example::`` (and the blank line after it) becomes the Google ``Examples:`` section,
  whose ``>>>`` lines are then rendered as code.

The library files are not changed; this runs only when the docs are built (mkdocs.yml names it).
"""

from __future__ import annotations

import re
from typing import Any

try:
    from griffe import Extension
except ImportError:  # tests/test_docs.py checks the rewrite without the docs extra installed
    Extension = object

_ROLES = "func|class|meth|attr|mod|data|obj|exc|const|ref|math"
_ROLE = re.compile(rf":(?:py:)?(?:{_ROLES}):`(~?)([^`<]*?)(?:\s*<([^>]*)>)?`")
_EXAMPLES = re.compile(r"^([ \t]*)Examples?::[ \t]*\n(?:[ \t]*\n)*", flags=re.M)  # and the blank lines after


def _role(match: re.Match) -> str:
    tilde, text, target = match.groups()
    name = (target or text).strip()
    if text.strip() and target:  # :func:`shown text <target>`
        return f"`{text.strip()}`"
    return f"`{name.rsplit('.', 1)[-1] if tilde else name}`"


def torch_style_to_google(text: str) -> str:
    """The rewrite described in the module docstring (exposed for tests/test_docs.py)."""
    text = _ROLE.sub(_role, text)
    return _EXAMPLES.sub(lambda m: f"{m.group(1)}Examples:\n", text)


class TorchStyleDocstrings(Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = torch_style_to_google(obj.docstring.value)
