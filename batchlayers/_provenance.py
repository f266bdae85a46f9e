"""Knowing, not guessing, which tensors carry the models' samples inside a stacked model's ``forward``.

A stacked model runs the architecture's own ``forward`` on one folded batch of ``M * B`` samples (see
``batchlayers._fold``). A batched layer inside must tell whether an input holds the models' samples (and
view it back to ``(M, n, *)``) or is a value that every sample shares (position indices, a mask built from
constants), which it broadcasts. Guessing that from sizes is wrong whenever sizes coincide (a sequence
length equal to ``M * B``), so batchlayers follows where every tensor came from:

- **Provenance tags.** While a stacked ``forward`` runs, a ``TorchFunctionMode`` sees every torch call of
  the architecture's code (not the batched layers' own math: the mode is paused inside them). Each tensor
  made from the models' samples carries a tag, ``tensor._batchlayers_models``:

  * an ``int`` ``d``: dimension ``d`` is *model-major*: its indices split into M equal consecutive blocks,
    block ``i`` holding model ``i``'s data, and the model of an element depends on that index alone. The
    folded inputs are tagged ``0``; so is every batched layer's output. This is independent of ``B``: a
    flattened ``(M * B * T, C)`` view of a ``(M * B, T, C)`` tensor is model-major on dimension 0 too, and
    a time-major ``(T, M * B, C)`` one on dimension 1.
  * a :class:`Lost`: made from the samples by an operation whose layout batchlayers does not follow (or one
    that mixes the models, e.g. a mean over the folded batch), with the operation's name as the reason.
  * no tag: the value does not depend on the samples (constants, ``arange``, shared buffers, anything made
    only from them), the same for every model.

- **Rules.** Every torch function that may see a tagged tensor has a rule saying where the model dimension
  of its output is: broadcasting elementwise ops align dimensions from the right; reshapes keep a model-major
  dimension wherever a prefix of the shape has the same product and the new dimension divides by M;
  permutations move it; ``cat``/``split`` along it, indexing into it lose it. A function without a rule
  makes its outputs :class:`Lost`. So a tag is never a guess: either the rule proves the layout or the
  tensor is marked as unknown.

- **Reductions over the samples.** A reduction of values (a mean, sum, product, norm, std/var, min/max
  values, median, logsumexp, a count, all/any; a loss with ``reduction='mean'`` or ``'sum'``) is computed
  per model on the samples viewed ``(M, *one model's shape)`` and gives a per-model value
  (``batchlayers._per_model``): each model's own loss, ignore_index and class weights included; so is a
  matrix product or einsum that contracts the samples (``h.T @ h``), and a reduction or loss over rows
  picked by a boolean mask (``h[mask].mean()``: see :data:`_SELECTION`). Indices over
  the samples (``argmax``, ``max(dim).indices``) stay :class:`Lost`: they count positions in the folded
  batch. A size read from the samples given to an elementwise op (``x.sum(0) / x.size(0)``,
  ``mask.sum() == mask.numel()``) is each model's own there (see :func:`_each_models_values`).

- **At the boundaries.** A batched layer takes a tagged input by its tag (model dimension first; row-wise
  layers such as Linear also take it on another dimension), broadcasts an untagged one, and refuses a
  :class:`Lost` one with the reason. The stacked root unfolds tagged outputs and refuses lost ones.

- **Custom autograd Functions.** Their forward is followed op by op; their backward, which autograd would run on
  every model's gradient at once, is computed model by model (``batchlayers._custom_function``).

- **Code the mode does not see.** A tensor with an autograd history but no tag, made by code the mode never saw
  (TorchScript, ``as_subclass``), is refused where it reaches a layer, an output or the samples, and so is what
  ops make from it alone (:func:`untracked`). Inside a torch.func transform entered in forward the mode sees
  the ops, on the transform's wrapped tensors, but not what the transform returns: an op inside one on a tensor
  holding the samples or a per-model value (mapped over, or read from outside), and a batched layer called
  inside one, are refused (:func:`_refuse_inside_transform`).

- **Sizes.** ``B = x.size(0)`` is ``M * B``, returned as a :class:`FoldedSize` (an int that knows it counts
  the samples: a reshape by it, or by ``B * T``, is known, a literal is not). What Python computes from it
  carries each original model's value too (``batchlayers._numbers``): torch is given a number that differs
  per model where it takes it as the size of the samples (reshapes, creation, indexing), each model's own
  number where an elementwise op takes it as a value (``h / B``), and elsewhere it is refused; comparisons
  whose answer differs per model are refused. The mode notes when the folded size of a
  tagged tensor is read; from then on, tensors created with that size are known to be batch-sized: those
  with equal (``zeros``, ``ones``, ``full``, ``empty``) or independent random values (``rand``, ``randn``)
  are model-major on that dimension (every split of equal values is right): the dimension given ``B``, where
  it was. ``B`` given to any other dimension (``torch.ones(B, B)``, ``h.unsqueeze(1).expand(-1, B, -1)``), or
  slicing, narrowing or splitting one, would make it ``M * B`` wide where each model's is ``B``: Lost, as is a
  tensor built from ``B`` alone (``torch.arange(B) % 4``, marked) indexing another dimension or broadcast
  onto one. Any other untagged tensor of that size (``arange``, ``eye``) may be a sequence or per-sample
  indices of the folded batch: combined with samples along the model dimension it is checked to be the same
  along it (else :class:`Lost`), and a batched layer or the stacked root refuses it as ambiguous when the
  folded size leads its shape.

The tags are plain Python attributes and the mode is an ordinary ``TorchFunctionMode``, so ``torch.compile``
traces both into one graph (the tags decide at trace time, like any Python control flow).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import string
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._numbers import FoldedInt, FoldedSize, FoldedValue, close_call, differs, open_call, plain_number_message
from .functional import _kept, _short_attention

__all__ = ["FoldedInt", "FoldedSize", "FoldedValue", "Lost", "PerModel", "Tracker", "get_tag", "set_tag"]

_ATTR = "_batchlayers_models"
_VIEWS = frozenset({Tensor.view, Tensor.view_as})
# A view where the layout allows it, else a copy: which one depends on the memory format
_RESHAPES = frozenset(
    {Tensor.reshape, torch.reshape, Tensor.reshape_as, Tensor.flatten, torch.flatten, Tensor.ravel, torch.ravel,
     Tensor.contiguous}
)  # fmt: skip
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


_OTHER_FORMAT = ".view() of a layer output that a batched layer keeps in another memory format"
_OTHER_RESHAPE = "a reshape of a layer output that a batched layer keeps in another memory format"


def _holds_samples(x: Tensor) -> bool:
    return isinstance(get_tag(x), int)


class CopiedViews:
    """Tensors that are a copy in a stacked (or model-by-model) pass where the original model's are an alias,
    or the reverse (see :func:`view_of_a_copy`, :func:`reshape_of_another_layout`): an in-place write to one of
    them afterwards would reach the other tensor in one and not in the other, so it is refused. Writes are
    seen by the tensors' version counters (:meth:`check`), which also count writes the tracker does not see;
    inference tensors have none, so under ``torch.inference_mode()`` their storages are recorded instead and a
    write into one is refused before it runs (:meth:`refuse_write`)."""

    def __init__(self) -> None:
        self.versions: list[tuple[Tensor, int, str]] = []  # (tensor, version when recorded, what)
        # inference tensors: storage address -> (what, the tensor, held so that its storage is not freed and its
        # address given to another tensor while recorded)
        self.storages: dict[int, tuple[str, Tensor]] = {}

    def record(self, tensors: Sequence[Tensor], what: str) -> None:
        for t in tensors:
            if t.is_inference():
                address = _storage_address(t)
                if address:
                    self.storages[address] = (what, t)
            else:
                self.versions.append((t, t._version, what))

    def check(self) -> None:
        """Refuse an in-place write, since it was recorded, to a tensor with a version counter."""
        for t, version, what in self.versions:
            if t._version != version:
                self.versions.clear()  # reported once (the root's output hook runs after an error in forward too)
                _refuse_copied_write(what)

    def refuse_write(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """Refuse ``func`` if it writes in place into a recorded inference tensor."""
        if self.storages:
            for t in written_tensors(func, args, kwargs):
                found = self.storages.get(_storage_address(t))
                if found is not None:
                    self.storages.clear()
                    _refuse_copied_write(found[0])


def _refuse_copied_write(what: str) -> None:
    raise RuntimeError(
        f"batchlayers: a tensor was written in place after {what}, so the write would reach the other tensor in "
        "one and not in the other. Use an out-of-place operation there, or call .contiguous() first"
    )


def _storage_address(t: Tensor) -> int:
    """The address of ``t``'s storage, shared by all its views (0: none, e.g. an empty or a meta tensor)."""
    try:
        return t.untyped_storage().data_ptr() if t.numel() else 0
    except (RuntimeError, NotImplementedError):  # (sparse and other storage-less tensors)
        return 0


def _safe_signature(f: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):  # (builtins without one)
        return None


def _viewed(t: Tensor) -> bool:
    """Whether another tensor shares ``t``'s storage (a view of it, or one it views). ``untyped_storage()``
    itself holds one reference while it is asked. A torch without the (private) count: taken as viewed, so
    that nothing relies on an answer it cannot give."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is None or use_count(t.untyped_storage()._cdata) > 2


def written_tensors(func: Callable, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors that the call ``func(*args, **kwargs)`` writes in place: an in-place method's or function's
    first argument, ``x[i] = v``'s ``x``, the input of ``F.relu(x, inplace=True)`` (and every functional
    with ``inplace``), ``out=``'s tensors."""
    found: object = kwargs.get("out")
    if found is None and args and (_IN_PLACE.get(func, False) or func is Tensor.__setitem__):
        found = args[0]
    elif found is None and args and func in _INPLACE_PARAMETER:
        position = _INPLACE_PARAMETER[func]
        if kwargs.get("inplace", len(args) > position and args[position]) is True:
            found = args[0]
    if isinstance(found, Tensor):
        return [found]
    return [t for t in found if isinstance(t, Tensor)] if isinstance(found, (tuple, list)) else []


# torch.nn.functional's functions with an ``inplace`` argument (relu, leaky_relu, hardtanh, dropout, ...): its
# position, for the writes they make into their input (see written_tensors)
_INPLACE_PARAMETER = {
    f: list(parameters).index("inplace")
    for f in (getattr(F, n) for n in dir(F) if not n.startswith("_"))
    if callable(f) and "inplace" in (parameters := getattr(_safe_signature(f), "parameters", {}))
}


