"""Model-by-model execution of a stacked model: ``stack(models, execution="model_by_model")``.

The stacked model keeps its ``(M, *)`` parameters and buffers (one optimizer, one ``state_dict``, ``.to()``),
but its ``forward`` runs the architecture's own ``forward`` once per model on that model's ``(B, *)`` inputs:
every batched layer is replaced, for the call, by its torch.nn layer holding model ``m``'s slices of the
stacked tensors (views: gradients and in-place buffer updates reach the stacked tensors), and every other
per-model tensor by its slice. Each model computes exactly what the original model computes, so nothing
has to be known about which tensors carry the samples: sizes that coincide with ``M * B`` are harmless.

Why: on a CPU, convolutional networks computed batched stream every activation of all models through
memory between layers, where a loop over models keeps one model's activations in cache (measured on a
stacked ResNet: the same convolutions, 15-20 ms a step more in copies and elementwise kernels). Running model
by model keeps that locality and still computes the convolutions channels-last, as the batched strategy does.

The per-model outputs are stacked to ``(M, B, *)`` at the end (a 0-dim output, a loss, gives ``(M,)``).
Under ``torch.compile`` the model runs batched (folded) instead: the swapping of modules is not traceable.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence, Sized
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import _fold, backends
from ._architecture import _MODULE_INTERNALS, _config, same, tensor_table
from ._fold import check_inputs, input_tensors, map_tensors
from ._provenance import (
    _RESHAPES,
    _VIEWS,
    CopiedViews,
    PerModel,
    get_tag,
    inside_checkpoint,
    note_views,
    reshape_of_another_layout,
    set_tag,
    view_of_a_copy,
)
from .registry import counterpart_of_batched

__all__ = ["ModelByModel"]

_CONVOLUTIONS: dict[type, torch.memory_format] = {
    nn.Conv2d: torch.channels_last,
    nn.Conv3d: torch.channels_last_3d,
    nn.ConvTranspose2d: torch.channels_last,
    nn.ConvTranspose3d: torch.channels_last_3d,
}

# (container, key, value per model): what one model's pass installs
_Install = tuple[dict[str, Any], str, tuple[Any, ...]]


class ModelByModel:
    """The ``forward`` of a stacked root that runs model by model (stored as the root's ``forward``
    attribute by :func:`batchlayers.stack`; deep copies and pickles with the model)."""

    model_by_model = True  # read by _fold.runs_model_by_model

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._setup()

    def _setup(self) -> None:
        # id(batched layer) -> (its type and configuration, the torch.nn layer built for it, its tensor slots)
        self._plain: dict[int, tuple[tuple, nn.Module, list[tuple[dict[str, Any], str, str]]]] = {}
        self._lock = threading.RLock()
        self._depth = 0

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root}  # the torch.nn layers are rebuilt when needed; a lock does not pickle

    def __setstate__(self, state: dict[str, object]) -> None:
        self.root = cast(nn.Module, state["root"])
        self._setup()

    def __call__(self, *args: object, **kwargs: object) -> object:
        root = self.root
        if _fold.runs_batched_anyway():  # the root's hooks folded the inputs: the batched forward
            return type(root).forward(root, *args, **kwargs)
        with self._lock:
            if self._depth:
                raise RuntimeError(f"stacked {type(root).__name__}: its forward called the model itself")
            self._depth += 1
            try:
                return self._run(args, kwargs)
            finally:
                self._depth -= 1

    def _run(self, args: tuple, kwargs: dict) -> object:
        root = self.root
        num_models = cast(int, root.num_models)
        check_inputs(root, input_tensors(args, kwargs))
        layers, tensors, shared, converting, modules = self._installs(num_models)
        installs = layers + tensors
        originals = [(container, key, container.get(key)) for container, key, _ in installs]
        state = _PythonState(modules, {(id(container), key) for container, key, _ in tensors})
        ends: list[list[dict[str, object]]] = []
        # (key, buffer, its value): some writes leave a tensor's version as it was (.data, F.batch_norm's
        # running statistics), so the values are compared
        real = {i: cast(Tensor, originals[len(layers) + i][2]) for i in shared}  # each shared buffer itself
        cloned = {i for i in shared if tensors[i][2][0] is not real[i]}  # small ones: each pass writes its own
        snapshots = [(tensors[i][1], real[i], real[i].detach().clone()) for i in shared]
        replaced: dict[int, list[object]] = {}
        outputs = []
        views = _CopiedViews() if converting else None
        _fold._local.model_by_model = getattr(_fold._local, "model_by_model", 0) + 1
        _fold._local.model_by_model_grad = torch.is_grad_enabled()
        sliced = state.per_model()  # containers holding per-model tensors: each pass gets its slices
        try:
            for m in range(num_models):
                if m or sliced:
                    state.restore(m if sliced else None)  # every model's pass starts from the call's state
                for container, key, values in installs:
                    container[key] = values[m]
                inputs = map_tensors((args, kwargs), _slice_of_model(m))
                model_args, model_kwargs = cast(tuple[tuple, dict], inputs)
                if views is None:
                    outputs.append(type(root).forward(root, *model_args, **model_kwargs))
                else:
                    with views:
                        outputs.append(type(root).forward(root, *model_args, **model_kwargs))
                for i, (container, key, values) in enumerate(tensors):
                    if container.get(key) is not values[m]:  # forward assigned a new value (a cache)
                        replaced.setdefault(i, [None] * num_models)[m] = container.get(key)
                ends.append(state.record())
        except BaseException:
            state.restore()
            raise
        finally:
            _fold._local.model_by_model -= 1
            for container, key, value in originals:
                container[key] = value
        try:
            state.settle(ends, type(root).__name__)
        except ValueError:
            state.restore()
            raise
        if views is not None:
            views.check()
        for key, buffer, start in snapshots:
            if not _same_values(buffer, start):
                with torch.no_grad():
                    for _, other, value in snapshots:
                        other.copy_(value)
                raise RuntimeError(
                    f"stacked {type(root).__name__}: forward modified the buffer '{key}' in place, but it is one copy "
                    "shared by all models (it was equal in every model), so every model's pass modified it. Register "
                    "a batched counterpart for the module that owns it with batchlayers.register(...)"
                )
        settled = {id(real[i]): (real[i], tensors[i][2]) for i in sorted(cloned - set(replaced))}  # (held twice)
        for buffer, passes in settled.values():
            self._settle_shared(buffer, passes)
        for i, assigned in replaced.items():
            container, key, _ = tensors[i]
            _store_replaced(root, container, key, assigned, i in shared)
        return _stack_outputs(root, outputs)

    def _settle_shared(self, buffer: Tensor, passes: tuple[Tensor, ...]) -> None:
        """A small buffer shared by all models, of which each pass wrote its own copy: kept one where every pass
        left the same values (a step counter), stored per model from now on where they differ (a running
        statistic), as the batched forward stores it."""
        if all(_same_values(p, buffer) for p in passes):
            return
        if all(_same_values(p, passes[0]) for p in passes[1:]):
            with torch.no_grad():
                buffer.copy_(passes[0])
            return
        name = next(n for n in _fold.root_shared_buffers(self.root) if _fold._tensor(self.root, n) is buffer)
        cast(_fold.FoldInputs, _fold.fold_inputs(self.root)).store_per_model(self.root, name, None)
        with torch.no_grad():
            buffer.copy_(torch.stack(passes))

    def _installs(
        self, num_models: int
    ) -> tuple[list[_Install], list[_Install], set[int], bool, list[tuple[str, nn.Module]]]:
        """What each model's pass installs: for every batched layer its torch.nn layer and that layer's slices
        (``layers``), the slice of every other tensor of the architecture's own modules (``tensors``, which
        forward may assign anew), which of those are one buffer shared by all models (indices into
        ``tensors``), whether a convolution converts its input to channels-last, and the architecture's own
        modules (not the batched layers) with their paths."""
        root = self.root
        shared = {id(_fold._tensor(root, n)) for n in _fold.root_shared_buffers(root)}
        shared_slots: set[int] = set()
        slices: dict[int, tuple[Tensor, ...]] = {}

        def per_model(t: Tensor, where: str, own: bool = False) -> tuple[Tensor, ...]:
            if id(t) in shared:
                if not own or t.numel() > CLONED_SHARED_MAX_NUMEL:
                    return (t,) * num_models
                found = slices.get(id(t))  # (a buffer that two modules hold: one clone per model for both)
                if found is None:
                    found = slices[id(t)] = tuple(t.clone() for _ in range(num_models))
                return found
            found = slices.get(id(t))
            if found is None:
                if t.dim() == 0 or t.shape[0] != num_models:
                    raise ValueError(
                        f"stacked {type(root).__name__}: '{where}' holds every model's value, stored (M, *) with "
                        f"M={num_models}, but was replaced by a tensor of shape {tuple(t.shape)}"
                    )
                found = slices[id(t)] = t.unbind(0)
            return found

        layers: list[_Install] = []
        tensors: list[_Install] = []
        converting = False
        seen: set[int] = set()
        modules: list[tuple[str, nn.Module]] = []
        todo: list[tuple[str, nn.Module]] = [("", root)]
        while todo:
            path, module = todo.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            modules.append((path, module))
            for kind in ("_parameters", "_buffers"):
                container = getattr(module, kind)
                for name, t in container.items():
                    if t is not None:
                        if id(t) in shared:
                            shared_slots.add(len(tensors))
                        tensors.append((container, name, per_model(t, _join(path, name), own=True)))
            for name, value in vars(module).items():
                if isinstance(value, Tensor) and get_tag(value) is PerModel:
                    tensors.append((module.__dict__, name, per_model(value, _join(path, name))))
            for key, child in module._modules.items():
                if child is None:
                    continue
                where = _join(path, key)
                if not _fold.is_swapped_leaf(child):
                    todo.append((where, child))
                    continue
                plain, slots = self._plain_for(child, where)
                for container, key_in, name in slots:
                    layers.append((container, key_in, per_model(_fold._tensor(child, name), f"{where}.{name}")))
                plain.train(child.training)
                layers.append((module._modules, key, (plain,) * num_models))
                converting = converting or type(plain) in _CONVOLUTIONS
        return layers, tensors, shared_slots, converting, modules

    def _plain_for(self, leaf: nn.Module, where: str) -> tuple[nn.Module, list[tuple[dict[str, Any], str, str]]]:
        """The torch.nn layer standing for ``leaf`` in a model's pass, built once per configuration, and
        the slots of its tensors: ``(container, key, name in leaf)``."""
        if not _fold.only_fold_hooks(leaf):
            raise ValueError(
                f"stacked {type(self.root).__name__}: '{where}' ({type(leaf).__name__}) has hooks of its own, which "
                "a model-by-model pass would not run; stack with execution='batched'"
            )
        # its type and plain attributes (constructor arguments and whatever else forward reads: momentum,
        # padding_mode): the torch.nn layer is built again when they change
        config = (type(leaf), _config(leaf))
        cached = self._plain.get(id(leaf))
        if cached is not None and same(cached[0], config):
            return cached[1], cached[2]
        counterpart = counterpart_of_batched(type(leaf))
        if counterpart is None:
            raise TypeError(
                f"stacked {type(self.root).__name__}: '{where}' ({type(leaf).__name__}) has no torch.nn counterpart "
                "registered; stack with execution='batched'"
            )
        plain = counterpart.to_torch(leaf)
        if set(tensor_table(plain)) != set(tensor_table(leaf)):
            raise TypeError(
                f"stacked {type(self.root).__name__}: '{where}': the torch.nn counterpart of {type(leaf).__name__} "
                f"has parameters/buffers {sorted(tensor_table(plain))}, the layer {sorted(tensor_table(leaf))}"
            )
        plain.register_forward_pre_hook(functools.partial(_refuse_checkpointing, where))
        if type(plain) in _CONVOLUTIONS:
            plain.register_forward_pre_hook(_channels_last_input)
        slots = []
        for name in tensor_table(leaf):
            *path, key = name.split(".")
            owner = plain
            for atom in path:
                owner = cast(nn.Module, owner._modules[atom])
            container = owner._parameters if key in owner._parameters else owner._buffers
            slots.append((cast(dict[str, Any], container), key, name))
        self._plain[id(leaf)] = (config, plain, slots)
        return plain, slots


# A buffer shared by all models (equal in every model when stacked) of at most this many elements is copied for
# each model's pass, so that forward may write it (a step counter, a running statistic: see
# ModelByModel._settle_shared); a larger one (a causal mask, a table) is the one tensor in every pass, and a
# write into it is refused.
CLONED_SHARED_MAX_NUMEL = 4096

_INTERNALS = _MODULE_INTERNALS | {"forward"}
_MISSING = object()


def _copied(value: object, tensors: list[tuple[Tensor, int]], depth: int = 0, model: int | None = None) -> object:
    """``value`` with its lists, tuples, dicts, sets and deques (subclasses too) copied all the way down;
    tensors and other objects as they are, each tensor recorded in ``tensors`` with its version. With
    ``model``, a per-model ``(M, *)`` tensor inside a container is replaced by that model's slice."""
    if isinstance(value, Tensor):
        tensors.append((value, value._version))
        return value[model] if model is not None and depth > 0 and get_tag(value) is PerModel else value
    if depth > 16 or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, tuple):
        items = [_copied(v, tensors, depth + 1, model) for v in value]
        kind: Any = type(value)
        return kind(*items) if hasattr(value, "_fields") else kind(items)
    if isinstance(value, (list, dict, set, collections.deque)):
        made: Any = copy.copy(value)  # the same type (an OrderedDict, a defaultdict's factory)
        if isinstance(value, dict):
            for k, v in value.items():
                made[k] = _copied(v, tensors, depth + 1, model)
        elif isinstance(value, list):
            made[:] = [_copied(v, tensors, depth + 1, model) for v in value]
        elif isinstance(value, collections.deque):
            made.clear()
            made.extend(_copied(v, tensors, depth + 1, model) for v in value)
        return made
    return value


