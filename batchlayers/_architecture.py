"""Checking that N models are instances of one architecture, naming the first difference otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor, nn

__all__ = ["check_models", "check_same_architecture", "first_difference", "names_by_tensor", "tensor_table"]


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


def _config(module: nn.Module) -> dict[str, object]:
    """A module's plain configuration attributes (stride, eps, n_head, ...): they must agree between models."""
    plain = (int, float, str, bool, tuple, type(None))
    skip = ("training", "num_models")
    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and k not in skip and (isinstance(v, plain) or dataclasses.is_dataclass(v))
    }


def first_difference(reference: Mapping, other: Mapping) -> str | None:
    for key in list(reference) + [k for k in other if k not in reference]:
        if key not in other:
            return f"'{key}' is missing"
        if key not in reference:
            return f"'{key}' is unexpected"
        if reference[key] != other[key]:
            return f"'{key}': {other[key]} instead of {reference[key]}"
    return None


def check_same_architecture(models: Sequence[nn.Module], what: str = "stack", model_dim: bool = False) -> None:
    """Raise naming the first difference between ``models[i]`` and ``models[0]``.

    ``model_dim``: the models are stacked ones; their tensors' first dimension may differ.
    """
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
                shape, ref_shape = shape[1:], ref_shape[1:]
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
            diff = first_difference(_config(ref_module), _config(module))
            if diff:
                raise ValueError(f"{what}: {where} is configured differently in model {i} than in model 0: {diff}")


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
    return models