def view_of_a_copy(
    func: Callable, args: tuple, kwargs: dict, copied: CopiedViews, copies: Callable, what: str
) -> Tensor:
    """``x.view(...)`` (``func``: a view function) where torch.nn's layout would allow it: when ``x`` is in
    another memory format (``copies(x)``: one that batchlayers made) and the view has no strides, the view is
    made of a contiguous copy. A copy does not alias its source, so both are recorded in ``copied`` with
    ``what`` the view was, and an in-place write to either afterwards is refused instead of silently not
    reaching the other."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        x = args[0]
        if not copies(x) or "view size is not compatible" not in str(error):
            raise
    out = func(x.contiguous(), *args[1:], **kwargs)
    copied.record((x, out), f"{what}, a copy in the stacked model and an alias in the original")
    return out


def reshape_of_another_layout(
    func: Callable, args: tuple, kwargs: dict, copied: CopiedViews, copies: Callable, what: str
) -> object:
    """``x.reshape(...)``, ``x.flatten(...)``, ``x.contiguous()`` (``func`` in :data:`_RESHAPES`): a view of
    ``x`` where its layout allows one, else a copy. Where ``x`` is, or is a permutation of, a tensor in a
    memory format batchlayers made (``copies``: channels-last where torch.nn's is contiguous), the original's
    result may alias where this one is a copy, or the reverse: both are then recorded in ``copied``, and an
    in-place write to either afterwards is refused (:class:`CopiedViews`)."""
    out = func(*args, **kwargs)
    x = args[0] if args else None
    if torch.compiler.is_compiling() or not isinstance(x, Tensor) or not isinstance(out, Tensor):
        return out  # (compiled: a graph has no aliasing to follow, its in-place writes are functional)
    if x.device.type == "meta":
        return out
    # (under inference mode, a view of a tensor made there does not say it is one)
    with torch.inference_mode(False) if x.is_inference() else contextlib.nullcontext():
        original = _original_layout(x, copies)
        if original is None:
            return out
        probe = func(original, *args[1:], **kwargs)
    would_alias = probe is original or probe._is_view()
    aliases = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    if aliases != would_alias:
        kinds = ("an alias", "a copy") if aliases else ("a copy", "an alias")
        copied.record((x, out), f"{what}, {kinds[0]} in the stacked model and {kinds[1]} in the original")
    return out


def base_of(t: Tensor) -> Tensor | None:
    """The tensor that ``t`` is a view of (``Tensor._base``), or None. Inference tensors do not record it;
    the tracker does, for the views that the code it follows makes of them (see :func:`note_views`)."""
    return t._base if t._base is not None else getattr(t, "_batchlayers_base", None)


def note_views(x: Tensor, out: object) -> None:
    """Under ``torch.inference_mode()``: mark the outputs of an op on ``x`` that share its storage (views) with
    the tensor they view, as ``Tensor._base`` does outside inference mode."""
    address = _storage_address(x)
    for o in _outputs(out):
        if o is not x and address and _storage_address(o) == address:
            base = base_of(x)
            o._batchlayers_base = x if base is None else base  # type: ignore[attr-defined]  # (syntax: see set_tag)


def _original_layout(x: Tensor, copies: Callable) -> Tensor | None:
    """A meta tensor with the strides the original model's ``x`` would have, where ``x`` views a tensor in a
    memory format batchlayers made (the original's: contiguous) by folding and permuting its dimensions; else
    None."""
    base = base_of(x)
    if base is None:
        base = x
    if not (copies(x) or copies(base)) or base.is_contiguous() or x.storage_offset() != base.storage_offset():
        return None
    standard = torch.empty(base.shape, device="meta").stride()
    runs = _dimension_runs(x, base)
    if runs is None:
        return None
    return torch.empty_strided(x.shape, [standard[run[-1]] for run in runs], device="meta")


def _dimension_runs(x: Tensor, base: Tensor) -> list[list[int]] | None:
    """For each dimension of ``x`` (a view of ``base``), the run of consecutive dimensions of ``base`` it
    merges (one, or several folded together), in ``x``'s order; None where ``x`` is not such a view (a slice,
    a selection)."""
    runs: list[list[int]] = []
    used: set[int] = set()
    for size, stride in zip(x.shape, x.stride()):
        found = None
        for d in range(base.dim()):
            if d in used:
                continue
            run, product = [d], base.shape[d]
            while product < size and run[-1] + 1 < base.dim() and run[-1] + 1 not in used:
                inner = run[-1] + 1
                if base.stride(run[-1]) != base.stride(inner) * base.shape[inner]:
                    break
                run.append(inner)
                product *= base.shape[inner]
            if product == size and (size == 1 or base.stride(run[-1]) == stride):
                found = run
                break
        if found is None:
            return None
        runs.append(found)
        used.update(found)
    if any(base.shape[d] != 1 for d in range(base.dim()) if d not in used):
        return None
    return runs


def inside_checkpoint(grad_enabled: bool) -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint`` (``grad_enabled``: grad mode where the
    stacked call began; the reentrant variant runs its function under ``no_grad``)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    checkpointed = hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")
    if not checkpointed and grad_enabled and not torch.is_grad_enabled():  # use_reentrant=True
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and not checkpointed:
            code = frame.f_code
            checkpointed = code.co_name == "forward" and code.co_filename.endswith(_CHECKPOINT_FILE)
            frame = frame.f_back
    return checkpointed


def _getter(name: str) -> Callable:
    """``Tensor.<name>.__get__``: the function that reading the property ``name`` of a tensor passes to
    ``__torch_function__`` (torch's stubs declare the properties as plain attributes)."""
    return getattr(Tensor, name).__get__


@dataclass(frozen=True)
class Lost:
    """A tensor made from the models' samples whose layout is not known; ``data_sized``: its size, too,
    depends on the values of every model's samples (``x[mask]``, ``nonzero``); ``wide``: a dimension that does
    not hold the samples was given their folded size (``torch.ones(B, B)``)."""

    reason: str
    data_sized: bool = False
    wide: bool = False  # a dimension sized by the folded size does not hold the samples (see _sized_dims)


class PerModel:
    """The tag (the class itself, never instantiated) of a per-model value: a tensor stored ``(M, *S)`` that
    every model holds its own ``S``-shaped part of (parameters, buffers, values computed from them). See
    ``batchlayers._per_model``."""


Tag = int | Lost | type[PerModel] | None


def get_tag(t: Tensor) -> Tag:
    return getattr(t, _ATTR, None)


def set_tag(t: Tensor, tag: Tag) -> None:
    # Attribute syntax, not setattr(): torch.compile traces a store to a tensor attribute, not the builtin.
    if tag is not None:
        t._batchlayers_models = tag  # type: ignore[attr-defined]  # our own attribute, unknown to Tensor's stubs
    elif getattr(t, _ATTR, None) is not None:
        del t._batchlayers_models  # type: ignore[attr-defined]


@dataclass
class SharedBuffer:
    """A buffer that the stacked model ``name`` stores once for all models, at ``path``, with its version
    counter's value after the last write the tracker allowed (None: an inference tensor, without one)."""

    path: str
    tensor: Tensor
    version: int | None
    name: str
    # stores it (M, *), tagged per-model, from this call on (see batchlayers._fold.FoldInputs.store_per_model)
    store_per_model: Callable[[], None]

    def unseen_write(self) -> bool:
        """Whether the buffer was written in place other than by writes the tracker allowed (untracked code)."""
        return self.version is not None and self.tensor._version != self.version


class Tracker(TorchFunctionMode):
    """The mode active during one stacked call (see the module docstring)."""

    def __init__(self, num_models: int, folded_sizes: Sequence[int]) -> None:
        super().__init__()
        self.num_models = num_models
        # M * B of the call's inputs, each once (inputs may hold different numbers of samples), and the first
        self.folded_sizes = tuple(folded_sizes)
        self.folded = self.folded_sizes[0]
        self.paused = 0  # > 0: passing calls through (under torch.compile; see pause())
        self.popped = 0  # > 0: off torch's mode stack (eager; see pause())
        self.size_read = False  # the folded size of a tagged tensor was read into an int
        self.eager_only = False  # refuse to be traced by torch.compile (see FoldInputs.tag_per_model)
        self.own_numbers = False  # an elementwise op was given each model's own number (see _each_models_values)
        self.picked = False  # this call picked rows of the samples by a mask (see _SELECTION)
        self.grad_enabled = torch.is_grad_enabled()  # at the start of the call (see refuse_checkpointing)
        # tensors that a .view() or reshape of a layer output copied where the original aliases, or the reverse
        # (see _view); any later in-place write to either would not reach the other, as it would in torch.
        self.copied_views = CopiedViews()
        # buffers stored once for all models, by storage address (see guard_shared_buffer)
        self.shared_buffers: dict[int, SharedBuffer] = {}
        # the custom autograd.Functions called, whose backward each model gets its own of (None: no gradients)
        self.functions: Calls | None = None  # made at the first call seen inside one, never while compiling
        # the torch.func transform level the call runs at (None: none); ops deeper run inside a transform entered
        # in forward (see _refuse_inside_transform)
        self.transform_level = _transform_level()

    def __enter__(self):
        self.numbers = open_call()  # the sizes read in this call (batchlayers._numbers.Call)
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            exited = super().__exit__(*exc_info)
            if self.functions is not None:
                self.functions.caller = self.functions.apply = None
                if self.functions.pending and sys.exc_info()[1] is None:
                    self.functions.settle()  # (off the mode stack: its reads of the outputs are not the forward's)
        finally:
            close_call(self.numbers)  # from here they are plain numbers (kept in caches, returned)
        return exited

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.paused:
            return func(*args, **kwargs)
        if self.eager_only and torch.compiler.is_compiling():
            raise RuntimeError(
                "batchlayers: this stacked model's own code uses per-model tensors, whose sizes torch.compile "
                "would read as the stored (M, *) ones; it runs without compiling (torch.compile falls back)"
            )
        if self.num_models > 1 and _transform_level() != self.transform_level and not torch.compiler.is_compiling():
            _refuse_inside_transform(func, args, kwargs)
        shaped, numbers, deferred = False, None, None
        tagged = _tagged(args, kwargs)
        function = None
        if self.grad_enabled and self.num_models > 1 and not torch.compiler.is_compiling():
            if not torch.is_grad_enabled():
                if self.functions is None:
                    self.functions = Calls(self.num_models)
                function = self.functions.op(self, func, args, kwargs, tagged)
            elif self.functions is not None and (self.functions.pending or self.functions.caller is not None):
                function = self.functions.grad_mode_on(func, tagged)
        if self.num_models > 1 and not isinstance(func, torch._ops.OpOverload):  # (a compiled graph's ops)
            numbers = _numbers_that_differ(args, kwargs)
            if numbers and func in _BATCH_LED_SIZES:
                numbers = _without_leading_batch(func, args, kwargs, numbers)
            if numbers and func in _VALUE_OPERANDS and _each_models_values(tagged, numbers):
                args, kwargs, numbers = _each_models_numbers(args), _each_models_numbers(kwargs), None
                self.own_numbers = True
            if numbers:
                if func in _OWN_POSITIONS:
                    deferred = numbers  # each model's own position in its samples, or refused below
                else:
                    self._refuse_numbers_that_differ(func, numbers)
                    shaped = func in _SHAPE_GIVING
        if deferred is not None and (not tagged or any(i.tag is PerModel for i in tagged)):
            self._refuse_numbers_that_differ(func, deferred)
        if self.copied_views.storages:
            self.copied_views.refuse_write(func, args, kwargs)
        written = None
        if self.shared_buffers:
            written = self._write_into_shared_buffer(func, args, kwargs, tagged)
            if written is None:  # a buffer just stored per model: the write is one into a per-model value
                tagged = _tagged(args, kwargs)
        if not tagged:
            if self.size_read and _ESCAPES.get(func, False) and self.num_models > 1:
                _refuse_escape_from_size(func, args, kwargs)
            out = func(*args, **kwargs)
            sized = _sized_dims(func, args, kwargs, out) if shaped else None
            if self.size_read and (numbers or _from_size_among(args, kwargs)):
                _mark_from_size(out)
            if self.size_read and func in _CREATORS:
                _CREATORS[func](self, out, sized, args[0] if args else None)
            if func is torch.arange and self.num_models > 1:
                _mark_positions(args, kwargs, out)
            elif func in _KEEPS_POSITIONS and args and isinstance(out, Tensor) and out.shape == args[0].shape:
                own = getattr(args[0], _POSITIONS, None)  # (torch.arange(B).clone(), .long(), .to(device))
                if own is not None:
                    out._batchlayers_positions = own  # (syntax: see set_tag)
            if isinstance(out, Tensor) and out.grad_fn is not None and not _untracked_among(args, kwargs):
                out._batchlayers_seen = True  # from a shared trainable tensor (see untracked)
        else:
            named = _torch_names(kwargs) if "axis" in kwargs or "keepdims" in kwargs else kwargs
            out = self._tracked(func, args, named, tagged, kwargs, deferred)
            sized = _sized_dims(func, args, kwargs, out) if shaped else None
            if self.size_read and _from_size_among(args, kwargs):
                _mark_from_size([o for o in _outputs(out) if get_tag(o) is None])  # (arange(B).type_as(h))
            if type(out) is tuple and self.num_models > 1 and not torch.compiler.is_compiling():
                out = Parts(out)  # (h.unbind(1), h.chunk(k, 1): not to be indexed by B)
        if sized:
            _check_sized(func, sized, out)
        elif numbers and tagged and func in _COUNTED_BY_SIZE and isinstance(get_tag(out), int):
            set_tag(
                out,
                Lost(
                    f"{_name(func)} by a size read from the models' samples (M * B, where each original model reads "
                    "its own B)",
                    wide=True,
                ),
            )
        elif (
            self.size_read
            and not tagged
            and (func in _SIZES or func is Tensor.__len__)
            and getattr(args[0], _FROM_SIZE, False)
        ):
            out = _marked_sizes_from_size(self, func, args, kwargs, out)
        for guard in written or ():
            if guard.version is not None:
                guard.version = guard.tensor._version
        if function is not None:
            self.functions.made(function, func, out)
        return out

    def _tracked(
        self, func, args: tuple, kwargs: dict, tagged: list[_In], given: dict, deferred: list | None = None
    ) -> object:
        """A call with tensors that carry the models' samples or per-model values; the rules read ``kwargs``
        by torch's names, ``func`` is called with the ``given`` ones."""
        out: Any
        if any(i.tag is PerModel for i in tagged):
            if isinstance(func, torch._ops.OpOverload):
                return func(*args, **given)  # a compiled graph running: its ops are on the stored tensors
            rows = self._per_model_rows(func, args, given, tagged) if self.picked else None
            return rows if rows is not None else _per_model.call(self, func, args, kwargs)
        if self.copied_views.versions:
            self.copied_views.check()
        if _ESCAPES.get(func, False) and self.num_models > 1:  # (one model: every value is its own)
            _refuse_escape(func, tagged)
        entry = _RULES.get(func)
        # rows picked by a mask (from the first h[mask] of the call on: other calls pay nothing for it)
        follows = (self.picked or func in _PICKS) and self.num_models > 1
        if follows and torch.compiler.is_compiling() and func in _PICKS and _picks_rows(func, args, kwargs):
            raise RuntimeError(
                "batchlayers: h[mask] picks rows of the models' samples, which batchlayers follows per model only "
                "without compiling; it runs without compiling (torch.compile falls back)"
            )
        follows = follows and not torch.compiler.is_compiling()
        before = [_selection_of(i.tensor) for i in tagged] if follows else []  # (an in-place call moves versions)
        if entry is not None and follows:
            selection = _reduced_selection(entry, args, kwargs, tagged, before)
            if selection is not None:
                return self._over_selection(entry.name, func, args, kwargs, selection)
        if entry is not None and entry.over_samples and entry.over_samples(entry.name, args, kwargs, tagged):
            return self._over_samples(entry.name, func, args, kwargs)
        computed = entry.compute(self, func, args, given, tagged) if entry is not None and entry.compute else None
        if computed is None and deferred:
            self._refuse_numbers_that_differ(func, deferred)
        if computed is not None:
            out = computed  # tagged by entry.compute
        elif func in _VIEWS:
            out = self._view(func, args, kwargs)
        elif func in _RESHAPES:
            out = reshape_of_another_layout(func, args, kwargs, self.copied_views, _holds_samples, _OTHER_RESHAPE)
        else:
            try:
                out = func(*args, **given)
            except RuntimeError as error:
                wide = next((i.tag for i in tagged if isinstance(i.tag, Lost) and i.tag.wide), None)
                if wide is None:
                    if type(error) is not RuntimeError or self.num_models == 1:
                        raise
                    # torch's own error (its type and message kept) for a shape only the folded batch has
                    raise RuntimeError(
                        f"{error}\n(batchlayers: in a stacked model's batched forward the models' samples are folded "
                        f"into one dimension, M * B = {self.folded_text()} rows where each original model has B; "
                        f"{_name(func)} got "
                        + ", ".join(
                            f"{tuple(i.shape)} (samples on dimension {i.tag})"
                            if isinstance(i.tag, int)
                            else str(tuple(i.shape))
                            for i in tagged
                        )
                        + ". Code that pairs the samples of one model with each other needs each model's B: stack "
                        "with execution='model_by_model')"
                    ) from error
                # (M * B, B) scores plus a (B, B) constant: torch's own shape error, with why the sizes differ
                raise ValueError(
                    f"batchlayers: {_name(func)} raised '{error}' on a tensor made by {wide.reason}. Stack with "
                    "execution='model_by_model' for this code"
                ) from None
        if args and isinstance(args[0], Tensor) and not torch.compiler.is_compiling() and args[0].is_inference():
            note_views(args[0], out)
        if isinstance(out, (tuple, list)) and torch.compiler.is_compiling():
            # torch.compile cannot store an attribute on the outputs of a multi-output op (split, sort): tag
            # views of them instead.
            out = type(out)([o.view(o.shape) if isinstance(o, Tensor) else o for o in out])
        if entry is None:
            lost = _first_lost(tagged) if all(isinstance(i.tag, Lost) for i in tagged) else None
            _tag_all(out, lost or Lost(f"{_name(func)} (batchlayers has no rule for it)"))
        elif computed is None:
            entry.rule(self, entry.name, args, kwargs, out, tagged)
        if follows:
            _follow_selection(self, func, entry, args, kwargs, out, tagged, before)
        if self.num_models > 1 and out is not (args[0] if args else None) and not torch.compiler.is_compiling():
            _note_picked_rows(out, tagged)
            if entry is not None and entry.rule in (_like_self, _elementwise):  # (dimensions kept where they were)
                _pass_samples_dim(out, tagged)
        if _SIZES.get(func, False) and self.num_models > 1 and not torch.compiler.is_compiling():
            out = _marked_sizes(func, args, kwargs, out, self.num_models)
        if self.num_models > 1 and not torch.compiler.is_compiling():  # (an eager check: it compares values)
            for written in written_tensors(func, args, kwargs):
                if base_of(written) is not None:
                    _refuse_lost_write_into_a_view(func, written, tagged)
        if torch.compiler.is_compiling() and _IN_PLACE.get(func, False) and args and isinstance(args[0], Tensor):
            # torch.compile traces the result of an in-place op (``x += y``, ``x.relu_()``) as another tensor
            # than its input, one without the input's tag: give back the input, as eager torch does.
            tag = get_tag(out)
            set_tag(args[0], get_tag(args[0]) if tag is None else tag)
            return args[0]
        return out

    def _view(self, func, args: tuple, kwargs: dict) -> Tensor:
        """``x.view(...)``, ``x.view_as(y)``. Batched layers may return their outputs in another memory format
        than torch.nn's (channels-last from a grouped convolution), where a view that the original allows has
        no strides: see :func:`view_of_a_copy`."""
        return view_of_a_copy(func, args, kwargs, self.copied_views, _holds_samples, _OTHER_FORMAT)

    def check_copied_views(self) -> None:
        self.copied_views.check()

    def guard_shared_buffer(
        self, path: str, buffer: Tensor, name: str, store_per_model: Callable[[], None]
    ) -> SharedBuffer:
        """Follow the in-place writes into a buffer that the stacked model ``name`` stores once because it was
        equal in every model (see :meth:`_write_into_shared_buffer`)."""
        version = None if buffer.is_inference() else buffer._version
        guard = SharedBuffer(path, buffer, version, name, store_per_model)
        address = _storage_address(buffer)
        if address:
            self.shared_buffers[address] = guard
        return guard

    def _write_into_shared_buffer(
        self, func: Callable, args: tuple, kwargs: dict, tagged: list[_In]
    ) -> list[SharedBuffer] | None:
        """An in-place write into a buffer stored once for all models (``self.steps += 1``, a view of it, or
        ``.data``): one of values that do not depend on the samples or per-model values keeps it equal in every
        model, as every original writes the same values into its own copy. One of per-model values into the
        buffer itself (an exponential moving average of ``x.mean(0)``) makes the models' copies differ: the
        buffer is stored per model from then on (:meth:`SharedBuffer.store_per_model`), and the caller runs the
        write as one into a per-model value. Any other is refused before it runs, so the buffer keeps its
        value. Returns the buffers written (their versions are taken after), None after storing one per
        model."""
        allowed: list[SharedBuffer] = []
        promoted = False
        for t in written_tensors(func, args, kwargs):
            guard = self.shared_buffers.get(_storage_address(t))
            if guard is None:
                continue
            if not tagged:
                allowed.append(guard)
                continue
            viewed = t is guard.tensor and _viewed(t)
            if t is guard.tensor and all(i.tag is PerModel for i in tagged) and not viewed:
                del self.shared_buffers[_storage_address(t)]
                guard.store_per_model()
                promoted = True
                continue
            if viewed:
                raise ValueError(
                    f"{guard.name}: forward writes {_name(func)} per-model values into the buffer '{guard.path}', "
                    "which the stacked model stores once because it was equal in every model; it would store it per "
                    "model from now on, but other tensors view it (a view taken in forward, such as "
                    "self.buffer.detach(), or kept in an attribute), which would keep the old value. Register a "
                    "batched counterpart for the module that owns it with batchlayers.register(...), or stack with "
                    "execution='model_by_model'"
                )
            samples = next((i for i in tagged if i.tag is not PerModel), None)
            raise ValueError(
                f"{guard.name}: forward writes {_name(func)} into "
                + (f"the buffer '{guard.path}'" if t is guard.tensor else f"a view of the buffer '{guard.path}'")
                + " values computed from "
                + ("the models' samples" if samples is not None else "per-model values")
                + ", but the stacked model stores that buffer once because it was equal in every model; one tensor "
                "cannot hold what differs per model. "
                + (
                    "A buffer written whole with per-model values (x.mean(0) or x.sum(0), a reduction over the "
                    "samples) is stored per model; "
                    if samples is not None or t is not guard.tensor
                    else ""
                )
                + "register a batched counterpart for the module that owns it with batchlayers.register(...), or "
                "stack with execution='model_by_model'"
            )
        return None if promoted else allowed

    def _over_samples(self, name: str, func, args: tuple, kwargs: dict) -> object:
        """A reduction over the models' samples (a loss, ``x.mean(0)``, ``x.max()``): each model's own, a
        per-model value (see ``batchlayers._per_model``)."""
        self.refuse_checkpointing(name)
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"batchlayers: {name} reduces over the models' samples, which gives per-model values whose "
                "sizes torch.compile would read as the stored (M, *) ones; it runs without compiling (torch.compile "
                "falls back). Compute losses from the (M, B, *) outputs outside forward to compile all of it"
            )
        out = _per_model.call(self, func, args, kwargs)
        indices = getattr(out, "indices", None)  # max(dim=...) and the like: positions within one model's samples
        if isinstance(indices, Tensor):
            set_tag(indices, Lost(f"the indices of {name} over the models' samples"))
        return out

    def _over_selection(self, name: str, func, args: tuple, kwargs: dict, selection: Selection) -> object:
        """A reduction or a loss over rows picked from the samples by a boolean mask (``h[mask].mean()``,
        ``F.cross_entropy(logits[mask], labels[mask])``): each model's own over its own rows (a per-model
        value), computed model by model on its block of the rows."""
        self.refuse_checkpointing(name)
        counts = selection.counts.tolist()
        results = []
        parts = [
            a.split(counts) if (picked := _selection_of(a)) is not None and selection.same(picked) else None
            for a in (*args, *kwargs.values())
        ]
        keys = list(kwargs)
        for i in range(self.num_models):
            own = [a if part is None else part[i] for a, part in zip((*args, *kwargs.values()), parts)]
            results.append(func(*own[: len(args)], **dict(zip(keys, own[len(args) :]))))
        if not all(isinstance(r, Tensor) for r in results):  # values and indices (h[mask].max(0)): not followed
            whole = func(*args, **kwargs)
            _tag_all(whole, Lost(f"{name} over rows picked from the models' samples by a mask"))
            return whole
        out = torch.stack(results)
        set_tag(out, PerModel)
        return out

    def _per_model_rows(self, func, args: tuple, given: dict, tagged: list[_In]) -> Tensor | None:
        """An elementwise op of per-model values and rows picked by a mask (``self.weight * h[mask]``, a norm
        written in Python on picked rows): each per-model value, shaped ``(M, *own)``, goes to every row of its
        own model (indexed by row), broadcast over the row as in the original model. None where this is not
        such a call (``_per_model.call`` then refuses the rows)."""
        entry = _RULES.get(func)
        rows = [i for i in tagged if i.tag is not PerModel]
        if entry is None or entry.rule is not _elementwise or not rows or "out" in given:
            return None
        if torch.compiler.is_compiling():
            return None
        picked = [_selection_of(i.tensor) if isinstance(i.tag, Lost) else None for i in rows]
        first = picked[0]
        if first is None or not all(p is not None and first.same(p) for p in picked[1:]):
            return None
        ndim, count = rows[0].tensor.dim(), rows[0].tensor.shape[0] if rows[0].tensor.dim() else None
        if count is None or any(i.tensor.dim() != ndim or i.tensor.shape[0] != count for i in rows):
            return None
        if _shared_rows((*args, *given.values()), ndim) or _any_marked((*args, *given.values())):
            return None  # (a size read from the samples left as it is: _per_model.call refuses it)
        model = first.row_models()

        def per_row(t: object) -> object:
            if not isinstance(t, Tensor) or get_tag(t) is not PerModel:
                return t
            own = tuple(t.shape[1:])
            if len(own) > ndim or (len(own) == ndim and own[0] != 1):
                raise _NotRowwise  # (broadcast against the rows' own dimension: no row of the original has it)
            own = (1,) * (ndim - len(own)) + own
            return t.reshape(self.num_models, *own[1:]).index_select(0, model.to(t.device))

        try:
            out = func(*(per_row(a) for a in args), **{k: per_row(v) for k, v in given.items()})
        except _NotRowwise:
            return None
        if not isinstance(out, Tensor) or out.dim() != ndim or out.shape[0] != count:
            return None
        set_tag(out, rows[0].tag)
        keep_picked_rows(out, first)
        return out

    def _refuse_numbers_that_differ(self, func: Callable, numbers: list[tuple[Any, object, bool]]) -> None:
        """A number that differs per model (a :class:`FoldedSize` ``B``, or ``B - 1``, ``1 / B``: see
        ``batchlayers._numbers``) given to torch anywhere but as the size of the models' samples (``y / B`` with
        ``y`` holding the samples, ``count += x.shape[0]`` into a buffer stored once, ``torch.full(shape, B)``):
        each original model would use its own. (An elementwise op is given that own number instead before
        this: see :func:`_each_models_values`.)"""
        values = _SIZE_TAKING.get(func)
        for number, where, top_level in numbers:
            if values is not None and isinstance(number, FoldedSize) and not (top_level and where in values):
                continue  # a size: reshapes, creation and indexing follow it
            own = f"{'reads' if isinstance(number, FoldedSize) else 'computes'} its own ({number.own})"
            raise ValueError(
                f"batchlayers: {_name(func)} uses the number {number}, {number.made} the size of a tensor that "
                f"holds the models' samples (M * B = {self.folded_text()} there), as a value (or as the size of "
                f"something else than the samples): each original model {own}. Compute it from the samples "
                "(x.mean(0), or x.sum(0) / x.size(0): a reduction over the samples is each model's own, and so "
                "is a size given with it), or stack with execution='model_by_model'"
            )

    def refuse_inside_transform(self, what: str) -> None:
        """Raise if a batched layer (``what``) is called inside a torch.func transform entered in forward: it
        would take the transform's wrapped tensors for the folded samples."""
        if self.num_models > 1 and _transform_level() != self.transform_level and not torch.compiler.is_compiling():
            raise ValueError(f"{what} is called {INSIDE_TRANSFORM}. {TRANSFORM_HELP}")

    def folded_text(self) -> str:
        """``M * B`` of the call, as ``2 * 3`` (``2 * 3 or 2 * 5`` for inputs with different numbers of samples)."""
        return " or ".join(f"{self.num_models} * {n // self.num_models}" for n in self.folded_sizes)

    def refuse_checkpointing(self, what: str) -> None:
        """Raise when ``torch.utils.checkpoint`` runs this part of the forward: it is recomputed in backward,
        outside the stacked call, where batched layers, per-model values and per-model reductions would not be
        followed (a silent wrong gradient, or an unclear error)."""
        if torch.compiler.is_compiling():
            return
        if inside_checkpoint(self.grad_enabled):
            raise ValueError(
                f"{what} runs inside torch.utils.checkpoint in a stacked model's forward: checkpointing recomputes "
                "it in backward, outside the stacked call, where batchlayers cannot follow it. Turn activation "
                "checkpointing off before stacking (transformers: model.gradient_checkpointing_disable())"
            )

    def pause(self) -> None:
        """Stop tracking until :meth:`resume`: batchlayers' own code (fold hooks, batched layers) runs
        untracked. In eager mode the mode leaves torch's mode stack, so that code pays nothing per op (an
        intercepted call costs about 1 us even when it only passes through); torch.compile, which cannot
        trace the stack being changed, gets a counter instead."""
        if self.popped:
            self.popped += 1
        elif torch.compiler.is_compiling() or torch.overrides._get_current_function_mode() is not self:
            self.paused += 1  # (also when user code pushed a mode of its own above this one)
        else:
            torch.overrides._pop_mode()
            self.popped = 1

    def resume(self) -> None:
        if self.popped:
            self.popped -= 1
            if not self.popped:
                torch.overrides._push_mode(self)
        else:
            self.paused -= 1


@dataclass
class _In:
    """A tagged tensor argument, with its shape before the call (in-place ops change it)."""

    tensor: Tensor
    tag: int | Lost
    shape: torch.Size


def _tagged(args: Sequence, kwargs: dict) -> list[_In]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            tag = getattr(a, _ATTR, None)
            if tag is not None:
                found.append(_In(a, tag, a.shape))
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    tag = getattr(b, _ATTR, None)
                    if tag is not None:
                        found.append(_In(b, tag, b.shape))
    return found


def _numbers_that_differ(args: Sequence, kwargs: dict) -> list[tuple[Any, object, bool]]:
    """``(number, position or keyword, top level)`` of every number among the arguments (in lists, tuples
    and slices too) that differs per model (see ``batchlayers._numbers``)."""
    found: list[tuple[Any, object, bool]] = []
    for where, a in enumerate(args) if not kwargs else (*enumerate(args), *kwargs.items()):
        if type(a) in _MARKED:
            if differs(a):
                found.append((a, where, True))
        elif isinstance(a, (list, tuple, slice)):
            for b in (a.start, a.stop, a.step) if isinstance(a, slice) else a:
                if type(b) in _MARKED:
                    if differs(b):
                        found.append((b, where, False))
                elif isinstance(b, (list, tuple, slice)):
                    for c in (b.start, b.stop, b.step) if isinstance(b, slice) else b:
                        if differs(c):
                            found.append((c, where, False))
    return found


_MARKED = frozenset({FoldedSize, FoldedInt, FoldedValue})

# Functions taking the whole size of a batch-first tensor they make, batch size first, beside a tensor that
# holds the samples on its first dimension (a spatial transformer's ``F.affine_grid(theta, img.size())``):
# (position, keyword) of that size.
_BATCH_LED_SIZES: dict[Callable, tuple[int, str]] = {F.affine_grid: (1, "size")}


def _without_leading_batch(
    func: Callable, args: Sequence, kwargs: dict, numbers: list[tuple[Any, object, bool]]
) -> list[tuple[Any, object, bool]]:
    """``numbers`` (see :func:`_numbers_that_differ`) less the first entry of ``func``'s size (see
    :data:`_BATCH_LED_SIZES`) where that is the folded batch read from the samples: the size of the samples'
    dimension, as each original model gives its own ``B``. Read anywhere else in the size, it stays."""
    position, key = _BATCH_LED_SIZES[func]
    size = _arg(args, kwargs, position, key)
    if not isinstance(size, (list, tuple)) or not size or type(size[0]) is not FoldedSize:
        return numbers
    if any(type(d) in _MARKED for d in size[1:]):
        return numbers  # (B read as another of its sizes too: refused)
    return [n for n in numbers if not (n[0] is size[0] and n[1] in (position, key))]


def _each_models_values(tagged: list[_In], numbers: list[tuple[Any, object, bool]]) -> bool:
    """Whether an elementwise op computes each element as its original model would with its own number in
    place of each number that differs per model (``h / x.size(0)``, ``x.sum(0) / x.size(0)``, ``count +
    x.shape[0]``): the numbers are arguments themselves (not in a list) and no tensor among them is
    :class:`Lost` but rows picked by a mask (see :data:`_SELECTION`). That own number is the same for every
    model (``B`` of ``M * B``), and an elementwise op computes every element alone, from the elements at its
    position: each element of its result is then its original model's, whether the tensors hold the samples,
    picked rows, per-model values or neither. (A tensor built from the read size alone, ``torch.arange(B)``,
    stays marked so, wherever it goes.)"""
    lost = (i for i in tagged if isinstance(i.tag, Lost))
    return all(_selection_of(i.tensor) is not None for i in lost) and all(top for _, _, top in numbers)


def _each_models_numbers(obj: Any) -> Any:
    """``obj`` (arguments or keyword arguments) with each number that differs per model replaced by each
    model's own (the same in every model: ``B`` of ``M * B``)."""
    own = lambda a: a.own if type(a) in _MARKED and differs(a) else a  # noqa: E731
    return {k: own(v) for k, v in obj.items()} if isinstance(obj, dict) else tuple(own(a) for a in obj)


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property: its getter is a method of the descriptor
        return f"Tensor.{getattr(getattr(func, '__self__', None), '__name__', '?')}"
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if (isinstance(owner, type) and "Tensor" in owner.__name__) or getattr(func, "__qualname__", "").startswith(
        "Tensor."
    ):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    return f"{'F' if 'functional' in module else 'torch'}.{name}"


def _outputs(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


# The in-place operator methods (``x += y``); not ``__iter__``, ``__int__``, ``__index__``, ``__invert__``
IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in "add sub mul truediv div pow and or xor floordiv mod matmul lshift rshift".split()
)


def in_place_name(name: str) -> bool:
    """Whether a torch function or method of this name writes into its first argument: ``mul_``,
    ``index_fill_``, ``__iadd__``."""
    return name in IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _in_place_functions() -> dict:
    """The in-place methods and functions, which return their first argument: ``Tensor.add_``,
    ``Tensor.__iadd__``, ``torch.relu_``, ``F.elu_``."""
    found = set()
    for namespace in (Tensor, torch, F):
        for name in dir(namespace):
            if in_place_name(name):
                found.add(getattr(namespace, name))
    return dict.fromkeys((f for f in found if callable(f)), True)  # a dict: torch.compile traces .get, not `in`


def _tag_all(out: object, tag: Tag) -> None:
    for o in _outputs(out):
        set_tag(o, tag)


def _first_lost(tagged: list[_In]) -> Lost | None:
    return next((i.tag for i in tagged if isinstance(i.tag, Lost)), None)


def _marked_sizes(func: Callable, args: tuple, kwargs: dict, out: object, num_models: int) -> object:
    """The sizes ``x.size()``, ``x.shape``, ``x.size(d)``, ``x.numel()`` returned with the ones that count the
    models' samples as :class:`FoldedSize`."""
    x = args[0] if args else None
    d = _samples_dim(x) if isinstance(x, Tensor) else None
    if d is None or isinstance(out, FoldedSize):
        return out
    if isinstance(out, torch.Size):
        return torch.Size([FoldedSize(n, num_models) if i == d else n for i, n in enumerate(out)])
    if type(out) is not int:
        return out
    if func is not torch.Tensor.size:  # numel
        return FoldedSize(out, num_models)
    dim = _arg(args, kwargs, 1, "dim", None)
    return FoldedSize(out, num_models) if dim is not None and _norm(dim, cast(Tensor, x).dim()) == d else out


# Set on a view of a tensor holding the samples that picked some of their rows (``y[0]``, ``y.narrow(0, 0, 1)``,
# ``y[:, :4].diagonal()``): Lost, its rows no model's; a write into it would reach some models' rows only.
_PICKED = "_batchlayers_picked"


def _note_picked_rows(out: object, tagged: list[_In]) -> None:
    """Mark the Lost outputs of a call that share storage with a tensor holding the samples (or with such a
    view): views that picked some of the samples' rows (see :data:`_PICKED`)."""
    for o in _outputs(out):
        if not isinstance(get_tag(o), Lost):
            continue
        address = _storage_address(o)
        for i in tagged:
            if i.tensor is not o and (isinstance(i.tag, int) or getattr(i.tensor, _PICKED, False)):
                if address and _storage_address(i.tensor) == address:
                    o._batchlayers_picked = True  # type: ignore[attr-defined]  # (syntax: see set_tag)
                    break


def _refuse_lost_write_into_a_view(func: Callable, written: Tensor, tagged: list[_In]) -> None:
    """An in-place write (``copy_``, ``x[...] = v``, ``out=``) into a view of a tensor that held the models'
    samples, of values whose rows cannot be assigned to models: the view's tag says so, but the tensor it
    views (``y`` after ``y[:, :2].copy_(...)``), or other views of it, would still claim per-model rows."""
    before = next((i.tag for i in tagged if i.tensor is written), None)
    after = get_tag(written)
    if getattr(written, _PICKED, False):
        # a view that picked some of the samples' rows (``y[0]``, ``y[:1]``, ``y.narrow(0, 0, 1)``): each original
        # writes its own rows, the folded write reaches one model's
        made = f", a view made by {before.reason}" if isinstance(before, Lost) else ""
        raise ValueError(
            f"batchlayers: {_name(func)} writes into part of a tensor that holds the models' samples{made}: each "
            "original model writes its own rows, here the write would reach only some "
            "models' rows. Compute it out of place (torch.where, a mask), or stack with execution='model_by_model'"
        )
    if not isinstance(before, int) or after == before:
        return
    if after is None and not _differs_along(written, before):
        return set_tag(written, before)  # a value the same for every sample (a constant) written into them
    what = f"values made by {after.reason}" if isinstance(after, Lost) else "values that differ along the models"
    raise ValueError(
        f"batchlayers: {_name(func)} writes {what} into part of a tensor that holds the models' "
        "samples: the tensor it is a view of would hold rows that cannot be assigned to models. Compute it out "
        "of place, or stack with execution='model_by_model'"
    )


def _refuse_escape(func: Callable, tagged: list[_In]) -> None:
    """A value computed from the models' samples leaving the tracked code: read into Python (a number, a
    bool, a list, an array, a comparison's answer) or handed to a gradient hook, which would see every
    model's gradient at once. One value for all models, where each original model reads its own: refused."""
    name = _name(func)
    lost = _first_lost(tagged)
    if lost is not None:
        what = f"a value computed from the models' samples ({lost.reason})"
    else:
        what = "a tensor that holds the models' samples (all models' samples folded into one batch)"
    raise ValueError(
        f"batchlayers: {name} reads {what} into Python in a stacked model's forward: every model would get "
        "one value, computed from all models' samples, where each original model reads its own. Keep it a "
        "tensor (torch.where instead of if; a mean, sum or count over the samples is each model's own), or "
        "stack with execution='model_by_model', which runs each model's forward on its own samples"
    )


def _refuse_escape_from_size(func: Callable, args: Sequence, kwargs: dict) -> None:
    """A value computed from a size read from the samples alone (``int(torch.arange(B).sum())``,
    ``torch.arange(B)[-1].item()``) read into Python: the folded size's value, where each original model reads
    its own ``B``'s."""
    alone = from_size_alone(args, kwargs)
    if alone is not None:
        raise ValueError(from_size_message(f"batchlayers: {_name(func)} reads into Python a tensor that", alone))


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# numpy's names that torch's argument parser takes for its own (``x.mean(axis=1, keepdims=True)``): the rules
# and per-model transforms read torch's.
_NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim"}


def _torch_names(kwargs: dict) -> dict:
    return {_NUMPY_NAMES.get(k, k): v for k, v in kwargs.items()}


def _arg(args: Sequence, kwargs: dict, index: int, name: str, default: object = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# ----------------------------------------------------------------------------------------------------------
# Rules: each sets the tags of ``out`` from the tagged inputs


def _broadcast_tag(ctx: Tracker, what: str, tensors: Sequence, out_shape: Sequence[int]) -> Tag:
    """The model dimension of a broadcasting combination of ``tensors`` (or probes) with result shape
    ``out_shape``."""
    n, dim = len(out_shape), None
    for t in tensors:
        tag = _tag_any(t)
        if tag is None:
            continue
        if isinstance(tag, Lost):
            return tag
        d = tag + n - t.dim()
        if not 0 <= d < n or out_shape[d] != t.shape[tag]:
            return Lost(f"{what} moves the models' samples to a dimension batchlayers cannot follow")
        if dim is None:
            dim = d
        elif dim != d:
            return Lost(f"{what} combines the models' samples along two different dimensions")
    if dim is None:
        return None
    for t in tensors:
        if isinstance(t, Tensor) and untracked(t):
            return Lost(f"{what} combines the models' samples with {UNTRACKED}")
        # A value computed from B alone (torch.arange(B).mean()) that does not span the samples: the same for
        # every sample, where each original model computes its own from its own B.
        if isinstance(t, Tensor) and getattr(t, _FROM_SIZE, False) and get_tag(t) is None:
            k = dim - (n - t.dim())
            if not (0 <= k < t.dim() and t.shape[k] == out_shape[dim]):
                return Lost(
                    f"{what} combines the models' samples with values computed from a size read from the models' "
                    f"samples alone (torch.arange(B), shape {tuple(t.shape)}), the same for every sample, where each "
                    "original model computes its own from its own B"
                )
    # An untagged operand that spans the model dimension (not broadcast over it) must be the same for every
    # sample along it, as a batch-sized constant is; otherwise each model would get another model's part.
    if any(isinstance(t, Tensor) and _differs_along(t, dim - (n - t.dim())) for t in tensors):
        return Lost(f"{what} combines the models' samples with a value that differs along the models")
    return dim


def _differs_along(t: Tensor, dim: int) -> bool:
    """An untagged ``t`` spans dimension ``dim`` (not broadcast over it) with values that are not the same
    all along it. A batch-sized constant does not; a sequence or per-sample indices of that length do."""
    if get_tag(t) is not None or not 0 <= dim < t.dim() or t.shape[dim] <= 1 or t.stride(dim) == 0:
        return False
    return not torch.equal(t, t.narrow(dim, 0, 1).expand_as(t))


def _broadcast_pairs(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """An elementwise op whose operands all hold the samples, on different dimensions once broadcast
    (``a[:, None] - b[None]``: pairs of samples, as in pairwise distances): each model's own, computed with
    every operand viewed ``(M, *one model's shape)`` so that broadcasting pairs each model's samples with its
    own; the result folds back on the first of those dimensions. None (the plain call, tagged by
    :func:`_elementwise`) where they hold them on one dimension, or where some operand does not hold them."""
    if len(tagged) < 2 or len({i.tag - len(i.shape) for i in tagged if isinstance(i.tag, int)}) < 2:
        return None  # (the common case, first: one dimension from the right, or fewer than two operands)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    if len(tensors) != len(tagged) or any(not isinstance(i.tag, int) for i in tagged) or "out" in kwargs:
        return None
    n = max(t.dim() for t in tensors)
    positions = {cast(int, i.tag) + n - i.tensor.dim() for i in tagged}
    m = ctx.num_models

    def per_model(a: object) -> object:
        return _per_model.explicit(a, m, n) if isinstance(a, Tensor) else a

    computed = func(*[per_model(a) for a in args], **{k: per_model(v) for k, v in kwargs.items()})
    if not isinstance(computed, Tensor) or computed.dim() != n + 1:
        return None  # (torch.equal: a bool) the plain call, as for any other form
    first = min(positions)
    computed = computed.movedim(0, first).flatten(first, first + 1)
    set_tag(computed, first)
    return computed


def _elementwise(ctx, name, args, kwargs, out, tagged) -> None:
    outs = _outputs(out)
    if not outs:
        return
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    tag = _broadcast_tag(ctx, name, tensors, outs[0].shape)
    _tag_all(out, tag)


def _like_self(ctx, name, args, kwargs, out, tagged) -> None:
    """Same shape as the tensor it is called on (casts, copies, unary functions, ``*_like``): the same tag."""
    x = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("input", tagged[0].tensor)
    _tag_all(out, get_tag(x))


def _dim_rule(position: int, key: str, default: int | tuple[int, ...] | None) -> Callable:
    """Ops along one ``dim`` keeping every other dimension (softmax, cumsum, sort, flip, ...)."""

    def rule(ctx, name, args, kwargs, out, tagged) -> None:
        first = tagged[0]
        lost = _first_lost(tagged)
        if lost is not None:
            return _tag_all(out, lost)
        dims = _arg(args, kwargs, position, key, default)
        if key == "dims" and len(args) > position + 1:  # x.flip(0, 1)
            dims = args[position:]
        if dims is None:
            return _tag_all(out, Lost(f"{name} over every dimension"))
        dims = [dims] if isinstance(dims, int) else list(dims)
        if first.tag in {_norm(d, len(first.shape)) for d in dims}:
            _tag_all(out, Lost(f"{name} along the dimension that holds the models' samples"))
            return _keep_samples_dim(out, first)
        if any(i.tag != first.tag or len(i.shape) != len(first.shape) for i in tagged):
            return _tag_all(out, Lost(f"{name} of tensors with the models on different dimensions"))
        # an untagged tensor argument (torch.diff's prepend) beside the samples must be the same for every sample
        others = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.dim() == len(first.shape)]
        if any(_differs_along(t, first.tag) for t in others):
            return _tag_all(
                out, Lost(f"{name} combines the models' samples with a value that differs along the models")
            )
        _tag_all(out, first.tag)

    return rule


# (dimension, shape) of a tensor made by an op along the samples' dimension that kept it (sort, cumsum, roll):
# its rows are no model's, but that dimension still counts the samples, so its size is read as the folded size
_SAMPLES_DIM = "_batchlayers_samples_dim"


def _keep_samples_dim(out: object, first: _In) -> None:
    """Note on each output of an op along the samples' dimension ``first.tag`` of ``first`` (``torch.sort(h,
    dim=0)``: Lost, its rows no model's) that kept that dimension as it was, that it still counts the samples:
    read, its size is each model's ``B`` folded (:func:`_samples_dim`), not a plain ``M * B``."""
    if torch.compiler.is_compiling():
        return  # (compiled, sizes are not marked: see Tracker.__torch_function__)
    d = cast(int, first.tag)
    for o in _outputs(out):
        if o.dim() == len(first.shape) and o.shape[d] == first.shape[d]:
            o._batchlayers_samples_dim = (d, tuple(o.shape))  # type: ignore[attr-defined]  # (syntax: see set_tag)


def _pass_samples_dim(out: object, tagged: list[_In]) -> None:
    """What :func:`_keep_samples_dim` noted, passed on to the Lost outputs of an elementwise call (or one
    computed like its input: ``.detach()``, ``.clone()``, ``+ 1``, ``.relu()``, a cast) that keep the shape of
    the tensor it was noted on: their dimension still counts the samples. (Any other call, a slice or a
    transpose, passes nothing on: a documented gap.)"""
    noted = [i for i in tagged if isinstance(i.tag, Lost) and getattr(i.tensor, _SAMPLES_DIM, None) is not None]
    if not noted:
        return
    for o in _outputs(out):
        if isinstance(get_tag(o), Lost) and getattr(o, _SAMPLES_DIM, None) is None:
            d, shape = getattr(noted[0].tensor, _SAMPLES_DIM)
            if tuple(o.shape) == shape == tuple(noted[0].shape):
                o._batchlayers_samples_dim = (d, shape)  # type: ignore[attr-defined]  # (syntax: see set_tag)


class _NotRowwise(Exception):
    """A per-model value that does not broadcast over rows picked by a mask (see ``Tracker._per_model_rows``)."""


# Rows picked from the samples by a boolean mask, ``h[mask]`` (``h`` and the mask holding the samples on
# dimension 0): they keep the folded batch's order, so each model's rows are one block, of that model's own
# count. The tag stays Lost (everything else refuses it as ever); a tensor that still holds exactly those rows
# carries a Selection too, checked against its version counter (any write into it, through a view too, drops
# it), so that reductions and losses over the rows can be computed per model (Tracker._over_selection), and
# the rows written back by the same mask (_writes_back).
_SELECTION = "_batchlayers_selection"
_PICKS = frozenset({Tensor.__getitem__, torch.masked_select, Tensor.masked_select})


@dataclass(frozen=True, eq=False)
class Selection:
    mask: Tensor
    version: int  # the mask's, when the rows were picked
    counts: Tensor  # (M,): each model's number of rows

    def same(self, other: Selection) -> bool:
        """The same rows: picked by one mask, or by two masks equal in every element (``labels != -100``
        computed twice), neither written since."""
        if self is other or (self.mask is other.mask and self.version == other.version):
            return True
        unchanged = self.mask._version == self.version and other.mask._version == other.version
        return unchanged and self.mask.shape == other.mask.shape and torch.equal(self.mask, other.mask)

    def row_models(self) -> Tensor:
        """``(K,)``: the model each picked row belongs to (the rows in the folded order, one block a model)."""
        return torch.repeat_interleave(torch.arange(len(self.counts), device=self.counts.device), self.counts)


def _selection_of(t: object) -> Selection | None:
    """The rows ``t`` holds, picked by a mask, while nothing has written into ``t`` since."""
    noted = getattr(t, _SELECTION, None) if isinstance(t, Tensor) else None
    if noted is None or noted[1] != cast(Tensor, t)._version:
        return None
    return noted[0]


def keep_picked_rows(t: Tensor, selection: Selection) -> None:
    """Note on ``t``, a new tensor, that it holds the rows ``selection`` picked (a batched layer's output on
    them: ``self.head(h[mask])``, see ``_fold.UnfoldLeafInputs``)."""
    setattr(t, _SELECTION, (selection, t._version))


def _one_selection(before: Sequence[Selection | None]) -> Selection | None:
    """The rows that every one of the tagged arguments held before the call (``before``), or None."""
    first = before[0] if before else None
    return first if first is not None and all(p is not None and first.same(p) for p in before) else None


def _follow_selection(ctx, func, entry, args, kwargs, out, tagged, before) -> None:
    """Note on the outputs the rows picked by a mask they hold (see :data:`_SELECTION`): ``h[mask]``, and an
    elementwise op whose operands holding samples all hold the same picked rows on dimension 0 (the others
    broadcast over them). Any other call's outputs hold none (an in-place one's included)."""
    outs = [o for o in _outputs(out) if isinstance(o, Tensor)]
    for o in outs:
        o.__dict__.pop(_SELECTION, None)
    picked = None
    if func in _PICKS and _picks_rows(func, args, kwargs) and len(outs) == 1:
        mask = cast(Tensor, args[1] if len(args) > 1 else kwargs["mask"])
        if not mask.is_inference():  # (inference tensors have no version counters to check a selection by)
            picked = Selection(mask, mask._version, mask.detach().reshape(ctx.num_models, -1).sum(1))
    elif entry is not None and entry.rule in (_like_self, _elementwise, _inplace_elementwise) and len(outs) == 1:
        picked = _same_selection(args, kwargs, tagged, before, outs[0])
    elif func in _ROWS_IN_PLACE and len(outs) == 1:
        picked = _rows_in_place(func, args, kwargs, tagged, before, outs[0])
    elif func in _JOINS and len(outs) == 1:
        picked = _rows_joined(func, args, kwargs, tagged, before, outs[0])
    elif entry is not None and len(outs) == 1 and outs[0].dim() > 0:
        picked = _rows_kept(entry, args, kwargs, tagged, before, outs[0])
    if picked is None or any(o.is_inference() for o in outs):
        return
    ctx.picked = True
    for o in outs:
        setattr(o, _SELECTION, (picked, o._version))


def _picks_rows(func: Callable, args: Sequence, kwargs: dict) -> bool:
    """``h[mask]``: a boolean mask holding the samples on dimension 0 over ``h``'s leading dimensions, ``h``
    holding them there too; ``h.masked_select(mask)`` with a mask of ``h``'s whole shape (its elements)."""
    operands = [*args, *(kwargs[k] for k in ("mask",) if k in kwargs)]
    if len(operands) != 2 or not isinstance(operands[0], Tensor) or not isinstance(operands[1], Tensor):
        return False
    x, mask = operands
    whole = func is Tensor.__getitem__ or mask.dim() == x.dim()
    return (
        whole
        and mask.dtype == torch.bool
        and get_tag(x) == 0
        and get_tag(mask) == 0
        and 1 <= mask.dim() <= x.dim()
        and mask.shape == x.shape[: mask.dim()]
    )


# Calls that only reshape, in row-major order: where dimension 0 keeps its size, each of its rows holds the same
# elements as before (row i is elements [i * R, (i + 1) * R) of both), so picked rows stay where they were.
_PURE_RESHAPES = frozenset(
    {
        Tensor.view,
        Tensor.view_as,
        Tensor.reshape,
        Tensor.reshape_as,
        torch.reshape,
        Tensor.unsqueeze,
        torch.unsqueeze,
        Tensor.squeeze,
        torch.squeeze,
        Tensor.flatten,
        torch.flatten,
        Tensor.unflatten,
        torch.unflatten,
    }
)
_SWAPS = frozenset(
    {Tensor.transpose, torch.transpose, Tensor.swapaxes, torch.swapaxes, Tensor.swapdims, torch.swapdims}
)
_ROWS_IN_PLACE = _PURE_RESHAPES | _SWAPS | {Tensor.permute, torch.permute, Tensor.__getitem__}


def _rows_in_place(
    func: Callable, args: Sequence, kwargs: dict, tagged: list[_In], before, out: Tensor
) -> Selection | None:
    """The rows picked by a mask that a reshape keeping dimension 0's size, a transposition or permutation of
    other dimensions, or an index that leaves dimension 0 whole (``h[:, :1]``, ``h[:, 0]``, ``h[:, None]``)
    keeps on ``out``'s dimension 0, each row where it was; None otherwise."""
    x = args[0] if args else None
    if not isinstance(x, Tensor) or x.dim() == 0 or out.dim() == 0:
        return None
    picked = next((p for i, p in zip(tagged, before) if i.tensor is x), None)
    if picked is None or _any_marked((*args[1:], *kwargs.values())):
        return None  # (a size read from the samples, M * B here, where each original model has its own B)
    if func in _PURE_RESHAPES:
        kept = out.shape[0] == x.shape[0] and out.numel() == x.numel()
    elif func in _SWAPS:
        dims = (_arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1"))
        kept = all(_is_int(d) and _norm(cast(int, d), x.dim()) != 0 for d in dims)
    elif func is Tensor.__getitem__:
        index = args[1] if len(args) > 1 else None
        kept = (
            isinstance(index, tuple)
            and bool(index)
            and isinstance(index[0], slice)
            and index[0] == slice(None)
            and all(i is None or i is Ellipsis or isinstance(i, slice) or _is_int(i) for i in index[1:])
        )
    else:  # permute
        order = args[1:] if len(args) > 2 or (len(args) == 2 and _is_int(args[1])) else _arg(args, kwargs, 1, "dims")
        kept = isinstance(order, (tuple, list)) and bool(order) and _is_int(order[0]) and _norm(order[0], x.dim()) == 0
    return picked if kept and out.shape[0] == x.shape[0] else None


_JOINS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack})


def _rows_joined(
    func: Callable, args: Sequence, kwargs: dict, tagged: list[_In], before, out: Tensor
) -> Selection | None:
    """The rows picked by a mask that every tensor given to ``torch.cat`` or ``torch.stack`` along another
    dimension than 0 holds (``torch.cat([r, self.proj(r)], -1)``): each row is joined with the same row of the
    others, and stays where it was; None otherwise (along dimension 0 the models' blocks would follow each
    other twice)."""
    tensors = _arg(args, kwargs, 0, "tensors")
    dim = kwargs.get("axis", _arg(args, kwargs, 1, "dim", 0))
    if not isinstance(tensors, (list, tuple)) or not tensors or type(dim) is not int:
        return None
    held = {id(i.tensor): p for i, p in zip(tagged, before)}
    first = held.get(id(tensors[0]))
    if first is None or not all(isinstance(t, Tensor) and t.dim() > 0 for t in tensors):
        return None
    if not all((p := held.get(id(t))) is not None and first.same(p) for t in tensors[1:]):
        return None
    ndim = tensors[0].dim() + (1 if func is torch.stack else 0)
    if _norm(dim, ndim) == 0 or out.dim() == 0 or out.shape[0] != tensors[0].shape[0]:
        return None
    return first


def _is_int(value: object) -> bool:
    """A plain int (not a bool, which indexes as a new dimension, nor a tensor)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _any_marked(values: Iterable[object]) -> bool:
    """Whether a number computed from a read size (``B``, ``B - 1``: see ``batchlayers._numbers``) is among
    ``values``, in a slice, a list or a tuple of them (where :func:`_numbers_that_differ` finds those that differ
    per model, this finds every one)."""
    for v in values:
        if type(v) in _MARKED:
            return True
        if isinstance(v, slice) and _marked_slice(v):
            return True
        if isinstance(v, (tuple, list)) and _any_marked(v):
            return True
    return False


def _same_selection(args: Sequence, kwargs: dict, tagged: list[_In], before, out: Tensor) -> Selection | None:
    """The rows picked by a mask that every tagged operand holds on dimension 0 as ``out`` does, where the
    untagged ones broadcast over those rows; None otherwise."""
    found = _one_selection(before)
    if found is None or any(len(i.shape) != out.dim() or i.shape[0] != out.shape[0] for i in tagged) or not out.dim():
        return None
    return None if _shared_rows((*args, *kwargs.values()), out.dim()) else found


def _shared_rows(values: Iterable[object], ndim: int) -> bool:
    """Whether a tensor holding no samples among ``values`` has rows of its own against picked rows of ``ndim``
    dimensions (as many values as rows: each row's own, from where?), where it should broadcast over them."""
    return any(isinstance(t, Tensor) and get_tag(t) is None and t.dim() == ndim and t.shape[0] != 1 for t in values)


def _rows_kept(entry: _Rule, args: Sequence, kwargs: dict, tagged: list[_In], before, out: Tensor) -> Selection | None:
    """The rows picked by a mask that a call computes row by row keeps on ``out``'s dimension 0: a reduction
    over other dimensions (``.sum(-1)``), ``softmax``/``log_softmax`` along another dimension, a loss with
    ``reduction='none'`` of operands that all hold those rows (one loss per row)."""
    first = _one_selection(before)
    if first is None or any(not i.shape or i.shape[0] != out.shape[0] for i in tagged):
        return None
    if any(isinstance(t, Tensor) and get_tag(t) is None and t.dim() > 0 and t.shape[0] == out.shape[0] != 1
           for t in (*args, *kwargs.values())):  # fmt: skip
        return None  # (per-row values from elsewhere)
    x = tagged[0].tensor
    if entry.name.split(".")[-1] in ("softmax", "log_softmax") and len(tagged) == 1 and x is args[0]:
        dim = _arg(args, kwargs, 1, "dim", None)
        return first if isinstance(dim, int) and _norm(dim, x.dim()) != 0 else None
    return first if _reduces_rows(entry, args, kwargs, tagged) is False else None


def _reduces_rows(entry: _Rule, args: Sequence, kwargs: dict, tagged: list[_In]) -> bool | None:
    """For a reduction of one tensor or a loss: whether it reduces dimension 0, the rows (a reduction over it,
    a loss with ``'mean'``, ``'sum'`` or ``'batchmean'``), or keeps them (a reduction over other dimensions,
    ``reduction='none'``); None for any other call."""
    if entry.rule is _reduction:
        x = args[0] if args else None
        if len(tagged) != 1 or tagged[0].tensor is not x or (len(args) > 1 and isinstance(args[1], Tensor)):
            return None  # (torch.max(a, b): elementwise)
        return 0 in _reduced_dims(entry.name, args, kwargs, cast(Tensor, x).dim())
    if entry.rule is _loss:
        return loss_arguments(getattr(F, entry.name.split(".")[-1]), args, kwargs)["reduction"] != "none"
    return None


def _reduced_selection(entry: _Rule, args: Sequence, kwargs: dict, tagged: list[_In], before) -> Selection | None:
    """The rows picked by a mask that a reduction over them (``h[mask].mean()``, ``.sum(0)``) or a loss of
    them (``'mean'``, ``'sum'``, ``'batchmean'``: every tagged tensor holding the same rows) reduces; None
    for any other call."""
    first = _one_selection(before)
    if first is None or kwargs.get("out") is not None or any(not i.shape for i in tagged):
        return None
    if entry.rule is _reduction and entry.name.split(".")[-1] not in _OF_VALUES:
        return None  # (argmax: an index)
    return first if _reduces_rows(entry, args, kwargs, tagged) else None


def _samples_dim(x: Tensor) -> int | None:
    """The dimension of ``x`` that counts the models' samples: its tag, or the one :func:`_keep_samples_dim`
    noted (while ``x`` keeps its shape)."""
    tag = get_tag(x)
    if isinstance(tag, int):
        return tag
    noted = getattr(x, _SAMPLES_DIM, None)
    return noted[0] if noted is not None and noted[1] == tuple(x.shape) else None


def _reduced_dims(name: str, args: Sequence, kwargs: dict, ndim: int) -> set[int]:
    position = 2 if name.endswith("norm") else 1  # norm(p, dim, ...), every other one (dim, ...)
    dims = _arg(args, kwargs, position, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return set(range(ndim))
    return {_norm(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)}


# Reductions of values: over the samples, each model's own (a per-model value). The sizes code pairs a sum
# with (``x.sum(0) / x.size(0)``) are M times one model's; given to an elementwise op they are each model's own
# (_each_models_values), anywhere else refused. Indices over the folded
# batch (argmax, argmin) are positions among every model's samples: those stay reductions over all of them,
# refused where they meet the samples, a per-model value or the output.
_OF_VALUES = {"mean", "nanmean", "sum", "nansum", "prod", "logsumexp", "count_nonzero", "norm", "vector_norm",
              "amax", "amin", "max", "min", "median", "nanmedian", "mode", "std", "var", "std_mean", "var_mean",
              "aminmax", "all", "any", "_is_all_true"}  # fmt: skip


def _reduces_samples(name, args, kwargs, tagged) -> bool:
    """Over-samples check of reductions: one of values over the samples' dimension (among others)."""
    first = tagged[0]
    if (len(args) > 1 and isinstance(args[1], Tensor)) or not isinstance(first.tag, int) or len(tagged) > 1:
        return False
    if name.split(".")[-1] not in _OF_VALUES:
        return False
    return first.tensor is args[0] and first.tag in _reduced_dims(name, args, kwargs, len(first.shape))


def _reduction(ctx, name, args, kwargs, out, tagged) -> None:
    first = tagged[0]
    if len(args) > 1 and isinstance(args[1], Tensor):  # torch.max(a, b) and the like: elementwise
        return _elementwise(ctx, name, args, kwargs, out, tagged)
    if isinstance(first.tag, Lost):
        return _tag_all(out, first.tag)
    ndim = len(first.shape)
    reduced = _reduced_dims(name, args, kwargs, ndim)
    d = first.tag
    if d in reduced:  # indices, or a tagged tensor among other arguments (torch.sum(x, dim=d, out=buf))
        return _tag_all(out, Lost(f"{name} over the models' samples"))
    outs = _outputs(out)
    keepdim = bool(outs) and outs[0].dim() == ndim
    _tag_all(out, d if keepdim else d - sum(r < d for r in reduced))


def _paired_reduction(dim_of: Callable[[Sequence, dict], int]) -> Callable:
    """Two operands broadcast together and reduced along one dimension of the result, ``dim_of(args,
    kwargs)``: ``cosine_similarity`` (its ``dim``) and ``pairwise_distance`` (the last, ``keepdim``)."""

    def rule(ctx, name, args, kwargs, out, tagged) -> None:
        outs = _outputs(out)
        if not outs:
            return
        tensors = [t for t in (_arg(args, kwargs, 0, "x1"), _arg(args, kwargs, 1, "x2")) if isinstance(t, Tensor)]
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        tag = _broadcast_tag(ctx, name, tensors, shape)
        if not isinstance(tag, int):
            return _tag_all(out, tag)
        reduced = _norm(dim_of(args, kwargs), len(shape))
        if reduced == tag:
            return _tag_all(out, Lost(f"{name} over the models' samples"))
        _tag_all(out, tag if outs[0].dim() == len(shape) else tag - (reduced < tag))

    return rule


def _packed(ctx, name, args, kwargs, out, tagged) -> None:
    """``pack_padded_sequence`` (and ``pack_sequence``): a PackedSequence's rows interleave the samples time step by
    time step, sorted by length over the folded batch, so no row is known to be one model's."""
    _tag_all(
        out,
        Lost(
            "torch.nn.utils.rnn.pack_padded_sequence, which sorts every model's samples together by length into "
            "one PackedSequence (pass the padded sequences, with their lengths as a mask, or stack with "
            "execution='model_by_model', which runs each model's PackedSequence exactly)"
        ),
    )


def _trailing(count: Callable[[Sequence, dict], int]) -> Callable:
    """Ops on the last ``count`` dimensions of ``args[0]`` (layer_norm, linear, pad, ...), the others kept as
    batch dimensions; other tensor arguments (weights) must not carry samples."""

    def rule(ctx, name, args, kwargs, out, tagged) -> None:
        x = args[0]
        tag = get_tag(x) if isinstance(x, Tensor) else None
        if any(i.tensor is not x for i in tagged):
            return _tag_all(out, Lost(f"{name} with weights computed from the models' samples"))
        if isinstance(tag, Lost):
            return _tag_all(out, tag)
        if tag is None or tag >= x.dim() - count(args, kwargs):
            return _tag_all(out, Lost(f"{name} over the dimension that holds the models' samples"))
        _tag_all(out, tag)

    return rule


def _batch_long(ctx, t: Tensor) -> bool:
    """An untagged ``t`` as long as the folded batch along a dimension, with values that differ along it
    (``linspace(0, 1, B)`` after ``B`` was read): each original model builds it with its own ``B``, so it
    is not one shared value (a table, boundaries) for every model. A fixed one that merely has ``M * B``
    entries is refused with it: which it is cannot be told."""
    return ctx.num_models > 1 and any(n in ctx.folded_sizes and _differs_along(t, d) for d, n in enumerate(t.shape))


def _bucketize(ctx, name, args, kwargs, out, tagged) -> None:
    """Element-wise in its input; the boundaries must be shared (not tagged, not built from the batch size)."""
    boundaries = _arg(args, kwargs, 1, "boundaries")
    if isinstance(boundaries, Tensor) and _batch_long(ctx, boundaries):
        return _tag_all(out, Lost(f"{name} by boundaries as long as the folded batch"))
    _trailing(lambda a, k: 0)(ctx, name, args, kwargs, out, tagged)


def _pad(ctx, name, args, kwargs, out, tagged) -> None:
    """``F.pad(x, pad)``: the pairs pad the last ``len(pad) // 2`` dimensions, the first pair the last one. A
    pair of zeros on the samples' dimension leaves it as it is (mobilebert pads ``[0, 0, 0, 1, 0, 0]``)."""
    x, pad = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "pad")
    tag = get_tag(x) if isinstance(x, Tensor) else None
    if any(i.tensor is not x for i in tagged):
        return _tag_all(out, Lost(f"{name} with a value computed from the models' samples"))
    if not isinstance(tag, int):
        return _tag_all(out, tag)
    pair = x.dim() - 1 - tag  # the pair that pads the samples' dimension
    if 2 * pair < len(pad) and (pad[2 * pair] != 0 or pad[2 * pair + 1] != 0):
        return _tag_all(out, Lost(f"{name} over the dimension that holds the models' samples"))
    _tag_all(out, tag)


def _batched_matrices(ctx, name, args, kwargs, out, tagged) -> None:
    """Linear algebra over the last two dimensions, batched over the others (``solve_triangular(A, B)``): the
    samples on a batch dimension of each operand that has them, never on a matrix's own dimensions."""
    outs = _outputs(out)
    if not outs:
        return
    if any(isinstance(i.tag, int) and i.tag >= len(i.shape) - 2 for i in tagged):
        return _tag_all(
            out, Lost(f"{name} over the dimensions of its matrices, one of which holds the models' samples")
        )
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    _tag_all(out, _broadcast_tag(ctx, name, tensors, outs[0].shape))


def _as_tensor(ctx, name, args, kwargs, out, tagged) -> None:
    """``torch.as_tensor(x, dtype=, device=)`` of a tensor: the same tensor (or a cast copy)."""
    data = args[0] if args else kwargs.get("data")
    _tag_all(out, get_tag(data) if isinstance(data, Tensor) else Lost(f"{name} of a list of tensors of samples"))


def _batch_first(ctx, name, args, kwargs, out, tagged) -> None:
    """Convolutions, pooling, resampling: dimension 0 is the batch; every other tensor argument must be a
    weight (untagged) or hold the same samples on dimension 0 (a grid, a target)."""
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    x = args[0] if args and isinstance(args[0], Tensor) else tagged[0].tensor
    if get_tag(x) != 0 or any(i.tag != 0 for i in tagged):
        return _tag_all(out, Lost(f"{name} needs the models' samples on dimension 0 (the batch)"))
    _tag_all(out, 0)


class MeanWithExpandedGradient(torch.autograd.Function):
    """``x.mean((-2, -1), keepdim=True)``, which is what ``F.adaptive_avg_pool2d(x, 1)`` computes, whose gradient
    is ``grad / (H * W)`` expanded over the pixels, a stride-0 view, not written out. torch's own gradient is
    that expand materialised contiguous; the backward of the activation before the pooling, which saved a
    channels-last result, then mixed two layouts (threshold_backward on (128, 16, 32, 32): 5.75 ms against
    176 us). From the expand it reads one value per channel and writes its result in the saved tensor's
    channels-last layout, with no full-size gradient made first (threshold_backward on (512, 32, 16, 16),
    2 threads: 0.53-0.57 ms, against 1.23-1.26 ms with the gradient first copied channels-last). The same
    numbers, differentiable again."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.shape = x.shape
        return x.mean((-2, -1), keepdim=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        height, width = ctx.shape[-2:]
        return (grad / (height * width)).expand(ctx.shape)


def _global_pool_channels_last(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``F.adaptive_avg_pool2d(x, 1)`` of a channels-last ``x`` that holds the samples and requires grad (a
    converted CNN's global pooling on the CPU, where the batched convolutions keep channels-last): through
    :class:`MeanWithExpandedGradient`. The benchmark's small CNN, training step at M=16: 113.8 -> 109.6 ms;
    its ResNet at M=4: 75.2 -> 74.0 ms (medians of three alternating rounds, 2 CPU cores), with the gradient
    copied channels-last; as an expand, 0.935-0.938x and 0.970x of that (alternating in one process). None (the
    plain call) otherwise."""
    x, size = args[0] if args else kwargs.get("input"), _arg(args, kwargs, 1, "output_size")
    if size not in (1, (1, 1), [1, 1]) or not isinstance(x, Tensor) or x.dim() != 4 or len(tagged) != 1:
        return None
    if get_tag(x) != 0 or not x.requires_grad or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    out = MeanWithExpandedGradient.apply(x)
    set_tag(out, 0)
    return out


def _tagged_by_own_rule(ctx, func, args, kwargs, tagged, out: Tensor | None) -> Tensor | None:
    """``out``, a compute rule's result for ``func`` (None: the plain call), tagged by ``func``'s own rule as the
    plain call's result would be."""
    if out is not None:
        entry = _RULES[func]
        entry.rule(ctx, entry.name, args, kwargs, out, tagged)
    return out


def _kept_relu(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``F.relu(x)``, ``torch.relu(x)``, ``x.relu()`` of a large tensor: through
    :func:`batchlayers.functional._kept.relu`, its result and gradient in kept memory, tagged as the plain
    call's. The benchmark's small CNN at M=16 and its ResNet at M=4 (2-core CPU): see that module. In place
    (``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``, ``torch.relu_``, ``x.relu_()``), through
    :func:`batchlayers.functional._kept.relu_`: its gradient in kept memory. None (the plain call) otherwise."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor):
        return None
    in_place = func in (torch.relu_, Tensor.relu_) or _arg(args, kwargs, 1, "inplace", False)
    out = _kept.relu_(x) if in_place else _kept.relu(x)
    return _tagged_by_own_rule(ctx, func, args, kwargs, tagged, out)


def _kept_max_pool2d(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``F.max_pool2d(x, ...)`` of a large batch of images that records gradients: through
    :func:`batchlayers.functional._kept.max_pool2d`, its input gradient in kept memory, tagged as the plain
    call's. None (the plain call) otherwise."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor) or len(tagged) != 1 or _arg(args, kwargs, 6, "return_indices", False):
        return None
    out = _kept.max_pool2d(
        x,
        _arg(args, kwargs, 1, "kernel_size"),
        _arg(args, kwargs, 2, "stride"),
        _arg(args, kwargs, 3, "padding", 0),
        _arg(args, kwargs, 4, "dilation", 1),
        _arg(args, kwargs, 5, "ceil_mode", False),
    )
    return _tagged_by_own_rule(ctx, func, args, kwargs, tagged, out)


def _explicit_short_attention(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``F.scaled_dot_product_attention`` over short sequences on the CPU: through
    :func:`batchlayers.functional._short_attention.attention` (faster than torch's flash kernel there, see that
    module), tagged as the plain call's. None (the plain call) otherwise."""
    out = _short_attention.attention(
        _arg(args, kwargs, 0, "query"),
        _arg(args, kwargs, 1, "key"),
        _arg(args, kwargs, 2, "value"),
        _arg(args, kwargs, 3, "attn_mask"),
        _arg(args, kwargs, 4, "dropout_p", 0.0),
        _arg(args, kwargs, 5, "is_causal", False),
        scale=kwargs.get("scale"),
        enable_gqa=kwargs.get("enable_gqa", False),
    )
    return _tagged_by_own_rule(ctx, func, args, kwargs, tagged, out)


def _recurrent(ctx, name, args, kwargs, out, tagged) -> None:
    """``torch.lstm/gru/rnn_tanh/rnn_relu(input, hx, params, ..., batch_first)``: the output has the samples
    on the batch dimension (0 if ``batch_first`` else 1), the states ``(layers, N, H)`` on dimension 1."""
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    if isinstance(args[1], Tensor) and args[1].dim() == 1 and not args[1].is_floating_point():
        return _tag_all(out, Lost(f"{name} of a PackedSequence (its rows interleave the samples by length)"))
    d = 0 if _arg(args, kwargs, 8, "batch_first", False) else 1
    x = args[0]
    states = [i for i in tagged if i.tensor is not x]
    if x.dim() != 3 or get_tag(x) != d or any(i.tag != 1 for i in states):
        return _tag_all(out, Lost(f"{name} needs the models' samples on the batch dimension of its input and states"))
    outs = _outputs(out)
    set_tag(outs[0], d)
    for o in outs[1:]:
        set_tag(o, 1)


def _multi_head_attention(ctx, name, args, kwargs, out, tagged) -> None:
    """``F.multi_head_attention_forward``: query/key/value ``(L, N, E)`` with the samples on dimension 1,
    masks ``(N, S)`` / ``(N * heads, L, S)`` on dimension 0; the output on 1, the weights ``(N, L, S)`` on 0."""
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    sequences = {id(a) for a in args[:3] if isinstance(a, Tensor)}
    for i in tagged:
        expected = 1 if id(i.tensor) in sequences else 0
        if i.tag != expected or (expected == 1 and i.tensor.dim() != 3):
            return _tag_all(out, Lost(f"{name} needs the models' samples on the batch dimension of every input"))
    attention, weights = out
    set_tag(attention, 1)
    if isinstance(weights, Tensor):
        set_tag(weights, 0)


def _bilinear(ctx, name, args, kwargs, out, tagged) -> None:
    """``F.bilinear(x1, x2, W, b)``: ``(N, *, H)`` inputs with the samples on one leading dimension."""
    x1, x2 = args[0], args[1]
    tags = {get_tag(x1), get_tag(x2)}
    if len(tags) != 1 or not isinstance(d := tags.pop(), int) or d >= x1.dim() - 1 or len(tagged) > 2:
        return _tag_all(out, _first_lost(tagged) or Lost(f"{name} of inputs with the samples on different dimensions"))
    _tag_all(out, d)


def _embedding_bag(ctx, name, args, kwargs, out, tagged) -> None:
    """``F.embedding_bag`` of ``(N, bag)`` indices: one bag per sample. Bags given by ``offsets`` into a
    flat index tensor are not followed."""
    x = args[0]
    if _arg(args, kwargs, 2, "offsets", None) is not None or x.dim() != 2:
        return _tag_all(out, _first_lost(tagged) or Lost(f"{name} with offsets (bags of any length)"))
    _batch_first(ctx, name, args, kwargs, out, tagged)


def _batch_norm(ctx, name, args, kwargs, out, tagged) -> None:
    training = _arg(args, kwargs, 5, "training", False)
    if training or any(i.tensor is not args[0] for i in tagged):
        return _tag_all(out, Lost("F.batch_norm in training mode mixes the samples of every model"))
    _batch_first(ctx, name, args, kwargs, out, tagged)


# keyword names of the operands of matmul and friends, in their positional order (``alibi.baddbmm(batch1=q,
# batch2=k)``)
_MATMUL_OPERANDS = ("input", "batch1", "batch2", "mat1", "mat2", "mat", "vec", "other")


def _matmul_operands(args: Sequence, kwargs: dict) -> list[Tensor]:
    """The tensor operands of a matrix product, positional or by keyword, in their positional order."""
    return [a for a in args if isinstance(a, Tensor)] + [
        kwargs[k] for k in _MATMUL_OPERANDS if isinstance(kwargs.get(k), Tensor)
    ]


def _matmul(ctx, name, args, kwargs, out, tagged) -> None:
    outs = _outputs(out)
    if not outs:
        return
    n = outs[0].dim()
    operands = _matmul_operands(args, kwargs)
    extra = None
    if name.split(".")[-1] in ("addmm", "baddbmm", "addbmm", "addmv"):
        extra, operands = operands[0], operands[1:]
    if len(operands) != 2:
        return _tag_all(out, Lost(f"{name} (batchlayers has no rule for this form)"))
    a, b = operands
    dims = []
    for t, role in ((a, "a"), (b, "b")):
        tag = _tag_any(t)
        if tag is None:
            continue
        if isinstance(tag, Lost):
            return _tag_all(out, tag)
        if t.dim() < 2:
            return _tag_all(out, Lost(f"{name} of a 1-D tensor holding the models' samples"))
        contracted = t.dim() - 1 if role == "a" else t.dim() - 2
        if tag == contracted:
            return _tag_all(out, Lost(f"{name} contracts the dimension that holds the models' samples"))
        if b.dim() == 1 and role == "a":
            dims.append(tag)  # (..., n, k) @ (k,) -> (..., n)
        elif a.dim() == 1 and role == "b":  # (k,) @ (..., k, m) -> (..., m): the k dimension goes
            dims.append(tag + n - (t.dim() - 1) if tag < t.dim() - 2 else n - 1)
        else:
            dims.append(tag + n - t.dim())
    if len(set(dims)) > 1:
        return _tag_all(out, Lost(f"{name} combines the models' samples along two different dimensions"))
    dim = dims[0] if dims else None
    # an untagged partner that spans the model dimension as a batch dimension must be the same all along it
    if dim is not None and dim < n - 2 and any(_differs_along(t, dim - (n - t.dim())) for t in (a, b)):
        return _tag_all(out, Lost(f"{name} combines the models' samples with a value that differs along them"))
    if extra is not None:
        combined = _broadcast_tag(ctx, name, [extra, _Probe(outs[0], dim)], outs[0].shape)
        return _tag_all(out, combined)
    _tag_all(out, dim)


def _contracts_samples(name, args, kwargs, tagged) -> bool:
    """Over-samples check of matrix products: ``a @ b`` (``matmul``, ``mm``, ``bmm``) whose two operands both
    hold the samples on the dimension it contracts (``h.T @ h``, a covariance or cross-correlation over the
    batch): a sum over the samples, each model's own (a per-model value), as ``x.sum(0)`` is."""
    if name.split(".")[-1] not in ("matmul", "__matmul__", "mm", "bmm") or len(tagged) != 2:
        return False
    operands = _matmul_operands(args, kwargs)
    if len(operands) != 2 or any(t.dim() < 2 for t in operands):
        return False
    a, b = operands
    return get_tag(a) == a.dim() - 1 and get_tag(b) == b.dim() - 2


def _within_each_model(position: int, key: str) -> Callable:
    """A function along one dimension (``softmax(x, dim)``) of the dimension that holds the models' samples:
    each model's along its own samples, computed on that dimension viewed ``(M, B)``, the result tagged as the
    input (a ``softmax(dim=1)`` of CLIP's ``logits_per_image``, whose columns are every model's texts).
    None for any other dimension (then the plain call, tagged by the rule)."""

    def compute(ctx, func, args, kwargs, tagged) -> Tensor | None:
        x = args[0] if args else kwargs.get("input")
        d = get_tag(x) if isinstance(x, Tensor) else None
        dim = _arg(args, kwargs, position, key)
        if len(tagged) != 1 or tagged[0].tensor is not x or not isinstance(d, int) or not isinstance(dim, int):
            return None
        if _norm(dim, x.dim()) != d:
            return None
        m = ctx.num_models
        per_model = _per_model.split_models(x, d, m)
        args, kwargs = list(args), dict(kwargs)
        if len(args) > position:
            args[position] = d + 1
        else:
            kwargs[key] = d + 1
        if args:
            args[0] = per_model
        else:
            kwargs["input"] = per_model
        out = func(*args, **kwargs).flatten(d, d + 1)
        set_tag(out, d)
        return out

    return compute


def _cat_within_each_model(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``torch.cat`` along the dimension that holds the models' samples, of tensors that all hold them there
    (two views of a batch encoded together, ``torch.cat([x1, x2])``; classifier-free guidance's ``cat([x,
    x])``): each original model joins its own samples, so each model's blocks are joined, model-major as
    ever. None (the plain call, refused by the rule) for any other form."""
    tensors, dim = _arg(args, kwargs, 0, "tensors"), _arg(args, kwargs, 1, "dim", kwargs.get("axis", 0))
    m = ctx.num_models
    if m == 1 or kwargs.get("out") is not None or not isinstance(dim, int) or not tensors:
        return None
    tags = {get_tag(t) if isinstance(t, Tensor) else None for t in tensors}
    d = tags.pop()
    if tags or not isinstance(d, int) or len(tagged) != len(tensors):
        return None
    ndim = tensors[0].dim()
    if any(t.dim() != ndim or t.shape[d] % m for t in tensors) or _norm(dim, ndim) != d:
        return None
    out = torch.cat([_per_model.split_models(t, d, m) for t in tensors], d + 1).flatten(d, d + 1)
    set_tag(out, d)
    return out


# Calls whose computation along the samples (see _slice_within_each_model, _split_within_each_model) takes a
# number computed from their size (``z[:B - 1]``, ``z.split([B - 1, B + 1])``) as each model's own position.
_OWN_POSITIONS = frozenset(
    {
        torch.Tensor.__getitem__,
        torch.split,
        torch.Tensor.split,
        torch.split_with_sizes,
        torch.Tensor.split_with_sizes,
        torch.tensor_split,
        torch.Tensor.tensor_split,
    }
)

# the sections argument of each split (position, name), the dimension's position and its default
_SPLITS = {
    "split": (1, "split_size_or_sections"),
    "split_with_sizes": (1, "split_sizes"),
    "chunk": (1, "chunks"),
    "tensor_split": (1, "indices_or_sections"),
}


def _split_within_each_model(ctx, func, args, kwargs, tagged) -> tuple[Tensor, ...] | None:
    """``split``, ``chunk``, ``tensor_split`` along the dimension that holds the models' samples (a batch of two
    views split back, ``z1, z2 = z.chunk(2)``): each original model splits its own samples, so each model's
    block is split alike and the parts joined model-major. They are copies where the original's are views: an
    in-place write to them or to the split tensor afterwards is refused (:class:`CopiedViews`). None (the
    plain call) for any other form, sections given by a size read from the samples included."""
    name = getattr(func, "__name__", "")
    x = args[0] if args else kwargs.get("input", kwargs.get("tensor"))
    d = get_tag(x) if isinstance(x, Tensor) else None
    m = ctx.num_models
    if m == 1 or name not in _SPLITS or not isinstance(d, int) or len(tagged) != 1 or tagged[0].tensor is not x:
        return None
    position, key = _SPLITS[name]
    sections = _arg(args, kwargs, position, key if func is not Tensor.split else "split_size")
    if sections is None and name == "tensor_split":  # (its overloads' keywords)
        sections = kwargs.get("sections", kwargs.get("indices"))
    dim = _arg(args, kwargs, position + 1, "dim", 0)
    numbers: list[int] = list(sections) if isinstance(sections, (list, tuple)) else [sections]
    if not isinstance(dim, int) or _norm(dim, x.dim()) != d or x.shape[d] % m:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):  # (a tensor: the plain call)
        return None
    # each original model's numbers: a size read from the samples (``z.split(B)``) is its own B
    own = [int(getattr(n, "own", n)) for n in numbers]
    given = own if isinstance(sections, (list, tuple)) else own[0]
    parts = getattr(torch, name)(_per_model.split_models(x, d, m), given, d + 1)
    outs = tuple(p.flatten(d, d + 1) for p in parts)
    for o in outs:
        set_tag(o, d)
    ctx.copied_views.record(
        (x, *outs), "a split along the samples' dimension, copies in the stacked model and views in the original"
    )
    return outs


def _slice_within_each_model(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``z[:B]``, ``z[B:]``, ``h[-1:]``, ``h[::2]`` along the dimension that holds the models' samples (the halves
    of classifier-free guidance's doubled batch, a batch's first rows): each original model slices its own
    samples by its own numbers (a size read from the samples is each model's ``B``; a plain int is the same in
    every model), so each model's block is sliced alike and the parts joined model-major. A copy where the
    original's is a view: an in-place write to it or to the sliced tensor afterwards is refused
    (:class:`CopiedViews`). None (the plain call, tagged by the rule) for any other index."""
    x, index = args[0], args[1]
    d, m = get_tag(x), ctx.num_models
    if m == 1 or not isinstance(d, int) or len(tagged) != 1 or tagged[0].tensor is not x or x.shape[d] % m:
        return None
    items = index if isinstance(index, tuple) else (index,)
    if not all(it is None or it is Ellipsis or isinstance(it, (int, slice)) for it in items):
        return None  # (index tensors and lists: the rule)
    if sum(it is Ellipsis for it in items) > 1:
        return None
    consumed = sum(it is not None and it is not Ellipsis for it in items)
    per_model: list[object] = []  # the index of x split into (M, B) on d
    in_dim = out_dim = 0
    position = None  # where the models' dimension lands in the result
    for it in items:
        if it is Ellipsis:
            skip = x.dim() - consumed
            if in_dim <= d < in_dim + skip:
                return None  # (d not sliced)
            per_model += [slice(None)] * skip
            in_dim, out_dim = in_dim + skip, out_dim + skip
        elif it is None:
            per_model.append(None)
            out_dim += 1
        elif in_dim == d:
            if not isinstance(it, slice):
                return None  # (one sample of the folded batch: the rule)
            if any(type(n) in _MARKED and not n.call.alive for n in (it.start, it.stop, it.step)):
                return None  # (a size read in an earlier call)
            bounds = [n.own if type(n) in _MARKED else n for n in (it.start, it.stop, it.step)]
            if it == slice(None) or not all(n is None or type(n) is int for n in bounds):
                return None
            per_model += [slice(None), slice(*bounds)]
            position = out_dim
            in_dim, out_dim = in_dim + 1, out_dim + 1
        else:
            if isinstance(it, slice) and _marked_slice(it):
                return None  # (another dimension by a size read from the samples: the rule refuses)
            if type(it) is bool or type(it) in _MARKED:
                return None
            per_model.append(it)
            in_dim += 1
            out_dim += isinstance(it, slice)
    if position is None:
        return None
    out = _per_model.split_models(x, d, m)[cast(tuple, tuple(per_model))].flatten(position, position + 1)
    set_tag(out, position)
    ctx.copied_views.record(
        (x, out), "a slice along the samples' dimension, a copy in the stacked model and a view in the original"
    )
    return out


def _pairs(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``a @ b`` where ``a`` holds the models' samples on its rows and ``b`` on its columns: scores over pairs
    of samples (CLIP's ``text @ image.T``, a Gram matrix ``x @ x.T``, per-head ``q @ k`` across the batch).
    Each original model pairs its own samples with its own, a ``(B_a, B_b)`` matrix; the folded product would
    pair every model's samples with every model's. So each model's block is computed on its own (one batched
    product over a model dimension), and the result holds the samples on its rows, model-major as any other
    tensor: row block ``i`` is model ``i``'s matrix, whose columns are that model's ``b`` samples. None (the
    call runs as it is, and :func:`_matmul` tags it) for any other form."""
    if kwargs or len(args) != 2 or not all(isinstance(t, Tensor) for t in args):
        return None
    a, b = args
    if a.dim() < 2 or b.dim() < 2 or get_tag(a) != a.dim() - 2 or get_tag(b) != b.dim() - 1:
        return None
    m = ctx.num_models
    rows = _per_model.split_models(a, -2, m)  # (..., M, B_a, k)
    columns = _per_model.split_models(b, -1, m).movedim(-2, -3)  # (..., M, k, B_b)
    out = torch.matmul(rows, columns).flatten(-3, -2)  # (..., M * B_a, B_b)
    set_tag(out, out.dim() - 2)
    return out


_ELLIPSIS = "..."
# One dimension's subscript in an einsum equation: a letter, or ("...", k) for the ellipsis dimension k places
# from the right (ellipsis dimensions broadcast like elementwise operands, aligned from the right).
_Label = str | tuple[str, int]


def einsum_operands(args: Sequence) -> list:
    """The operands of ``torch.einsum(equation, *operands)`` or of the older ``einsum(equation, [operands])``
    (the sublist form reaches the mode already turned into an equation by ``torch.functional.einsum``)."""
    operands = list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return operands


def einsum_labels(equation: str, ndims: Sequence[int]) -> tuple[list[list[_Label]], list[_Label]] | None:
    """Each operand's subscript per dimension and the output's, for operands of ``ndims`` dimensions; None for
    an equation this does not read (torch raises for most of those itself). Without ``->`` the output is the
    ellipsis dimensions, then the letters used once in ASCII order (torch's implicit output)."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None

    def expand(term: str, ndim: int) -> list[_Label] | None:
        head, dots, tail = term.partition(_ELLIPSIS)
        if any(c not in string.ascii_letters for c in head + tail):
            return None
        if not dots:
            return list(term) if len(term) == ndim else None
        k = ndim - len(head) - len(tail)
        return None if k < 0 else [*head, *((_ELLIPSIS, k - i) for i in range(k)), *tail]

    labels = [expand(term, n) for term, n in zip(terms, ndims)]
    if any(ls is None for ls in labels):
        return None
    inputs = cast(list[list[_Label]], labels)
    broadcast = max([0, *(sum(isinstance(x, tuple) for x in ls) for ls in inputs)])  # (max(default=): not traced)
    if arrow:
        out = expand(rhs, len(rhs.replace(_ELLIPSIS, "")) + (broadcast if _ELLIPSIS in rhs else 0))
        return None if out is None else (inputs, out)
    letters = [x for ls in inputs for x in ls if isinstance(x, str)]
    once = sorted(c for c in set(letters) if letters.count(c) == 1)
    return inputs, [*((_ELLIPSIS, broadcast - i) for i in range(broadcast)), *once]


def einsum_tag(name: str, operands: Sequence[Tensor], labels: Sequence[list[_Label]], out: list[_Label]) -> Tag:
    """Where the models' samples are in einsum's output. Model-major on output dimension ``d`` exactly when
    every operand holding samples holds them on one subscript ``L``, once, ``L`` is output dimension ``d``
    (so no sum runs over it), and every operand without samples that spans ``L`` is the same all along it:
    then output element ``l`` along ``d`` reads model ``l // n``'s samples at their own row on ``L``, and
    everything else it reads is that model's own or the same for every model. Per-model operands are
    ``batchlayers._per_model``'s (it calls this with one model's view)."""
    model: set[_Label] = set()
    for t, ls in zip(operands, labels):
        tag = get_tag(t)
        if tag is None or tag is PerModel:
            continue
        if isinstance(tag, Lost):
            return tag
        label = ls[cast(int, tag)]
        if ls.count(label) > 1:
            return Lost(f"{name} takes a diagonal along the dimension that holds the models' samples")
        model.add(label)
    if not model:
        return None
    if len(model) > 1:
        return Lost(f"{name} combines the models' samples along two different dimensions")
    (label,) = model
    if label not in out:
        return Lost(f"{name} sums over the dimension that holds the models' samples")
    for t, ls in zip(operands, labels):
        if get_tag(t) is None and any(x == label and _differs_along(t, k) for k, x in enumerate(ls)):
            return Lost(f"{name} combines the models' samples with a value that differs along them")
    return out.index(label)


def _einsum(ctx, name, args, kwargs, out, tagged) -> None:
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    operands = einsum_operands(args)
    parsed = None
    if args and isinstance(args[0], str) and not kwargs and all(isinstance(t, Tensor) for t in operands):
        parsed = einsum_labels(args[0], [t.dim() for t in operands])
    if parsed is None:
        return _tag_all(out, Lost(f"{name} (batchlayers has no rule for this form)"))
    _tag_all(out, einsum_tag(name, operands, *parsed))


def _einsum_over_samples(name, args, kwargs, tagged) -> bool:
    """Over-samples check of ``torch.einsum``: every operand holding samples holds them once, on one subscript
    that the output sums over (``"bc,bd->cd"``, a cross-correlation over the batch), and no other operand spans
    it: a sum over the samples, each model's own (a per-model value), as ``x.sum(0)`` is."""
    operands = einsum_operands(args)
    if kwargs or not args or not isinstance(args[0], str) or not all(isinstance(t, Tensor) for t in operands):
        return False
    if not all(isinstance(i.tag, int) or i.tag is PerModel for i in tagged):
        return False
    parsed = einsum_labels(args[0], [t.dim() for t in operands])
    if parsed is None:
        return False
    labels, out = parsed
    model = {ls[cast(int, get_tag(t))] for t, ls in zip(operands, labels) if isinstance(get_tag(t), int)}
    if len(model) != 1:
        return False
    (label,) = model
    spans = [ls.count(label) for t, ls in zip(operands, labels)]
    holds = [isinstance(get_tag(t), int) for t in operands]
    return label not in out and all(n == (1 if h else 0) for n, h in zip(spans, holds))


def _einsum_pairs(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``torch.einsum("nc,kc->nk", a, b)`` with the samples on ``n`` in ``a`` and on ``k`` in ``b``: scores
    over pairs of samples (MoCo's, CLIP's), each model's own, as :func:`_pairs` computes ``a @ b.T``: each
    tagged dimension is split into ``(M, B)`` under a new subscript for the models, shared by both operands
    and kept in the output just before ``n``, which it then folds back into. None (the plain call, tagged by
    :func:`_einsum`) for any other form: more or fewer operands, an ellipsis, or a subscript holding samples
    that the other operand has too or the output does not keep."""
    operands = einsum_operands(args)
    if kwargs or not isinstance(args[0], str) or len(operands) != 2 or len(tagged) != 2:
        return None
    if not all(isinstance(t, Tensor) and isinstance(get_tag(t), int) for t in operands):
        return None
    parsed = einsum_labels(args[0], [t.dim() for t in operands])
    if parsed is None:
        return None
    if any(not isinstance(x, str) for ls in (*parsed[0], parsed[1]) for x in ls):
        return None
    labels, out = cast(tuple[list[list[str]], list[str]], parsed)  # letters only, no ellipsis
    held = [ls[cast(int, get_tag(t))] for t, ls in zip(operands, labels)]
    for label, ls, other in ((held[0], labels[0], labels[1]), (held[1], labels[1], labels[0])):
        if ls.count(label) != 1 or label in other or label not in out:
            return None
    models = next(c for c in string.ascii_letters if c not in {*labels[0], *labels[1]})
    m = ctx.num_models
    split, terms = [], []
    for t, ls, label in zip(operands, labels, held):
        d = ls.index(label)
        split.append(_per_model.split_models(t, d, m))
        terms.append("".join(ls[:d]) + models + "".join(ls[d:]))
    first = out.index(held[0])
    result = "".join(out[:first]) + models + "".join(out[first:])
    computed = torch.einsum(f"{','.join(terms)}->{result}", *split).flatten(first, first + 1)
    set_tag(computed, first)
    return computed


def _cdist(ctx, name, args, kwargs, out, tagged) -> None:
    """``torch.cdist(x1, x2)``, ``(..., P, F)`` and ``(..., R, F)`` to ``(..., P, R)``: the samples on the
    rows of one operand stay on that dimension of the output (the two together: :func:`_cdist_per_model`)."""
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    x1 = _arg(args, kwargs, 0, "x1")
    dims = {cast(int, i.tag) - i.tensor.dim() for i in tagged}
    n = out.dim()
    if dims == {-2} and len(tagged) == 1:
        return _tag_all(out, n - 2 if get_tag(x1) is not None else n - 1)
    _tag_all(out, Lost(f"{name} along another dimension than the rows of the samples"))


def _cdist_per_model(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``torch.cdist`` with the samples on the rows (dimension -2) of either or both operands, computed with
    each model's rows as a batch: as many rows per call as each original model has, so the same algorithm
    (cdist computes by matrix products above 25 rows) and the same rounding; with both, each model's own
    pairs (as :func:`_pairs`)."""
    x1, x2 = _arg(args, kwargs, 0, "x1"), _arg(args, kwargs, 1, "x2")
    if not (isinstance(x1, Tensor) and isinstance(x2, Tensor)) or not all(i.tag == i.tensor.dim() - 2 for i in tagged):
        return None
    m = ctx.num_models
    split = [_per_model.split_models(t, -2, m) if get_tag(t) is not None else t.unsqueeze(-3) for t in (x1, x2)]
    rest = {k: v for k, v in kwargs.items() if k not in ("x1", "x2")}
    computed = func(*split, *args[2:], **rest)  # (..., M, P, R)
    d = computed.dim() - 3
    if get_tag(x1) is not None:
        computed, tag = computed.flatten(d, d + 1), d
    else:
        computed, tag = computed.movedim(d, -2).flatten(-2, -1), computed.dim() - 2
    set_tag(computed, tag)
    return computed


_CTC_OPERANDS = ("log_probs", "targets", "input_lengths", "target_lengths")


def _ctc_loss_per_model(ctx, func, args, kwargs, tagged) -> Tensor | None:
    """``F.ctc_loss`` of a folded batch, each model's own call on its samples: log-probabilities ``(T, M * B,
    C)`` (samples on dimension 1), lengths ``(M * B,)``, and targets padded per sample ``(M * B, S)`` or
    concatenated in the samples' order by a mask (``labels.masked_select(labels >= 0)``, wav2vec2's: each
    model's targets are one block of its own count, see :data:`_SELECTION`). ``(M,)`` per-model losses for
    ``'mean'`` and ``'sum'`` (torch's mean divides by each sample's target length, then averages over the
    model's own samples), each sample's for ``'none'``. None for anything else (refused as lost)."""
    log_probs, targets, input_lengths, target_lengths = (_arg(args, kwargs, i, n) for i, n in enumerate(_CTC_OPERANDS))
    m = ctx.num_models
    lengths = (input_lengths, target_lengths)
    if m == 1 or not isinstance(log_probs, Tensor) or log_probs.dim() != 3 or get_tag(log_probs) != 1:
        return None
    if not all(isinstance(t, Tensor) and t.dim() == 1 and get_tag(t) == 0 for t in lengths):
        return None
    if not isinstance(targets, Tensor):
        return None
    picked = _selection_of(targets) if targets.dim() == 1 else None
    if picked is not None:
        own_targets = targets.split(picked.counts.tolist())
    elif targets.dim() == 2 and get_tag(targets) == 0:
        own_targets = _per_model.split_models(targets, 0, m).unbind(0)
    else:
        return None
    ctx.refuse_checkpointing("F.ctc_loss")
    rest = {k: v for k, v in kwargs.items() if k not in _CTC_OPERANDS}
    own_log_probs = _per_model.split_models(log_probs, 1, m).unbind(1)
    own_inputs, own_lengths = (_per_model.split_models(t, 0, m).unbind(0) for t in lengths)
    own = [func(own_log_probs[i], own_targets[i], own_inputs[i], own_lengths[i], *args[4:], **rest) for i in range(m)]
    if own[0].dim():  # reduction='none': each sample's loss
        out = torch.cat(own)
        set_tag(out, 0)
    else:
        out = torch.stack(own)
        set_tag(out, PerModel)
    return out


def _ctc_loss(ctx, name, args, kwargs, out, tagged) -> None:
    """``F.ctc_loss`` that :func:`_ctc_loss_per_model` does not compute per model."""
    reason = f"{name} of other operands than a folded batch's log-probabilities, lengths and targets"
    _tag_all(out, _first_lost(tagged) or Lost(reason))


class _Probe:
    """Stands for an intermediate result with a known tag in :func:`_broadcast_tag`."""

    def __init__(self, like: Tensor, tag: Tag) -> None:
        self.shape, self._tag = like.shape, tag

    def dim(self) -> int:
        return len(self.shape)


def _tag_any(t: Tensor | _Probe) -> int | Lost | None:
    """The tag of a rule's tensor (or probe): never PerModel, as the tracker hands every call that sees a
    per-model tensor to ``_per_model.call`` instead of a rule."""
    return cast("int | Lost | None", t._tag if isinstance(t, _Probe) else get_tag(t))


def _sdpa(ctx, name, args, kwargs, out, tagged) -> None:
    """scaled_dot_product_attention: every dimension but the last two is a batch dimension."""
    tensors = [a for a in (*args[:4], kwargs.get("attn_mask")) if isinstance(a, Tensor)]
    for i in tagged:
        if isinstance(i.tag, int) and i.tag >= i.tensor.dim() - 2:
            return _tag_all(out, Lost("F.scaled_dot_product_attention over the dimension that holds the samples"))
    _tag_all(out, _broadcast_tag(ctx, "F.scaled_dot_product_attention", tensors, _outputs(out)[0].shape))


def _reshape(ctx, name, args, kwargs, out, tagged) -> None:
    """Row-major reshapes keep the order of elements: a model-major dimension ``d`` (M blocks of
    ``K = shape[d] * prod(shape[d+1:])`` consecutive elements, ``prod(shape[:d])`` times) is model-major in
    the result at the dimension ``d'`` whose prefix has the same product and whose size divides by M."""
    first = tagged[0]
    if first.tensor is not args[0]:  # x.view_as(y) with only y tagged: x's values, y's shape
        return _tag_all(out, None)
    if isinstance(first.tag, Lost):
        return _tag_all(out, first.tag)
    outs = _outputs(out)
    tag = _reshaped(first.tag, first.shape, outs[0].shape, ctx.num_models, name)
    if isinstance(tag, int) and ctx.num_models > 1 and not torch.compiler.is_compiling():
        tag = _given_size_counts_the_samples(name, args, kwargs, first.shape, tag)
    _tag_all(out, tag)


def _given_size_counts_the_samples(name: str, args: tuple, kwargs: dict, before: Sequence[int], k: int) -> Tag:
    """``x.view(B, -1)``, ``x.reshape(2, -1)``: the size a reshape is given for the dimension ``k`` that holds
    the models' samples must count them (``M`` times each original's), which a number read from them does (a
    :class:`FoldedSize`, ``-1``, or a size the reshape keeps) and a literal does not: with ``M = 2``,
    ``h.view(2, -1)`` would split the models where each original splits its batch in halves. Under
    torch.compile sizes are not marked, and this is not checked."""
    given = _given_sizes(name, args, kwargs, before)
    if given is None or k >= len(given):
        return k
    size = given[k]
    if size is None or isinstance(size, FoldedSize) or size == -1:
        return k
    given_as = "sizes" if name.endswith(".unflatten") else "shape"
    shown = tuple(_arg(args, kwargs, 2, "sizes") if given_as == "sizes" else given)
    return Lost(
        f"{name} with the {given_as} {shown}, whose size {size} on the dimension of the models' samples is a number, "
        "not a size read from them (x.size(0), or -1): each original model would get it as its own"
    )


def _given_sizes(name: str, args: tuple, kwargs: dict, before: Sequence[int]) -> list | None:
    """The sizes a reshape is given, one per dimension of its result (None: kept from the input); None
    where it is given none (``flatten``, ``squeeze``, ``view_as``) or another kind of argument (``view(dtype)``)."""
    if name.endswith(".unflatten"):
        dim, sizes = _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "sizes")
        if not isinstance(dim, int) or not isinstance(sizes, (list, tuple)):
            return None
        dim = _norm(dim, len(before))
        return [None] * dim + list(sizes) + [None] * (len(before) - dim - 1)
    if not (name.endswith(".view") or name.endswith(".reshape")):
        return None
    shape = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) else _arg(args, kwargs, 1, "shape")
    if shape is None:
        shape = kwargs.get("size")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) for n in shape):
        return None
    return list(shape)


def _reshaped(d: int, before: Sequence[int], after: Sequence[int], num_models: int, what: str) -> Tag:
    outer = math.prod(before[:d])
    prefix = 1
    for k, size in enumerate(after):
        if prefix == outer and size % num_models == 0 and size > 0:
            return k
        prefix *= size
        if prefix > outer:
            break
    return Lost(f"{what} to {tuple(after)} splits the models' samples across dimensions")


def _permutation(perm_of: Callable[[Sequence, dict, int], list[int]]) -> Callable:
    def rule(ctx, name, args, kwargs, out, tagged) -> None:
        first = tagged[0]
        if first.tensor is not args[0] or isinstance(first.tag, Lost):
            return _tag_all(out, first.tag)
        perm = perm_of(args, kwargs, len(first.shape))
        _tag_all(out, perm.index(first.tag))

    return rule


def _transpose_perm(args, kwargs, ndim) -> list[int]:
    a, b = _norm(_arg(args, kwargs, 1, "dim0"), ndim), _norm(_arg(args, kwargs, 2, "dim1"), ndim)
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _permute_perm(args, kwargs, ndim) -> list[int]:
    dims = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else _arg(args, kwargs, 1, "dims")
    return [_norm(d, ndim) for d in dims]


def _movedim_perm(args, kwargs, ndim) -> list[int]:
    src, dst = _arg(args, kwargs, 1, "source"), _arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src, dst = [_norm(s, ndim) for s in src], [_norm(s, ndim) for s in dst]
    rest = iter([k for k in range(ndim) if k not in src])
    placed = dict(zip(dst, src))
    return [placed[k] if k in placed else next(rest) for k in range(ndim)]


def _last_two_perm(args, kwargs, ndim) -> list[int]:
    perm = list(range(ndim))
    if ndim >= 2:
        perm[-1], perm[-2] = perm[-2], perm[-1]
    return perm


def _reverse_perm(args, kwargs, ndim) -> list[int]:
    return list(range(ndim))[::-1]


def _expand(ctx, name, args, kwargs, out, tagged) -> None:
    """expand, broadcast_to, repeat, tile: the input aligned to the right; repeating the model dimension
    would tile the models."""
    first = tagged[0]
    outs = _outputs(out)
    if first.tensor is not args[0] or not outs:  # x.expand_as(y), only y tagged: x broadcast along y's samples
        d = first.tag + outs[0].dim() - len(first.shape) if isinstance(first.tag, int) and outs else None
        uniform = d is not None and 0 <= d < outs[0].dim() and outs[0].stride(d) == 0
        return _tag_all(out, d if uniform else None)
    if isinstance(first.tag, Lost):
        return _tag_all(out, first.tag)
    d = first.tag + outs[0].dim() - len(first.shape)
    if outs[0].shape[d] != first.shape[first.tag] and ctx.num_models > 1:
        return _tag_all(out, Lost(f"{name} repeats the models' samples"))
    _tag_all(out, d)


def _diagonal(ctx, name, args, kwargs, out, tagged) -> None:
    """``x.diagonal(offset, dim1, dim2)`` (``torch.linalg.diagonal``'s dims: -2, -1): ``dim1`` and ``dim2`` go,
    their diagonal becomes the last dimension."""
    first = tagged[0]
    x = args[0] if args else kwargs.get("input", kwargs.get("A"))
    if isinstance(first.tag, Lost) or first.tensor is not x:
        return _tag_all(out, _first_lost(tagged) or Lost(name))
    n = len(first.shape)
    default = (-2, -1) if name == "torch.linalg.diagonal" else (0, 1)
    dims = {_norm(_arg(args, kwargs, 2 + k, f"dim{k + 1}", default[k]), n) for k in range(2)}
    if first.tag in dims:
        return _tag_all(out, Lost(f"{name} of the dimension that holds the models' samples"))
    _tag_all(out, first.tag - sum(k < first.tag for k in dims))


def _diag_embed(ctx, name, args, kwargs, out, tagged) -> None:
    """``torch.diag_embed(x, offset, dim1, dim2)``: the last dimension of ``x`` becomes the diagonal of
    dimensions ``dim1`` and ``dim2`` of the result (-2, -1), the others fill its remaining dimensions in order."""
    first = tagged[0]
    x = args[0] if args else kwargs.get("input", kwargs.get("A"))
    if isinstance(first.tag, Lost) or first.tensor is not x:
        return _tag_all(out, _first_lost(tagged) or Lost(name))
    n = len(first.shape) + 1
    dims = {_norm(_arg(args, kwargs, 2 + k, f"dim{k + 1}", -2 + k), n) for k in range(2)}
    if first.tag == n - 2:
        return _tag_all(out, Lost(f"{name} of the dimension that holds the models' samples"))
    _tag_all(out, [k for k in range(n) if k not in dims][first.tag])


def _repeat_interleave(ctx, name, args, kwargs, out, tagged) -> None:
    first = tagged[0]
    dim = _arg(args, kwargs, 2, "dim", None)
    repeats = _arg(args, kwargs, 1, "repeats", None)
    if isinstance(first.tag, Lost) or first.tensor is not args[0]:
        return _tag_all(out, first.tag if isinstance(first.tag, Lost) else Lost("Tensor.repeat_interleave"))
    if dim is None or isinstance(repeats, Tensor):
        return _tag_all(out, Lost(f"{name} without dim or with per-element repeats"))
    _tag_all(out, first.tag)  # repeating rows in place keeps each model's block contiguous


def _split(position: int, default: int | None) -> Callable:
    def rule(ctx, name, args, kwargs, out, tagged) -> None:
        first = tagged[0]
        if isinstance(first.tag, Lost) or first.tensor is not args[0]:
            return _tag_all(out, first.tag if isinstance(first.tag, Lost) else Lost(name))
        ndim = len(first.shape)
        dim = _norm(_arg(args, kwargs, position, "dim", default), ndim)
        if dim == first.tag:
            return _tag_all(out, Lost(f"{name} along the dimension that holds the models' samples"))
        if _numbers_that_differ(args[1:], kwargs):  # (a FoldedSize: other numbers that differ were refused)
            return _tag_all(out, _wide_index(name, dim))
        removes = name.endswith(("unbind", "select"))
        _tag_all(out, first.tag - (removes and dim < first.tag))

    return rule


_ONE_INDEX_FOR_ALL_ROWS = frozenset({"index_select", "index_add", "index_copy", "index_fill"})


def _index_dim(ctx, name, args, kwargs, out, tagged) -> None:
    """index_select / gather / scatter / index_add along ``dim`` (argument 1): the model dimension must
    be another one, and an index that carries samples must carry them on the same dimension."""
    first = get_tag(args[0])
    dim = _arg(args, kwargs, 1, "dim")
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    if first is None:
        index, table = _arg(args, kwargs, 2, "index"), args[0]
        if name.endswith("index_select") and isinstance(index, Tensor) and index.dim() == 1 and get_tag(index) == 0:
            # rows of a shared table looked up by the samples (m2m_100's sinusoidal positions): a lookup
            if _batch_long(ctx, table):
                return _tag_all(out, Lost(f"{name} of a shared table as long as the folded batch, by the samples"))
            return _tag_all(out, _norm(dim, table.dim()))
        return _tag_all(out, Lost(f"{name} of a shared tensor by the models' samples"))
    if _norm(dim, args[0].dim()) == first or any(i.tag != first for i in tagged):
        return _tag_all(out, Lost(f"{name} along the dimension that holds the models' samples"))
    index = _arg(args, kwargs, 2, "index")
    if name.rsplit(".", 1)[-1].rstrip("_") in _ONE_INDEX_FOR_ALL_ROWS:
        if get_tag(index) is not None:
            # a 1-D index picks the same entries for every row: picked by every model's samples at once
            return _tag_all(out, Lost(f"{name} by an index computed from the models' samples"))
        batch_sized = _batch_sized(ctx)
        if batch_sized is not None and isinstance(index, Tensor) and batch_sized(index):
            return _tag_all(out, _batch_long_index(name, _norm(dim, args[0].dim()), index))
    # gather's index, scatter's index and source, index_add's source: aligned with the input dimension by
    # dimension, row i with row i. Tagged or not, each must have the input's number of rows: another number
    # per model would pair one model's rows with another's, and fewer (which torch allows) would reach only
    # the first models' rows (an index built for one model's batch). An untagged one spanning the samples must
    # be the same for every sample (a batch-sized constant), not per-sample values (positions of the folded
    # batch).
    aligned = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, Tensor) and a.dim() == args[0].dim()]
    rows = args[0].shape[cast(int, first)]
    if any(t.shape[cast(int, first)] != rows for t in aligned):
        return _tag_all(out, Lost(f"{name} of tensors with different numbers of rows of the models' samples"))
    if not name.endswith("index_select") and any(_differs_along(t, cast(int, first)) for t in aligned):
        return _tag_all(out, Lost(f"{name} combines the models' samples with a value that differs along the models"))
    _tag_all(out, first)


