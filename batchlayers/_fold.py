"""Folded execution of a stacked model: the architecture's own ``forward`` sees one batch of ``M * B`` samples.

The root of a stacked model folds every tensor input ``(M, B, *)`` to model-major ``(M * B, *)`` and unfolds
its tensor outputs back; each batched layer swapped in for a torch.nn leaf views its ``(M * B, *)`` input as
``(M, B, *)`` and folds its output again. Everything is wired with forward (pre-)hooks held by small
picklable objects, so a stacked model deep-copies, pickles and saves its ``state_dict`` like any module.

Which tensors carry the models' samples is known, not guessed from sizes: the root tags its folded inputs
and runs ``forward`` under a ``batchlayers._provenance.Tracker``, which follows every torch call (see that
module). A batched layer views a tagged input back to ``(M, n, *)``; an untagged input has no samples
(position indices ``(1, T)`` or ``(T,)`` looked up in an embedding) and gives each model its own rows,
broadcast over that model's ``B`` samples; an input whose layout was lost is refused with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import _workspace
from ._numbers import _Marked, close_call
from ._provenance import (
    UNTRACKED,
    Lost,
    PerModel,
    Selection,
    SharedBuffer,
    Tracker,
    _name,
    _selection_of,
    _viewed,
    from_size_alone,
    from_size_message,
    get_tag,
    keep_picked_rows,
    set_tag,
    untracked,
)
from ._utils import global_module_hooks, layer_name

__all__ = [
    "attach_leaf_hooks",
    "attach_root_hooks",
    "detach_hooks",
    "is_swapped_leaf",
    "map_tensors",
    "only_fold_hooks",
    "run_as_one_leaf",
]

_local = threading.local()


@dataclass(frozen=True)
class _PickedRows:
    """Rows picked from the samples by a mask (``h[mask]``) given to a batched layer: each model's rows are one
    block of the folded order, of its own count, so the layer gets them as ``(M, width, *)`` with each model's
    block padded with zeros to the widest, and its output is taken back at ``positions``."""

    selection: Selection
    tag: Lost
    width: int
    positions: Tensor  # (K,): where each picked row sits in the padded (M * width) rows

    @staticmethod
    def of(selection: Selection, tag: Lost, device: torch.device) -> _PickedRows:
        counts = selection.counts.to(device)
        width = int(counts.max()) if counts.numel() else 0
        model = selection.row_models().to(device)
        starts = torch.cumsum(counts, 0) - counts
        positions = model * width + torch.arange(len(model), device=device) - starts[model]
        return _PickedRows(selection, tag, width, positions)

    def pad(self, t: Tensor, num_models: int) -> Tensor:
        rows = t.new_zeros((num_models * self.width, *t.shape[1:])).index_copy(0, self.positions, t)
        return rows.view(num_models, self.width, *t.shape[1:])

    def take(self, t: Tensor) -> Tensor:
        out = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, self.positions)
        set_tag(out, self.tag)
        keep_picked_rows(out, self.selection)
        return out


def _picked_rows(layer: nn.Module, tensors: list[Tensor], num_models: int) -> _PickedRows | None:
    """The rows picked from the samples by a mask (``self.head(h[mask])``) that every input of ``layer`` holding
    samples holds, where ``layer`` computes each row on its own (its ``_mixes_picked_rows`` is None: a zero row
    padded in changes no other row, no statistic and no state); None where no input holds such rows, or where
    some input holds all the samples or other rows (refused below as rows whose models are lost)."""
    held = [t for t in tensors if get_tag(t) is not None and get_tag(t) is not PerModel]
    tags = [get_tag(t) for t in held]
    if num_models == 1 or not held or not all(isinstance(tag, Lost) for tag in tags):
        return None
    picked = [_selection_of(t) for t in held]
    first = picked[0]
    if first is None or not all(p is not None and first.same(p) for p in picked[1:]):
        return None
    mixes = getattr(layer, "_mixes_picked_rows", "is not known to compute each row on its own")
    if mixes is not None:
        raise ValueError(
            f"{layer_name(layer)}: its input holds rows picked from the models' samples by a mask, and "
            f"{type(layer).__name__} {mixes}, so it cannot be given each model's rows alone. Stack with "
            "execution='model_by_model'"
        )
    return _PickedRows.of(first, cast(Lost, tags[0]), held[0].device)


@dataclass
class _Call:
    """One call of a stacked root: what its batched layers need to know about the folded batch."""

    owner: int  # id() of the root that made this call
    num_models: int
    batch: int
    tracker: Tracker
    shared_buffers: list[SharedBuffer]
    # per swapped layer being called: (broadcast, model dimension of its inputs, whether an input without samples
    # has a leading 1, None when it has samples; the rows picked by a mask it is given), a stack for re-entry
    leaves: dict[int, list[tuple[bool, int, bool | None, _PickedRows | None]]] = field(default_factory=dict)
    # (module, name, tensor) of every per-model parameter and buffer at the start of the call (see UnfoldOutputs)
    per_model_slots: list[tuple[nn.Module, str, Tensor | None]] = field(default_factory=list)
    signature: tuple = ()  # see _signature
    fold_inputs: Any = None  # the root's FoldInputs hook


def _calls() -> list[_Call]:
    calls = getattr(_local, "calls", None)
    if calls is None:
        calls = _local.calls = []
    return calls


def _current_call() -> _Call | None:
    calls = _calls()
    return calls[-1] if calls else None


def map_tensors(
    obj: object, fn: Callable[[Tensor, str], object], where: str = "", other: Callable[[object], object] | None = None
) -> object:
    """Apply ``fn(tensor, where)`` to every tensor in nested tuples, namedtuples, lists, dicts and dataclasses,
    keeping the structure (and the container types); ``other`` (if given) to every other leaf."""
    if isinstance(obj, Tensor):
        return fn(obj, where)
    if isinstance(obj, tuple):
        items: list[Any] = [map_tensors(v, fn, f"{where}[{i}]", other) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_tensors(v, fn, f"{where}[{i}]", other) for i, v in enumerate(obj)]
    if type(obj) is dict:
        return {k: map_tensors(v, fn, f"{where}[{k!r}]", other) for k, v in obj.items()}
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict, defaultdict and dict-like output classes
        for k, v in obj.items():
            out[k] = map_tensors(v, fn, f"{where}[{k!r}]", other)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {
            f.name: map_tensors(getattr(obj, f.name), fn, f"{where}.{f.name}", other) for f in dataclasses.fields(obj)
        }
        made = type(obj).__new__(type(obj))  # not __init__: it may validate or compute (and torch.compile traces this)
        for name, value in {**getattr(obj, "__dict__", {}), **values}.items():
            object.__setattr__(made, name, value)
        return made
    return obj if other is None else other(obj)


def _each_models_number(obj: object) -> object:
    """A number computed from a read batch size, returned by forward (``return h, x.size(0)``): each original
    model's own, as a plain number (the folded ``M * B`` is no model's)."""
    return obj.own if isinstance(obj, _Marked) else obj


def _tensors(obj: object, where: str) -> list[tuple[str, Tensor]]:
    found: list[tuple[str, Tensor]] = []
    map_tensors(obj, lambda t, w: found.append((w, t)), where)
    return found


def runs_model_by_model(root: nn.Module) -> bool:
    """Whether ``root`` was stacked with ``execution="model_by_model"`` and runs so now (not while compiling,
    nor in the eager check of what a compiled call would run, see :func:`check_batched_forward`)."""
    return getattr(root.__dict__.get("forward"), "model_by_model", False) and not runs_batched_anyway()


def runs_batched_anyway() -> bool:
    """Whether a stacked root runs its batched forward whatever its execution: compiled, or checked eagerly
    before it is compiled."""
    return torch.compiler.is_compiling() or getattr(_local, "checking", False)


def input_tensors(args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    """Every tensor among a call's arguments (in nested containers too), with where it is."""
    return _tensors(args, "args") + _tensors(kwargs, "kwargs")


