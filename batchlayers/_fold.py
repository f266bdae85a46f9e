"""Folded execution of a stacked model: the architecture's own ``forward`` sees one batch of ``M * B`` samples.

The root of a stacked model folds every tensor input ``(M, B, *)`` to model-major ``(M * B, *)`` and unfolds
its tensor outputs back; each batched layer swapped in for a torch.nn leaf views its ``(M * B, *)`` input as
``(M, B, *)`` and folds its output again. Everything is wired with forward (pre-)hooks held by small
picklable objects, so a stacked model deep-copies, pickles and saves its ``state_dict`` like any module.

The root records ``M`` and ``B`` for the duration of the call, so that an input of a batched layer that has
no batch dimension (position indices ``(1, T)`` or ``(T,)`` looked up in an embedding) gives each model its
own rows, broadcast over that model's ``B`` samples.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ._utils import layer_name

__all__ = [
    "attach_leaf_hooks",
    "attach_root_hooks",
    "detach_hooks",
    "is_swapped_leaf",
    "map_tensors",
]

_local = threading.local()


@dataclass
class _Call:
    """One call of a stacked root: what its batched layers need to know about the folded batch."""

    owner: int  # id() of the root that made this call
    num_models: int
    batch: int
    # The folded root inputs and the sizes of their non-batch dimensions, used to refuse a 1-D layer input
    # whose length is both M*B and a sequence length (batched or not: ambiguous).
    inputs: list[Tensor]
    input_sizes: set[int]
    shared_buffer_versions: list[tuple[str, Tensor, int]]
    leaf_broadcast: dict[int, bool] = field(default_factory=dict)


def _calls() -> list[_Call]:
    calls = getattr(_local, "calls", None)
    if calls is None:
        calls = _local.calls = []
    return calls


def _current_call() -> _Call | None:
    calls = _calls()
    return calls[-1] if calls else None


def map_tensors(obj: object, fn: Callable[[Tensor, str], object], where: str = "") -> object:
    """Apply ``fn(tensor, where)`` to every tensor in nested tuples, namedtuples, lists, dicts and dataclasses,
    keeping the structure (and the container types)."""
    if isinstance(obj, Tensor):
        return fn(obj, where)
    if isinstance(obj, tuple):
        items = [map_tensors(v, fn, f"{where}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_tensors(v, fn, f"{where}[{i}]") for i, v in enumerate(obj)]
    if type(obj) is dict:
        return {k: map_tensors(v, fn, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict, defaultdict and dict-like output classes
        for k, v in obj.items():
            out[k] = map_tensors(v, fn, f"{where}[{k!r}]")
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: map_tensors(getattr(obj, f.name), fn, f"{where}.{f.name}") for f in dataclasses.fields(obj)}
        out = type(obj).__new__(type(obj))  # not __init__: it may validate or compute (and torch.compile traces this)
        for name, value in {**getattr(obj, "__dict__", {}), **values}.items():
            object.__setattr__(out, name, value)
        return out
    return obj


def _tensors(obj: object, where: str) -> list[tuple[str, Tensor]]:
    found: list[tuple[str, Tensor]] = []
    map_tensors(obj, lambda t, w: found.append((w, t)), where)
    return found


class FoldInputs:
    """Forward pre-hook of the stacked root: ``(M, B, *)`` tensor inputs become ``(M * B, *)``."""

    def __init__(self, shared_buffers: Iterable[str] = ()) -> None:
        self.shared_buffers = list(shared_buffers)

    def __call__(self, root: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        num_models = root.num_models
        name = type(root).__name__
        found = _tensors(args, "args") + _tensors(kwargs, "kwargs")
        if not found:
            raise ValueError(
                f"stacked {name} (M={num_models}): needs at least one tensor input shaped (M, B, *) to know the "
                "batch size, got none"
            )
        batch = None
        for where, t in found:
            if t.dim() < 2 or t.shape[0] != num_models:
                raise ValueError(
                    f"stacked {name}: expected every tensor input shaped (M, B, *) with M={num_models}, but "
                    f"{where} has shape {tuple(t.shape)}"
                )
            if batch is None:
                batch = t.shape[1]
            elif t.shape[1] != batch:
                raise ValueError(
                    f"stacked {name}: every tensor input needs the same (M, B) = ({num_models}, {batch}), but "
                    f"{where} has shape {tuple(t.shape)}"
                )

        folded: list[Tensor] = []

        # A shared input (stride-0 expand) is copied here: the user's forward needs one ordinary batch.
        def fold(t: Tensor, where: str) -> Tensor:
            folded.append(t.reshape(num_models * batch, *t.shape[2:]))
            return folded[-1]

        args, kwargs = map_tensors(args, fold), map_tensors(kwargs, fold)
        # Under torch.compile, tensors kept across hooks upset dynamo and version counters are not traceable:
        # it runs without the ambiguity check's input list (so that check is stricter) and the buffer check.
        compiling = torch.compiler.is_compiling()
        buffers = [] if compiling else [(n, _buffer(root, n)) for n in self.shared_buffers]
        _calls().append(
            _Call(
                owner=id(root),
                num_models=num_models,
                batch=batch,
                inputs=[] if compiling else folded,
                input_sizes={s for _, t in found for s in t.shape[2:]},
                shared_buffer_versions=[(n, b, b._version) for n, b in buffers],
            )
        )
        return args, kwargs


def _buffer(root: nn.Module, name: str) -> Tensor:
    # A walk through the module dicts: Module.get_buffer costs ~7 us a name (hasattr/getattr per atom), on
    # every forward of a stacked model with shared buffers.
    *path, leaf = name.split(".")
    module = root
    for atom in path:
        module = module._modules[atom]
    return module._buffers[leaf]


class UnfoldOutputs:
    """Forward hook of the stacked root (always called): ``(M * B, *)`` tensor outputs become ``(M, B, *)``."""

    def __call__(self, root: nn.Module, args: tuple, output: object) -> object:
        calls = _calls()
        if not calls or calls[-1].owner != id(root):
            return None  # the pre-hook refused the input; nothing to unwind
        call = calls.pop()
        if output is None:
            return None
        num_models, batch = call.num_models, call.batch
        for path, buf, version in call.shared_buffer_versions:
            if buf._version != version:
                raise RuntimeError(
                    f"stacked {type(root).__name__}: forward modified the buffer '{path}' in place, but it is one "
                    "copy shared by all models (it was equal in every model). Register a batched counterpart "
                    "for the module that owns it with batchlayers.register(...)"
                )

        def unfold(t: Tensor, where: str) -> Tensor:
            if t.dim() == 0:
                return t  # e.g. a loss: already reduced over every model (see stack's docs on scaling)
            if t.shape[0] != num_models * batch:
                raise ValueError(
                    f"stacked {type(root).__name__}: output{where} has shape {tuple(t.shape)}, whose first dimension "
                    f"is not the folded batch M*B = {num_models}*{batch} = {num_models * batch}, so the rows cannot "
                    "be assigned to models. Return outputs with the batch dimension first, as torch.nn layers do"
                )
            return t.reshape(num_models, batch, *t.shape[1:])

        return map_tensors(output, unfold)


class UnfoldLeafInputs:
    """Forward pre-hook of a swapped-in batched layer: ``(M * B, *)`` inputs become ``(M, B, *)``.

    An input without the folded batch dimension is the same for every sample of a model: it becomes
    ``(M, 1, *)`` (a ``(1, *)`` input) or ``(M, 1, *input)`` (any other), an expand, never a copy.
    """

    def __call__(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call = _current_call()
        if call is None:
            return None  # called on its own: an ordinary batched layer taking (M, B, *)
        num_models, folded = call.num_models, call.num_models * call.batch
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.dim() > 0]
        for t in tensors:
            _refuse_ambiguous(layer, t, call)
        broadcast = all(t.shape[0] != folded for t in tensors)
        call.leaf_broadcast[id(layer)] = broadcast

        def unfold(t: object) -> object:
            if not isinstance(t, Tensor) or t.dim() == 0:
                return t
            if t.shape[0] == folded:
                return t.reshape(num_models, call.batch, *t.shape[1:])
            rest = t.shape[1:] if t.shape[0] == 1 else t.shape
            shared = t.reshape(1, 1, *rest).expand(num_models, 1, *rest)
            return shared if broadcast else shared.expand(num_models, call.batch, *rest)

        return tuple(unfold(a) for a in args), {k: unfold(v) for k, v in kwargs.items()}


class FoldLeafOutput:
    """Forward hook of a swapped-in batched layer: its ``(M, B, *)`` output becomes ``(M * B, *)``."""

    def __call__(self, layer: nn.Module, args: tuple, output: object) -> object:
        call = _current_call()
        if call is None:
            return None
        num_models, batch = call.num_models, call.batch
        broadcast = call.leaf_broadcast.pop(id(layer), False)

        def fold(t: Tensor, where: str) -> Tensor:
            expected = (num_models, 1 if broadcast else batch)
            if tuple(t.shape[:2]) != expected:
                raise ValueError(
                    f"{layer_name(layer)}: expected the batched layer's output{where} to start with {expected}, "
                    f"got shape {tuple(t.shape)}"
                )
            if broadcast:
                t = t.expand(num_models, batch, *t.shape[2:])
            # contiguous: user code calls .view on layer outputs, which torch.nn layers allow
            return t.reshape(num_models * batch, *t.shape[2:]).contiguous()

        return map_tensors(output, fold)


def _refuse_ambiguous(layer: nn.Module, t: Tensor, call: _Call) -> None:
    folded = call.num_models * call.batch
    if (
        t.dim() == 1
        and call.num_models > 1
        and t.shape[0] == folded
        and folded in call.input_sizes
        and not any(t is x for x in call.inputs)
    ):
        raise ValueError(
            f"{layer_name(layer)}: a 1-D input of length {folded} is ambiguous here: it may be one value per sample "
            f"of the folded batch (M*B = {call.num_models}*{call.batch}) or a sequence of that length shared by "
            "all samples (e.g. position indices torch.arange(T)). Give a shared sequence a leading dimension of "
            "1 (torch.arange(T).unsqueeze(0)), or use a batch size with M*B different from the sequence length"
        )


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
    """Load-state-dict pre-hook of the stacked root: the ``(M, *)`` entry of a shared buffer must hold the
    same value for every model; it is loaded as that one value."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)

    def __call__(self, root, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name in self.names:
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != root.num_models:
                continue  # torch's own shape check reports it
            if not all(torch.equal(value[0], value[i]) for i in range(1, value.shape[0])):
                error_msgs.append(
                    f"'{key}' is one buffer shared by all models in the stacked {type(root).__name__}, but the "
                    "state dict holds different values for different models"
                )
                continue
            state_dict[key] = value[0]


_HOOK_TYPES = (FoldInputs, UnfoldOutputs, UnfoldLeafInputs, FoldLeafOutput, ExpandSharedBuffers, SqueezeSharedBuffers)


def attach_root_hooks(root: nn.Module, shared_buffers: Iterable[str]) -> None:
    shared_buffers = list(shared_buffers)
    root.register_forward_pre_hook(FoldInputs(shared_buffers), with_kwargs=True)
    root.register_forward_hook(UnfoldOutputs(), always_call=True)
    if shared_buffers:
        # state_dict() saves a buffer under every name it has (a module reused in two places): expand each
        every_name = _every_name(root, shared_buffers)
        root.register_state_dict_post_hook(ExpandSharedBuffers(every_name))
        root.register_load_state_dict_pre_hook(SqueezeSharedBuffers(every_name))


def _every_name(root: nn.Module, buffer_names: list[str]) -> list[str]:
    wanted = {id(root.get_buffer(n)) for n in buffer_names}
    return [n for n, b in root.named_buffers(remove_duplicate=False) if id(b) in wanted]


def attach_leaf_hooks(layer: nn.Module, path: str) -> None:
    layer._batchlayers_path = path
    layer.register_forward_pre_hook(UnfoldLeafInputs(), with_kwargs=True)
    layer.register_forward_hook(FoldLeafOutput())


def is_swapped_leaf(module: nn.Module) -> bool:
    return any(isinstance(h, UnfoldLeafInputs) for h in module._forward_pre_hooks.values())


def root_shared_buffers(root: nn.Module) -> list[str]:
    for hook in root._forward_pre_hooks.values():
        if isinstance(hook, FoldInputs):
            return list(hook.shared_buffers)
    return []


def detach_hooks(module: nn.Module) -> None:
    """Remove every batchlayers hook from ``module`` itself (not its children)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks, module._state_dict_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, _HOOK_TYPES)]:
            del hooks[key]
    pre_hooks = module._load_state_dict_pre_hooks
    for key in [k for k, h in pre_hooks.items() if isinstance(getattr(h, "hook", h), _HOOK_TYPES)]:
        del pre_hooks[key]
    module.__dict__.pop("_batchlayers_path", None)