def _data_sized(ctx, name, args, kwargs, out, tagged) -> None:
    """``nonzero``, ``masked_select``, ``unique``: a result whose size depends on every model's values."""
    lost = _first_lost(tagged)
    reason = lost.reason if lost is not None else f"{name} of the models' samples"
    _tag_all(out, Lost(reason, data_sized=True))


def _cat(ctx, name, args, kwargs, out, tagged) -> None:
    tensors = list(_arg(args, kwargs, 0, "tensors"))
    dim = _arg(args, kwargs, 1, "dim", 0)
    outs = _outputs(out)
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    stacking = name.endswith("stack")
    dim = _norm(dim, outs[0].dim())
    tags = {get_tag(t) for t in tensors if get_tag(t) is not None}
    if len(tags) > 1:
        return _tag_all(out, Lost(f"{name} of tensors with the models on different dimensions"))
    (d,) = cast("set[int]", tags)  # (Lost tags returned above)
    if dim == d and not stacking:
        return _tag_all(out, Lost(f"{name} along the dimension that holds the models' samples"))
    if any(_differs_along(t, d) for t in tensors):
        return _tag_all(out, Lost(f"{name} joins the models' samples with a value that differs along them"))
    _tag_all(out, d + (stacking and dim <= d))


def _getitem(ctx, name, args, kwargs, out, tagged) -> None:
    x, index = args[0], args[1]
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    d = get_tag(x)
    if d is None:  # a shared table looked up by a tensor that carries samples: table[idx]
        if isinstance(index, Tensor) and index.dtype != torch.bool and get_tag(index) is not None:
            return _tag_all(out, get_tag(index))
        return _tag_all(out, Lost("indexing a shared tensor with values computed from the models' samples"))
    if _per_sample_rows(x, index):
        return _tag_all(out, 0)
    if any(i.tensor is not x for i in tagged):
        masked = any(i.tensor is not x and i.tensor.dtype == torch.bool for i in tagged)
        return _tag_all(out, Lost("indexing by values computed from the models' samples", data_sized=masked))
    # (x is among the tagged: a Lost tag returned above)
    _tag_all(out, _index_position(x, index, cast(int, d), _batch_sized(ctx)))