def check_inputs(root: nn.Module, found: list[tuple[str, Tensor]]) -> list[int]:
    """The batch sizes ``B`` of a stacked root's tensor inputs (:func:`input_tensors`), each ``(M, B, *)``,
    sorted, each once (inputs may hold different numbers of samples: CLIP's texts and images); a clear error
    otherwise."""
    num_models = cast(int, root.num_models)  # set by stack(); torch's stubs type module attributes as tensors
    name = type(root).__name__
    if not found:
        raise ValueError(
            f"stacked {name} (M={num_models}): needs at least one tensor input shaped (M, B, *) to know the "
            "batch size, got none"
        )
    for where, t in found:
        if t.dim() < 2 or t.shape[0] != num_models:
            raise ValueError(
                f"stacked {name}: expected every tensor input shaped (M, B, *) with M={num_models}, but "
                f"{where} has shape {tuple(t.shape)}"
            )
    return sorted({t.shape[1] for _, t in found})


def _by_module(names: list[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    """``names`` grouped by the path of their module (its atoms) and the names within it."""
    by_module: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        *path, leaf = name.split(".")
        by_module.setdefault(tuple(path), []).append(leaf)
    return list(by_module.items())


class FoldInputs:
    """Forward pre-hook of the stacked root: ``(M, B, *)`` tensor inputs become ``(M * B, *)``."""

    def __init__(
        self, shared_buffers: Iterable[str] = (), per_model: Iterable[str] = (), own_code: Iterable[str] = ()
    ) -> None:
        self.shared_buffers = list(shared_buffers)
        self.per_model = list(per_model)  # every (M, *) parameter and buffer, by name
        # ... grouped by module (path atoms, tensor names): tagging walks to each module once per call
        self.per_model_by_module = _by_module(self.per_model)
        self.own_code = list(own_code)  # those of them that the architecture's own code uses (not a batched layer)
        # a call gave an elementwise op each model's own number for a size read from the samples (see
        # batchlayers._provenance._each_models_values): torch.compile does not show the tracker the size reads,
        # so calls run without compiling from then on
        self.sizes_as_values = False
        # a call that recorded gradients applied a custom autograd.Function (its name): batchlayers computes its
        # backward per model only without compiling (see batchlayers._custom_function), so calls run so from then on
        self.custom_function: str | None = None

    def __call__(self, root: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if runs_model_by_model(root):
            return None  # its forward runs the architecture once per model, on (B, *) inputs
        num_models = cast(int, root.num_models)  # set by stack(); torch's stubs type module attributes as tensors
        inputs = input_tensors(args, kwargs)
        batches = check_inputs(root, inputs)
        signature = _signature(root, inputs)
        if torch.compiler.is_compiling() and num_models > 1 and signature not in getattr(root, _CHECKED, ()):
            _check_eagerly(root, args, kwargs)

        # A shared input (stride-0 expand) is copied here: the user's forward needs one ordinary batch.
        def fold(t: Tensor, where: str) -> Tensor:
            folded = t.reshape(num_models * t.shape[1], *t.shape[2:])
            if folded is t:
                folded = t.view(t.shape)  # a new tensor object to tag, never the caller's own
            set_tag(folded, 0)
            return folded

        # map_tensors keeps the container types: a tuple and a dict
        args, kwargs = cast(tuple, map_tensors(args, fold)), cast(dict, map_tensors(kwargs, fold))
        slots = self.tag_per_model(root)
        # Under torch.compile version counters are not traceable: it runs without the shared-buffer check.
        compiling = torch.compiler.is_compiling()
        buffers = [] if compiling else [(n, _tensor(root, n)) for n in self.shared_buffers]
        _unwind_stale_calls(root)
        tracker = Tracker(num_models, [num_models * b for b in batches])
        name = f"stacked {type(root).__name__}"
        tracker.eager_only = (
            bool(getattr(self, "own_code", ()))
            or getattr(self, "sizes_as_values", False)
            or getattr(self, "custom_function", None) is not None
        )
        call = _Call(
            owner=id(root),
            num_models=num_models,
            batch=batches[0],
            tracker=tracker,
            shared_buffers=[],
            per_model_slots=slots,
            signature=signature,
            fold_inputs=self,
        )
        call.shared_buffers = [
            tracker.guard_shared_buffer(n, b, name, functools.partial(self.store_per_model, root, n, call=call))
            for n, b in buffers
        ]
        _calls().append(call)
        tracker.__enter__()
        return args, kwargs

    def store_per_model(self, root: nn.Module, name: str, call: _Call | None) -> None:
        """From ``call`` on, store the shared buffer ``name`` per model, ``(M, *)``: forward writes per-model
        values into it (see ``Tracker._write_into_shared_buffer``), or assigned it one (``call``: None, after
        the call). Written in place, each model's copy starts as its value now; the tensor object stays the same
        (``Tensor.set_``), so every reference to it sees the change."""
        buffer = _tensor(root, name)
        every_name = _every_name(root, [name])
        if get_tag(buffer) is not PerModel:
            with torch.no_grad():
                stored = buffer.detach().expand(cast(int, root.num_models), *buffer.shape).clone()
                buffer.set_(stored.untyped_storage(), 0, stored.shape, stored.stride())
            set_tag(buffer, PerModel)
        self.shared_buffers.remove(name)
        self.per_model.append(name)
        self.own_code.append(name)  # read by the architecture's code: calls run without compiling
        self.per_model_by_module = _by_module(self.per_model)
        *path, leaf = name.split(".")
        for hook in (*root._state_dict_hooks.values(), *root._load_state_dict_pre_hooks.values()):
            hook = getattr(hook, "hook", hook)  # (torch wraps load-state-dict pre-hooks)
            if isinstance(hook, (ExpandSharedBuffers, SqueezeSharedBuffers)):
                hook.names = [n for n in hook.names if n not in every_name]
        if call is not None:
            call.tracker.eager_only = True
            call.shared_buffers = [g for g in call.shared_buffers if g.tensor is not buffer]
            call.per_model_slots.append((root.get_submodule(".".join(path)), leaf, buffer))

    def tag_per_model(self, root: nn.Module) -> list[tuple[nn.Module, str, Tensor | None]]:
        """Tag the ``(M, *)`` tensors as per-model: the architecture's code reads them as one model's (see
        ``batchlayers._per_model``). Checked on every call, as ``.to()`` and ``load_state_dict(assign=True)``
        replace tensors; torch.compile cannot trace the tagging of a parameter, so there it only checks.
        Returns every such tensor with its module and name."""
        compiling = torch.compiler.is_compiling()
        if compiling and getattr(self, "own_code", None):  # None, not (): mypy checks a () default against the bool
            # torch.compile does not pass size reads (x.shape) to the tracker: the architecture's own code
            # would see the stored (M, *) sizes of its per-model tensors. Raising here (and in the tracker,
            # for frames compiled on their own) makes torch.compile run those frames eagerly.
            raise RuntimeError(
                f"stacked {type(root).__name__}: its own code uses per-model tensors such as '{self.own_code[0]}'; "
                "it runs without compiling"
            )
        if compiling and getattr(self, "sizes_as_values", False):
            raise RuntimeError(
                f"stacked {type(root).__name__}: its own code computes with a batch size read from the samples "
                "(h / x.size(0)), which is each model's own B only where batchlayers sees the size read; it runs "
                "without compiling"
            )
        if compiling and getattr(self, "custom_function", None) is not None:
            raise RuntimeError(
                f"stacked {type(root).__name__}: its forward applies the custom autograd.Function "
                f"{self.custom_function}, whose backward batchlayers computes for each model only without compiling; "
                "it runs without compiling"
            )
        slots = []
        num_models = cast(int, root.num_models)
        for path, leaves in getattr(self, "per_model_by_module", ()):
            module = root
            for atom in path:
                module = cast(nn.Module, module._modules[atom])  # a submodule on the path, never a None entry
            for leaf in leaves:
                t: Tensor | None = module._parameters.get(leaf)
                if t is None:
                    t = module._buffers[leaf]  # a registered buffer, None where forward set it so
                slots.append((module, leaf, t))
                if t is None or getattr(t, "_batchlayers_models", None) is PerModel:
                    continue
                if t.dim() == 0 or t.shape[0] != num_models:
                    raise ValueError(
                        f"stacked {type(root).__name__}: '{'.'.join((*path, leaf))}' holds every model's value, "
                        f"stored (M, *) with M={num_models}, but was replaced by a tensor of shape {tuple(t.shape)}"
                    )
                if compiling:
                    raise RuntimeError(
                        f"stacked {type(root).__name__}: '{'.'.join((*path, leaf))}' was replaced since the model "
                        "was last called (by .to() or load_state_dict(assign=True)); call the stacked model once "
                        "without torch.compile before compiling it"
                    )
                set_tag(t, PerModel)
        return slots


def _keep_replaced_per_model(root: nn.Module, call: _Call) -> None:
    """A per-model buffer that the architecture's forward assigned anew (a cache: ``self.rel_indices =
    self.get_rel_indices(N)``) is stored per model again, as each original model would hold it: a per-model
    value as it is, a value without the samples (the same for every model) copied for each. A value computed
    from the samples is each model's part of the batch, which batchlayers does not store: the old tensor is put
    back and the call refused, as it is for a replaced parameter."""
    name = f"stacked {type(root).__name__}"
    for module, leaf, before in call.per_model_slots:
        now = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
        if now is before or now is None:
            continue
        tag = get_tag(now)
        if tag is PerModel:
            continue  # stored (M, *) already
        if leaf in module._parameters or tag is not None:
            if leaf in module._parameters:
                module._parameters[leaf] = cast(nn.Parameter, before)
                what = "a parameter"
            else:
                module._buffers[leaf] = before
                what = "a value computed from the models' samples" + (
                    f" by {tag.reason}" if isinstance(tag, Lost) else ""
                )
            raise ValueError(
                f"{name}: forward assigned {what} (shape {tuple(now.shape)}) to '{leaf}' of {type(module).__name__}, "
                "which the stacked model stores per model (M, *); it keeps only values without the samples "
                "there (a cache of constants or of values computed from parameters)"
            )
        try:  # (sized from the folded batch, it would hold M*B values where each model holds B)
            _refuse_batch_sized(
                name, f"the tensor forward assigned to '{leaf}' of {type(module).__name__}", now, call, True
            )
        except ValueError:
            module._buffers[leaf] = before
            raise
        stored = now.unsqueeze(0).expand(call.num_models, *now.shape).clone()
        set_tag(stored, PerModel)
        module._buffers[leaf] = stored


def _refuse_replaced_shared_buffer(root: nn.Module, path: str, before: Tensor, name: str) -> None:
    """A buffer stored once because it was equal in every model, that forward assigned anew (``self.cache_k =
    k``): a value without the samples stays (the same for every model); a per-model value of the buffer's
    shape (``self.mean = 0.9 * self.mean + 0.1 * x.mean(0)``) is stored per model from now on; one computed
    from the samples would differ per model, which one shared tensor cannot hold: the old tensor is put back
    and the call refused."""
    now = _tensor(root, path)
    tag = get_tag(now) if now is not None else None
    if now is before or tag is None:
        return
    if tag is PerModel and now.shape == (cast(int, root.num_models), *before.shape):
        cast(FoldInputs, fold_inputs(root)).store_per_model(root, path, None)  # (a stacked root's call)
        return
    *parents, leaf = path.split(".")
    module = root.get_submodule(".".join(parents))
    module._buffers[leaf] = before
    what = "a per-model value of another shape" if tag is PerModel else "a value computed from the models' samples"
    raise ValueError(
        f"{name}: forward assigned {what} (shape {tuple(now.shape)}) to the buffer '{path}', which the stacked "
        "model stores once because it was equal in every model; one tensor cannot hold what differs per model. "
        "Keep such a cache out of the module's buffers (a local variable, or a returned value), or stack with "
        "execution='model_by_model'"
    )


def _unwind_stale_calls(root: nn.Module) -> None:
    """Drop what an earlier call of ``root`` left behind when it was interrupted by an exception that skipped
    the hooks (``KeyboardInterrupt``, ``SystemExit``): its call record and its tracker on torch's mode stack.
    A stacked root never calls itself, so a record of it still open here is stale."""
    calls = _calls()
    while any(c.owner == id(root) for c in calls):
        stale = calls.pop()
        close_call(stale.tracker.numbers)
        modes = torch.overrides._get_current_function_mode_stack()
        if stale.tracker in modes:
            while torch.overrides._get_current_function_mode() is not stale.tracker:
                torch.overrides._pop_mode()
            torch.overrides._pop_mode()


def _tensor(root: nn.Module, name: str) -> Tensor:
    # A walk through the module dicts: Module.get_buffer costs ~7 us a name (hasattr/getattr per atom), on
    # every forward of a stacked model.
    *path, leaf = name.split(".")
    module = root
    for atom in path:
        module = cast(nn.Module, module._modules[atom])  # a submodule on the path, never a None entry
    found = module._parameters.get(leaf)
    return cast(Tensor, module._buffers[leaf]) if found is None else found  # a registered buffer, not None


class UnfoldOutputs:
    """Forward hook of the stacked root (always called): tensor outputs that carry the models' samples on
    dimension ``d`` become ``(M, *)`` with that dimension split per model; an output with no samples is
    the same for every model, a stride-0 ``(M, *)`` expand."""

    def __call__(self, root: nn.Module, args: tuple, output: object) -> object:
        calls = _calls()
        if not calls or calls[-1].owner != id(root):
            return None  # the pre-hook refused the input; nothing to unwind
        call = calls.pop()
        call.tracker.__exit__(None, None, None)
        if call.tracker.own_numbers and call.fold_inputs is not None:
            call.fold_inputs.sizes_as_values = True
        noted = call.tracker.functions.noted if call.tracker.functions is not None else None
        if noted is not None and call.fold_inputs is not None:
            call.fold_inputs.custom_function = noted
        failed = sys.exc_info()[1]  # (torch calls this hook from its except clause when forward raised)
        if failed is not None:
            _explain(failed, call)
            return None
        _keep_replaced_per_model(root, call)
        call.tracker.check_copied_views()
        if output is None:
            _passed(root, call)
            return None
        num_models = call.num_models
        name = f"stacked {type(root).__name__}"
        for guard in call.shared_buffers:
            _refuse_replaced_shared_buffer(root, guard.path, guard.tensor, name)
            if guard.unseen_write():
                raise RuntimeError(
                    f"{name}: forward modified the buffer '{guard.path}' in place, where batchlayers does not see "
                    "what it wrote (code outside torch's Python API), but it is one copy shared by all models (it "
                    "was equal in every model). Register a batched counterpart for the module that owns it with "
                    "batchlayers.register(...)"
                )

        def unfold(t: Tensor, where: str) -> Tensor:
            tag = get_tag(t)
            if isinstance(tag, Lost) and num_models == 1 and t.dim() > 0:
                tag = 0  # one model: every row is its own
            if isinstance(tag, int):
                return t.unflatten(tag, (num_models, t.shape[tag] // num_models)).movedim(tag, 0)
            if tag is PerModel:
                return t  # stored (M, *) already
            if isinstance(tag, Lost) and t.dim() == 0:
                raise ValueError(
                    f"{name}: output{where} (a 0-dim value) was computed from every model's samples by {tag.reason}, "
                    "so it is not any one model's. A reduction of values over the samples (x.mean(), x.sum(), a loss "
                    "with reduction='mean' or 'sum') is each model's own; an index into them is not. Return such a "
                    "value, or compute per-model losses from the (M, B, *) outputs with batchlayers.losses"
                )
            if isinstance(tag, Lost):
                raise ValueError(
                    f"{name}: output{where} (shape {tuple(t.shape)}) was computed from the models' samples by "
                    f"{tag.reason}, so its rows cannot be assigned to models. Return outputs that keep each "
                    "sample's rows apart (the batch dimension first, as torch.nn layers do)"
                )
            if num_models > 1 and tag is None and untracked(t):
                raise ValueError(f"{name}: output{where} (shape {tuple(t.shape)}) is {UNTRACKED}")
            if t.dim() > 0:
                _refuse_batch_sized(name, f"output{where}", t, call, anywhere=True)
            return t.expand(num_models, *t.shape)  # the same value for every model (a 0-dim one too, as model by model)

        output = map_tensors(output, unfold, other=_each_models_number)
        _passed(root, call)
        return output


def _explain(error: BaseException, call: _Call) -> None:
    """Add to torch's own ``TypeError`` or ``IndexError`` raised in a stacked model's batched forward (not
    batchlayers' refusals, which say why) what differs from the original model's forward there: torch's
    argument parser rejects a per-model value where it takes a Python number (``torch.arange(n.max())``,
    ``x[:, :lengths.max()]``), and folded sizes index out of one model's range."""
    if type(error) not in (TypeError, IndexError) or call.num_models == 1 or not error.args:
        return
    if "batchlayers" in str(error.args[0]) or "stacked " in str(error.args[0]):
        return  # batchlayers' own message, or explained already (an inner stacked model's)
    error.args = (
        f"{error.args[0]}\n(batchlayers: raised in a stacked model's batched forward, where the models' samples "
        f"are folded into one batch of M * B = {call.tracker.folded_text()} rows and a per-model value (a "
        "parameter, a buffer, or a value computed from one or reduced over each model's samples, such as "
        "lengths.max()) is stored (M, *): torch cannot take it where it takes one Python number (torch.arange, "
        "torch.full, a slice bound), and an index made for one model's B is out of range for the folded batch. "
        "Stack with execution='model_by_model' for this code)",
        *error.args[1:],
    )


# The signatures (see _signature) of the calls a stacked root has run eagerly, each followed by the tracker
# from start to end: a compiled call unlike them is checked by one eager call first (see _check_eagerly).
_CHECKED = "_batchlayers_checked_calls"


def _passed(root: nn.Module, call: _Call) -> None:
    """An eager call that the tracker followed from start to end without refusing anything: compiled calls
    like it need no check."""
    if not torch.compiler.is_compiling() and call.signature not in getattr(root, _CHECKED, ()):
        root.__dict__[_CHECKED] = (*getattr(root, _CHECKED, ()), call.signature)


def _signature(root: nn.Module, inputs: list[tuple[str, Tensor]]) -> tuple:
    """What a compiled call of ``root`` must share with an eager one that passed: train or eval mode, and each
    tensor input's number of dimensions and dtype (the code a forward runs depends on them, rarely on sizes)."""
    return (root.training, *[(t.dim(), t.dtype) for _, t in inputs])


def check_batched_forward(root: nn.Module, args: tuple, kwargs: dict) -> None:
    """One call of ``root`` without torch.compile and without effects: on copies of its arguments (a cache
    object passed in is not appended to; a stride-0 shared batch is not copied: a write into it fails anyway),
    with the random number generators forked and every buffer (running statistics, caches) put back as it
    was (nothing is differentiated); the batched forward also for a root stacked to run model by model (see
    :func:`batchlayers.check_batched`)."""
    if not isinstance(root, nn.Module) or _CHECKED not in root.__dict__:
        raise TypeError(f"check_batched: expected a stacked model (from batchlayers.stack), got {type(root).__name__}")
    leaves = [t for _, t in input_tensors(args, kwargs)]
    memo: dict[int, object] = {id(t): t if 0 in t.stride() else t.detach().clone() for t in leaves}
    try:
        args, kwargs = copy.deepcopy((args, kwargs), memo)
    except Exception as exc:
        raise RuntimeError(
            f"stacked {type(root).__name__}: its first compiled call with inputs like these runs once without "
            f"compiling first, on copies of the arguments, which could not be copied ({type(exc).__name__}: {exc}). "
            "Call the stacked model once without compiling on such inputs before compiling it"
        ) from exc
    saved = [
        (module, name, b, b.clone())
        for module in root.modules()
        for name, b in module._buffers.items()
        if b is not None
    ]
    devices = sorted({t.device.index or 0 for t in leaves if t.device.type == "cuda"})
    checking, _local.checking = getattr(_local, "checking", False), True
    try:
        with torch.random.fork_rng(devices=devices):  # (gradients recorded as the call would: its paths)
            # Past a compiled call of the module itself (``root.compile()``), which would come back here.
            getattr(root, "_call_impl", root)(*args, **kwargs)
    finally:
        _local.checking = checking
        with torch.no_grad():
            for module, name, b, value in saved:
                module._buffers[name] = b
                b.copy_(value)


_check_eagerly = torch.compiler.disable(
    check_batched_forward,
    reason=(
        "batchlayers: the first compiled call of a stacked model with inputs like these (number of dimensions, "
        "dtypes, train/eval mode) runs once without compiling first, so that batchlayers checks its forward: "
        "under torch.compile it cannot follow a batch size read with x.size(0), and code such as "
        "h / x.size(0) would give every model a wrong result without an error. With fullgraph=True, call "
        "batchlayers.check_batched(stacked, *inputs) (or the stacked model) once before compiling it"
    ),
)


def _refuse_batch_sized(name: str, what: str, t: Tensor, call: _Call, anywhere: bool) -> None:
    """A tensor without the models' samples whose size is the folded M*B may have been sized from the batch
    (``torch.arange(x.size(0))``) or be a sequence of that length: refuse it rather than guess. Eagerly the
    tracker knows which tensors were made from the read size (``from_size_alone``): only those are refused, a
    sequence that merely has M*B entries (a (T, T) causal mask, ``torch.arange(T)``) is what it is."""
    compiling = torch.compiler.is_compiling()
    if not compiling and from_size_alone((t,), {}) is None:
        return
    sizes = t.shape if anywhere else t.shape[:1]
    folded = next((n for n in call.tracker.folded_sizes if n in sizes), None)
    # torch.compile does not pass size reads to the tracker: there any such tensor may have been sized so.
    size_read = call.tracker.size_read or compiling
    if call.num_models > 1 and size_read and folded is not None:
        raise ValueError(
            f"{name}: {what} is ambiguous: it has shape {tuple(t.shape)}, with the folded batch size M*B = "
            f"{call.num_models}*{folded // call.num_models} = {folded}, but was not computed from the models' samples, "
            "so it may be sized from the batch (e.g. torch.arange(x.size(0))) or be a sequence of that length; "
            "batchlayers does not guess which. Build batch-sized tensors from the inputs (torch.zeros_like(x), "
            "x.new_zeros(...)); give a sequence shared by all samples a leading dimension of 1 "
            "(torch.arange(T).unsqueeze(0)), or use a batch size with M*B different from its length"
        )


def _refuse_compiling(call: _Call, layer: nn.Module) -> None:
    """A batched layer's hooks where the stacked model's own code uses per-model tensors (see
    FoldInputs.tag_per_model): that call runs without compiling, but torch.compile still compiles the frames
    it calls on their own, the hooks among them, and a compiled hook would read the stored (M, *) sizes of a
    per-model input (it crashed). Raising while torch.compile traces the hook makes it run eagerly."""
    if call.tracker.eager_only and torch.compiler.is_compiling():
        raise RuntimeError(
            f"{layer_name(layer)}: its stacked model's own code uses per-model tensors, so it runs without compiling"
        )


class UnfoldLeafInputs:
    """Forward pre-hook of a swapped-in batched layer: inputs that carry the models' samples become
    ``(M, n, *)``; one without samples is the same for every sample of a model: it becomes ``(M, 1, *)`` (a
    ``(1, *)`` input) or ``(M, 1, *input)`` (any other), an expand, never a copy."""

    def __call__(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call = _current_call()
        if call is None:
            if getattr(_local, "model_by_model", 0):
                raise ValueError(
                    f"{layer_name(layer)} was called while its stacked model runs model by model, through a "
                    "reference that is not a submodule of the model (a list or a function holding the layer); "
                    "batchlayers swaps each model's torch.nn layer in for it only where the module tree holds it. "
                    "Reach the layer through its parent module, or stack with execution='batched'"
                )
            if any(isinstance(get_tag(t), int) for t in (*args, *kwargs.values()) if isinstance(t, Tensor)):
                raise ValueError(
                    f"{layer_name(layer)} was called with a stacked model's folded samples after that model's call "
                    "ended: torch.utils.checkpoint recomputes parts of forward in backward, outside the stacked "
                    "call. Turn activation checkpointing off before stacking"
                )
            return None  # called on its own: an ordinary batched layer taking (M, B, *)
        _refuse_compiling(call, layer)
        call.tracker.refuse_checkpointing(layer_name(layer))
        call.tracker.refuse_inside_transform(layer_name(layer))
        call.tracker.pause()  # from here to the end of FoldLeafOutput: batchlayers' own code, not tracked
        try:
            return self._unfold(layer, args, kwargs, call)
        except BaseException:
            call.tracker.resume()
            raise

    def _unfold(self, layer: nn.Module, args: tuple, kwargs: dict, call: _Call) -> tuple[tuple, dict]:
        num_models = call.num_models
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.dim() > 0]
        picked = _picked_rows(layer, tensors, num_models)
        layouts = set()  # (model dimension, its size) of each input that carries samples
        for t in tensors:
            tag = get_tag(t)
            if isinstance(tag, Lost) and picked is not None:
                continue  # (rows picked by a mask: each model's block is padded below)
            if isinstance(tag, Lost):
                if num_models > 1:
                    raise ValueError(
                        f"{layer_name(layer)}: its input (shape {tuple(t.shape)}) was computed from the models' "
                        f"samples by {tag.reason}, so batchlayers cannot tell which model each row belongs to"
                    )
                tag = 0  # one model: every row is its own
            if tag is None or tag is PerModel:
                if getattr(layer, "_samples_in_every_input", False):
                    raise ValueError(
                        f"{layer_name(layer)}: its input of shape {tuple(t.shape)} holds none of the models' samples "
                        f"({'a per-model value' if tag is PerModel else 'the same for every model'}), but every input "
                        f"of {type(layer).__name__} is rows of tokens, as many as its other inputs'"
                    )
            if tag is None:
                if num_models > 1 and from_size_alone((t,), {}) is not None:
                    raise ValueError(from_size_message(f"{layer_name(layer)}: its input", t))
                if num_models > 1 and untracked(t):
                    raise ValueError(f"{layer_name(layer)}: its input (shape {tuple(t.shape)}) is {UNTRACKED}")
                _refuse_batch_sized(layer_name(layer), "its input", t, call, anywhere=False)
            elif tag is not PerModel:
                model_dim = cast(int, tag)  # not None, not PerModel, not Lost (refused or made 0 above)
                layouts.add((model_dim, t.shape[model_dim]))
        if len(layouts) > 1:
            raise ValueError(
                f"{layer_name(layer)}: its inputs hold the models' samples on different dimensions or in different "
                f"numbers: (dimension, size) {sorted(layouts)}"
            )
        dim, size = layouts.pop() if layouts else (0, None)
        if picked is not None:
            size = num_models * picked.width
        if dim:
            trailing = getattr(layer, "_rowwise_trailing_dims", None)
            if trailing is None or any(dim >= t.dim() - trailing for t in tensors if isinstance(get_tag(t), int)):
                raise ValueError(
                    f"{layer_name(layer)}: its input has the models' samples on dimension {dim} (e.g. time-major), "
                    f"but {type(layer).__name__} needs them on dimension 0, as the batch dimension"
                )
        # Without samples (positions, a per-model table) the layer computes one value per model: its output
        # is per-model, shaped as the one model's would be: (1, *) stays (1, *), (T,) gives (T, *).
        leading_one = None
        if size is None and tensors:
            first = tensors[0]
            shape = first.shape[1:] if get_tag(first) is PerModel else first.shape
            leading_one = len(shape) >= 2 and shape[0] == 1
        call.leaves.setdefault(id(layer), []).append((size is None, dim, leading_one, picked))

        def unfold(t: object) -> object:
            if not isinstance(t, Tensor) or t.dim() == 0:
                return t
            tag = get_tag(t)
            if picked is not None and isinstance(tag, Lost):
                return picked.pad(t, num_models)
            if tag is not None and tag is not PerModel:
                t = t.movedim(dim, 0) if dim else t
                return t.reshape(num_models, t.shape[0] // num_models, *t.shape[1:])
            # (1, *): the leading 1 is the batch dimension it is broadcast over, as in (1, T) positions; a 1-D
            # (T,) keeps its one dimension (T may be 1)
            own = t.shape[1:] if tag is PerModel else t.shape
            rest = own[1:] if len(own) >= 2 and own[0] == 1 else own
            if tag is PerModel:
                shared = t.reshape(num_models, 1, *rest)
            else:
                shared = t.reshape(1, 1, *rest).expand(num_models, 1, *rest)
            return shared if size is None else shared.expand(num_models, size // num_models, *rest)

        return tuple(unfold(a) for a in args), {k: unfold(v) for k, v in kwargs.items()}


class FoldLeafOutput:
    """Forward hook of a swapped-in batched layer (always called): its ``(M, n, *)`` output becomes
    ``(M * n, *)`` (with the model dimension back where its input had it), tagged as holding the samples."""

    def __call__(self, layer: nn.Module, args: tuple, output: object) -> object:
        call = _current_call()
        if call is None:
            return None
        _refuse_compiling(call, layer)
        stack = call.leaves.get(id(layer))
        if not stack:
            return None  # the pre-hook refused the input
        broadcast, dim, leading_one, picked = stack.pop()
        try:
            if output is None:
                return None
            return self._fold(layer, args, output, call, broadcast, dim, leading_one, picked)
        finally:
            call.tracker.resume()

    def _fold(
        self,
        layer: nn.Module,
        args: tuple,
        output: object,
        call: _Call,
        broadcast: bool,
        dim: int,
        leading_one: bool | None,
        picked: _PickedRows | None,
    ) -> object:
        num_models = call.num_models

        def fold(t: Tensor, where: str) -> Tensor:
            if t.dim() < 2 or t.shape[0] != num_models or (broadcast and t.shape[1] != 1):
                expected = f"({num_models}, 1, *)" if broadcast else f"({num_models}, n, *)"
                raise ValueError(
                    f"{layer_name(layer)}: expected the batched layer's output{where} to be {expected}, "
                    f"got shape {tuple(t.shape)}"
                )
            if picked is not None:  # (the rows a mask picked: each model's back from its padded block)
                return picked.take(t)
            if broadcast:
                if torch.compiler.is_compiling():
                    # torch.compile does not pass size reads to the tracker, so a per-model value would show its
                    # stored (M, *) sizes to the architecture's code: the value goes to every sample instead.
                    t = t.expand(num_models, call.batch, *t.shape[2:])
                else:  # one value per model: per-model, in the one model's shape
                    t = t if leading_one or leading_one is None else t.reshape(num_models, *t.shape[2:])
                    set_tag(t, PerModel)
                    return t
            # The memory format the batched layer produced (channels-last stays channels-last): torch.nn layers
            # accept any, and a .view() that needs torch.nn's layout is made of a copy (Tracker._view). A
            # compiled graph has no tracker to do that, and inductor plans its own layouts: contiguous there.
            if _folds_as_own_tensor(layer, output, t, args):
                t = _FoldedOwnTensor.apply(t)
            else:
                t = t.reshape(num_models * t.shape[1], *t.shape[2:])
            if torch.compiler.is_compiling():
                t = t.contiguous()
            if dim:
                t = t.movedim(0, dim)
            set_tag(t, dim)
            return t

        return map_tensors(output, fold)


# The smallest output :func:`_folds_as_own_tensor` folds into a tensor of its own: the Function costs about
# 60 us a call forward and backward (2-core CPU), where no in-place write follows for nothing; an in-place
# write's copies of a smaller output cost less than that.
OWN_TENSOR_MIN_BYTES = 1 << 20


class _FoldedOwnTensor(torch.autograd.Function):
    """A batched layer's ``(M, n, *)`` output as ``(M * n, *)``, on the same memory and with the same version
    counter (a write into either is seen by autograd's checks of both), but not a view of it.

    An in-place op on a view makes autograd rewrite the view's base: in backward it copies the whole base's
    gradient into a new tensor, and the op's own gradient into that (``CopySlices``). Folded as a view,
    ``nn.ReLU(inplace=True)`` and ``out += identity`` on a batch norm's output (torchvision's and timm's
    ResNets) cost those copies in a stacked model and not in the original, whose batch norm's output is a
    tensor of its own. Measured on the benchmark's ResNet written that way (``resnet-tv``, M=4, 2-core CPU): see
    ``docs/guides/performance.md``."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        ctx.shape = t.shape
        # .detach(): not a view of t for autograd, and (detach's) t's version counter
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.reshape(ctx.shape)


def _folds_as_own_tensor(layer: nn.Module, output: object, t: Tensor, args: tuple) -> bool:
    """Whether ``t``, ``layer``'s whole output, folds into a tensor of its own (:class:`_FoldedOwnTensor`): a
    large batch of images or volumes (``(M, n, C, *spatial)``, where torchvision and timm write in-place
    activations and residual adds) that one of batchlayers' layers computed while autograd records (where
    torch.func, forward AD and compile run torch's ops), that no other hook sees, on memory of this call's own
    (not an input's, a parameter's or a buffer's; it may be a view of the layer's own result). Nothing but
    autograd's saved tensors, which share its version counter, can then read ``t`` after a write into its
    fold."""
    if torch.compiler.is_compiling():
        return False  # (before reading anything of t: dynamo traces this hook)
    if not (
        output is t
        and type(t) is Tensor  # (no subclass: a tracer's fake tensor, a transform's wrapper)
        and t.dim() >= 5
        and t.grad_fn is not None
        and t.nbytes >= OWN_TENSOR_MIN_BYTES
        and type(layer).__module__.startswith("batchlayers.")  # (a user's registered layer might keep it)
        and only_fold_hooks(layer)
        and not global_module_hooks()
        and torch.is_grad_enabled()
        and _workspace._own_functions_run()
    ):
        return False
    if layer._modules:
        others = (*args, *layer.parameters(), *layer.buffers())
    else:  # (a leaf: its own dictionaries, without parameters()' walk over the submodules)
        others = (*args, *layer._parameters.values(), *layer._buffers.values())
    try:
        memory = t.untyped_storage().data_ptr()
        return all(not isinstance(a, Tensor) or a.untyped_storage().data_ptr() != memory for a in others)
    except (RuntimeError, NotImplementedError):  # an input without storage (sparse, a subclass): as a view
        return False


def only_fold_hooks(layer: nn.Module | None) -> bool:
    """Whether ``layer`` is swapped into a stacked model and holds batchlayers' two leaf hooks, no other."""
    return (
        layer is not None
        and is_swapped_leaf(layer)
        and all(isinstance(h, UnfoldLeafInputs) for h in layer._forward_pre_hooks.values())
        and all(isinstance(h, FoldLeafOutput) for h in layer._forward_hooks.values())
        and not layer._backward_pre_hooks
        and not layer._backward_hooks
    )


def run_as_one_leaf(
    first: nn.Module, last: nn.Module, x: Tensor, compute: Callable[[Tensor], Tensor | None]
) -> Tensor | None:
    """Compute a chain of swapped-in batched layers, ``first`` to ``last``, as one layer: ``x`` unfolded as
    ``first``'s pre-hook unfolds it, ``compute``'s ``(M, n, *)`` output folded as ``last``'s hook folds its
    own. Returns None, having changed nothing, where the layers must run one by one: ``compute`` declines,
    the input holds no samples (a per-model value), or it holds a stacked call's samples after that call
    ended (the layers raise). Outside a stacked call the layers are ordinary batched layers: ``compute(x)``."""
    call = _current_call()
    if call is None:
        return None if isinstance(get_tag(x), int) else compute(x)
    # pauses the tracker until the fold below resumes it; returns the arguments (never None inside a call)
    args = cast(tuple[tuple, dict], UnfoldLeafInputs()(first, (x,), {}))[0]
    stack = call.leaves[id(first)]
    y = None
    try:
        if not stack[-1][0]:  # not broadcast: the input carries the models' samples
            y = compute(args[0])
    finally:
        if y is None:
            stack.pop()
            call.tracker.resume()
    if y is None:
        return None
    call.leaves.setdefault(id(last), []).append(stack.pop())
    return cast(Tensor, FoldLeafOutput()(last, args, y))


class ExpandSharedBuffers:
    """State-dict post-hook of the stacked root: a buffer kept as one copy for all models (equal in every
    model, e.g. a causal mask) is saved as a stride-0 ``(M, *)`` expand, like every other entry."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)

    def __call__(self, root: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for name in self.names:
            key = prefix + name
            if key in state_dict:
                value = state_dict[key]
                state_dict[key] = value.expand(root.num_models, *value.shape)


class SqueezeSharedBuffers:
    """Load-state-dict pre-hook of the stacked root: the ``(M, *)`` entry of a shared buffer that holds the
    same value for every model is loaded as that one value; one that differs between the models (saved after
    forward stored the buffer per model, see ``FoldInputs.store_per_model``) makes it a per-model buffer, into
    which each model's value loads."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)

    def __call__(self, root, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name in list(self.names):  # (storing one per model takes its names out of this list)
            if name not in self.names:
                continue  # another name of a buffer stored per model above
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != root.num_models:
                continue  # torch's own shape check reports it
            if all(torch.equal(value[0], value[i]) for i in range(1, value.shape[0])):
                state_dict[key] = value[0]
                continue
            fold = cast(FoldInputs, fold_inputs(root))  # (this hook is a stacked root's)
            buffer = _tensor(root, name)
            canonical = next((n for n in fold.shared_buffers if _tensor(root, n) is buffer), None)
            if canonical is None or _viewed(buffer):
                error_msgs.append(
                    f"'{key}' is one buffer shared by all models in the stacked {type(root).__name__}, but the "
                    "state dict holds different values for different models"
                    + (" (and other tensors view it, so it cannot be stored per model)" if canonical else "")
                )
                continue
            fold.store_per_model(root, canonical, None)


class MovesKeysOnly:
    """A load-state-dict pre-hook of the architecture (transformers' renaming of old checkpoints' keys),
    kept on the stacked model: it runs on the stacked state dict, whose tensors hold every model's values, so
    it may move and rename entries but not compute new values from them (which it would do per model). One
    that does is refused before anything is loaded into the module."""

    def __init__(self, hook: Callable, where: str) -> None:
        self.hook = hook
        self.where = where

    def __call__(self, state_dict: dict, *args: object) -> None:
        given = {id(v): _version(v) for v in state_dict.values() if isinstance(v, Tensor)}
        with _Reads(given) as reads:
            self.hook(state_dict, *args)
        if reads.first is not None:
            raise ValueError(
                f"load_state_dict: a load-state-dict hook of {self.where} read the state dict's tensors "
                f"({reads.first}: their shapes or values), which in a stacked model hold every model's, (M, *); "
                "it can only move and rename entries there. Load each model's state dict into an original model "
                "and stack them"
            )
        for key, value in state_dict.items():
            if isinstance(value, Tensor) and given.get(id(value), -1) != _version(value):
                raise ValueError(
                    f"load_state_dict: a load-state-dict hook of {self.where} computed '{key}' from the state dict's "
                    "tensors, which in a stacked model hold every model's values; it can only move and rename "
                    "entries there. Load each model's state dict into an original model and stack them"
                )


class _Reads(TorchFunctionMode):
    """Notes the first torch call (a property read included: ``.shape``, ``.dtype``) on one of the tensors
    ``given`` (ids) while a load-state-dict hook runs."""

    def __init__(self, given: Mapping[int, object]) -> None:
        super().__init__()
        self.given = given
        self.first: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.first is None and any(id(a) in self.given for a in (*args, *kwargs.values())):
            self.first = _name(func)
        return func(*args, **kwargs)


def _version(t: Tensor) -> int | None:
    """``t``'s version counter, None for an inference tensor (a state dict loaded under inference mode), which
    has none: such a tensor is compared by identity alone."""
    return None if t.is_inference() else t._version


def keep_load_hooks(root: nn.Module) -> None:
    """Wrap the load-state-dict pre-hooks of ``root``'s modules in :class:`MovesKeysOnly`."""
    for path, module in root.named_modules():
        hooks = module._load_state_dict_pre_hooks
        for key, hook in list(hooks.items()):
            if not isinstance(getattr(hook, "hook", hook), _HOOK_TYPES):
                where = f"'{path}' ({type(module).__name__})" if path else f"the model itself ({type(module).__name__})"
                hooks[key] = MovesKeysOnly(hook, where)


class NestedTensorGuard:
    """Forward pre-hook of a ``torch.nn.TransformerEncoder`` inside a stacked model. In eval mode without
    gradients and with a ``src_key_padding_mask``, torch may run the original through its nested-tensor
    fast path, which returns zeros at padded positions; a stacked model (whose code is followed call by call)
    never takes that path, so those positions would differ. Refused there, instead of differing."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training or torch.is_grad_enabled():
            return
        if not getattr(module, "use_nested_tensor", False):
            return
        padding = kwargs.get("src_key_padding_mask", args[2] if len(args) > 2 else None)
        if padding is not None:
            raise ValueError(
                f"{layer_name(module)}: in eval mode without gradients and with a src_key_padding_mask, torch "
                "may run each original TransformerEncoder through its nested-tensor fast path, which sets the "
                "padded positions to 0; the stacked model cannot take that path. Build the encoders with "
                "enable_nested_tensor=False (or set .use_nested_tensor = False on them) before stacking, or "
                "run with gradients enabled"
            )


def guard_nested_tensors(root: nn.Module) -> None:
    for path, module in root.named_modules():
        if isinstance(module, nn.TransformerEncoder):
            module._batchlayers_path = path
            module.register_forward_pre_hook(NestedTensorGuard(), with_kwargs=True)


_HOOK_TYPES = (
    FoldInputs,
    UnfoldOutputs,
    UnfoldLeafInputs,
    FoldLeafOutput,
    ExpandSharedBuffers,
    SqueezeSharedBuffers,
    NestedTensorGuard,
)


def attach_root_hooks(
    root: nn.Module, shared_buffers: Iterable[str], per_model: Iterable[str] = (), own_code: Iterable[str] = ()
) -> None:
    shared_buffers = list(shared_buffers)
    root.__dict__[_CHECKED] = ()  # no call checked yet (see FoldInputs)
    root.register_forward_pre_hook(FoldInputs(shared_buffers, per_model, own_code), with_kwargs=True)
    root.register_forward_hook(UnfoldOutputs(), always_call=True)
    if shared_buffers:
        # state_dict() saves a buffer under every name it has (a module reused in two places): expand each
        every_name = _every_name(root, shared_buffers)
        root.register_state_dict_post_hook(ExpandSharedBuffers(every_name))
        root.register_load_state_dict_pre_hook(SqueezeSharedBuffers(every_name))
    tag_per_model(root)


def fold_inputs(root: nn.Module) -> FoldInputs | None:
    """The :class:`FoldInputs` pre-hook of a stacked root (which knows its shared and per-model tensors), or None
    for any other module."""
    return next((h for h in root._forward_pre_hooks.values() if isinstance(h, FoldInputs)), None)


def tag_per_model(root: nn.Module) -> None:
    hook = fold_inputs(root)
    if hook is not None:
        hook.tag_per_model(root)


def _every_name(root: nn.Module, buffer_names: list[str]) -> list[str]:
    wanted = {id(root.get_buffer(n)) for n in buffer_names}
    return [n for n, b in root.named_buffers(remove_duplicate=False) if id(b) in wanted]


def attach_leaf_hooks(layer: nn.Module, path: str) -> None:
    layer._batchlayers_path = path  # type: ignore[assignment]  # torch's stubs allow only tensors and modules
    layer.register_forward_pre_hook(UnfoldLeafInputs(), with_kwargs=True)
    layer.register_forward_hook(FoldLeafOutput(), always_call=True)


def is_swapped_leaf(module: nn.Module) -> bool:
    return any(isinstance(h, UnfoldLeafInputs) for h in module._forward_pre_hooks.values())


def root_shared_buffers(root: nn.Module) -> list[str]:
    hook = fold_inputs(root)
    return [] if hook is None else list(hook.shared_buffers)


def detach_hooks(module: nn.Module) -> None:
    """Remove every batchlayers hook from ``module`` itself (not its children)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks, module._state_dict_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, _HOOK_TYPES)]:
            del hooks[key]
    pre_hooks = module._load_state_dict_pre_hooks
    for key in [k for k, h in pre_hooks.items() if isinstance(getattr(h, "hook", h), _HOOK_TYPES)]:
        del pre_hooks[key]
    for key, hook in list(pre_hooks.items()):
        if isinstance(hook, MovesKeysOnly):
            pre_hooks[key] = hook.hook
    module.__dict__.pop("_batchlayers_path", None)
