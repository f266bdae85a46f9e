"""Converters between N ordinary models of one architecture and one stacked model holding all of them.

``stack(models)`` returns a copy of the architecture (the same class, so its own ``forward`` runs unchanged and
its ``state_dict()`` keys are the architecture's own; an ``nn.Sequential`` holding a run ``Linear, activation,
Linear`` becomes the subclass ``BatchedSequential``, which trains the run as one autograd node) in which every
torch.nn leaf with a registered batched counterpart is swapped for it, holding all models' weights shaped
``(M, *)``. Every other parameter (and the buffers of modules that hold parameters, or that differ between
the models) is stored ``(M, *)`` too, in its own module, whose code reads it as one model's value
(``batchlayers._per_model``): class tokens, position tables, layer-scale gammas, subclasses and look-alikes
of torch.nn layers, parametrizations.
The stacked model is called with every tensor input shaped ``(M, B, *)``; inside, the architecture's
``forward`` sees one ordinary batch of ``M * B`` samples, model-major (see ``batchlayers._fold``), and the
layers that must know the model boundaries (linear, conv, norms) view it back to ``(M, B, *)``.

Limits, by design:

- A reduction of values over the samples inside ``forward`` (``x.mean(0)``, ``x.sum()``, ``x.std()``,
  ``x.amax()``, ``x.norm()``, a loss with ``reduction='mean'`` or ``'sum'`` including ``ignore_index`` and
  class weights) is each model's own: the output is ``(M,)``, entry ``i`` model ``i``'s loss, and
  ``loss.sum().backward()`` gives every model exactly its own gradient. An index over the samples
  (``argmax``) is refused where it reaches a layer or an output. Sizes read from the samples (``x.size(0)``)
  are ``M * B`` inside: given to an elementwise op (``x / x.size(0)``, ``x.sum(0) / x.size(0)``) they are
  each model's own ``B``; used as values anywhere else (``torch.full((4,), x.size(0))``) they are refused.
- Which tensors carry the models' samples is followed through every torch call of ``forward``, not guessed
  from sizes (``batchlayers._provenance``). Code that would mix the models' samples (``torch.roll`` over the
  batch, a functional batch norm in training mode, an op without a rule) is refused where its result reaches
  a batched layer or an output, naming the operation; torch.nn layers that mix a batch (BatchNorm) are
  swapped for batched counterparts.
- A shared input (a stride-0 expand) is copied to ``M * B`` samples on entry: the architecture's own code
  needs one ordinary batch. Batched layers used directly never copy it.
"""

from __future__ import annotations

import copy
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn.utils import prune
from torch.nn.utils.weight_norm import WeightNorm

from . import _fold, _per_model
from ._architecture import (
    _MODULE_INTERNALS,
    _param_names,
    check_materialised,
    check_models,
    check_same_architecture,
    first_difference,
    same,
    tensor_attributes,
    tensor_table,
)
from ._copy import rebind_functions
from ._model_by_model import ModelByModel
from ._provenance import Lost, PerModel, get_tag, set_tag
from ._utils import model_count_holders, set_num_models_
from .container import BatchedSequential, Folded, fusable_runs
from .population import _model_tensors
from .registry import (
    _BY_BATCHED,
    _Counterpart,
    constructor_kwargs,
    counterpart_of,
    isinstance_torch,
    load_builtins,
    register,
)

__all__ = [
    "concat",
    "isinstance_torch",  # re-exported from batchlayers.registry
    "register",  # re-exported from batchlayers.registry
    "replicate",
    "select",
    "set_execution",
    "shared_buffers",
    "stack",
    "stack_state_dicts",
    "unstack",
    "unstack_state_dict",
]


# ----------------------------------------------------------------------------------------------------------
# Building a stacked model: the plan, the skeleton, then one model's values at a time


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# Every kind of hook a module can hold; none can be moved onto the batched layer that replaces it.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _plan(
    template: nn.Module, differing: frozenset[str] = frozenset()
) -> tuple[list[tuple[str, nn.Module, _Counterpart]], list[tuple[nn.Module, dict[str, Tensor]]], list[str]]:
    """Which modules to swap for batched layers, which tensors of the other modules are per-model, and
    which buffers stay one copy shared by all models.

    A leaf of a registered torch.nn type is swapped for its batched counterpart (unless it has hooks, which
    belong to the torch layer). Every other module runs its own ``forward`` on per-model tensors (see
    ``batchlayers._per_model``): its own parameters, the buffers of a module that has parameters of its own
    (running statistics of a norm) and the buffers named in ``differing`` (not equal in all models) are
    stored ``(M, *)``; the other buffers of modules without parameters (masks, rotary tables) are one copy
    shared by all models.
    """
    swaps: list[tuple[str, nn.Module, _Counterpart]] = []
    per_model: list[tuple[nn.Module, dict[str, Tensor]]] = []
    shared: list[str] = []
    blockers: list[str] = []
    seen: set[int] = set()
    # Buffers stored per model, by id: every module holding one sees it so (a buffer registered in two modules)
    own_buffers = {id(b) for n, b in template.named_buffers(remove_duplicate=False) if n in differing}
    for module in template.modules():
        swapped = counterpart_of(type(module)) is not None and not any(getattr(module, h) for h in _HOOK_DICTS)
        if not swapped and next(module.parameters(recurse=False), None) is not None:
            own_buffers.update(id(b) for b in module.buffers(recurse=False))
    shared_buffers: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        kinds = [
            kind for attr, kind in _UNTRACKED_HOOKS if any(not _known_hook(h) for h in getattr(module, attr).values())
        ]
        if kinds:
            blockers.append(
                f"{repr(path) if path else 'the model itself'} ({type(module).__qualname__}) has {' and '.join(kinds)} "
                "hooks: they would see all models' tensors at once (folded gradients, (M, *) state dicts). "
                "Remove them before stacking and register them on the stacked model if needed"
            )
        counterpart = counterpart_of(type(module))
        if counterpart is not None and not any(getattr(module, hooks) for hooks in _HOOK_DICTS):
            swaps.append((path, module, counterpart))
            return
        params = dict(module.named_parameters(recurse=False))
        buffers = dict(module.named_buffers(recurse=False))
        own = {**params, **{n: b for n, b in buffers.items() if id(b) in own_buffers}}
        if own:
            per_model.append((module, own))
        for n, b in buffers.items():
            if n not in own and id(b) not in shared_buffers:  # (one name for a buffer held twice: the first)
                shared_buffers.add(id(b))
                shared.append(_join(path, n))
        for name, child in module.named_children():
            visit(_join(path, name), child)

    visit("", template)
    if blockers:
        raise TypeError("stack: cannot stack this architecture:\n- " + "\n- ".join(blockers))
    return swaps, per_model, shared