def _per_sample_rows(x: Tensor, index: object) -> bool:
    """``x[torch.arange(B), idx]`` (a pooled token per sample) and ``mask[arange(B)[:, None, None, None],
    kv[None, None, None, :]]`` (transformers' mask building): the first index is the identity on the samples
    along its first dimension (size 1 elsewhere); every other index either is the same for every sample (size
    1 along that dimension, no samples) or holds each sample's own values there. Row ``i`` of the result (the
    broadcast index's first dimension) is then sample ``i``'s."""
    if get_tag(x) != 0 or not isinstance(index, tuple) or len(index) < 2:
        return False
    if not all(isinstance(i, Tensor) or i == slice(None) for i in index):
        return False  # (an int, None or Ellipsis among them moves the broadcast dimensions)
    first, rest = index[0], [i for i in index[1:] if isinstance(i, Tensor)]
    n = x.shape[0]
    if not isinstance(first, Tensor) or get_tag(first) is not None or first.dim() < 1:
        return False
    if first.shape[0] != n or first.numel() != n or first.dtype.is_floating_point or first.dtype == torch.bool:
        return False
    k = first.dim()
    for i in rest:
        if i.dtype == torch.bool or i.dim() > k:
            return False
        lead = i.shape[0] if i.dim() == k else 1  # its size along the broadcast first dimension
        tag = get_tag(i)
        if (tag is None and lead != 1) or (tag is not None and (tag != 0 or lead != n)):
            return False
    return torch.equal(first.flatten(), torch.arange(n, device=first.device, dtype=first.dtype))


