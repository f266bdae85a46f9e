"""Deep copies of modules whose stored functions still point at the right modules.

``copy.deepcopy`` treats functions as atoms: a lambda stored on a module in ``__init__`` that captured a
submodule (or a container of submodules, or ``self``) would keep calling the *original's* submodules after the
copy. Every converter copies modules, so each copy goes through ``rebind_functions``, which gives the copy
new function objects whose closure cells and defaults point at the copied (or swapped-in) objects. The
original's functions are never modified.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import cast

from torch import nn

__all__ = ["rebind_functions"]

# Attributes every nn.Module has (parameter/buffer/module dicts, hooks): never user functions.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def rebind_functions(root: nn.Module, translate: Callable[[object], object]) -> None:
    """Rebind the functions stored on every module of ``root`` (attributes, also inside lists, tuples and
    dicts) so that each captured object ``x`` becomes ``translate(x)``; each item ``x`` of such a list, tuple
    or dict becomes ``translate(x)`` too."""
    for module in root.modules():
        for key, value in list(vars(module).items()):
            if key in _MODULE_INTERNALS:
                continue
            new = _rebind(value, translate, depth=0)
            if new is not value:
                module.__dict__[key] = new


def _rebind(value: object, translate: Callable[[object], object], depth: int) -> object:
    if depth > 8:  # captured functions capturing functions: deep enough for any real model
        return value
    if isinstance(value, types.FunctionType):
        return _rebind_function(value, translate, depth)
    if isinstance(value, functools.partial):
        func = _rebind(translate(value.func), translate, depth + 1)
        args = tuple(_rebind(translate(a), translate, depth + 1) for a in value.args)
        keywords = {k: _rebind(translate(v), translate, depth + 1) for k, v in value.keywords.items()}
        if func is value.func and all(a is b for a, b in zip(args, value.args)) and keywords == value.keywords:
            return value
        return functools.partial(cast(Callable, func), *args, **keywords)
    # The items of a plain list, tuple or dict (``self.layers = [self.fc1, self.fc2]``, which nn.Module does not
    # register) are translated themselves too: a module or tensor in it is the copy's own, or what replaced it.
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [_rebind(translate(v), translate, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items)
    if isinstance(value, dict) and type(value) is dict:
        entries = {k: _rebind(translate(v), translate, depth + 1) for k, v in value.items()}
        return value if all(entries[k] is v for k, v in value.items()) else entries
    return value


def _rebind_function(fn: types.FunctionType, translate: Callable[[object], object], depth: int) -> object:
    def new_value(old: object) -> object:
        return _rebind(translate(old), translate, depth + 1)

    cells = fn.__closure__ or ()
    contents = []
    for cell in cells:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell (a variable assigned after the closure was made)
            contents.append(_EMPTY)
    new_contents = [c if c is _EMPTY else new_value(c) for c in contents]
    defaults = fn.__defaults__ or ()
    new_defaults = tuple(new_value(d) for d in defaults)
    kwdefaults = fn.__kwdefaults__ or {}
    new_kwdefaults = {k: new_value(v) for k, v in kwdefaults.items()}
    unchanged = (
        all(a is b for a, b in zip(new_contents, contents))
        and all(a is b for a, b in zip(new_defaults, defaults))
        and all(new_kwdefaults[k] is v for k, v in kwdefaults.items())
    )
    if unchanged:
        return fn
    closure = tuple(types.CellType() if c is _EMPTY else types.CellType(c) for c in new_contents)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, new_defaults or None, closure or None)
    new.__kwdefaults__ = new_kwdefaults or None
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


_EMPTY = object()