# Hooks that run outside the tracked forward, on every model's tensors at once: refused. Forward hooks run
# inside it, on one model's view, and are kept (a swapped torch layer with any hook keeps its own code).
_UNTRACKED_HOOKS = (
    ("_backward_pre_hooks", "backward"),
    ("_backward_hooks", "backward"),
    ("_state_dict_pre_hooks", "state-dict"),
    ("_state_dict_hooks", "state-dict"),
    ("_load_state_dict_post_hooks", "load-state-dict"),
)  # (load-state-dict pre-hooks are kept: see _fold.MovesKeysOnly)


def _known_hook(hook: object) -> bool:
    """torch's own hooks that only mark or convert the state-dict format (spectral_norm's, weight_norm's)."""
    hook = getattr(hook, "hook", hook)
    name = getattr(hook, "__name__", type(hook).__name__)
    return name in ("SpectralNormStateDictHook", "SpectralNormLoadStateDictPreHook", "_weight_norm_compat_hook")


def _set_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    *parents, leaf = name.split(".")
    for p in parents:
        module = getattr(module, p)
    if leaf in module._parameters:
        module._parameters[leaf] = cast(nn.Parameter, value)  # the source's is a parameter too, kept one by _rebuilt
    else:
        module._buffers[leaf] = value


def _rebuilt(t: Tensor, data: Tensor) -> Tensor:
    """``data`` as the same kind of tensor as ``t``: a parameter (with its ``requires_grad``) or a buffer."""
    return nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data


def _new_stacked(t: Tensor, num_models: int) -> Tensor:
    return _rebuilt(t, torch.empty((num_models, *t.shape), dtype=t.dtype, device=t.device))


def _adopt(
    target: nn.Module, source: nn.Module, made: dict[int, Tensor], what: str, expected: Callable[[Tensor], Tensor]
) -> None:
    """Give ``target`` (freshly built, any device) ``expected(t)`` for every tensor ``t`` of ``source`` with
    the same name; the same source tensor maps to one target tensor (ties). Names and kinds (parameter or
    buffer) are checked before anything is changed."""
    target_table, source_table = tensor_table(target), tensor_table(source)
    if set(target_table) != set(source_table):
        raise TypeError(
            f"{what}: {type(target).__name__} has parameters/buffers {sorted(target_table)} but "
            f"{type(source).__name__} has {sorted(source_table)}; they must carry the same names"
        )
    target_params, source_params = _param_names(target), _param_names(source)
    for name in source_table:
        if (name in source_params) != (name in target_params):
            kinds = ("a parameter", "a buffer") if name in source_params else ("a buffer", "a parameter")
            raise TypeError(
                f"{what}: '{name}' is {kinds[0]} of {type(source).__name__} but {kinds[1]} of "
                f"{type(target).__name__}; a counterpart must register each tensor as the same kind (a parameter "
                "is trained by an optimizer over .parameters(), a buffer is not)"
            )
    for name, t in source_table.items():
        if id(t) not in made:
            made[id(t)] = expected(t)
        value = made[id(t)]
        built = target_table[name]
        if built.shape != value.shape:
            raise TypeError(
                f"{what}: {type(target).__name__} builds '{name}' with shape {tuple(built.shape)}, expected "
                f"{tuple(value.shape)}"
            )
        _set_tensor(target, name, value)


def _swap_in(root: nn.Module, replaced: dict[int, object]) -> nn.Module:
    for module in list(root.modules()):
        for key, child in module._modules.items():
            if child is not None and id(child) in replaced:
                module._modules[key] = cast(nn.Module, replaced[id(child)])  # what replaces a module is one
    return cast(nn.Module, replaced.get(id(root), root))


def _translator(memo: dict[int, object], replaced: dict[int, object]) -> Callable[[object], object]:
    def translate(obj: object) -> object:
        obj = memo.get(id(obj), obj)
        return replaced.get(id(obj), obj)

    return translate


@dataclass
class _Stacked:
    """A stacked model under construction: where each of one model's tensors goes."""

    module: nn.Module
    stacked: dict[str, Tensor]  # canonical name -> (M, *) tensor
    shared: dict[str, Tensor]  # canonical name -> one buffer for all models
    num_models: int

    @torch.no_grad()
    def fill(self, index: int, tensors: Mapping[str, Tensor], source: str) -> None:
        """Write one model's tensors into slice ``index``. A shared buffer (equal in the models so far, in a
        module without parameters of its own) that differs in this one is stored per model from here on, the
        models before it holding the shared value (``replicate`` and ``stack_checkpoints`` fill the models one
        at a time, so they cannot know in advance)."""
        for name, target in self.stacked.items():
            target[index].copy_(tensors[name])
        for name, target in list(self.shared.items()):
            value = tensors[name]
            if index == 0:
                target.copy_(value)
            elif not torch.equal(target, value.to(target.device, target.dtype)):
                fold = _fold.fold_inputs(self.module)
                if fold is None or name not in fold.shared_buffers:
                    raise ValueError(f"the buffer '{name}' differs between the first model and {source}")
                fold.store_per_model(self.module, name, None)  # (the same tensor object, now (M, *))
                target[index].copy_(value)
                self.stacked[name] = self.shared.pop(name)


