"""Populations of models: keep a subset (successive halving), copy one model onto another (PBT).

A batched model is any module whose parameters and buffers all have the model dimension first, of size
``M``. The functions here change such a model in place together with its optimizer (and optionally its
learning-rate schedulers and its :class:`batchlayers.amp.GradScaler`), so that training simply continues:

- :func:`keep_models_` keeps the models at ``indices``, in that order: parameters, buffers, gradients,
  every per-model optimizer state tensor and every ``(M,)`` hyperparameter tensor are indexed, and every
  submodule's ``num_models`` is updated. The ``nn.Parameter`` objects stay the same, so the optimizer keeps
  working on them.
- :func:`copy_model_` copies model ``src``'s weights, buffers, gradients, optimizer state (and by default
  its hyperparameters) onto model ``dst`` (the *exploit* step of population-based training); then perturb
  ``dst``'s values in the ``(M,)`` tensors, e.g. ``optimizer.param_groups[0]["lr"][dst] *= 1.2``.
- :func:`index_models_` is the module-only part of :func:`keep_models_`.

Example (successive halving)::

    for rung in range(3):
        train(model, optimizer, epochs=5)
        scores = evaluate(model)                               # (M,)
        best = scores.argsort(descending=True)[: len(scores) // 2]
        keep_models_(model, optimizer, best)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ._fold import root_shared_buffers
from ._utils import model_count_holders, set_num_models_
from .amp import GradScaler, stepped_optimizers, stepping_scalers
from .optim._base import PerModelValue

__all__ = ["copy_model_", "index_models_", "keep_models_"]

Indices = int | Sequence[int] | Tensor


def _model_tensors(module: nn.Module, caller: str) -> tuple[list[tuple[str, Tensor]], int]:
    """Every parameter and buffer (each once) and the number of models they agree on; a stacked model's
    shared buffers (one copy for all models, e.g. a causal mask) hold no model dimension and are left out."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller}: expected a batched nn.Module, got {type(module).__name__}")
    shared = set(root_shared_buffers(module))
    named = [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in shared]
    if not named:
        raise ValueError(f"{caller}: {type(module).__name__} has no parameters or buffers")
    sizes: dict[int, str] = {}
    for name, t in named:
        if t.dim() == 0:
            raise ValueError(
                f"{caller}: every parameter and buffer needs the model dimension first, but '{name}' is 0-d"
            )
        sizes.setdefault(t.shape[0], name)
    declared = {cast(int, m.num_models) for m in model_count_holders(module)}
    if len(sizes) != 1 or len(declared - set(sizes)) > 0:
        found = ", ".join(f"'{n}' has {s}" for s, n in sizes.items())
        raise ValueError(
            f"{caller}: every parameter and buffer must hold the same number of models (dimension 0) as the "
            f"modules' num_models {sorted(declared)}; {found}"
        )
    return named, next(iter(sizes))


def _as_indices(indices: Indices, num_models: int, what: str, caller: str, allow_mask: bool = False) -> Tensor:
    """Model indices as a 1-D long tensor in ``[0, M)``: negative ones count from the end, as in Python; with
    ``allow_mask`` an ``(M,)`` bool tensor selects the models where it is ``True``."""
    if isinstance(indices, Tensor):
        index = indices.detach().cpu()
        if index.dtype == torch.bool and allow_mask:
            if index.shape != (num_models,):
                raise ValueError(
                    f"{caller}: a bool mask for {what} must have shape (M,) = ({num_models},), got {tuple(index.shape)}"
                )
            index = index.nonzero().flatten()
            if index.numel() == 0:
                raise ValueError(f"{caller}: the mask for {what} selects no model")
        elif index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise TypeError(f"{caller}: {what} must be integers, got a {indices.dtype} tensor")
        index = index.reshape(-1) if index.dim() == 0 else index
    else:
        if not isinstance(indices, (int, Iterable)) or isinstance(indices, (str, bytes)):
            raise TypeError(
                f"{caller}: {what} must be an int, a sequence of ints or an integer tensor, got "
                f"{type(indices).__name__} {indices!r}"
            )
        values = [indices] if isinstance(indices, int) else list(indices)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
            raise TypeError(f"{caller}: {what} must be integers, got {values!r}")
        index = torch.tensor(values, dtype=torch.long)
    if index.dim() != 1 or index.numel() == 0:
        raise ValueError(
            f"{caller}: {what} must be a non-empty 1-D list of model indices, got shape {tuple(index.shape)}"
        )
    if bool(((index < -num_models) | (index >= num_models)).any()):
        raise ValueError(
            f"{caller}: {what} {index.tolist()} out of range for {num_models} models "
            f"({-num_models} to {num_models - 1})"
        )
    return index.long() % num_models


