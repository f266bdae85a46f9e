"""Checking that N models are instances of one architecture, naming the first difference otherwise."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

__all__ = [
    "check_models",
    "check_same_architecture",
    "first_difference",
    "names_by_tensor",
    "same",
    "tensor_attributes",
    "tensor_table",
]


def tensor_table(model: nn.Module, remove_duplicate: bool = False) -> dict[str, Tensor]:
    """Every parameter, then every buffer, under every name it has (tied ones under each; with
    ``remove_duplicate`` once, under its first name), in registration order."""
    return {
        **dict(model.named_parameters(remove_duplicate=remove_duplicate)),
        **dict(model.named_buffers(remove_duplicate=remove_duplicate)),
    }


def names_by_tensor(model: nn.Module) -> list[list[str]]:
    """All names of each parameter and buffer, one list per tensor (a tied tensor has several)."""
    groups: dict[int, list[str]] = {}
    for name, t in tensor_table(model).items():
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def _param_names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters(remove_duplicate=False)}


_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training", "num_models"}
# Where a checkpoint was loaded from (transformers' ``from_pretrained``): different for every fine-tuned
# checkpoint, never read by ``forward``. The stacked model keeps model 0's.
_METADATA = frozenset({"name_or_path"})
_PLAIN = (int, float, complex, str, bytes, bool, type(None), tuple, list, dict, set, frozenset)


def _config(module: nn.Module, model_dim: bool = False) -> dict[str, object]:
    """A module's plain attributes (stride, eps, n_head, a list of sizes, private ones too): one value for all
    models, so they must agree. Tensors held as plain attributes are compared by ``stack`` (see
    :func:`tensor_attributes`); functions and other objects (a transformers config) are the architecture's
    code, not compared. ``model_dim`` (stacked models): tensors holding values per model or samples, also
    inside containers, are compared by ``concat``, which joins them."""
    return {
        k: _without_models(v) if model_dim else v
        for k, v in vars(module).items()
        if k not in _MODULE_INTERNALS and k not in _METADATA and not k.startswith("_batchlayers") and _is_plain(v)
    }


def _without_models(v: object) -> object:
    if isinstance(v, Tensor) and getattr(v, "_batchlayers_models", None) is not None:
        return "a tensor with a value per model or the models' samples"
    if isinstance(v, (tuple, list)):
        items = [_without_models(x) for x in v]
        kind: Any = type(v)
        return kind(*items) if hasattr(v, "_fields") else kind(items)  # (a namedtuple takes fields)
    if isinstance(v, dict):
        return {k: _without_models(x) for k, x in v.items()}
    return v


def _is_plain(v: object) -> bool:
    """Numbers, strings, None and dataclasses, and containers of them (plain tensors inside allowed); not
    weak references, functions, other objects or lists of parameters (RNN's ``_flat_weights``: compared as
    parameters)."""
    if isinstance(v, (tuple, list, set, frozenset, dict)):
        items = v.values() if isinstance(v, dict) else v
        return all(_is_plain(x) or (isinstance(x, Tensor) and not isinstance(x, nn.Parameter)) for x in items)
    return isinstance(v, _PLAIN) or (dataclasses.is_dataclass(v) and not isinstance(v, type))


def tensor_attributes(model: nn.Module) -> dict[str, Tensor]:
    """Tensors held as plain attributes of ``model``'s modules (not parameters or buffers), by path."""
    registered = {id(t) for t in tensor_table(model).values()}
    return {
        f"{path}.{k}" if path else k: v
        for path, module in model.named_modules()
        for k, v in vars(module).items()
        if isinstance(v, Tensor) and id(v) not in registered and k not in _MODULE_INTERNALS
    }