def _merged(values: list[object], depth: int = 0) -> object:
    """One value for the passes' end ``values`` of a plain attribute: the value itself where all are the same;
    tensors of one shape stacked per model ``(M, *)``; containers of one structure merged item by item.
    ``_MISSING`` where they cannot be merged (anything else that differs)."""
    last = values[-1]
    if all(same(v, last) for v in values[:-1]):
        return last
    if all(isinstance(v, Tensor) for v in values):
        tensors = cast(list[Tensor], values)
        if len({(t.shape, t.dtype, t.device) for t in tensors}) != 1:
            return _MISSING
        stacked = torch.stack(tensors)
        set_tag(stacked, PerModel)
        return stacked
    if depth > 16 or any(type(v) is not type(last) for v in values):
        return _MISSING
    if isinstance(last, (list, tuple)) and all(len(cast(Sized, v)) == len(last) for v in values):
        items = [_merged([cast(Sequence, v)[j] for v in values], depth + 1) for j in range(len(last))]
        if any(item is _MISSING for item in items):
            return _MISSING
        if isinstance(last, tuple):
            kind: Any = type(last)
            return kind(*items) if hasattr(last, "_fields") else kind(items)
        made: Any = copy.copy(last)
        made[:] = items
        return made
    if isinstance(last, dict) and all(list(cast(dict, v)) == list(last) for v in values):
        made = copy.copy(last)
        for k in last:
            made[k] = _merged([cast(dict, v)[k] for v in values], depth + 1)
            if made[k] is _MISSING:
                return _MISSING
        return made
    return _MISSING