def _take(t: Tensor, index: Tensor) -> Tensor:
    return t.index_select(0, index.to(t.device))


@torch.no_grad()
def index_models_(module: nn.Module, indices: Indices) -> nn.Module:
    r"""Keep the models at ``indices`` (in that order) of a batched module, in place.

    Every parameter and buffer becomes ``t[indices]`` (gradients too), keeping the same ``nn.Parameter``
    and buffer objects; every submodule's ``num_models`` becomes ``len(indices)``. An index may appear more
    than once, which duplicates that model. Nothing changes if any check fails.

    Args:
        module: a batched module: all parameters and buffers shaped ``(M, *)``.
        indices: model indices (an int, a sequence of ints or an integer tensor; negative ones count from
            the end), or an ``(M,)`` bool mask of the models to keep.

    Returns:
        ``module``.
    """
    named, num_models = _model_tensors(module, "index_models_")
    index = _as_indices(indices, num_models, "indices", "index_models_", allow_mask=True)
    for _, t in named:
        # set_ rather than `.data =`: autograd keeps the size it recorded for a `.data` swap, so a graph
        # built before the call (still referenced by the caller) would make the next backward fail.
        t.set_(_take(t.detach(), index))  # type: ignore[call-overload]  # torch's stubs lack set_(Tensor)
        if t.grad is not None:
            t.grad = _take(t.grad, index)
    set_num_models_(module, index.numel())
    return module