def _wide_index(name: str, dim: int) -> Lost:
    return Lost(
        f"{name} of dimension {dim}, which does not hold the models' samples, by a size read from them (M * B where "
        "each original model reads its own B)",
        wide=True,
    )


def _batch_long_index(name: str, dim: int, index: Tensor) -> Lost:
    return Lost(
        f"{name} of dimension {dim}, which does not hold the models' samples, by an index of shape "
        f"{tuple(index.shape)}, as long as the folded batch (M * B): one made from the size read from the samples "
        "(torch.arange(B)) would be each original model's own B long",
        wide=True,
    )


# Untagged tensors made with a size read from the samples (``torch.arange(B)``) or computed from such a tensor
# without any that holds samples (``torch.arange(B) % 4``, ``.unsqueeze(0)``) carry this attribute: a dimension of
# theirs as long as the folded batch is then known to be M times each original model's, not a sequence that
# merely has M * B entries (``torch.arange(T)`` with T == M * B, exact as it is).
_FROM_SIZE = "_batchlayers_from_size"


def _mark_from_size(out: object) -> None:
    for o in _outputs(out):
        o._batchlayers_from_size = True  # type: ignore[attr-defined]  # (syntax: see set_tag)


def _from_size_among(args: Sequence, kwargs: dict) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            if getattr(a, _FROM_SIZE, False):
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(b, Tensor) and getattr(b, _FROM_SIZE, False) for b in a):
            return True
    return False