def same(a: object, b: object) -> bool:
    """Equality that compares tensors by value (shape, dtype and elements), also inside containers."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # (b: a's type)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    try:
        return bool(a == b) or (isinstance(a, float) and a != a and b != b)  # (nan == nan)
    except (TypeError, ValueError, RuntimeError):
        return False


def _show(v: object) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, Tensor):
        return f"a tensor {tuple(v.shape)} {v.dtype}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def first_difference(reference: Mapping, other: Mapping) -> str | None:
    """The first key missing, unexpected or with another value (tensors compared by value), in words."""
    for key in list(reference) + [k for k in other if k not in reference]:
        if key not in other:
            return f"'{key}' is missing"
        if key not in reference:
            return f"'{key}' is unexpected"
        if not same(reference[key], other[key]):
            return f"'{key}' is {_show(other[key])} instead of {_show(reference[key])}"
    return None


def check_same_architecture(
    models: Sequence[nn.Module],
    what: str = "stack",
    model_dim: bool = False,
    stored_once: Sequence[Iterable[str]] = (),
) -> None:
    """Raise naming the first difference between ``models[i]`` and ``models[0]``.

    ``model_dim``: the models are stacked ones; their tensors' first dimension may differ, and
    ``stored_once[i]`` names model ``i``'s buffers stored once for all its models (no model dimension).
    """
    once = [set(names) for names in stored_once] or [set() for _ in models]
    reference = models[0]
    ref_table, ref_params = tensor_table(reference), _param_names(reference)
    ref_modules = dict(reference.named_modules(remove_duplicate=False))
    ref_ties = _tie_groups(reference)
    for i, model in enumerate(models[1:], start=1):
        if type(model) is not type(reference):
            raise TypeError(
                f"{what}: model {i} is a {type(model).__qualname__}, model 0 a {type(reference).__qualname__}; "
                "all models must be instances of one architecture"
            )
        modules = dict(model.named_modules(remove_duplicate=False))
        types_ = {k: type(m).__qualname__ for k, m in modules.items()}
        diff = first_difference({k: type(m).__qualname__ for k, m in ref_modules.items()}, types_)
        if diff:
            raise TypeError(f"{what}: model {i} has a different module structure than model 0: {diff}")
        table, params = tensor_table(model), _param_names(model)
        for key in list(ref_table) + [k for k in table if k not in ref_table]:
            if key not in table or key not in ref_table:
                raise ValueError(
                    f"{what}: model {i} and model 0 have different parameters/buffers: '{key}' is "
                    f"{'missing in model ' + str(i) if key not in table else 'missing in model 0'}"
                )
            t, r, is_param = table[key], ref_table[key], key in params
            shape, ref_shape = tuple(t.shape), tuple(r.shape)
            if model_dim:
                shape = shape if key in once[i] else shape[1:]
                ref_shape = ref_shape if key in once[0] else ref_shape[1:]
            if shape != ref_shape or is_param != (key in ref_params):
                raise ValueError(
                    f"{what}: '{key}' has shape {tuple(t.shape)} in model {i} but {tuple(r.shape)} in model 0"
                )
            if t.dtype != r.dtype or t.device != r.device:
                raise ValueError(
                    f"{what}: '{key}' is {t.dtype} on {t.device} in model {i} but {r.dtype} on {r.device} in "
                    "model 0; move all models to one device and dtype first (model.to(...))"
                )
            if is_param and t.requires_grad != r.requires_grad:
                raise ValueError(
                    f"{what}: '{key}' has requires_grad={t.requires_grad} in model {i} but {r.requires_grad} in "
                    "model 0; a stacked parameter is trained or frozen for all models at once"
                )
        if _tie_groups(model) != ref_ties:
            raise ValueError(f"{what}: model {i} ties its weights differently than model 0")
        for path, ref_module in ref_modules.items():
            module = modules[path]
            where = f"'{path}'" if path else "the model itself"
            if module.training != ref_module.training:
                raise ValueError(
                    f"{what}: {where} is in {'train' if module.training else 'eval'} mode in model {i} but in "
                    f"{'train' if ref_module.training else 'eval'} mode in model 0; call .train() or .eval() "
                    "on all models first"
                )
            diff = first_difference(_config(ref_module, model_dim), _config(module, model_dim))
            if diff:
                raise ValueError(
                    f"{what}: {where} is configured differently in model {i} than in model 0: {diff}. A plain "
                    "attribute is one value for all models; to give each model its own, make it a buffer "
                    "(module.register_buffer(name, torch.as_tensor(value))), which stack stores per model"
                )


def _tie_groups(model: nn.Module) -> list[list[str]]:
    return [g for g in names_by_tensor(model) if len(g) > 1]


def check_models(models: object, what: str) -> list[nn.Module]:
    if isinstance(models, nn.Module) or not isinstance(models, Iterable):
        raise TypeError(f"{what}: expected a list of models, got {type(models).__name__}")
    models = list(models)
    if not models:
        raise ValueError(f"{what}: got an empty list of models")
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{what}: item {i} is a {type(m).__name__}, not an nn.Module")
    models = [uncompiled(m) for m in models]
    for i, m in enumerate(models):
        check_materialised(m, i, what)
    return models


def check_materialised(model: nn.Module, index: int, what: str) -> None:
    """Refuse a model holding an uninitialized parameter or buffer of a lazy module (``nn.LazyLinear``)."""
    lazy = next((n for n, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)), None)
    if lazy is not None:
        raise ValueError(
            f"{what}: '{lazy}' of model {index} is an uninitialized parameter of a lazy module, whose shape torch "
            f"sets on its first call: call each model once on an input, then {what}"
        )


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds, or ``module`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (no wrapper exists before it is imported)
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module