def _refill(now: object, saved: object, model: int | None = None) -> bool:
    """Put ``saved``'s items back into the container ``now`` (of the same type), keeping its identity (with
    ``model``: per-model tensors inside as that model's slices)."""
    if type(now) is not type(saved) or not isinstance(now, (list, dict, set, collections.deque)):
        return False
    fresh: Any = _copied(saved, [], 0, model)
    if isinstance(now, list):
        now[:] = fresh
    elif isinstance(now, collections.deque):
        now.clear()
        now.extend(fresh)
    else:
        now.clear()
        now.update(fresh)
    return True


class _PythonState:
    """The plain attributes of the architecture's own modules (counters, caches, flags), which every original
    model holds for itself: each model's pass starts from the values the call started with (containers
    copied all the way down, refilled in place), and all passes must end with equal values, kept; a tensor
    that differs is stored per model ``(M, *)``; anything else that differs, and a tensor held there that a
    pass wrote in place, is refused with the start values back. Objects other than containers and tensors
    are not copied: one that forward changes in place is changed by every model's pass. Tensors installed
    per model are left to the caller (``skip``: ``(id(dict), key)``)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], skip: set[tuple[int, str]]) -> None:
        self.skip = skip
        self.tensors: list[tuple[Tensor, int]] = []
        # torch.nn's own modules keep no state of their own between calls, only caches they rebuild when the
        # weights change (an RNN's _flat_weights): left alone
        mine = [(path, m) for path, m in modules if not type(m).__module__.startswith("torch.nn.")]
        self.saved = [(path, module, self._values(module, self.tensors)) for path, module in mine]

    def _values(self, module: nn.Module, tensors: list[tuple[Tensor, int]] | None) -> dict[str, object]:
        d = module.__dict__
        return {
            k: (v if tensors is None else _copied(v, tensors))
            for k, v in d.items()
            if k not in _INTERNALS and not k.startswith("_batchlayers") and (id(d), k) not in self.skip
        }

    def restore(self, model: int | None = None) -> None:
        """The values the call started with (``model``: per-model tensors in containers as its slices)."""
        for _, module, saved in self.saved:
            d = module.__dict__
            for k in [k for k in self._values(module, None) if k not in saved]:
                del d[k]
            for k, v in saved.items():
                if not _refill(d.get(k, _MISSING), v, model):
                    d[k] = _copied(v, [], 0, model)

    def per_model(self) -> bool:
        """Whether a container among the values holds per-model tensors, which each pass gets its slice of (the
        tensors copying the values recorded: per-model ones held directly are installed by the caller)."""
        return any(get_tag(t) is PerModel for t, _ in self.tensors)

    def record(self) -> list[dict[str, object]]:
        return [self._values(module, []) for _, module, _ in self.saved]

    def settle(self, ends: list[list[dict[str, object]]], name: str) -> None:
        """Check the passes' end values (``ends[m][i]``: model m's, module i's) and store what differs."""
        for tensor, version in self.tensors:
            if tensor._version != version:
                raise ValueError(
                    f"stacked {name}: forward wrote in place into a tensor of shape {tuple(tensor.shape)} held in a "
                    "plain attribute (not a parameter or buffer), which every model's pass would write. Make it a "
                    "buffer (register_buffer), which is stored per model"
                )
        for i, (path, module, _) in enumerate(self.saved):
            per_model = [end[i] for end in ends]
            for k in set().union(*per_model):
                values = [v.get(k, _MISSING) for v in per_model]
                if all(same(v, values[-1]) for v in values[:-1]):
                    continue  # the last pass's value, in place
                merged = _merged(values)
                if merged is not _MISSING:  # tensors that differ stored per model, in containers too
                    if not _refill(module.__dict__.get(k, _MISSING), merged):
                        module.__dict__[k] = merged
                    continue
                where = f"{path}.{k}" if path else k
                raise ValueError(
                    f"stacked {name}: forward left '{where}' with different values in different models; a stacked "
                    "model holds one value of a plain attribute for all models. Keep per-model state in a buffer "
                    "(register_buffer), which is stored per model"
                )