UNTRACKED = (
    "a tensor computed by code that batchlayers does not see (a torch.jit.script function, torch.vmap, "
    "Tensor.as_subclass, torch.Tensor(h), a DLPack round trip), so it cannot tell which model its values belong to"
)


def untracked(t: Tensor) -> bool:
    """A tensor with an autograd history but no tag, not made by a call the tracker saw (from a trainable tensor
    that all models share, a closure's): computed from the models' samples or per-model values by code the
    tracker never saw (every tensor the tracker sees made from them is tagged; the inputs, parameters and
    buffers are). Known only while gradients are recorded: under ``torch.no_grad()`` there is no history."""
    return (
        not torch.compiler.is_compiling()  # (dynamo cannot read grad_fn)
        and get_tag(t) is None
        and t.grad_fn is not None
        and not getattr(t, "_batchlayers_seen", False)  # computed here from a trainable tensor all models share
    )


def _tensors_among(args: Sequence, kwargs: dict) -> Iterable[Tensor]:
    """The tensors among the arguments, and those in a list or tuple argument (``torch.cat([a, b])``)."""
    for a in (*args, *kwargs.values()):
        for b in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(b, Tensor):
                yield b


def _untracked_among(args: Sequence, kwargs: dict) -> bool:
    """Whether a tensor among the arguments is :func:`untracked`: what an op makes from it is untracked too, not
    a value all models share that the tracker saw made."""
    return any(untracked(t) for t in _tensors_among(args, kwargs))


_transform_level = torch._C._functorch.maybe_current_level  # the innermost torch.func transform's level, or None


def _refuse_inside_transform(func: Callable, args: Sequence, kwargs: dict) -> None:
    """Raise if ``func`` runs inside a torch.func transform (``torch.vmap``, ``torch.func.grad``, ``jacrev``,
    ``vjp``, ...) entered in a stacked forward, on a tensor that holds the models' samples or a per-model value
    (seen through the transform's wrappers). The tracker sees the ops inside, on the transform's wrapped tensors,
    but not the transform: it cannot tell what its results hold. ``torch.vmap`` over the folded samples' features
    would reduce over every model's samples at once, over a per-model weight it would map over the models, and
    the results come back untagged, looking like values all models share.

    A tensor holding them that the transformed function reads from outside (not wrapped) is refused too:
    ``torch.vmap(lambda k: h[0, k])`` reads model 0's first sample for every model, and even transformers' mask
    functions' read, ``mask[b]`` mapped over ``b = torch.arange(B)``, which picks each sample's own row, returns
    the rows untagged, where a reduction over them (``.sum()``) would add every model's."""
    for t in _tensors_among(args, kwargs):
        read_from_outside = not _wrapped(t)
        t = _unwrapped(t)
        tag = get_tag(t)
        if tag is None and (read_from_outside or not untracked(t)):
            continue
        held = "a per-model value" if tag is PerModel else "the models' samples"
        how = "that it reads from outside the transform " if read_from_outside else ""
        raise ValueError(
            f"batchlayers: {_name(func)} runs {INSIDE_TRANSFORM}, on a tensor {how}that holds {held} (shape "
            f"{tuple(t.shape)}). {TRANSFORM_HELP}"
        )