def _non_leaf_attributes(model: nn.Module) -> list[str]:
    """Plain attributes of ``model``'s modules (not parameters, buffers or submodules) that hold a tensor with
    an autograd history, in containers too: what ``copy.deepcopy`` refuses to copy."""
    return [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name, value in vars(module).items()
        if not name.startswith("_") and any(t.grad_fn is not None for _, t in _fold._tensors(value, name))
    ]


def _recomputed_attributes(module: nn.Module) -> list[str]:
    """The plain tensor attributes of ``module`` that a forward pre-hook of torch's own computes again before
    every call, from the module's parameters and buffers: the pruned tensors of ``torch.nn.utils.prune`` (from
    ``<name>_orig`` and ``<name>_mask``) and the weight of the deprecated ``torch.nn.utils.weight_norm`` (from
    ``<name>_g`` and ``<name>_v``). They hold an autograd history from the start, which cannot be copied; the
    stacked model holds each model's value, detached, until its first call computes them again."""
    names = []
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, prune.BasePruningMethod):
            names.append(hook._tensor_name)
        elif isinstance(hook, WeightNorm):
            names.append(hook.name)
    return names


def _skeleton(template: nn.Module, num_models: int, differing: frozenset[str] = frozenset()) -> _Stacked:
    """The stacked architecture with empty ``(M, *)`` tensors, from one instance of it (``differing``: names
    of buffers that are not equal in all models)."""
    swaps, own_tensors, shared = _plan(template, differing)
    memo: dict[int, object] = {}
    # The tensors to be replaced stay the template's in the copy instead of being copied for nothing.
    for _, leaf, _ in swaps:
        for t in tensor_table(leaf).values():
            memo[id(t)] = t
    for _, tensors in own_tensors:
        for t in tensors.values():
            memo[id(t)] = t
    # (copied without their history: stack() then stores them per model where the models' values differ)
    for module in template.modules():
        for name in _recomputed_attributes(module):
            value = vars(module).get(name)
            if isinstance(value, Tensor):
                memo[id(value)] = value.detach().clone()
    try:
        root = copy.deepcopy(template, memo)
    except RuntimeError as exc:
        caches = _non_leaf_attributes(template)
        if not caches:
            raise
        raise ValueError(
            f"stack: {', '.join(repr(c) for c in caches)} of the models hold{'s' if len(caches) == 1 else ''} a "
            "tensor computed with gradients (a cache filled by a forward run with gradients enabled), which "
            "cannot be copied. Clear it before stacking, or fill such caches under torch.no_grad()"
        ) from exc
    replaced: dict[int, object] = {}
    made: dict[int, Tensor] = {}
    for path, leaf, counterpart in swaps:
        what = f"stack: the batched counterpart of '{path or type(template).__name__}'"
        batched = counterpart.to_batched(leaf, num_models)
        _adopt(batched, leaf, made, what, lambda t: _new_stacked(t, num_models))
        batched.train(leaf.training)
        _fold.attach_leaf_hooks(batched, path)
        replaced[id(memo[id(leaf)])] = batched
    for module, tensors in own_tensors:
        copied = cast(nn.Module, memo[id(module)])  # deepcopy's copy of the module
        for name, t in tensors.items():
            if id(t) not in made:
                made[id(t)] = _new_stacked(t, num_models)
            _set_tensor(copied, name, made[id(t)])
    replaced.update(made)
    root = _swap_in(root, replaced)
    _fuse_sequentials(root)
    rebind_functions(root, _translator(memo, replaced))
    _fold.keep_load_hooks(root)
    stacked = {n: t for n, t in tensor_table(root, remove_duplicate=True).items() if n not in shared}
    if not _fold.is_swapped_leaf(root):
        if "num_models" in vars(root):
            raise ValueError(
                f"stack: {type(template).__name__} has its own attribute 'num_models'; the stacked model uses that "
                "name for M. Rename the attribute"
            )
        root.num_models = num_models  # type: ignore[assignment]  # torch's stubs allow only tensors and modules
        _fold.guard_nested_tensors(root)
        own_ids = {id(made[id(t)]) for _, tensors in own_tensors for t in tensors.values()}
        own_code = [n for n, t in stacked.items() if id(t) in own_ids]
        _fold.attach_root_hooks(root, shared, list(stacked), own_code)
    buffers = dict(root.named_buffers())
    return _Stacked(root, stacked, {n: buffers[n] for n in shared}, num_models)


def _fuse_sequentials(root: nn.Module) -> None:
    """Every ``nn.Sequential`` of the stacked model holding a run ``BatchedLinear, activation, BatchedLinear``
    becomes a :class:`~batchlayers.container.BatchedSequential` (a subclass: same children, keys, results),
    which trains the run as one autograd node; :func:`unstack` makes it an ``nn.Sequential`` again."""
    for module in root.modules():
        if type(module) is nn.Sequential and fusable_runs(module):
            module.__class__ = BatchedSequential
            module._batchlayers_sequential = True  # type: ignore[assignment]  # stubs allow only tensors, modules


_EXECUTIONS = ("batched", "model_by_model")