def _optimizer_groups(optimizer: Optimizer, params: set[int], caller: str) -> list[dict[str, Any]]:
    """The param groups holding the model's parameters; a group mixing them with others is an error, and so is
    an optimizer holding none of them (it would silently keep every model's state)."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{caller}: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        inside = [id(p) in params for p in group["params"]]
        if any(inside) and not all(inside):
            raise ValueError(
                f"{caller}: param_groups[{i}] of the optimizer mixes the model's parameters with other tensors; "
                "its per-model values could not be kept consistent"
            )
        if any(inside):
            groups.append(group)
    if not groups:
        raise ValueError(
            f"{caller}: the optimizer ({type(optimizer).__name__}) holds none of the model's parameters; pass the "
            "optimizer over this model, or None"
        )
    return groups


def _per_model_entries(group: dict[str, Any], num_models: int) -> list[tuple[str, int | None, Tensor]]:
    """``(key, position in a tuple or None, tensor)`` for every ``(M,)`` tensor hyperparameter."""
    entries = []
    for key, value in group.items():
        if key == "params":
            continue
        values = value if isinstance(value, tuple) else (value,)
        for pos, v in enumerate(values):
            if isinstance(v, Tensor) and v.shape == (num_models,):
                entries.append((key, pos if isinstance(value, tuple) else None, v))
    return entries


def _set_entry(group: dict[str, Any], key: str, pos: int | None, value: Tensor) -> None:
    if pos is None:
        group[key] = value
    else:
        entries = list(group[key])
        entries[pos] = value
        group[key] = tuple(entries)


def _rewrap(old: Tensor, new: Tensor) -> Tensor:
    return new.as_subclass(PerModelValue) if isinstance(old, PerModelValue) else new


def _scheduler_lists(scheduler: Any) -> Iterable[list]:
    """The per-group lists a scheduler keeps (``base_lrs``, ``_last_lr``...), also in nested schedulers."""
    for value in vars(scheduler).values():
        if isinstance(value, list):
            if value and all(hasattr(s, "optimizer") and hasattr(s, "base_lrs") for s in value):
                for child in value:
                    yield from _scheduler_lists(child)
            else:
                yield value


def _scheduler_state(scheduler: Any, num_models: int) -> Iterable[tuple[Any, str, Tensor]]:
    """``(scheduler, name, tensor)`` for every ``(M,)`` tensor a scheduler holds as an attribute of its own: per-model
    state, not a per-group value (``batchlayers.optim.lr_scheduler.ReduceLROnPlateau``'s ``best``,
    ``num_bad_epochs``, ``cooldown_counter``), also in nested schedulers."""
    for name, value in list(vars(scheduler).items()):
        if isinstance(value, Tensor) and value.shape == (num_models,):
            yield scheduler, name, value
        elif isinstance(value, list) and value and all(hasattr(s, "optimizer") for s in value):
            for child in value:
                yield from _scheduler_state(child, num_models)


def _check_schedulers(
    schedulers: Iterable[Any] | None,
    optimizer: Optimizer | None,
    groups: list[dict[str, Any]],
    caller: str,
    silent: bool,
) -> list[Any]:
    """The schedulers whose per-model values follow the models: ``schedulers`` (each must be a scheduler of
    ``optimizer``) and the optimizer's ``batchlayers.optim.lr_scheduler`` schedulers, found through their
    registry.

    Not given (``None``): a ``torch.optim.lr_scheduler`` scheduler cannot be found from its optimizer; it leaves a
    per-model ``initial_lr`` in the param groups, and keeps a copy of it as its ``base_lrs``. When the call keeps
    the number of models (``silent``: a reordering, a duplicate, a copy), that stale copy would give its values to
    the wrong models without any error, so the call is refused. (When the number changes, the stale copy has the
    old number of entries and the scheduler's next step raises instead of mixing models.)
    """
    from .optim.lr_scheduler import live_schedulers  # (the population tools sit above the optimizers)

    if optimizer is None:
        if schedulers:
            raise ValueError(f"{caller}: schedulers were given without their optimizer")
        return []
    if schedulers is None:
        stale = [
            i
            for i, group in enumerate(optimizer.param_groups)
            if any(group is g for g in groups)
            and isinstance(group.get("initial_lr"), Tensor)
            and group["initial_lr"].dim() > 0
        ]
        if silent and stale:
            raise ValueError(
                f"{caller}: param_groups{stale} of the optimizer hold a per-model 'initial_lr', which a "
                "torch.optim.lr_scheduler scheduler sets and copies to its base_lrs; that copy would keep each "
                f"position's old model's value. Pass the scheduler: {caller}(model, optimizer, ..., "
                "schedulers=[scheduler]), or schedulers=[] if no scheduler uses this optimizer any more"
            )
        return live_schedulers(optimizer)
    if isinstance(schedulers, (str, bytes)) or not isinstance(schedulers, Iterable):
        raise TypeError(f"{caller}: schedulers must be a list of learning-rate schedulers, got {schedulers!r}")
    schedulers = list(schedulers)
    for i, scheduler in enumerate(schedulers):
        owner = getattr(scheduler, "optimizer", None)
        if not isinstance(owner, Optimizer):
            raise TypeError(
                f"{caller}: schedulers[{i}] is a {type(scheduler).__name__}, not a learning-rate scheduler (it has no "
                "optimizer)"
            )
        if owner is not optimizer:
            raise ValueError(
                f"{caller}: schedulers[{i}] ({type(scheduler).__name__}) schedules another optimizer than the one "
                "passed"
            )
    return schedulers + _unlisted_live_schedulers(optimizer, schedulers)


def _unlisted_live_schedulers(optimizer: Optimizer, schedulers: Iterable[Any]) -> list[Any]:
    """The optimizer's live ``batchlayers.optim.lr_scheduler`` schedulers (found through their registry) that
    ``schedulers`` does not list."""
    from .optim.lr_scheduler import live_schedulers  # (the population tools sit above the optimizers)

    listed = list(schedulers)
    return [s for s in live_schedulers(optimizer) if not any(s is t for t in listed)]


def _check_scalers(
    scalers: Iterable[GradScaler] | None, optimizer: Optimizer | None, num_models: int, caller: str
) -> list[GradScaler]:
    """The :class:`batchlayers.amp.GradScaler` objects whose per-model scale and growth tracker follow the models.

    Not given (``None``): a scaler that has stepped ``optimizer`` since the models were last selected (found
    through the scalers' registry) would keep each position's old model's scale, whether or not the number of
    models changes (the scale's shape alone cannot tell a reordering), so the call is refused. A scaler is not
    carried by itself, as a ``batchlayers.optim.lr_scheduler`` scheduler is: one scaler may step the optimizers
    of several models, and must then follow in one of their selection calls only.
    """
    if scalers is None:
        found = [] if optimizer is None else stepping_scalers(optimizer)
        if found:
            raise ValueError(
                f"{caller}: the optimizer is stepped by a batchlayers.amp.GradScaler whose per-model scales and "
                "growth trackers would stay at the old positions (each model then scaled, skipped and grown by "
                f"another model's state). Pass the scaler: {caller}(model, optimizer, ..., scalers=[scaler]), or "
                "scalers=[] if it no longer steps this optimizer"
            )
        return []
    if isinstance(scalers, (str, bytes, GradScaler)) or not isinstance(scalers, Iterable):
        raise TypeError(f"{caller}: scalers must be a list of batchlayers.amp.GradScaler, got {scalers!r}")
    scalers = list(scalers)
    if scalers and optimizer is None:
        raise ValueError(f"{caller}: scalers were given without their optimizer")
    for i, scaler in enumerate(scalers):
        if not isinstance(scaler, GradScaler):
            raise TypeError(
                f"{caller}: scalers[{i}] is a {type(scaler).__name__} from {type(scaler).__module__}, not a "
                "batchlayers.amp.GradScaler (one scale per model)"
            )
        again = next((j for j in range(i) if scalers[j] is scaler), None)
        if again is not None:
            raise ValueError(f"{caller}: scalers[{i}] is scalers[{again}] again; pass each scaler once")
        if scaler.num_models not in (None, num_models):
            raise ValueError(f"{caller}: scalers[{i}] holds {scaler.num_models} models, the model {num_models}")
        if scaler._in_iteration():
            raise ValueError(
                f"{caller}: scalers[{i}] is in the middle of an iteration (an optimizer was unscaled or stepped, "
                f"and the overflows found are the old models'); call {caller} after scaler.update()"
            )
        stepped = stepped_optimizers(scaler)
        if stepped and not any(o is optimizer for o in stepped):
            raise ValueError(
                f"{caller}: scalers[{i}] does not step this optimizer since the models were last selected: it "
                "steps another optimizer, or was carried already by the selection call of another optimizer it "
                "steps (a scaler over several optimizers follows once per selection)"
            )
    return scalers


def _state_tensors(optimizer: Optimizer | None, groups: list[dict[str, Any]], num_models: int):
    """``(state dict, key, tensor)`` for every per-model optimizer state tensor of these groups (none without an
    optimizer)."""
    if optimizer is None:
        return
    for group in groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == num_models:
                    yield state, key, value


def _check_optimizer_models(groups, optimizer, num_models, caller) -> None:
    for group in groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] != num_models:
                    raise ValueError(
                        f"{caller}: optimizer state '{key}' holds {value.shape[0]} models, the model {num_models}"
                    )


@torch.no_grad()
def keep_models_(
    model: nn.Module,
    optimizer: Optimizer | None,
    indices: Indices,
    *,
    schedulers: Iterable[Any] | None = None,
    scalers: Iterable[GradScaler] | None = None,
) -> None:
    r"""Keep only the models at ``indices`` (in that order), in the model and its optimizer, in place.

    Continuing training afterwards is exactly continuing the kept models' own runs: parameters, buffers,
    gradients, every per-model optimizer state tensor (momentum, moments, step counts) and every ``(M,)``
    hyperparameter tensor in the optimizer's param groups (``lr``, ``betas``, ``initial_lr``...) are
    indexed. Works with ``batchlayers.optim`` optimizers and with ``torch.optim`` ones over batched
    parameters (their 0-d step counts are shared and stay as they are).

    Args:
        model: a batched module (all parameters and buffers ``(M, *)``).
        optimizer: the optimizer over ``model``'s parameters, or ``None``.
        indices: the models to keep, in the new order (an index may repeat to duplicate a model), or an
            ``(M,)`` bool mask.
        schedulers: the learning-rate schedulers of ``optimizer``, whose per-model values follow: ``(M,)``
            base learning rates (``base_lrs`` and the like) and per-model state (the ``best``, ``num_bad_epochs``
            of :class:`batchlayers.optim.lr_scheduler.ReduceLROnPlateau`). Not given: the optimizer's
            ``batchlayers.optim.lr_scheduler`` schedulers follow by themselves; a ``torch.optim.lr_scheduler``
            scheduler cannot be found from the optimizer, so pass it whenever one with per-model learning rates
            is in use. Without it, a call that keeps the number of models (a reordering, a duplicate) is refused,
            since the scheduler's ``base_lrs`` would silently give other models' values; one that changes the
            number leaves the scheduler's lists at the old length, and its next step raises. Pass
            ``schedulers=[]`` if no scheduler uses the optimizer any more.
        scalers: the :class:`batchlayers.amp.GradScaler` objects that step ``optimizer``, whose ``(M,)`` scale
            and growth tracker follow (call this after ``scaler.update()``). Not given: the call is refused if a
            scaler has stepped the optimizer since the models were last selected (each model would silently get
            another model's scale); ``scalers=[]`` if it no longer does. One scaler over the optimizers of
            several models is passed to one of their ``keep_models_`` calls only.

    Nothing changes if any check fails.
    """
    named, num_models = _model_tensors(model, "keep_models_")
    index = _as_indices(indices, num_models, "indices", "keep_models_", allow_mask=True)
    groups = []
    if optimizer is not None:
        groups = _optimizer_groups(optimizer, {id(t) for _, t in model.named_parameters()}, "keep_models_")
        _check_optimizer_models(groups, optimizer, num_models, "keep_models_")
    schedulers = _check_schedulers(schedulers, optimizer, groups, "keep_models_", silent=len(index) == num_models)
    scalers = _check_scalers(scalers, optimizer, num_models, "keep_models_")
    index_models_(model, index)
    for state, key, value in list(_state_tensors(optimizer, groups, num_models)):
        state[key] = _take(value, index)
    for group in groups:
        for key, pos, value in _per_model_entries(group, num_models):
            _set_entry(group, key, pos, _rewrap(value, _take(value.as_subclass(Tensor), index)))
    for scheduler in schedulers:
        for owner, name, value in list(_scheduler_state(scheduler, num_models)):
            setattr(owner, name, _take(value, index))
        for values in _scheduler_lists(scheduler):
            for i, v in enumerate(values):
                if isinstance(v, Tensor) and v.shape == (num_models,):
                    values[i] = _take(v, index)
    for scaler in scalers:
        scaler._keep_models_(index, cast(Optimizer, optimizer))  # (_check_scalers: given with their optimizer)


@torch.no_grad()
def copy_model_(
    model: nn.Module,
    optimizer: Optimizer | None,
    src: Indices,
    dst: Indices,
    *,
    copy_hyperparameters: bool = True,
    schedulers: Iterable[Any] | None = None,
    scalers: Iterable[GradScaler] | None = None,
) -> None:
    r"""Copy model ``src`` onto model ``dst``, in the model and its optimizer, in place.

    Model ``dst`` gets ``src``'s parameters, buffers, gradients and optimizer state (momentum, moments,
    step counts), so it continues exactly as ``src`` would: the *exploit* step of population-based
    training. ``src`` and ``dst`` may be equal-length lists to copy several models at once (all reads
    happen before the writes); ``dst`` must not repeat.

    Args:
        model: a batched module.
        optimizer: the optimizer over ``model``'s parameters, or ``None``.
        src: the model(s) to copy from.
        dst: the model(s) to overwrite.
        copy_hyperparameters: also copy the ``(M,)`` hyperparameter tensors of the optimizer (and of
            ``schedulers``), as PBT does before it perturbs them. Default: ``True``.
        schedulers: the learning-rate schedulers of ``optimizer``: their per-model state (the ``best``,
            ``num_bad_epochs`` of :class:`batchlayers.optim.lr_scheduler.ReduceLROnPlateau`) is copied, and
            with ``copy_hyperparameters`` their per-model base learning rates. Not given: as in
            :func:`keep_models_`; with ``copy_hyperparameters`` a ``torch.optim.lr_scheduler`` scheduler with
            per-model learning rates must be passed (the call is refused otherwise).
        scalers: the :class:`batchlayers.amp.GradScaler` objects that step ``optimizer``: model ``dst`` gets
            ``src``'s scale and growth tracker (state, copied whatever ``copy_hyperparameters``). Not given: as in
            :func:`keep_models_`, refused if a scaler has stepped the optimizer since the last selection.

    Example::

        >>> copy_model_(model, optimizer, src=best, dst=worst)
        >>> optimizer.param_groups[0]["lr"][worst] *= 1.2          # explore
    """
    named, num_models = _model_tensors(model, "copy_model_")
    src_index = _as_indices(src, num_models, "src", "copy_model_")
    dst_index = _as_indices(dst, num_models, "dst", "copy_model_")
    if src_index.numel() != dst_index.numel():
        raise ValueError(f"copy_model_: src {src_index.tolist()} and dst {dst_index.tolist()} differ in length")
    if dst_index.unique().numel() != dst_index.numel():
        raise ValueError(f"copy_model_: dst {dst_index.tolist()} repeats a model")
    groups = []
    if optimizer is not None:
        groups = _optimizer_groups(optimizer, {id(t) for _, t in model.named_parameters()}, "copy_model_")
        _check_optimizer_models(groups, optimizer, num_models, "copy_model_")
    schedulers = _check_schedulers(schedulers, optimizer, groups, "copy_model_", silent=copy_hyperparameters)
    scalers = _check_scalers(scalers, optimizer, num_models, "copy_model_")

    def copy_(t: Tensor) -> None:
        t.index_copy_(0, dst_index.to(t.device), _take(t, src_index))

    for _, t in named:
        copy_(t.data)
        if t.grad is not None:
            copy_(t.grad)
    for _, _, value in _state_tensors(optimizer, groups, num_models):
        copy_(value)
    for scheduler in schedulers:
        for _, _, value in _scheduler_state(scheduler, num_models):
            copy_(value)
    for scaler in scalers:
        scaler._copy_models_(src_index, dst_index, cast(Optimizer, optimizer))
    if copy_hyperparameters:
        for group in groups:
            for _, _, value in _per_model_entries(group, num_models):
                copy_(value.as_subclass(Tensor))
        for scheduler in schedulers:
            for values in _scheduler_lists(scheduler):
                for v in values:
                    if isinstance(v, Tensor) and v.shape == (num_models,):
                        copy_(v)