def _wrapped(t: Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _unwrapped(t: Tensor) -> Tensor:
    """The tensor a torch.func transform's wrappers (any number of levels) wrap."""
    while _wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


INSIDE_TRANSFORM = (
    "inside a torch.func transform (torch.vmap, torch.func.grad, jacrev, vjp, ...) entered in a stacked model's forward"
)
TRANSFORM_HELP = (
    "batchlayers does not follow tensors through a transform: what it returns would pass for a value all models "
    "share (mapped over the folded samples' features it would reduce over every model's samples at once, mapped "
    "over a per-model value over the models). Call the transform outside the stacked model, or stack with "
    "execution='model_by_model'"
)


class Parts(tuple):
    """The parts of a tensor that holds the models' samples (``h.unbind(1)``, ``h.chunk(4, -1)``), as torch's
    tuple, which refuses to be indexed by a number that differs per model (``parts[B]`` with ``B = x.size(0)``:
    ``M * B`` in the folded forward, where each original model takes part ``B``). A plain tuple once copied."""

    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        for n in (index.start, index.stop, index.step) if isinstance(index, slice) else (index,):
            if differs(n):
                raise ValueError(
                    f"batchlayers: the parts of a tensor that holds the models' samples (a tuple of {len(self)}) "
                    f"are indexed by {n.folded()}, {n.where()}, where each original model takes its own "
                    f"({n.own}). Index by a number that does not come from the samples' size, or stack with "
                    "execution='model_by_model'"
                )
        return tuple.__getitem__(self, index)

    def __reduce__(self) -> tuple:
        return tuple, (tuple(self),)


def from_size_alone(args: Sequence, kwargs: dict) -> Tensor | None:
    """The first tensor among the arguments made from a size read from the samples without any tensor that holds
    them (``torch.arange(B).mean()``): the same for every model, where each original model computes its own
    from its own ``B``; None if there is none."""
    return next((t for t in _tensors_among(args, kwargs) if getattr(t, _FROM_SIZE, False) and get_tag(t) is None), None)


def from_size_message(what: str, t: Tensor) -> str:
    return (
        f"{what} (shape {tuple(t.shape)}) was computed from a size read from the models' samples alone "
        "(torch.arange(B) with B = x.size(0), which is M * B in the folded forward), the same for every model, "
        "where each original model computes its own from its own B. Compute it from the samples themselves, or "
        "stack with execution='model_by_model'"
    )


def _marked_sizes_from_size(ctx: Tracker, func: Callable, args: tuple, kwargs: dict, out: object) -> object:
    """``torch.arange(B).numel()``, ``.shape``: the sizes of a tensor built from a read size alone that are as
    long as the folded batch come back as :class:`FoldedSize` (M times each original model's), as read from the
    samples."""
    m, folded = ctx.num_models, ctx.folded_sizes
    if func is Tensor.__len__:
        n = cast(Tensor, args[0]).shape[0]
        if n in folded and m > 1:  # (len() makes any int it gets plain: refused, as for the samples themselves)
            where = f"read from the size of a tensor that holds the models' samples (M * B = {m} * {n // m} there)"
            raise TypeError(plain_number_message("len()", "a tensor made from that size", n, where, n // m))
        return out
    if isinstance(out, torch.Size):
        return torch.Size([FoldedSize(n, m) if n in folded else n for n in out])
    if type(out) is not int:
        return out
    x = cast(Tensor, args[0])
    dim = _arg(args, kwargs, 1, "dim", None) if func is torch.Tensor.size else None
    long = x.shape[_norm(dim, x.dim())] in folded if isinstance(dim, int) else any(n in folded for n in x.shape)
    return FoldedSize(out, m) if long and out % m == 0 else out


def _batch_sized(ctx: Tracker) -> Callable[[Tensor], bool] | None:
    """Whether an untagged tensor made from a size read from the samples has a dimension as long as the folded
    batch: used to index another dimension than the samples', it is ``M`` times each original model's."""
    if not ctx.size_read or ctx.num_models == 1:
        return None
    return lambda t: (
        get_tag(t) is None and getattr(t, _FROM_SIZE, False) and any(n in ctx.folded_sizes for n in t.shape)
    )


def _index_position(
    x: Tensor,
    index: object,
    d: int,
    batch_sized: Callable[[Tensor], bool] | None = None,
    name: str = "Tensor.__getitem__",
) -> Tag:
    """Where dimension ``d`` of ``x`` goes in ``x[index]``, or Lost if it is indexed into (or another dimension
    by a size read from the samples, or, where ``batch_sized`` says so, by an index as long as them)."""
    items = index if isinstance(index, tuple) else (index,)

    def advanced(it: object) -> bool:
        return isinstance(it, (list, Tensor)) and not (isinstance(it, Tensor) and it.dim() == 0)

    consumed = sum(_index_width(it) for it in items if it is not Ellipsis)
    if sum(advanced(it) for it in items) > 1:  # several may move their result dimensions to the front
        return Lost("indexing a tensor holding the models' samples with several index tensors")
    in_dim = out_dim = 0
    found = None  # where d went; the items after it are still checked
    for it in items:
        if it is Ellipsis:
            skip = x.dim() - consumed
            if in_dim <= d < in_dim + skip:
                found = out_dim + d - in_dim
            in_dim += skip
            out_dim += skip
        elif it is None:
            out_dim += 1
        elif isinstance(it, slice):
            if in_dim == d:
                full = it.step in (None, 1) and it.start in (None, 0) and (it.stop is None or it.stop >= x.shape[d])
                if not full:
                    return Lost("slicing into the dimension that holds the models' samples")
                found = out_dim
            elif any(isinstance(n, FoldedSize) for n in (it.start, it.stop, it.step)):
                return _wide_index(name, in_dim)
            in_dim += 1
            out_dim += 1
        elif advanced(it):  # one index tensor, list or mask: its result dimensions replace the ones it indexes
            width = _index_width(it)
            if in_dim <= d < in_dim + width:
                return Lost("advanced indexing into the dimension that holds the models' samples")
            if batch_sized is not None and isinstance(it, Tensor) and batch_sized(it):
                return _batch_long_index(name, in_dim, it)
            if isinstance(it, list) and _holds_a_folded_size(it):
                return _wide_index(name, in_dim)
            in_dim += width
            out_dim += 1 if isinstance(it, Tensor) and it.dtype == torch.bool else torch.as_tensor(it).dim()
        else:  # an int (or a 0-dim tensor) removes the dimension
            if in_dim == d:
                return Lost("indexing into the dimension that holds the models' samples")
            if isinstance(it, FoldedSize):
                return _wide_index(name, in_dim)
            in_dim += 1
    return found if found is not None else out_dim + d - in_dim  # (dimensions after the index keep their order)


def _holds_a_folded_size(items: list) -> bool:
    """Whether a (nested) index list holds a size read from the models' samples."""
    return any(_holds_a_folded_size(i) if isinstance(i, list) else isinstance(i, FoldedSize) for i in items)


def _index_width(it: object) -> int:
    """How many dimensions of the indexed tensor one index item consumes."""
    if it is None:
        return 0
    return it.dim() if isinstance(it, Tensor) and it.dtype == torch.bool else 1


def _setitem(ctx, name, args, kwargs, out, tagged) -> None:
    x, index, value = args[0], args[1], args[2]
    d = _tag_any(x)
    vtag = get_tag(value) if isinstance(value, Tensor) else None
    if isinstance(d, Lost):
        return
    if d is None:
        if vtag is not None:
            set_tag(x, Lost("writing the models' samples into a tensor shared by all models"))
        return
    if _fills_by_mask(x, index, value, d) or (d == 0 and _writes_back(x, index, value)):
        return set_tag(x, d)
    if d == 0 and _per_sample_rows(x, index) and _each_samples_value(value, x.shape[0]):
        return set_tag(x, d)  # x[torch.arange(B), labels] = 1 (a one-hot): sample i writes its own row i
    position = _index_position(x, index, d, _batch_sized(ctx), name)
    if isinstance(position, Lost):
        return set_tag(x, position if position.wide else Lost("writing into part of the models' samples (x[i] = ...)"))
    if isinstance(value, Tensor):
        view = x[index]
        tag = _broadcast_tag(ctx, "Tensor.__setitem__", [_Probe(view, position), value], view.shape)
        if tag != position:
            set_tag(x, tag if isinstance(tag, Lost) else Lost("writing samples of other models (x[...] = y)"))


def _each_samples_value(value: object, n: int) -> bool:
    """A value written at :func:`_per_sample_rows` positions that gives each sample its own: one number (or a
    0-dim tensor without samples) for all, or a tensor holding the ``n`` samples on its first dimension."""
    if isinstance(value, Tensor):
        tag = get_tag(value)
        return (value.dim() == 0 and tag is None) or (tag == 0 and value.dim() == 1 and value.shape[0] == n)
    return isinstance(value, (int, float, bool)) and not differs(value)


def _fills_by_mask(x: Tensor, index: object, value: object, d: int) -> bool:
    """``x[mask] = v`` with a boolean ``mask`` of ``x``'s shape holding the samples on ``x``'s dimension ``d``
    (or the same all along it) and one value ``v`` for every element (a number, or a 0-dim tensor without
    samples): ``x.masked_fill_(mask, v)``, elementwise (``torch.distributions.kl_divergence`` of two
    Categoricals sets ``t[(q.probs == 0).expand_as(t)] = inf``). Also a mask of ``x``'s leading dimensions
    (``h[row_mask] = v``, ``h[row_mask, 0] = v``: rows picked by each sample's own values, or the same for every
    sample) with a value the same for every row (a number, or a tensor without samples, shared by the models):
    each sample's own rows get it, as in each original model."""
    items = index if isinstance(index, tuple) else (index,)
    mask, rest = items[0], items[1:]
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() == 0:
        return False
    if mask.shape != x.shape[: mask.dim()] or (rest and mask.dim() == x.dim()):
        return False
    if not all(type(r) is int or (isinstance(r, slice) and not _marked_slice(r)) for r in rest):
        return False  # (ints and plain slices on the dimensions after the mask's)
    if isinstance(value, Tensor):
        if get_tag(value) is not None or getattr(value, _FROM_SIZE, False):
            return False
        if mask.dim() == x.dim() and value.dim() != 0:
            return False
    elif not isinstance(value, (int, float, bool)) or differs(value):
        return False
    tag = get_tag(mask)
    if tag is None:
        return d >= mask.dim() or not _differs_along(mask, d)
    return tag == d


def _writes_back(x: Tensor, index: object, value: object) -> bool:
    """``x[mask] = v`` with ``v`` holding the rows that ``mask`` picks (``h[mask] * 2``, ``y[mask]``: see
    :data:`_SELECTION`): every row goes back to the place it was picked from, each model's to its own."""
    picked = _selection_of(value)
    if picked is None or not _picks_rows(Tensor.__getitem__, (x, index), {}) or cast(Tensor, index).is_inference():
        return False
    mask = cast(Tensor, index)
    return picked.same(Selection(mask, mask._version, picked.counts))


def _masked_scatter(ctx, name, args, kwargs, out, tagged) -> None:
    """``x.masked_scatter(mask, source)`` (and ``masked_scatter_``) with ``source`` holding the rows that ``mask``
    picked (``h.masked_scatter(mask.unsqueeze(-1), self.norm(h[mask]))``, as higgs_audio_v2 writes its audio
    tokens back: see :data:`_SELECTION`): every row goes back where it was picked from, each model's to its own,
    so the result holds the samples as ``x`` does. Any other source or mask (fewer ones than rows: each
    original model would take its own first rows) leaves rows that cannot be assigned to models."""
    x, mask, source = args[0], _arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2, "source")
    result = x if name.endswith("_") else out
    if get_tag(x) == 0 and isinstance(mask, Tensor) and isinstance(source, Tensor) and _scatters_back(x, mask, source):
        return set_tag(result, 0)
    set_tag(result, Lost(f"{name} of values that are not the rows its mask picked"))


def _scatters_back(x: Tensor, mask: Tensor, source: Tensor) -> bool:
    """``mask`` is the mask that picked ``source``'s rows (or equal to it), over ``x``'s leading dimensions and
    broadcast along the rest, and each of ``source``'s rows fills one of ``x``'s rows (see :func:`_masked_scatter`)."""
    picked = _selection_of(source)
    if picked is None or mask.dtype != torch.bool or mask.is_inference() or mask.dim() != x.dim():
        return False
    d = picked.mask.dim()
    if mask.shape[:d] != x.shape[:d] or 0 in mask.shape[d:] or source.shape[1:] != x.shape[d:]:
        return False
    rows, ones = mask, (1,) * (mask.dim() - d)
    for _ in ones:
        rows = rows.select(-1, 0)  # (a view: mask's version counter)
    if mask.shape[d:] != ones and not torch.equal(mask, rows.view(rows.shape + ones).expand(mask.shape)):
        return False  # (not the same along the rows' own dimensions)
    return picked.same(Selection(rows, rows._version, picked.counts))


def _marked_slice(s: slice) -> bool:
    return any(type(n) in _MARKED for n in (s.start, s.stop, s.step))


def _inplace_elementwise(ctx, name, args, kwargs, out, tagged) -> None:
    """``x.add_(y)``, ``x += y``, ``x.copy_(y)``: ``x`` gets the combined tag."""
    x = args[0]
    tensors: list[Tensor | _Probe] = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    if name.endswith("copy_"):
        tensors = [_Probe(x, None), *tensors[1:]]
    set_tag(x, _broadcast_tag(ctx, name, tensors, x.shape))


def _size(ctx, name, args, kwargs, out, tagged) -> None:
    """``x.size()``, ``x.shape``, ``len(x)``: note when a size that holds the batch leaves a tagged tensor
    as an int (see "Sizes" in the module docstring)."""
    x = args[0]
    d = get_tag(x)
    if isinstance(d, Lost) and d.wide and ctx.num_models > 1:
        raise ValueError(
            f"batchlayers: {name} reads a size of a tensor made by {d.reason}: a number each original model reads "
            "as its own. Stack with execution='model_by_model' for this code"
        )
    if isinstance(d, Lost) and d.data_sized and ctx.num_models > 1:
        raise ValueError(
            f"batchlayers: {name} reads the size of a tensor computed from the models' samples ({d.reason}), "
            "which depends on the values of every model's samples: one number for all models, where each "
            "original model counts its own. Count with a tensor instead (mask.sum(...) per sample), or stack "
            "with execution='model_by_model'"
        )
    if not isinstance(d, int):
        return
    which = 0 if name.endswith("__len__") else _arg(args, kwargs, 1, "dim", None) if name.endswith("size") else None
    if which is None or _norm(which, x.dim()) == d:
        if name.endswith("__len__") and ctx.num_models > 1:
            # A TypeError, as Python's own for len() of what has none: list(x) and tuple(x), which ask len()
            # for a length hint only, go on without one (they iterate over the samples as before).
            raise TypeError(
                plain_number_message(
                    "len()",
                    "a tensor that holds the models' samples",
                    x.shape[0],
                    f"every model's samples (M * B = {ctx.num_models} * {x.shape[0] // ctx.num_models} there)",
                    x.shape[0] // ctx.num_models,
                )
            )
        ctx.size_read = True


def loss_arguments(fn: Callable, args: Sequence, kwargs: dict) -> dict:
    """A ``torch.nn.functional`` loss's arguments by name, with ``reduction`` resolved from the deprecated
    ``size_average``/``reduce`` where those are given. (By hand, not ``inspect``: torch.compile traces it.)"""
    bound = dict(zip(_LOSS_PARAMETERS[fn], args))
    bound.update(kwargs)
    size_average, reduce = bound.pop("size_average", None), bound.pop("reduce", None)
    if size_average is not None or reduce is not None:
        bound["reduction"] = torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    bound.setdefault("reduction", "mean")
    return bound


def _loss_over_samples(name, args, kwargs, tagged) -> bool:
    """Over-samples check of losses: a mean (``'mean'``, ``'batchmean'``) or a ``'sum'``, each model's own."""
    fn = getattr(F, name.split(".")[-1])
    if _first_lost(tagged) is not None or _per_sample_target(args, kwargs, tagged):
        return False
    return loss_arguments(fn, args, kwargs)["reduction"] in ("mean", "batchmean", "sum")


def _per_sample_target(args: Sequence, kwargs: dict, tagged: list[_In]) -> bool:
    """A loss's untagged target that differs along the folded batch (per-sample positions such as
    ``arange(B) % C`` after the folded size was read), where the input holds the samples on dimension 0."""
    target = _arg(args, kwargs, 1, "target")
    return all(i.tag == 0 for i in tagged) and isinstance(target, Tensor) and _differs_along(target, 0)


_POSITIONS = "_batchlayers_positions"
# copies and conversions that keep an arange(B)'s values (see _mark_positions)
_KEEPS_POSITIONS = {
    Tensor.clone, torch.clone, Tensor.contiguous, Tensor.detach, torch.detach, Tensor.to, Tensor.long, Tensor.int,
    Tensor.cpu, Tensor.cuda,
}  # fmt: skip


def _mark_positions(args: tuple, kwargs: dict, out: object) -> None:
    """``torch.arange(B)`` with ``B`` read from the samples: each original model's ``arange`` of its own
    ``B``, the positions of its samples. The folded tensor holds ``0 .. M*B - 1``, right as row indices into
    the folded samples (``x[torch.arange(B), last]``), which is how the rules take it; an attribute notes
    each model's ``B`` for the one use that needs each model's values, class targets (see
    :func:`_positions_as_targets`). A tensor computed from it is not marked."""
    given = [a for a in args if not isinstance(a, (torch.dtype, torch.device))]
    end = given[0] if len(given) == 1 else None
    if len(given) == 2 and type(given[0]) is int and given[0] == 0:  # arange(0, B)
        end = given[1]
    if (
        isinstance(end, FoldedSize)
        and not {"start", "end", "step", "out"} & kwargs.keys()
        and isinstance(out, Tensor)
        and out.dim() == 1
        and len(out) == end.folded()
    ):
        out._batchlayers_positions = end.one_model()  # type: ignore[attr-defined]  # (syntax: see set_tag)


def each_models_positions(ctx, obj: object) -> object:
    """``obj`` (arguments, nested) with each ``torch.arange(B)`` of a read ``B`` (see :func:`_mark_positions`)
    replaced by ``arange`` of one model's ``B``: what every original model holds, for a call on per-model
    values (``F.cross_entropy(scores.T, torch.arange(B))``, ``table[torch.arange(B)]``), which gives each
    model its own result."""
    if isinstance(obj, Tensor):
        own = getattr(obj, _POSITIONS, None)
        if own is None or get_tag(obj) is not None or len(obj) != own * ctx.num_models:
            return obj
        if not torch.equal(obj, torch.arange(len(obj), dtype=obj.dtype, device=obj.device)):
            return obj  # written in place since: not each model's arange any more
        return torch.arange(own, dtype=obj.dtype, device=obj.device)
    if isinstance(obj, (list, tuple)) and any(isinstance(o, Tensor) for o in obj):
        return type(obj)(each_models_positions(ctx, o) for o in obj)
    if isinstance(obj, dict):
        return {k: each_models_positions(ctx, v) for k, v in obj.items()}
    return obj


def _positions_as_targets(ctx, func, args, kwargs, tagged) -> object:
    """``F.cross_entropy(logits, torch.arange(B))``, ``B`` read from the samples: sample ``i``'s class is
    ``i`` (contrastive losses, where logits over pairs of samples score each sample against its own pair).
    Each original model's targets are ``arange`` of its own ``B``: they are given as such (each model's
    block counts from 0), and the loss is then followed as any loss with per-sample targets. None (the plain
    call) for any other target."""
    x, target = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
    own = getattr(target, _POSITIONS, None) if isinstance(target, Tensor) else None
    if own is None or get_tag(target) is not None or not isinstance(x, Tensor) or get_tag(x) != 0:
        return None
    if x.dim() < 1 or len(target) != x.shape[0] or len(target) != own * ctx.num_models:
        return None
    if not torch.equal(target, torch.arange(len(target), dtype=target.dtype, device=target.device)):
        return None  # written in place since (targets //= 2): not each model's arange any more
    positions = target.remainder(own)  # model i's block i*B .. i*B + B - 1 counts from 0
    set_tag(positions, 0)
    args, kwargs = list(args), dict(kwargs)
    if len(args) > 1:
        args[1] = positions
    else:
        kwargs["target"] = positions
    return ctx._tracked(func, tuple(args), kwargs, _tagged(args, kwargs), kwargs)


def _loss(ctx, name, args, kwargs, out, tagged) -> None:
    """``reduction='none'`` (a mean or a sum is per model, see :meth:`Tracker._over_samples`)."""
    lost = _first_lost(tagged)
    if lost is not None:
        return _tag_all(out, lost)
    if _per_sample_target(args, kwargs, tagged):
        return _tag_all(out, Lost(f"{name} of the models' samples with targets that differ along the models"))
    bound = loss_arguments(getattr(F, name.split(".")[-1]), args, kwargs)
    if bound["reduction"] != "none":
        return _tag_all(out, Lost(f"{name} with reduction={bound['reduction']!r} over the models' samples"))
    if name.endswith(_PER_ROW_LOSSES):
        first = args[0] if args else next(iter(bound.values()))
        if isinstance(first, Tensor) and first.dim() < 2:  # an unbatched input: the samples are its one vector
            return _tag_all(out, Lost(f"{name} of one unbatched vector holding the models' samples"))
        return _batch_first(ctx, name, args, kwargs, out, tagged)
    # (every tensor operand: the inputs, the target, margin_ranking_loss's third, gaussian_nll_loss's var)
    _elementwise(ctx, name, [v for v in bound.values() if isinstance(v, Tensor)], {}, out, tagged)


# ----------------------------------------------------------------------------------------------------------
# Creation of batch-sized tensors after the folded size was read


def _new_batch_sized(ctx: Tracker, out: Tensor, sized: list[tuple[int, int]] | None) -> list[int]:
    """The dimensions of a new tensor that hold the samples: those given a :class:`FoldedSize`
    (:func:`_sized_dims`). Never guessed from a size that equals the folded one (a (T, T) causal mask with
    T == M * B is a mask): ``int(B)`` is refused, and what CPython reads without asking is documented as not
    followed. The creators take the first."""
    if sized:
        return [k for k, _ in sized]
    return []


def _uniform_creator(
    ctx: Tracker, out: object, sized: list[tuple[int, int]] | None = None, source: object = None
) -> None:
    if isinstance(out, Tensor) and ctx.num_models > 1:
        d = next(iter(_new_batch_sized(ctx, out, sized)), None)
        if d is not None:
            set_tag(out, d)


def _broadcast_creator(
    ctx: Tracker, out: object, sized: list[tuple[int, int]] | None = None, source: object = None
) -> None:
    """``arange(T).expand(B, -1)`` with ``B`` read from the folded batch: the same row for every sample,
    a broadcast (stride 0) along that dimension, so every split of it is right."""
    if isinstance(out, Tensor) and ctx.num_models > 1:
        d = next((k for k in _new_batch_sized(ctx, out, sized) if out.stride(k) == 0), None)
        if d is not None:
            set_tag(out, d)
            _moved_batch_long(ctx, source, out, d)


def _moved_batch_long(ctx: Tracker, source: object, out: Tensor, d: int) -> None:
    """``torch.arange(B).expand(B, -1)``: the samples on the new dimension ``d``, and the source's own dimension
    as long as the folded batch, built from ``B`` (each original's is ``B`` long), on another one of the result
    (source and result aligned to the right): Lost."""
    if not isinstance(source, Tensor) or get_tag(source) is not None or not getattr(source, _FROM_SIZE, False):
        return
    shift = out.dim() - source.dim()
    for j, n in enumerate(source.shape):
        if n in ctx.folded_sizes and n > 1 and j + shift != d:
            return set_tag(
                out,
                Lost(
                    f"a tensor of shape {tuple(source.shape)}, as long as the folded batch (M * B) on dimension {j}, "
                    f"broadcast or repeated to {tuple(out.shape)} with the samples on dimension {d}: one made from "
                    "the size read from the samples (torch.arange(B)) would be each original model's own B long",
                    wide=True,
                ),
            )


_CREATORS: dict[Callable, Callable] = {}
_fn: Callable
for _n in ("zeros", "ones", "full", "empty", "rand", "randn", "randint", "normal"):
    _CREATORS[getattr(torch, _n)] = _uniform_creator
for _fn in (Tensor.expand, Tensor.broadcast_to, torch.broadcast_to):
    _CREATORS[_fn] = _broadcast_creator


def _repeat_creator(
    ctx: Tracker, out: object, sized: list[tuple[int, int]] | None = None, source: object = None
) -> None:
    """``arange(T).unsqueeze(0).repeat(B, 1)``: rows repeated to the folded batch size, checked equal."""
    if isinstance(out, Tensor) and ctx.num_models > 1:
        d = next(iter(_new_batch_sized(ctx, out, sized)), None)
        if d is not None and not _differs_along(out, d):
            set_tag(out, d)
            _moved_batch_long(ctx, source, out, d)


for _fn in (Tensor.repeat, torch.tile, Tensor.tile):
    _CREATORS[_fn] = _repeat_creator


# A size read from the samples given to a dimension that does not hold them (``torch.ones(B, B)``,
# ``h.unsqueeze(1).expand(-1, B, -1)``): each original model's dimension is ``B`` wide, the folded one ``M * B``.
# The functions that take a shape, and where it goes: "shape" (one size per dimension of the result, as
# varargs or one sequence from argument ``start`` or keyword ``key``), "right" (repeat and tile: aligned to the
# result's last dimensions), "unflatten" (the sizes replace dimension ``dim``).
_SHAPE_GIVING: dict[Callable, tuple[str, int, str]] = {}
for _names, _owner, _start, _key in (
    ("zeros ones empty rand randn full empty_strided", torch, 0, "size"),
    ("new_zeros new_ones new_empty new_full new_empty_strided", Tensor, 1, "size"),
    ("view reshape", Tensor, 1, "shape"),
    ("reshape broadcast_to", torch, 1, "shape"),
    ("expand broadcast_to", Tensor, 1, "size"),
):
    for _n in _names.split():
        _SHAPE_GIVING[getattr(_owner, _n)] = ("shape", _start, _key)
_SHAPE_GIVING[torch.eye] = ("eye", 0, "n")
for _fn in (torch.randint, torch.normal):  # (the shape is the one sequence among the arguments)
    _SHAPE_GIVING[_fn] = ("seq", 0, "size")
for _fn, _start in ((Tensor.repeat, 1), (Tensor.tile, 1), (torch.tile, 1)):
    _SHAPE_GIVING[_fn] = ("right", _start, "dims")
for _fn, _start in ((Tensor.unflatten, 2), (torch.unflatten, 2)):
    _SHAPE_GIVING[_fn] = ("unflatten", _start, "sizes")


# Where a size is a count (of repeats, of a window's elements) rather than a shape: a FoldedSize there is M times
# each original model's count, whichever dimension it applies to.
_COUNTED_BY_SIZE = frozenset((Tensor.repeat_interleave, torch.repeat_interleave, Tensor.unfold))

_UNIFORM_CREATORS = frozenset(
    (torch.zeros, torch.ones, torch.full, torch.empty, torch.rand, torch.randn, torch.randint, torch.normal)
    + (Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_empty)
)


def _sized_dims(func: Callable, args: tuple, kwargs: dict, out: object) -> list[tuple[int, int]]:
    """``(dimension of the result, size)`` for each size ``func`` was given as a :class:`FoldedSize`."""
    kind, start, key = _SHAPE_GIVING[func]
    if not isinstance(out, Tensor):
        return []
    if kind == "eye":
        n = _arg(args, kwargs, 0, "n")
        sizes = [n, _arg(args, kwargs, 1, "m", n)]
    elif kind == "seq":
        sizes = list(next((a for a in args if isinstance(a, (list, tuple))), kwargs.get(key, ())))
    elif len(args) > start:
        first = args[start]
        sizes = list(first) if isinstance(first, (list, tuple)) else list(args[start:]) if kind != "unflatten" else []
    else:
        sizes = list(kwargs.get(key, ()))
    offset = 0
    if kind == "right":
        offset = out.dim() - len(sizes)
    elif kind == "unflatten":
        dim = _arg(args, kwargs, 1, "dim")
        offset = _norm(dim, out.dim() - len(sizes) + 1) if isinstance(dim, int) else 0
    return [(offset + k, n) for k, n in enumerate(sizes) if isinstance(n, FoldedSize)]


def _check_sized(func: Callable, sized: list[tuple[int, int]], out: object) -> None:
    """After ``func`` made ``out`` with a :class:`FoldedSize` for the dimensions ``sized``: the samples must be on
    that one dimension; another sized one would be ``M * B`` wide where each original model's is ``B``."""
    if not sized or not isinstance(out, Tensor):
        return
    tag = get_tag(out)
    if func in _UNIFORM_CREATORS and len(sized) == 1 and tag is not PerModel and not isinstance(tag, Lost):
        # x.new_zeros(T, B) with T == M * B: the samples are where B was given, not at the first size that
        # equals M * B (the rule's guess where no size was given)
        return set_tag(out, sized[0][0])
    if tag is PerModel or isinstance(tag, Lost) or (tag is None and len(sized) == 1):
        return  # (one untagged batch-sized dimension: a table or indices, see "Sizes" in the module docstring)
    wide = [(k, n) for k, n in sized if k != tag]
    if not wide:
        return
    k, n = wide[0]
    folded = cast(FoldedSize, n)
    set_tag(
        out,
        Lost(
            f"{_name(func)} given the size {folded.folded()}, read from the size of a tensor that holds the models' "
            f"samples (M * B = {folded.num_models} * {folded.one_model()}), for dimension {k} of its result "
            f"{tuple(out.shape)}, which each original model makes {folded.one_model()} wide",
            wide=True,
        ),
    )


def _new_creator(ctx, name, args, kwargs, out, tagged) -> None:
    """``x.new_zeros(size)`` and friends: a new tensor, not x's samples (batch-sized ones as above; not
    ``new_tensor(data)``, whose values may be per-sample: ``x.new_tensor(range(B))``). ``x.new_tensor(data)`` of
    data that holds the samples is a copy of them: tagged as a tensor ``data`` is, Lost from a list of them."""
    data = (args[1] if len(args) > 1 else kwargs.get("data")) if name.endswith("new_tensor") else None
    if data is not None and _tagged((data,), {}):
        from_list = Lost(f"{name} of a list of tensors that hold the models' samples")
        set_tag(out, get_tag(data) if isinstance(data, Tensor) else from_list)
        return
    set_tag(out, None)
    if ctx.size_read and not name.endswith("new_tensor"):
        _uniform_creator(ctx, out)


# ----------------------------------------------------------------------------------------------------------
# The table


class _Rule(NamedTuple):
    rule: Callable  # rule(ctx, name, args, kwargs, out, tagged) tags out
    name: str
    over_samples: Callable | None = None  # (name, args, kwargs, tagged) -> the call reduces over the samples
    # (ctx, func, args, kwargs, tagged) -> the call's result, computed and tagged in a form that keeps the models
    # apart, or None for the plain call (then tagged by rule)
    compute: Callable | None = None


_RULES: dict[Callable, _Rule] = {}


def _add(
    rule: Callable,
    names: str,
    *,
    torch_: bool = True,
    method: bool = True,
    functional: bool = True,
    over_samples: Callable | None = None,
) -> None:
    """``rule`` for the functions called ``names`` of torch, Tensor and F; ``over_samples(name, args, kwargs,
    tagged)`` says before the call when it reduces over the models' samples (computed per model instead)."""
    owners: tuple[tuple[object, str, bool], ...] = (
        (torch, "torch", torch_),
        (torch.Tensor, "Tensor", method),
        (F, "F", functional),
    )
    owners += ((torch.special, "torch.special", torch_),)
    for name in names.split():
        for owner, prefix, ok in owners:
            fn = getattr(owner, name, None) if ok else None
            if fn is not None and callable(fn):
                _RULES.setdefault(fn, _Rule(rule, f"{prefix}.{name}", over_samples))


_ELEMENTWISE = """
add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow float_power where
maximum minimum fmax fmin masked_fill clamp clip clamp_min clamp_max lerp addcmul addcdiv hypot atan2 logaddexp
eq ne lt le gt ge equal greater less greater_equal less_equal not_equal logical_and logical_or logical_xor
bitwise_and bitwise_or bitwise_xor bitwise_not copysign xlogy heaviside isclose nan_to_num xlog1py igamma igammac
gammainc gammaincc zeta
__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __div__ __rdiv__ __floordiv__
__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__
__eq__ __ne__ __lt__ __le__ __gt__ __ge__
"""
_UNARY = """
neg negative abs absolute exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square reciprocal sign sgn signbit sin cos
tan asin acos atan sinh cosh tanh asinh acosh atanh sigmoid logit erf erfc erfinv floor ceil round trunc frac
isnan isinf isfinite isneginf isposinf logical_not relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh
hardswish hardsigmoid hardshrink softshrink tanhshrink softsign softplus logsigmoid threshold rrelu
lgamma digamma polygamma mvlgamma gammaln psi multigammaln i0 i0e i1 i1e sinc erfcx ndtr ndtri log_ndtr entr expit
dropout alpha_dropout feature_alpha_dropout contiguous clone detach to type type_as float double half bfloat16
int long short bool byte char cpu cuda requires_grad_ detach_ zero_ normal_ uniform_ bernoulli bernoulli_
zeros_like ones_like empty_like full_like rand_like randn_like randint_like pin_memory __neg__ __pos__ __abs__
__invert__ positive conj resolve_conj resolve_neg __deepcopy__ exponential_ geometric_ cauchy_ log_normal_ random_
relu_ sigmoid_ tanh_ elu_ leaky_relu_ hardtanh_ silu_ gelu_ softplus_
floor_ ceil_ round_ trunc_ frac_ neg_ negative_ abs_ absolute_ exp_ exp2_ expm1_ log_ log2_ log10_ log1p_ sqrt_
rsqrt_ square_ reciprocal_ sign_ sgn_ sin_ cos_ tan_ asin_ acos_ atan_ sinh_ cosh_ asinh_ acosh_ atanh_ logit_
erf_ erfc_ erfinv_ hardsigmoid_ hardswish_ mish_ relu6_ celu_ selu_ rrelu_ threshold_ logical_not_ bitwise_not_
"""
_INPLACE = """
add_ sub_ mul_ div_ pow_ masked_fill_ copy_ lerp_ addcmul_ addcdiv_ maximum_ minimum_ where_ floor_divide_
remainder_ fmod_ logical_and_ logical_or_ clamp_ clip_ nan_to_num_ fill_
__iadd__ __isub__ __imul__ __itruediv__ __idiv__ __ipow__ __iand__
__ior__ __ixor__ __ifloordiv__ __imod__
"""
_add(_elementwise, _ELEMENTWISE)
for _n in _ELEMENTWISE.split():
    for _owner in (torch, Tensor, F, torch.special):
        _entry = _RULES.get(getattr(_owner, _n, None))  # type: ignore[arg-type]  # (None: not registered)
        if _entry is not None and _entry.rule is _elementwise:
            _RULES[getattr(_owner, _n)] = _entry._replace(compute=_broadcast_pairs)
_add(_like_self, _UNARY)
# ``broadcast_tensors`` (``torch.distributions``' ``broadcast_all``): each result is its input expanded to the
# common shape, holding the samples where a broadcasting op of the same operands would; an untagged operand is
# checked to be the same all along that dimension, so its expanded result is right for every model too.
_add(_elementwise, "broadcast_tensors", method=False, functional=False)
_add(_inplace_elementwise, _INPLACE)
_REDUCTIONS = """
sum nansum mean nanmean prod amax amin max min argmax argmin std var norm logsumexp all any count_nonzero median
nanmedian mode aminmax std_mean var_mean
"""
_add(_reduction, _REDUCTIONS, over_samples=_reduces_samples)
# torch.distributions' argument validation, ``if not torch._is_all_true(constraint.check(value))``: an all(),
# each model's own over its samples (a per-model bool that must be True for every model to go on)
_add(_reduction, "_is_all_true", method=False, functional=False, over_samples=_reduces_samples)
for _n in ("norm", "vector_norm"):  # (input, ord, dim, keepdim)
    _RULES[getattr(torch.linalg, _n)] = _Rule(_reduction, f"torch.linalg.{_n}", _reduces_samples)
_add(_dim_rule(1, "dim", None), "softmax log_softmax softmin cumsum cumprod cummax cummin logcumsumexp")
for _fn in (torch.softmax, torch.log_softmax, Tensor.softmax, Tensor.log_softmax, F.softmax, F.log_softmax, F.softmin):
    _RULES[_fn] = _RULES[_fn]._replace(compute=_within_each_model(1, "dim"))
_add(_dim_rule(1, "dim", -1), "sort argsort")
_add(_dim_rule(1, "dim", 0), "msort")  # sorts along dimension 0 (it has no dim argument)
_add(_dim_rule(1, "dims", None), "flip")
_add(_dim_rule(2, "dim", -1), "topk kthvalue diff")
_add(_dim_rule(2, "dim", 1), "normalize")
_add(_dim_rule(1, "dim", -1), "glu")
_add(_dim_rule(2, "dims", None), "roll")
_add(_dim_rule(1, "dimension", None), "unfold", torch_=False, functional=False)  # sliding windows: a new last dim
_add(_dim_rule(4, "dim", -1), "gumbel_softmax")
_add(_trailing(lambda a, k: 1), "linear")
_add(_paired_reduction(lambda a, k: _arg(a, k, 2, "dim", 1)), "cosine_similarity", method=False)
_add(_paired_reduction(lambda a, k: -1), "pairwise_distance", method=False)
_add(_trailing(lambda a, k: len(_arg(a, k, 1, "normalized_shape"))), "layer_norm rms_norm")
_add(_trailing(lambda a, k: 2), "triu tril triu_ tril_")
_add(_pad, "pad")
_add(_trailing(lambda a, k: 0), "one_hot")
# Draws of torch.distributions: each row's (multinomial: (N, C) probabilities; a Dirichlet: the last dimension)
# or each element's from its own parameters
_add(_trailing(lambda a, k: 1), "multinomial _sample_dirichlet", functional=False)
_add(_like_self, "_standard_gamma poisson", functional=False)
_add(_elementwise, "binomial normal", functional=False)  # (normal(mean, std) of tensors; of numbers: a creation)
_add(
    _batch_first,
    """
conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d max_pool1d max_pool2d max_pool3d
avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d
adaptive_max_pool2d adaptive_max_pool3d lp_pool1d lp_pool2d lp_pool3d max_pool1d_with_indices
max_pool2d_with_indices max_pool3d_with_indices adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices
interpolate upsample upsample_nearest upsample_bilinear grid_sample affine_grid pixel_shuffle pixel_unshuffle
channel_shuffle native_channel_shuffle fold unfold group_norm instance_norm local_response_norm dropout1d
dropout2d dropout3d
""",
    method=False,
)
_RULES[F.adaptive_avg_pool2d] = _RULES[F.adaptive_avg_pool2d]._replace(compute=_global_pool_channels_last)
for _fn in (F.relu, torch.relu, Tensor.relu, torch.relu_, Tensor.relu_):
    _RULES[_fn] = _RULES[_fn]._replace(compute=_kept_relu)
_RULES[F.max_pool2d] = _RULES[F.max_pool2d]._replace(compute=_kept_max_pool2d)
_add(_batch_norm, "batch_norm", method=False, torch_=False)
_add(_recurrent, "lstm gru rnn_tanh rnn_relu", method=False, functional=False)
_add(_batch_first, "lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _native_multi_head_attention", method=False)
_add(_multi_head_attention, "multi_head_attention_forward", method=False, torch_=False)
_add(_bilinear, "bilinear", method=False)
_add(_embedding_bag, "embedding_bag", method=False, torch_=False)
_add(_like_self, "prelu", method=False)
_add(_matmul, "matmul mm bmm addmm baddbmm __matmul__ mv addmv", over_samples=_contracts_samples)
for _fn in (torch.matmul, torch.mm, torch.bmm, Tensor.matmul, Tensor.mm, Tensor.bmm, Tensor.__matmul__):
    _RULES[_fn] = _RULES[_fn]._replace(compute=_pairs)
_add(_trailing(lambda a, k: 1), "view_as_complex")  # (..., 2) real -> (...) complex
_add(_like_self, "view_as_real real imag angle", functional=False)  # (...) complex -> (..., 2) real; parts
_RULES[_getter("real")] = _Rule(_like_self, "Tensor.real")
_RULES[_getter("imag")] = _Rule(_like_self, "Tensor.imag")
_add(_elementwise, "polar complex")
_add(_bucketize, "bucketize")
_add(_as_tensor, "as_tensor")
_RULES[torch.linalg.solve_triangular] = _Rule(_batched_matrices, "torch.linalg.solve_triangular")
# Matrix to matrix (and cholesky_ex/inv_ex's info, one per matrix): MultivariateNormal's covariance and its
# positive-definite check, cholesky_ex(value).info.eq(0)
for _n in ("cholesky", "cholesky_ex", "inv", "inv_ex", "matrix_exp"):
    _RULES[getattr(torch.linalg, _n)] = _Rule(_batched_matrices, f"torch.linalg.{_n}")
_add(_batched_matrices, "cholesky cholesky_inverse matrix_exp", functional=False)
for _names, _default in (
    ("fft ifft rfft irfft hfft ihfft", -1),
    ("fft2 ifft2 rfft2 irfft2 hfft2 ihfft2", (-2, -1)),
    ("fftn ifftn rfftn irfftn hfftn ihfftn", None),  # every dimension (or the last len(s)): refused
):
    for _fft in _names.split():
        _RULES[getattr(torch.fft, _fft)] = _Rule(_dim_rule(2, "dim", _default), f"torch.fft.{_fft}")
for _fft in ("fftshift", "ifftshift"):
    _RULES[getattr(torch.fft, _fft)] = _Rule(_dim_rule(1, "dim", None), f"torch.fft.{_fft}")
_add(_sdpa, "scaled_dot_product_attention")
_RULES[F.scaled_dot_product_attention] = _RULES[F.scaled_dot_product_attention]._replace(
    compute=_explicit_short_attention
)
_RULES[torch.einsum] = _Rule(_einsum, "torch.einsum", _einsum_over_samples, _einsum_pairs)
_RULES[torch.cdist] = _Rule(_cdist, "torch.cdist", compute=_cdist_per_model)
_RULES[torch._pack_padded_sequence] = _Rule(_packed, "torch.nn.utils.rnn.pack_padded_sequence")
_RULES[F.ctc_loss] = _Rule(_ctc_loss, "F.ctc_loss", compute=_ctc_loss_per_model)
_add(_reshape, "view reshape flatten unflatten view_as reshape_as squeeze unsqueeze squeeze_ unsqueeze_ ravel")
_add(_permutation(_transpose_perm), "transpose swapaxes swapdims transpose_")
_add(_permutation(_permute_perm), "permute")
_add(_permutation(_movedim_perm), "movedim moveaxis")
_add(_permutation(_last_two_perm), "t t_")
_add(_expand, "expand expand_as broadcast_to repeat tile")
_add(_repeat_interleave, "repeat_interleave")
_add(_diagonal, "diagonal", functional=False)
_RULES[torch.linalg.diagonal] = _Rule(_diagonal, "torch.linalg.diagonal")
_add(_diag_embed, "diag_embed", functional=False)
_add(_split(2, 0), "split chunk tensor_split split_with_sizes unsafe_split")
_add(_split(1, 0), "unbind")
_add(_split(1, None), "select narrow")
_add(_index_dim, "index_select gather scatter scatter_add scatter_reduce index_add index_copy index_fill")
_add(
    _index_dim,
    "scatter_ scatter_add_ scatter_reduce_ index_add_ index_copy_ index_fill_",
    torch_=False,
    functional=False,
)
_add(_cat, "cat concat concatenate stack")
for _fn in (torch.cat, torch.concat, torch.concatenate):
    _RULES[_fn] = _RULES[_fn]._replace(compute=_cat_within_each_model)
for _fn in (
    torch.split,
    Tensor.split,
    torch.split_with_sizes,
    Tensor.split_with_sizes,
    torch.chunk,
    Tensor.chunk,
    torch.tensor_split,
    Tensor.tensor_split,
):
    _RULES[_fn] = _RULES[_fn]._replace(compute=_split_within_each_model)
# numpy's names for a split or a join along one dimension, as torch.tensor_split and torch.cat: the dimension
# for a tensor of n dimensions, or None where torch first reshapes (vstack of 1-D tensors: refused)
_NUMPY_SPLITS = {"vsplit": lambda n: 0, "hsplit": lambda n: 1 if n > 1 else 0, "dsplit": lambda n: 2}
_NUMPY_JOINS = {
    "vstack": lambda n: 0 if n > 1 else None,
    "row_stack": lambda n: 0 if n > 1 else None,
    "hstack": lambda n: 1 if n > 1 else 0,
    "dstack": lambda n: 2 if n > 2 else None,
}


def _as_tensor_split(name: str) -> tuple[Callable, Callable]:
    def translated(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = cast(Tensor, args[0] if args else kwargs["input"])
        sections = args[1] if len(args) > 1 else kwargs.get("indices_or_sections", kwargs.get("sections"))
        sections = kwargs.get("indices", sections)
        return (x, sections, _NUMPY_SPLITS[name](x.dim())), {}

    def rule(ctx, rule_name, args, kwargs, out, tagged) -> None:
        return _split(2, 0)(ctx, rule_name, *translated(args, kwargs), out, tagged)

    def compute(ctx, func, args, kwargs, tagged) -> tuple[Tensor, ...] | None:
        return _split_within_each_model(ctx, torch.tensor_split, *translated(args, kwargs), tagged)

    return rule, compute


def _as_cat(name: str) -> tuple[Callable, Callable]:
    def translated(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        tensors = list(_arg(args, kwargs, 0, "tensors"))
        dims = {_NUMPY_JOINS[name](t.dim()) if isinstance(t, Tensor) else None for t in tensors}
        if len(dims) != 1 or None in dims:
            return None
        return (tensors, dims.pop()), {}

    def rule(ctx, rule_name, args, kwargs, out, tagged) -> None:
        found = translated(args, kwargs)
        if found is None:
            lost = Lost(f"{rule_name} of tensors that it first reshapes (fewer dimensions than it joins along)")
            return _tag_all(out, _first_lost(tagged) or lost)
        return _cat(ctx, rule_name, *found, out, tagged)

    def compute(ctx, func, args, kwargs, tagged) -> Tensor | None:
        found = translated(args, kwargs)
        return None if found is None else _cat_within_each_model(ctx, torch.cat, *found, tagged)

    return rule, compute


for _numpy_name in _NUMPY_SPLITS:
    _numpy_rule, _numpy_compute = _as_tensor_split(_numpy_name)
    for _owner, _prefix in ((torch, "torch"), (torch.Tensor, "Tensor")):
        _RULES[getattr(_owner, _numpy_name)] = _Rule(_numpy_rule, f"{_prefix}.{_numpy_name}", compute=_numpy_compute)
for _numpy_name in _NUMPY_JOINS:
    _numpy_rule, _numpy_compute = _as_cat(_numpy_name)
    _RULES[getattr(torch, _numpy_name)] = _Rule(_numpy_rule, f"torch.{_numpy_name}", compute=_numpy_compute)

_LOSSES = """
cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits
kl_div soft_margin_loss poisson_nll_loss gaussian_nll_loss hinge_embedding_loss margin_ranking_loss
multilabel_soft_margin_loss multi_margin_loss multilabel_margin_loss cosine_embedding_loss triplet_margin_loss
"""
# losses of (N, C) or (N, D) inputs whose reduction='none' result is (N,): one value per sample
_PER_ROW_LOSSES = (
    "cross_entropy", "nll_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss",
    "cosine_embedding_loss", "triplet_margin_loss",
)  # fmt: skip
_add(_loss, _LOSSES, torch_=False, method=False, over_samples=_loss_over_samples)
_LOSS_PARAMETERS = {getattr(F, n): tuple(inspect.signature(getattr(F, n)).parameters) for n in _LOSSES.split()}
for _fn in (F.cross_entropy, F.nll_loss):
    _RULES[_fn] = _RULES[_fn]._replace(compute=_positions_as_targets)
_add(_new_creator, "new_zeros new_ones new_full new_empty new_tensor", torch_=False, functional=False)
_add(_size, "size __len__ numel nelement", torch_=False, functional=False)
_RULES[torch.numel] = _Rule(_size, "torch.numel")
_RULES[_getter("shape")] = _Rule(_size, "Tensor.shape")
_RULES[torch.Tensor.__getitem__] = _Rule(_getitem, "Tensor.__getitem__", compute=_slice_within_each_model)
_RULES[torch.Tensor.__setitem__] = _Rule(_setitem, "Tensor.__setitem__")
_RULES[torch.Tensor.masked_scatter] = _Rule(_masked_scatter, "Tensor.masked_scatter")
_RULES[torch.masked_scatter] = _Rule(_masked_scatter, "torch.masked_scatter")
_RULES[torch.Tensor.masked_scatter_] = _Rule(_masked_scatter, "Tensor.masked_scatter_")
_RULES[_getter("mT")] = _Rule(_permutation(_last_two_perm), "Tensor.mT")
_RULES[_getter("T")] = _Rule(_permutation(_reverse_perm), "Tensor.T")
_RULES[_getter("data")] = _Rule(_like_self, "Tensor.data")
_RULES[F.embedding] = _Rule(_trailing(lambda a, k: 0), "F.embedding")
# Reading properties that are not tensors, and methods that return no tensor: nothing to tag.
for _fn in (torch.Tensor.dim, torch.Tensor.stride, torch.Tensor.is_contiguous,
            _getter("dtype"), _getter("device"), _getter("requires_grad"),
            _getter("ndim"), torch.Tensor.is_floating_point, torch.Tensor.element_size,
            torch.Tensor.data_ptr, torch.Tensor.__hash__, torch.Tensor.__repr__, torch.Tensor.__format__,
            torch.Tensor.register_hook, torch.Tensor.retain_grad, _getter("grad"),
            _getter("is_leaf"), _getter("layout"), torch.Tensor.untyped_storage,
            torch.Tensor.storage_offset, torch.Tensor.get_device,
            _getter("is_cuda"), _getter("grad_fn"),
            torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
            torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.backward):  # fmt: skip
    _RULES.setdefault(_fn, _Rule(lambda *a: None, ""))


_add(_data_sized, "nonzero argwhere masked_select unique unique_consecutive")
# Functions whose result leaves the tracked code as a Python value, or hands a tensor to user code that
# batchlayers does not see (a gradient hook): refused for any tensor that holds or was computed from the
# models' samples (see _refuse_escape). A dict: torch.compile traces .get, not `in`.
_ESCAPES: dict[Callable, bool] = dict.fromkeys(
    (torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
     torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.numpy, torch.Tensor.__array__,
     torch.Tensor.__contains__, torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
     torch.allclose, torch.Tensor.allclose, torch.equal, torch.Tensor.equal, torch.is_nonzero,
     torch.Tensor.is_nonzero,
     # the storage: a tensor made from it (``torch.empty(0).set_(storage)``) holds the samples untagged
     torch.Tensor.untyped_storage, torch.Tensor.storage, torch.Tensor._typed_storage),
    True,
)  # fmt: skip
for _escape in _ESCAPES:
    _RULES.setdefault(_escape, _Rule(lambda *a: None, ""))

_SIZES: dict[Callable, bool] = dict.fromkeys(
    (torch.Tensor.size, _getter("shape"), torch.Tensor.numel, torch.numel, torch.Tensor.nelement), True
)
# Where torch takes a number as a size (of a shape, a slice, a split), a FoldedSize is the size of the models'
# samples and followed by the rules; anywhere else a number that differs per model is refused (see
# Tracker._refuse_numbers_that_differ). Each function maps to the positions and keywords that take a value.
# (Not F.pad, F.interpolate, the adaptive pools, F.fold/unfold: their sizes are of the other dimensions, never
# the samples', so the folded batch size there would be M times each model's.)
_SIZE_TAKING: dict[Callable, frozenset] = {}
for _owners, _names, _values in (
    (
        (Tensor,),
        "view reshape expand broadcast_to repeat tile unflatten new_zeros new_ones new_empty __getitem__ "
        "split split_with_sizes tensor_split chunk narrow select unfold as_strided repeat_interleave new_empty_strided",
        (),
    ),
    (
        (torch,),
        "reshape broadcast_to tile unflatten zeros ones empty rand randn randperm eye arange split "
        "tensor_split chunk narrow select as_strided repeat_interleave empty_strided",
        (),
    ),
    ((torch,), "full", (1, "fill_value")),
    ((Tensor,), "new_full", (2, "fill_value")),
    ((Tensor,), "__setitem__", (2, "value")),
    ((torch,), "randint", (0, 1, "low", "high")),
    ((torch,), "linspace logspace", (0, 1, "start", "end")),
    ((torch,), "normal", (0, 1, "mean", "std")),
):
    for _owner in _owners:
        for _n in _names.split():
            _SIZE_TAKING[getattr(_owner, _n)] = frozenset(_values)
# Elementwise ops, where a number is a value: a size read from the samples is each model's own there (see
# _each_models_values)
_VALUE_OPERANDS = frozenset(f for f, r in _RULES.items() if r.rule in (_elementwise, _inplace_elementwise))

_IN_PLACE = _in_place_functions()

from . import _per_model  # noqa: E402  (it builds on this module's rules)


def _never_compiled_on_its_own() -> None:
    """Where torch.compile runs a stacked forward eagerly (see ``Tracker.eager_only``), the tracker's
    ``__torch_function__`` is called from eager code, and dynamo would compile each such call as a frame of its
    own, guarded too loosely to tell one ``func`` from another (measured: ``x.device`` answered with the
    compiled ``x.size()``). Those frames and everything they call run as they are; inside a traced forward the
    tracker is still inlined (a frame's execution strategy applies only where the frame is evaluated)."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(Tracker.__torch_function__.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


_never_compiled_on_its_own()

from ._custom_function import Calls  # noqa: E402  (it builds on this module)