def stack(models: Sequence[nn.Module], *, execution: str = "batched") -> nn.Module:
    """One stacked model holding the weights and buffers of ``models``, N instances of one architecture.

    The result is a copy of the architecture (same class, same ``forward``) in which every torch.nn leaf with a
    batched counterpart is swapped for it, and every other parameter is stored per model in its own module
    (its code sees one model's value); tied weights map to one stacked parameter, functions stored on the
    modules are rebound to the copy. An ``nn.Sequential`` (exactly that class) holding a run ``Linear,
    activation, Linear`` becomes a :class:`~batchlayers.BatchedSequential`, its subclass, which trains the
    run as one autograd node; :func:`unstack` gives back ``nn.Sequential``. The input models are not modified.

    Args:
        models: N modules of one class, structure, configuration, device, dtype and train/eval mode.
        execution: how ``forward`` computes the models. ``"batched"`` (default): once, for all models' samples
            folded into one batch, every batched layer computing all models at once. ``"model_by_model"``: the
            architecture's ``forward`` once per model, each batched layer replaced for that pass by its torch.nn
            layer holding the model's slices (views of the stacked tensors), convolutions on the CPU
            channels-last; exactly the original models' computation, whatever the sizes, and often faster for
            convolutional networks with large per-model batches on a CPU (the performance guide has the
            measurements). Parameters, buffers, optimizers and
            ``state_dict`` are the same in both; under ``torch.compile`` the model runs batched.

    Returns:
        The stacked model. It has ``num_models`` (N) set, parameters and buffers under the architecture's own
        names shaped ``(N, *)``, and is called with every tensor input shaped ``(N, B, *)`` (or a stride-0
        expand of one batch for all models); tensor outputs come back ``(N, B, *)`` inside the same tuples,
        lists, dicts or dataclasses; a 0-dim output (a loss) comes back ``(N,)``, one per model.

    .. note::
        A loss computed inside ``forward`` with ``reduction='mean'`` (``F.cross_entropy``'s default,
        ``ignore_index`` and class weights included) is each model's own: ``out.loss`` is ``(N,)`` and
        ``out.loss.sum().backward()`` gives every model exactly its own gradient. Sums over the samples are
        refused (see the module docstring).

    Raises:
        TypeError / ValueError: naming the first difference between the models, or listing every module with
            hooks that would see all models at once (backward, state-dict hooks). Code in ``forward`` that
            cannot run per model raises when called, naming the torch function.

    Examples::

        >>> models = [MyNet() for _ in range(4)]           # or loaded from 4 checkpoints
        >>> batched = batchlayers.stack(models)
        >>> batched(x.expand(4, *x.shape)).shape           # one batch x for all 4 models
        torch.Size([4, 32, 10])
        >>> models = batchlayers.unstack(batched)          # 4 ordinary MyNet again
    """
    if execution not in _EXECUTIONS:
        raise ValueError(f"stack: execution must be one of {_EXECUTIONS}, got {execution!r}")
    models = check_models(models, "stack")
    check_same_architecture(models)
    buffers = [dict(m.named_buffers()) for m in models]
    differing = frozenset(
        name for name, b in buffers[0].items() if any(not torch.equal(b, other[name]) for other in buffers[1:])
    )
    result = _skeleton(models[0], len(models), differing)
    for i, model in enumerate(models):
        result.fill(i, tensor_table(model), f"model {i}")
    _stack_tensor_attributes(result.module, models)
    if execution != "batched" and not _fold.is_swapped_leaf(result.module):  # (a layer is batched math anyway)
        set_execution(result.module, execution)
    return result.module


def set_execution(batched: nn.Module, execution: str) -> nn.Module:
    """Choose how a stacked model's ``forward`` computes its models, as :func:`stack`'s ``execution`` does:
    ``"batched"`` or ``"model_by_model"``. For stacked models made another way (``stack_checkpoints``,
    ``replicate``, ``select``, ``concat``). Returns ``batched``, changed in place; parameters, buffers,
    optimizers and hooks are untouched.

    Examples::

        >>> model = batchlayers.set_execution(batchlayers.stack_checkpoints(MyNet(), paths), "model_by_model")
    """
    if execution not in _EXECUTIONS:
        raise ValueError(f"set_execution: execution must be one of {_EXECUTIONS}, got {execution!r}")
    if not isinstance(batched, nn.Module) or _fold.fold_inputs(batched) is None:
        raise TypeError(
            f"set_execution: expected a model stacked by batchlayers.stack (or stack_checkpoints, replicate, "
            f"select, concat), got {type(batched).__name__}; a model built from batched layers by hand runs batched"
        )
    current = vars(batched).get("forward")
    if execution == "batched":
        if isinstance(current, ModelByModel):
            del batched.forward  # the class's own forward again
    elif not isinstance(current, ModelByModel):
        if current is not None:
            raise ValueError(
                f"set_execution: {type(batched).__name__} stores its own 'forward' attribute, which "
                "execution='model_by_model' would replace"
            )
        batched.forward = ModelByModel(batched)
    return batched


def _stack_tensor_attributes(stacked: nn.Module, models: Sequence[nn.Module]) -> None:
    """Tensors that modules hold as plain attributes (not parameters or buffers) and that differ between
    the models are stored per model, ``(M, *)``, read by the module's code as its one model's value (as
    per-model buffers are); equal ones stay one tensor."""
    attributes = [tensor_attributes(m) for m in models]
    for name in dict.fromkeys(k for a in attributes for k in a):
        values = [a.get(name) for a in attributes]
        first = values[0]
        if all(same(first, v) for v in values[1:]):
            continue
        for i, v in enumerate(values):
            if v is None or first is None or v.shape != first.shape or v.dtype != first.dtype:
                raise ValueError(
                    f"stack: the tensor attribute '{name}' is {_described(v)} in model {i} but {_described(first)} "
                    "in model 0; per-model values need one shape and dtype"
                )
        _store_per_model(stacked, name, cast("list[Tensor]", values))  # (none is None: refused above)


def _store_per_model(stacked: nn.Module, name: str, values: Sequence[Tensor]) -> None:
    """The plain tensor attribute ``name`` (a path) of ``stacked``: the models' ``values`` as one per-model
    ``(M, *)`` tensor."""
    path, _, attr = name.rpartition(".")
    per_model = torch.stack([v.detach().to(values[0].device) for v in values])
    set_tag(per_model, PerModel)
    stacked.get_submodule(path).__dict__[attr] = per_model