def _same_values(now: Tensor, start: Tensor) -> bool:
    """Whether a buffer holds the values it started the call with (NaN where it had NaN)."""
    if now.shape != start.shape or now.dtype != start.dtype:
        return False
    if torch.equal(now, start):
        return True
    return now.is_floating_point() and bool(((now == start) | (now.isnan() & start.isnan())).all())


def _slice_of_model(m: int) -> Callable[[Tensor, str], Tensor]:
    return lambda t, where: t[m]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _refuse_checkpointing(where: str, layer: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a model's torch.nn layer: ``torch.utils.checkpoint`` would run the layer again in
    backward, after the pass, where the module tree holds the batched layer again (a wrong gradient)."""
    if inside_checkpoint(getattr(_fold._local, "model_by_model_grad", True)):
        raise ValueError(
            f"'{where}' runs inside torch.utils.checkpoint in a model-by-model pass: checkpointing runs it again "
            "in backward, after the pass. Turn activation checkpointing off before stacking "
            "(transformers: model.gradient_checkpointing_disable())"
        )


def _channels_last_input(layer: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of a model's convolution on the CPU: its input in the channels-last layout, as the
    batched strategies ``"auto"`` and ``"*_channels_last"`` compute it (the output follows the input's
    layout, and so do the batch norms and activations after it)."""
    x = args[0] if args else None
    if not isinstance(x, Tensor) or x.device.type != "cpu":
        return None
    strategy = backends.conv.strategy
    if strategy not in ("auto", "loop_channels_last", "grouped_channels_last"):
        return None
    layout = _CONVOLUTIONS[type(layer)]
    if x.dim() != (4 if layout is torch.channels_last else 5):
        return None  # an unbatched input: as torch.nn computes it
    # .to, not .contiguous: _CopiedViews records every .contiguous() the pass makes (the architecture's own
    # could alias in the original and copy here), holding both tensors to the end of the pass. This copy is
    # the convolution's alone, so it is freed with the call, before the next model runs. new/old, interleaved
    # in one process, 2 threads, keep_freed_memory(): inference U-Net (M=8) 0.78, small CNN (M=16) 0.89,
    # ResNet (M=4) 0.87-1.05 (four runs); training 0.93, 0.99, 0.97.
    return (x.to(memory_format=layout), *args[1:])


class _CopiedViews(TorchFunctionMode):
    """``x.view(...)`` of an activation that the channels-last convolutions left in another layout than
    torch.nn's: the batched forward's rule (``batchlayers._provenance.view_of_a_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = CopiedViews()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.copied.storages:
            self.copied.refuse_write(func, args, kwargs)
        if func in _VIEWS:
            out = view_of_a_copy(func, args, kwargs, self.copied, _not_contiguous, _CHANNELS_LAST_VIEW)
        elif func in _RESHAPES:
            out = reshape_of_another_layout(func, args, kwargs, self.copied, _not_contiguous, _CHANNELS_LAST_RESHAPE)
        else:
            out = func(*args, **kwargs)
        if args and isinstance(args[0], Tensor) and args[0].is_inference():
            note_views(args[0], out)  # (what Tensor._base would say: see _original_layout)
        return out

    def check(self) -> None:
        self.copied.check()


_CHANNELS_LAST_VIEW = ".view() of a layer output that a model-by-model pass keeps channels-last"
_CHANNELS_LAST_RESHAPE = "a reshape of a layer output that a model-by-model pass keeps channels-last"


def _not_contiguous(x: Tensor) -> bool:
    return not x.is_contiguous()


def _store_replaced(root: nn.Module, container: dict[str, Any], key: str, values: list[object], shared: bool) -> None:
    """A tensor that forward assigned anew (a cache), as each original model would hold it: a per-model one
    stacked ``(M, *)`` again, where every model assigned a tensor of one shape; one buffer shared by all models
    stays one, where every model assigned an equal value; a parameter is not replaced."""
    name = f"stacked {type(root).__name__}"
    if isinstance(container.get(key), nn.Parameter) or any(isinstance(v, nn.Parameter) for v in values):
        raise ValueError(f"{name}: forward assigned a new value to the parameter '{key}'; it is stored (M, *)")
    if all(v is None for v in values):
        container[key] = None
        return
    first = values[0]
    if not all(isinstance(v, Tensor) for v in values) or not all(
        cast(Tensor, v).shape == cast(Tensor, first).shape and cast(Tensor, v).dtype == cast(Tensor, first).dtype
        for v in values
    ):
        raise ValueError(
            f"{name}: forward assigned '{key}' values of different kinds or shapes in different models; it is "
            "stored (M, *), one tensor of one shape per model"
        )
    if shared:
        if not all(torch.equal(cast(Tensor, v), cast(Tensor, first)) for v in values):
            raise ValueError(
                f"{name}: forward assigned different values to '{key}' in different models, but the stacked model "
                "keeps it as one buffer shared by all models (it was equal in every model when stacked)"
            )
        container[key] = first
        return
    stacked = torch.stack(cast(list[Tensor], values))
    set_tag(stacked, PerModel)
    container[key] = stacked


def _stack_outputs(root: nn.Module, outputs: list[object]) -> object:
    """The models' outputs as one: every tensor stacked to ``(M, *)`` in the first model's structure; the
    structure and every value that is not a tensor must be the same in every model."""
    name = f"stacked {type(root).__name__}"
    for m in range(1, len(outputs)):
        where = _difference(outputs[0], outputs[m], "output")
        if where is not None:
            cache = "cache" in where.lower() or "past" in where.lower()
            raise ValueError(
                f"{name}: model {m}'s {where} differs from model 0's and is not a tensor; a model-by-model pass "
                "stacks the outputs' tensors and keeps other values only where every model returns the same"
                + (
                    " (a transformers cache: call with use_cache=False, or stack with execution='batched')"
                    if cache
                    else ""
                )
            )
    found = [dict(_fold._tensors(out, "output")) for out in outputs]

    def stacked(t: Tensor, where: str) -> Tensor:
        parts = [f[where] for f in found]
        if any(p.shape != t.shape for p in parts):
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise ValueError(f"{name}: {where} has a different shape in different models: {shapes}")
        return torch.stack(parts)

    return map_tensors(outputs[0], stacked, "output")


def _difference(a: object, b: object, where: str) -> str | None:
    """Where two models' outputs differ in their structure or in a value that is not a tensor, or None."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return None if isinstance(a, Tensor) and isinstance(b, Tensor) else where
    if type(a) is not type(b):
        return where
    pairs: list[tuple[object, object, str]]
    if isinstance(a, (list, tuple)):
        other = cast(list | tuple, b)
        if len(a) != len(other):
            return where
        pairs = [(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, other))]
    elif isinstance(a, dict):
        entries = cast(dict, b)
        if a.keys() != entries.keys():
            return where
        pairs = [(a[k], entries[k], f"{where}[{k!r}]") for k in a]
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        pairs = [(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}") for f in dataclasses.fields(a)]
    else:
        return None if same(a, b) else where
    return next((w for x, y, w0 in pairs if (w := _difference(x, y, w0)) is not None), None)