def _described(t: Tensor | None) -> str:
    return "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"


def replicate(factory: Callable[[], nn.Module], num_models: int) -> nn.Module:
    """``stack`` of ``num_models`` fresh models made by ``factory()``, the user's own constructor, so that its
    initialisation scheme (custom ``_init_weights``, seeds) is respected. At most two ordinary models exist at
    any time, next to the stacked one."""
    if isinstance(num_models, bool) or not isinstance(num_models, int) or num_models < 1:
        raise ValueError(f"replicate: num_models must be a positive int, got {num_models!r}")
    if isinstance(factory, nn.Module) or not callable(factory):
        raise TypeError(
            f"replicate: factory must be a function that builds a new model (the class, e.g. replicate(MyNet, "
            f"{num_models}), or a lambda), got {'an instance of ' if isinstance(factory, nn.Module) else ''}"
            f"{type(factory).__name__}; to stack models you already have, use stack([...])"
        )
    first = _made(factory, 0)
    result = _skeleton(first, num_models)
    result.fill(0, tensor_table(first), "model 0")
    first_attributes = tensor_attributes(first)
    # pruned weights and the like (see _recomputed_attributes): each model's own, kept per model
    recomputed = {
        where: [first_attributes[where].detach()]
        for path, module in first.named_modules()
        for where in (_join(path, name) for name in _recomputed_attributes(module))
        if where in first_attributes
    }
    for i in range(1, num_models):
        model = _made(factory, i)
        check_same_architecture([first, model], "replicate")
        result.fill(i, tensor_table(model), f"model {i}")
        for name, value in tensor_attributes(model).items():
            if name in recomputed:
                recomputed[name].append(value.detach())
            elif name not in first_attributes or not same(first_attributes[name], value):
                raise ValueError(
                    f"replicate: the tensor attribute '{name}' differs between model {i} and model 0; replicate "
                    "keeps one value for all models. Build the models and call stack(models), which stores it per "
                    "model"
                )
    for name, values in recomputed.items():
        _store_per_model(result.module, name, values)
    return result.module


def _made(factory: Callable[[], nn.Module], i: int) -> nn.Module:
    model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"replicate: factory() must return an nn.Module, call {i} returned a {type(model).__name__}")
    check_materialised(model, i, "replicate")
    return model


# ----------------------------------------------------------------------------------------------------------
# Back to ordinary models, and new stacked models from stacked ones


def _require_stacked(module: nn.Module, what: str) -> int:
    """The number of models of a stacked model (its ``num_models``) or of a model built from batched layers
    by hand, in which every parameter and buffer belongs to a batched layer and all hold the same ``M``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected a stacked model (from batchlayers.stack), got {type(module).__name__}")
    num_models = getattr(module, "num_models", None)
    if isinstance(num_models, int) and not isinstance(num_models, bool):
        return num_models
    holders = {id(m) for m in model_count_holders(module)}
    for path, owner in module.named_modules():
        for name, t in [*owner._parameters.items(), *owner._buffers.items()]:
            if t is not None and id(owner) not in holders:
                # Only a batched layer says that dimension 0 counts models: an nn.Linear(4, 4) would pass for 4.
                raise TypeError(
                    f"{what}: expected a stacked model (from batchlayers.stack) or one built from batched layers, "
                    f"got {type(module).__name__}, whose '{_join(path, name)}' belongs to {type(owner).__name__}, "
                    "which holds one model (it has no num_models). Stack ordinary models with batchlayers.stack"
                )
    return _model_tensors(module, what)[1]  # raises unless every tensor holds the same number of models


# Parameter-free torch.nn modules that compute each element on its own: in a model built from batched layers
# they see all models' ``(M, B, *)`` tensors, in an unstacked model one model's ``(B, *)``, with the same
# result. Exact types only: a subclass may compute something else.
_ELEMENTWISE = frozenset(
    {
        nn.Identity,
        nn.ReLU,
        nn.ReLU6,
        nn.LeakyReLU,
        nn.RReLU,
        nn.ELU,
        nn.SELU,
        nn.CELU,
        nn.GELU,
        nn.SiLU,
        nn.Mish,
        nn.Sigmoid,
        nn.Tanh,
        nn.Softplus,
        nn.Softsign,
        nn.Hardtanh,
        nn.Hardswish,
        nn.Hardsigmoid,
        nn.Hardshrink,
        nn.Softshrink,
        nn.Tanhshrink,
        nn.LogSigmoid,
        nn.Threshold,
        nn.Dropout,
        nn.AlphaDropout,
    }
)
# Containers, and what each becomes in an unstacked model.
_CONTAINERS: dict[type, type[nn.Module]] = {
    BatchedSequential: nn.Sequential,
    nn.Sequential: nn.Sequential,
    nn.ModuleList: nn.ModuleList,
    nn.ModuleDict: nn.ModuleDict,
}


def _torch_counterpart(kind: type) -> Callable[[nn.Module], nn.Module] | None:
    """How to build the torch.nn module a batched layer type stands for: its registered ``to_torch``, else
    (recurrent and attention layers, which ``stack`` leaves to per-model code) from its ``torch_module``."""
    registered = _BY_BATCHED.get(kind)
    if registered is not None:
        return registered.to_torch
    torch_type = vars(kind).get("torch_module")  # the class's own: a subclass may compute something else
    if not (isinstance(torch_type, type) and issubclass(torch_type, nn.Module)):
        return None

    def to_torch(module: nn.Module) -> nn.Module:
        # The batched constructor's arguments are torch's, after num_models (nn.LSTM's own signature is *args);
        # a layer that keeps some only as tensors (attention's bias) says what they were.
        torch_kwargs = getattr(module, "torch_kwargs", None)
        kwargs = torch_kwargs() if callable(torch_kwargs) else constructor_kwargs(module, kind)
        kwargs.pop("num_models", None)
        return torch_type(**kwargs, device="meta")

    return to_torch


def _bare_sequence_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a batched recurrent or attention layer on its own. It has ``num_models`` as a
    stacked model has, but ``stack`` never makes one (it leaves those layers to per-model code), so it was built
    by hand; the stacked model's path would keep its class (no registered counterpart) and drop its model
    count."""
    return type(module) not in _BY_BATCHED and _torch_counterpart(type(module)) is not None


def _one_model(module: nn.Module, path: str, index: int, made: dict[int, Tensor]) -> nn.Module:
    """Model ``index`` of a module built from batched layers, as ordinary torch.nn modules (``made``: the
    tensors sliced so far, so that tied weights stay tied)."""
    where = repr(path) if path else "the model itself"
    kind = type(module)
    if any(getattr(module, hooks) for hooks in _HOOK_DICTS):
        raise TypeError(
            f"unstack: {where} ({kind.__name__}) has hooks, written for the tensors of all models; remove them, "
            "unstack, and register them on the unstacked models"
        )
    to_torch = _torch_counterpart(kind)
    if to_torch is not None:
        for t in tensor_table(module, remove_duplicate=True).values():
            if id(t) not in made:
                made[id(t)] = _rebuilt(t, t.detach()[index].clone())
        one = copy.deepcopy(module, {**made})  # (a copy of the memo: deepcopy adds its own entries)
        plain = to_torch(one)
        _adopt(plain, one, {}, f"unstack: the torch counterpart of {where} ({kind.__name__})", lambda t: t)
        plain.train(module.training)
        return plain
    if kind is Folded:
        return copy.deepcopy(cast(Folded, module).module)
    if kind in _CONTAINERS:
        result = _CONTAINERS[kind]()
        for name, child in module._modules.items():
            result.add_module(name, None if child is None else _one_model(child, _join(path, name), index, made))
        result.training = module.training
        return result
    if kind in _ELEMENTWISE:
        return copy.deepcopy(module)
    raise TypeError(
        f"unstack: cannot rebuild {where} ({kind.__name__}) as one model: its forward was written for (M, B, *) "
        "tensors of all models. unstack rebuilds models built from batched layers, nn.Sequential, nn.ModuleList, "
        "nn.ModuleDict, Folded modules and elementwise activations and dropout; for others, load each model's "
        "state dict (batchlayers.unstack_state_dict(model.state_dict())) into your own torch.nn model"
    )


def shared_buffers(batched: nn.Module) -> list[str]:
    """Names of the buffers a stacked model keeps as one copy for all models (equal in every model when
    stacked, e.g. a causal mask); every other parameter and buffer has the model dimension first. Code that
    indexes a stacked model's tensors by model must leave these alone. ``state_dict()`` shows them as a
    stride-0 ``(M, *)`` expand, like every other entry. One that ``forward`` writes per-model values into,
    or whose entry in a loaded state dict differs between the models, is stored per model from then on."""
    return _fold.root_shared_buffers(batched)


def _stacked_tensors(batched: nn.Module) -> dict[int, Tensor]:
    """The ``(M, *)`` tensors of a stacked model (everything but its shared buffers, and per-model tensors
    that forward stored as plain attributes, e.g. spectral_norm's weight), by id."""
    shared = set(shared_buffers(batched))
    found = {id(t): t for n, t in tensor_table(batched, remove_duplicate=True).items() if n not in shared}
    for _, t in _attribute_tensors(batched):
        if get_tag(t) is PerModel:
            found.setdefault(id(t), t)
    return found


def _attribute_tensors(batched: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """Tensors that ``batched``'s modules hold in plain attributes (not parameters or buffers), also inside
    lists, tuples, deques, sets and dicts (``self.history.append(h)``) and the attributes of other objects
    (a ``SimpleNamespace``, a dataclass), with where each is held. Modules, classes and functions are not
    entered (the modules are walked as modules)."""
    registered = {id(t) for t in tensor_table(batched).values()}
    seen: set[int] = set()

    def walk(value: object, where: str, depth: int) -> Iterable[tuple[str, Tensor]]:
        if isinstance(value, Tensor):
            if id(value) not in registered:
                yield where, value
            return
        if depth > 16 or id(value) in seen or isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
            return
        seen.add(id(value))
        if isinstance(value, (list, tuple, deque, set, frozenset)):
            for i, item in enumerate(value):
                yield from walk(item, f"{where}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for k, item in value.items():
                yield from walk(item, f"{where}[{k!r}]", depth + 1)
        elif not isinstance(value, (nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)):
            for k, item in getattr(value, "__dict__", {}).items():
                yield from walk(item, f"{where}.{k}", depth + 1)

    for path, module in batched.named_modules():
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS:
                yield from walk(value, f"{path}.{name}" if path else name, 0)


def _samples_held(attributes: Iterable[tuple[str, Tensor]], what: str) -> dict[int, tuple[Tensor, int]]:
    """Tensors that a stacked model's forward stored in plain attributes from the models' samples (``self.prev
    = h.detach()``), by id, with the dimension holding all models' samples, model-major: each model's copy
    holds its own rows. A value computed from every model's samples together is no model's: refused."""
    found: dict[int, tuple[Tensor, int]] = {}
    for where, t in attributes:  # (_attribute_tensors of a stacked model)
        tag = get_tag(t)
        if isinstance(tag, int):
            found[id(t)] = (t, tag)
        elif isinstance(tag, Lost):
            raise ValueError(
                f"{what}: the attribute '{where}' holds a tensor (shape {tuple(t.shape)}) that forward computed from "
                f"every model's samples together by {tag.reason}, so no part of it is one model's. Set it to None "
                f"before {what}, or keep it per sample (the batch dimension first)"
            )
    return found


def _rows(t: Tensor, dim: int, num_models: int, index: Tensor) -> Tensor:
    """The samples of the models ``index`` in ``t``, whose dimension ``dim`` holds all models' samples."""
    if t.shape[dim] % num_models:
        raise ValueError(
            f"a tensor attribute holds {t.shape[dim]} samples in dimension {dim}, which {num_models} models "
            "cannot share equally; it was not made by this stacked model's forward"
        )
    parts = _per_model.split_models(t.detach(), dim, num_models)
    return parts.index_select(dim, index.to(t.device)).flatten(dim, dim + 1)


def _copy_with(batched: nn.Module, memo: dict[int, object]) -> nn.Module:
    result = copy.deepcopy(batched, memo)
    rebind_functions(result, _translator(memo, {}))
    return result


def unstack(batched: nn.Module) -> list[nn.Module]:
    """The N ordinary models inside a stacked model: instances of the original class with the current
    weights, buffers, ``requires_grad``, train/eval mode, device and dtype; tied weights stay tied. They share
    no memory with ``batched``.

    A model built by hand from batched layers gives the torch.nn modules it stands for: each batched layer
    its torch.nn layer, ``BatchedSequential`` an ``nn.Sequential``, ``Folded(m)`` ``m``; ``nn.Sequential``,
    ``nn.ModuleList``, ``nn.ModuleDict`` and elementwise activations and dropout stay as they are. Any other
    module is refused (its ``forward`` was written for all models' ``(M, B, *)`` tensors), and so are hooks."""
    num_models = _require_stacked(batched, "unstack")
    load_builtins()
    if not isinstance(getattr(batched, "num_models", None), int) or _bare_sequence_layer(batched):
        return [_one_model(batched, "", i, {}) for i in range(num_models)]  # built from batched layers by hand
    stacked = _stacked_tensors(batched)
    samples = _samples_held(_attribute_tensors(batched), "unstack")
    models = []
    for i in range(num_models):
        memo: dict[int, object] = {k: _rebuilt(t, t.detach()[i].clone()) for k, t in stacked.items()}
        for k, (t, dim) in samples.items():
            memo[k] = _rows(t, dim, num_models, torch.tensor([i]))
        model = copy.deepcopy(batched, memo)
        replaced: dict[int, object] = {}
        for path, module in list(model.named_modules()):
            if not (_fold.is_swapped_leaf(module) or (module is model and type(module) in _BY_BATCHED)):
                continue
            counterpart = _BY_BATCHED[type(module)]
            plain = counterpart.to_torch(module)
            where = repr(path) if path else "the model itself"
            what = f"unstack: the torch counterpart of {where} ({type(module).__name__})"
            _adopt(plain, module, {}, what, lambda t: t)
            plain.train(module.training)
            replaced[id(module)] = plain
        model = _swap_in(model, replaced)
        if isinstance(vars(model).get("forward"), ModelByModel):
            del model.forward  # the class's own forward
        for module in model.modules():
            _fold.detach_hooks(module)
            if module.__dict__.pop("_batchlayers_sequential", False):
                module.__class__ = nn.Sequential
        model.__dict__.pop("num_models", None)
        rebind_functions(model, _translator(memo, replaced))
        models.append(model)
    return models


def _indices(indices: object, num_models: int) -> list[int]:
    if isinstance(indices, Tensor):
        if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8) or indices.dim() != 1:
            raise TypeError(f"select: indices must be a 1-D integer tensor or a list of ints, got {indices!r}")
        indices = indices.tolist()
    elif not isinstance(indices, Iterable):
        raise TypeError(f"select: indices must be a 1-D integer tensor or a list of ints, got {indices!r}")
    indices = list(indices)
    if not indices:
        raise ValueError("select: got no indices; a stacked model holds at least one model")
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"select: indices must be ints, got {i!r}")
        if not -num_models <= i < num_models:
            raise IndexError(f"select: index {i} is out of range for a stacked model of {num_models} models")
    return [i % num_models for i in indices]


def select(batched: nn.Module, indices: Sequence[int] | Tensor) -> nn.Module:
    """A stacked model (or one built from batched layers) with the models ``indices`` of ``batched``, in that
    order (repeats allowed), sharing nothing mutable with it (gradients are not copied)."""
    num_models = _require_stacked(batched, "select")
    index = torch.tensor(_indices(indices, num_models), dtype=torch.long)
    memo: dict[int, object] = {}
    for k, t in _stacked_tensors(batched).items():
        memo[k] = rebuilt = _rebuilt(t, t.detach().index_select(0, index.to(t.device)))
        set_tag(rebuilt, get_tag(t))  # (tensor attributes are tagged only here; parameters on every call)
    for k, (t, dim) in _samples_held(_attribute_tensors(batched), "select").items():
        memo[k] = rows = _rows(t, dim, num_models, index)
        set_tag(rows, dim)
    result = _copy_with(batched, memo)
    set_num_models_(result, len(index))
    _fold.tag_per_model(result)
    return result


def concat(models: Sequence[nn.Module]) -> nn.Module:
    """One stacked model holding the models of several stacked models (or models built from batched layers)
    of the same architecture, in order."""
    models = check_models(models, "concat")
    counts = [_require_stacked(m, "concat") for m in models]
    stored_once = [set(_fold.root_shared_buffers(m)) for m in models]
    check_same_architecture(models, "concat", model_dim=True, stored_once=stored_once)
    tables = [tensor_table(m, remove_duplicate=True) for m in models]
    # A buffer stored once in every part with one value stays so; one stored per model in some part, or with
    # another value in another part, is stored per model in the result.
    shared = {
        name
        for name in set.intersection(*stored_once)
        if all(torch.equal(table[name], tables[0][name]) for table in tables[1:])
    }
    memo: dict[int, object] = {}
    promoted: dict[str, Tensor] = {}
    for name, t in tables[0].items():
        if name not in shared:
            parts = [
                table[name].detach().expand(count, *table[name].shape) if name in once else table[name].detach()
                for table, once, count in zip(tables, stored_once, counts)
            ]
            if name in stored_once[0]:
                promoted[name] = torch.cat(parts)
            else:
                memo[id(t)] = _rebuilt(t, torch.cat(parts))
    memo.update(_joined_attributes(models))
    result = _copy_with(models[0], memo)
    set_num_models_(result, sum(counts))
    for name, data in promoted.items():
        cast(_fold.FoldInputs, _fold.fold_inputs(result)).store_per_model(result, name, None)
        with torch.no_grad():
            result.get_buffer(name).copy_(data)
    _fold.tag_per_model(result)
    return result


def _joined_attributes(models: Sequence[nn.Module]) -> dict[int, Tensor]:
    """The per-model tensors that the stacked models hold as plain attributes (see stack) and the samples
    their forward stored there (see _samples_held), joined as one stacked model would hold them (model-major),
    by the id of the first model's tensor."""
    where = [dict(_attribute_tensors(m)) for m in models]
    held = [_samples_held(attributes.items(), "concat") for attributes in where]
    counts = [_require_stacked(m, "concat") for m in models]
    joined = {}
    for name, t in where[0].items():
        tag = get_tag(t)
        if tag is not PerModel and id(t) not in held[0]:
            continue
        dim = 0 if tag is PerModel else held[0][id(t)][1]
        parts = []
        for i, (attributes, count) in enumerate(zip(where, counts)):
            other = attributes.get(name)
            if other is None or get_tag(other) != tag or (tag is not PerModel and other.shape[dim] % count):
                raise ValueError(
                    f"concat: the attribute '{name}' holds {'a per-model value' if tag is PerModel else 'samples'} in "
                    f"stacked model 0 but not in stacked model {i}; set it to None in every model before concat"
                )
            parts.append(other.detach() if tag is PerModel else _per_model.split_models(other.detach(), dim, count))
        if len({p.shape[dim + 1 :] for p in parts}) > 1:
            raise ValueError(
                f"concat: the attribute '{name}' holds tensors of different shapes (or samples of different batch "
                "sizes) in the stacked models; set it to None in every model before concat"
            )
        rows = torch.cat(parts, dim)
        joined[id(t)] = rows if tag is PerModel else rows.flatten(dim, dim + 1)
        set_tag(joined[id(t)], tag)
    return joined


# ----------------------------------------------------------------------------------------------------------
# State dicts


def stack_state_dicts(state_dicts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One state dict with every entry of N state dicts stacked along a new first dimension, ready for
    ``stacked_model.load_state_dict``. Keys, shapes, dtypes and devices must agree."""
    if isinstance(state_dicts, (Mapping, nn.Module)) or not isinstance(state_dicts, Iterable):
        raise TypeError(
            f"stack_state_dicts: expected a list of state dicts, got {_kind(state_dicts)}; pass "
            "[model.state_dict() for model in models]"
        )
    state_dicts = list(state_dicts)
    if not state_dicts:
        raise ValueError("stack_state_dicts: got an empty list of state dicts")
    for i, sd in enumerate(state_dicts):
        _check_state_dict(sd, f"stack_state_dicts: state dict {i}")
    reference = state_dicts[0]
    for i, sd in enumerate(state_dicts[1:], start=1):
        diff = first_difference(dict.fromkeys(reference), dict.fromkeys(sd))
        if diff:
            raise ValueError(f"stack_state_dicts: state dict {i} has different keys than state dict 0: {diff}")
        for key, ref in reference.items():
            value = sd[key]
            if value.shape != ref.shape:
                raise ValueError(
                    f"stack_state_dicts: '{key}' has shape {tuple(value.shape)} in state dict {i} but "
                    f"{tuple(ref.shape)} in state dict 0"
                )
            if value.dtype != ref.dtype or value.device != ref.device:
                raise ValueError(
                    f"stack_state_dicts: '{key}' is {value.dtype} on {value.device} in state dict {i} but "
                    f"{ref.dtype} on {ref.device} in state dict 0"
                )
    return {key: torch.stack([sd[key] for sd in state_dicts]) for key in reference}


def unstack_state_dict(state_dict: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
    """N ordinary state dicts from the state dict of a stacked model. Entries are copies, not views, so that
    ``torch.save`` of one writes only that model's data."""
    if isinstance(state_dict, Mapping) and not state_dict:
        raise ValueError("unstack_state_dict: got an empty state dict")
    _check_state_dict(state_dict, "unstack_state_dict: the state dict")
    for key, value in state_dict.items():
        if value.dim() == 0:
            raise ValueError(f"unstack_state_dict: every entry must be (M, *); '{key}' is 0-d (shape ())")
    sizes = {k: v.shape[0] for k, v in state_dict.items()}
    first_key = next(iter(sizes))
    num_models = sizes[first_key]
    for key, size in sizes.items():
        if size != num_models:
            raise ValueError(
                f"unstack_state_dict: every entry must be (M, *) with one M; '{key}' has shape "
                f"{tuple(state_dict[key].shape)} but the first entry has M={num_models} ('{first_key}' has shape "
                f"{tuple(state_dict[first_key].shape)})"
            )
    return [{k: v[i].clone() for k, v in state_dict.items()} for i in range(num_models)]


def _kind(value: object) -> str:
    if isinstance(value, nn.Module):
        return f"a model ({type(value).__name__}); pass model.state_dict()"
    if isinstance(value, Mapping):
        return "one state dict (a mapping)"
    return f"a {type(value).__name__}"


def _check_state_dict(state_dict: object, what: str) -> None:
    """Refuse anything but a mapping of names to tensors."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{what} is {_kind(state_dict)}, not a mapping of names to tensors")
    for key, value in state_dict.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{what}: entry '{key}' is a {type(value).__name__}, not a tensor")
