"""Custom ``torch.autograd.Function``\\ s inside a stacked model's batched ``forward``: each model's gradient.

A custom Function's ``forward`` is ordinary torch code: the provenance tracker follows it op by op, so its
outputs are each model's. Its ``backward`` is not: autograd runs it once, on the folded gradient of every
model's samples, after the stacked call has ended. One that reduces over the batch (``g - g.mean(0)``) or sums
the gradient of an input that every model holds its own of (a per-model weight) would mix the models'
gradients without an error.

So, while a stacked call records gradients, the tracker notes each Function called in it (:class:`Calls`):
its class, its arguments and what they hold, and the values of the random ops inside. When the call has
returned, its backward node is made to run :class:`_EachModels` instead of the Function's ``backward`` (which
then never sees the folded gradient): the Function is applied again to model ``i``'s part of every argument
(block ``i`` of the samples, slice ``i`` of a per-model value, a shared value as it is), under the forward's
autocast, each random op giving model ``i``'s part of what it gave in the stacked call, and differentiated with
model ``i``'s part of the output gradients; the results are joined as the arguments were. That is exact for
any Function whose forward depends on its arguments and torch's random ops alone, at the cost of one forward
and backward of it per model (torch's generators are left as they were).

Refused in forward, naming the Function: a forward that uses a tensor holding the models' samples or
per-model values that is not among its arguments (a parameter read from a closure: applied again to one
model's arguments it would still see every model's); an argument or a random draw whose rows batchlayers
cannot assign to the models (:class:`~batchlayers._provenance.Lost`); a write into an argument that
requires gradients (``ctx.mark_dirty``; one without, a running statistic, is recomputed from its value
before the write, on a copy); a Function under ``torch.utils.checkpoint``. Refused in backward: the gradient of an
output that no op batchlayers saw made, or of a Lost one. Under ``create_graph=True`` the gradients are
computed in the arguments' graph (a double backward reaches the parameters).
batchlayers' own Functions, which know the model dimension, and torch's (see :func:`_outermost_apply`) are
left alone. Under ``torch.compile`` nothing is noted: a stacked model whose eager call noted a Function runs
without compiling from then on (``FoldInputs.custom_function``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._numbers import differs
from ._provenance import _MARKED, Lost, PerModel, _In, _outputs, _storage_address, get_tag, written_tensors

__all__ = ["Calls"]

_APPLY = torch.autograd.function.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_NODE = torch.autograd.function.BackwardCFunction

# Functions of torch.nn.functional, written in Python, that draw random values inside (the ops they call run
# unseen, inside the tracker's handling of the call). The others are known from aten's tag (see _draws).
_DRAWING_PYTHON = frozenset(
    """dropout1d dropout2d dropout3d gumbel_softmax fractional_max_pool2d fractional_max_pool3d
    fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices multi_head_attention_forward""".split()
)
_DRAWING: dict[str, bool] = {}


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or ""


def _draws(func: Callable) -> bool:
    """Whether ``func`` draws random values: torch's random ops (``rand_like``, ``bernoulli_``, ``dropout``,
    ``_sample_dirichlet``, ...: aten's ``nondeterministic_seeded`` tag) and the Python ones above."""
    name = _name(func)
    found = _DRAWING.get(name)
    if found is None:
        packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
        found = name in _DRAWING_PYTHON or (
            packet is not None
            and any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())
        )
        _DRAWING[name] = found
    return found


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _own(tensor: Tensor, tag: object, model: int, num_models: int) -> Tensor:
    """Model ``model``'s part of a tensor of the folded call that holds ``tag``."""
    if tag is PerModel:
        return tensor[model]
    if isinstance(tag, int):
        n = tensor.shape[tag] // num_models
        return tensor.narrow(tag, model * n, n)
    return tensor  # shared by every model


def _joined(parts: list[Tensor], tag: object) -> Tensor:
    """The folded call's gradient from each model's: the inverse of :func:`_own` (a shared value's, summed)."""
    if tag is PerModel:
        return torch.stack(parts)
    if isinstance(tag, int):
        return torch.cat(parts, dim=tag)
    return torch.stack(parts).sum(0)


@dataclass
class _Call:
    """One ``Function.apply`` in a stacked call, from its first op on until its outputs are known."""

    cls: type
    frame: FrameType | None  # Function.apply's frame while its forward runs (None once settled)
    args: tuple
    kwargs: dict
    tags: dict[int, object]  # id of a tensor among the arguments -> its tag then
    versions: list[tuple[Tensor, int]]  # the tensor arguments and their versions then
    # id of an argument without gradients that the forward writes in place (a running statistic) -> its value
    # before the first write, which each model's recomputation starts from (on a copy: the write is not redone)
    before: dict[int, Tensor] = field(default_factory=dict)
    node: Any = None  # the backward node (the forward's ctx), once known
    made: list[Tensor] = field(default_factory=list)  # tensors made by ops of the forward (kept until settled)
    known: set[int] = field(default_factory=set)  # ids of the arguments' tensors and of those made
    draws: list[tuple[str, list[tuple[Tensor, object]]]] = field(default_factory=list)  # by ops that draw
    output_tags: dict[int, object] = field(default_factory=dict)  # output number -> tag
    num_models: int = 1
    devices: list[int] = field(default_factory=list)  # CUDA devices of the arguments (their generators kept)
    # (device type, enabled, dtype) of autocast where the forward ran, which its recomputation runs under too
    autocast_state: list[tuple[str, bool, torch.dtype]] = field(default_factory=list)

    def autocast(self) -> contextlib.ExitStack:
        """Autocast as the forward had it, for each device type where it differs now."""
        stack = contextlib.ExitStack()
        for device_type, enabled, dtype in self.autocast_state:
            if (enabled, dtype) != _autocast_state(device_type)[1:]:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        return stack

    @property
    def title(self) -> str:
        return f"the custom autograd.Function {self.cls.__qualname__}"

    def refuse_from_outside(self, func: Callable, tagged: list[_In]) -> None:
        """Refuse a call in the forward given a tensor of the samples or per-model values that is neither an
        argument nor made in the forward (before the call runs)."""
        for i in tagged:
            if id(i.tensor) not in self.known:
                raise ValueError(
                    f"batchlayers: the forward of {self.title} in a stacked model uses a tensor that holds "
                    + ("per-model values" if i.tag is PerModel else "the models' samples")
                    + f" (shape {tuple(i.tensor.shape)}, in {_name(func)}) that is not among its arguments (a "
                    "parameter or activation read from outside): batchlayers computes each model's backward by "
                    "applying the Function to that model's arguments, which would still see every model's. "
                    "Pass the tensor to apply(...), or stack with execution='model_by_model'"
                )

    def keep_before_writes(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """Before a call of the forward that writes in place: keep the value of each argument without gradients
        whose memory it writes, the first time (see ``before``)."""
        for written in written_tensors(func, args, kwargs):
            address = _storage_address(written)
            for t, _ in self.versions:
                if address and _storage_address(t) == address and id(t) not in self.before and not t.requires_grad:
                    self.before[id(t)] = t.detach().clone()

    def own_arguments(self, model: int, graph: bool) -> tuple[tuple, dict]:
        """Model ``model``'s arguments: its part of every tensor (a new leaf where the original required
        gradients; ``graph``: a view of the original, in its graph), each model's own number in place of one
        read from the samples' size."""

        def own(a: object, top: bool) -> object:
            if isinstance(a, Tensor):
                if id(a) in self.before:
                    return _own(self.before[id(a)], self.tags.get(id(a)), model, self.num_models).clone()
                part = _own(a, self.tags.get(id(a)), model, self.num_models)
                if graph:
                    return part
                return part.detach().requires_grad_(a.requires_grad) if top else part.detach()
            if type(a) in _MARKED and differs(a):
                return a.own  # type: ignore[attr-defined]
            if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
                return type(a)(own(b, False) for b in a)
            return a

        return tuple(own(a, True) for a in self.args), {k: own(v, True) for k, v in self.kwargs.items()}

    def backward(self, needs_input_grad: tuple[bool, ...], grad_outputs: tuple) -> tuple:
        """The gradients of the Function's arguments (its ``backward``'s result), each model's own, joined. Under
        ``create_graph=True`` (grad mode on in backward) they are computed in the arguments' graph, so that a
        double backward reaches what they were made from."""
        graph = torch.is_grad_enabled()
        for i, g in enumerate(grad_outputs):
            if g is None:
                continue
            if i not in self.output_tags:
                raise ValueError(
                    f"batchlayers: output {i} of {self.title} in a stacked model was not made by an op that "
                    "batchlayers saw (code it does not see: a C extension, torch.jit.script), so it cannot tell "
                    "which of its gradient's rows are each model's. Stack with execution='model_by_model'"
                )
            tag = self.output_tags[i]
            if isinstance(tag, Lost):
                raise ValueError(
                    f"batchlayers: output {i} of {self.title} in a stacked model was made from the models' samples "
                    f"by {tag.reason}, so batchlayers cannot tell which of its gradient's rows are each model's. "
                    "Stack with execution='model_by_model'"
                )
        wanted = [j for j, a in enumerate(self.args) if isinstance(a, Tensor) and needs_input_grad[j]]
        parts: list[list[Tensor]] = [[] for _ in wanted]
        for model in range(self.num_models):
            args, kwargs = self.own_arguments(model, graph)
            # (the draws made again leave the generators as they were: the user's random stream goes on as is)
            with torch.enable_grad(), torch.random.fork_rng(self.devices), self.autocast(), _GiveBack(self, model):
                out = self.cls.apply(*args, **kwargs)  # type: ignore[attr-defined]
            outs = out if isinstance(out, tuple) else (out,)
            # An output without the samples or per-model values is the same in every model: its gradient holds
            # every model's contributions, summed, and goes back through one model's call.
            pairs = [
                (o, _own(g, self.output_tags[i], model, self.num_models))
                for i, (o, g) in enumerate(zip(outs, grad_outputs))
                if g is not None
                and isinstance(o, Tensor)
                and o.requires_grad
                and (self.output_tags[i] is not None or model == 0)
            ]
            leaves = [args[j] for j in wanted]
            grads = (
                torch.autograd.grad(
                    [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True, create_graph=graph
                )
                if pairs
                else (None,) * len(leaves)
            )
            for k, (leaf, g) in enumerate(zip(leaves, grads)):
                parts[k].append(torch.zeros_like(leaf) if g is None else g)
        joined: list[Tensor | None] = [None] * len(self.args)
        for k, j in enumerate(wanted):
            joined[j] = _joined(parts[k], self.tags.get(id(self.args[j])))
        return tuple(joined)


class _EachModels(torch.autograd.Function):
    """What a noted call's backward node runs in place of the Function's own ``backward`` (the node's
    ``_forward_cls``, from which autograd takes it, is set to this class): each model's gradients."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:  # (never applied)
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        return ctx._batchlayers_call.backward(ctx.needs_input_grad, grad_outputs)


class _GiveBack(TorchFunctionMode):
    """While a Function runs again for one model: each op that draws random values gives that model's part of
    what the same op gave in the stacked call, in the same order. (Nothing in a Function's forward is
    differentiated, its backward is: any op's result may be replaced by its values.)"""

    def __init__(self, call: _Call, model: int) -> None:
        super().__init__()
        self.call, self.model, self.next = call, model, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))  # (the tensors the op gives, of their shapes; their values replaced)
        if not _draws(func):
            return out
        name = _name(func)
        outs = _outputs(out)
        given = self.call.draws[self.next][1] if self.next < len(self.call.draws) else []
        if self.next >= len(self.call.draws) or self.call.draws[self.next][0] != name or len(given) != len(outs):
            raise ValueError(
                f"batchlayers: {self.call.title}, run again for one model in backward, draws random values "
                f"({name}) in another order than in the stacked forward; its forward must depend on its arguments "
                "alone. Stack with execution='model_by_model'"
            )
        self.next += 1
        with torch.no_grad():
            for o, (drawn, tag) in zip(outs, given):
                own = _own(drawn, tag, self.model, self.call.num_models)
                if o.shape != own.shape:
                    raise ValueError(
                        f"batchlayers: {self.call.title}, run again for one model in backward, draws {name} of "
                        f"shape {tuple(o.shape)} where that model's part of the stacked forward's draw has "
                        f"{tuple(own.shape)}. Stack with execution='model_by_model'"
                    )
                o.copy_(own)
        return out


class Calls:
    """The custom Functions of one stacked call that records gradients (see the module docstring).

    The tracker calls :meth:`op` before every torch call it sees while grad mode is off in a call that began
    with it on (inside a Function's forward, or a ``torch.no_grad()`` block), :meth:`grad_mode_on` before a call
    with grad mode on again while a Function is noted, :meth:`made` after a call that belongs to one, and
    :meth:`settle` when the stacked call ends."""

    def __init__(self, num_models: int) -> None:
        self.num_models = num_models
        self.pending: list[_Call] = []
        self.noted: str | None = None  # the name of the first Function noted
        # the frame of the last call seen with grad mode off, and its Function.apply frame (see op; kept only
        # while grad mode stays off, so that no finished frame, nor its locals, stays alive)
        self.caller: FrameType | None = None
        self.apply: FrameType | None = None

    def grad_mode_on(self, func: Callable, tagged: list[_In]) -> _Call | None:
        """Before a torch call with grad mode on (again): settle the noted call if its ``Function.apply`` has
        returned. Returns the call while it has not: ``func`` is part of it (its forward computes under
        ``torch.enable_grad()``, or torch's own ``apply`` works on its outputs)."""
        self.caller = self.apply = None
        if not self.pending:
            return None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame is self.pending[-1].frame:
                self.pending[-1].refuse_from_outside(func, tagged)
                return self.pending[-1]
            frame = frame.f_back
        self.settle()
        return None

    def op(self, tracker: Any, func: Callable, args: tuple, kwargs: dict, tagged: list[_In]) -> _Call | None:
        """Before ``func`` runs: the Function call it belongs to (None: not inside one)."""
        caller = sys._getframe(2)
        if caller is not self.caller:  # (the frames above a running one stay as they are: one walk for its calls)
            self.caller, self.apply = caller, _outermost_apply(caller)
        frame = self.apply
        if self.pending and (frame is None or frame is not self.pending[-1].frame):
            self.settle()
        if frame is None:
            return None
        call = self.pending[-1] if self.pending else self._note(frame, tracker)
        call.refuse_from_outside(func, tagged)
        call.keep_before_writes(func, args, kwargs)
        return call

    def made(self, call: _Call, func: Callable, out: object) -> None:
        """After ``func`` ran inside ``call``'s forward."""
        outs = _outputs(out)
        call.made.extend(outs)
        call.known.update(id(o) for o in outs)
        if _draws(func):
            for o in outs:
                tag = get_tag(o)
                if isinstance(tag, Lost):
                    raise ValueError(
                        f"batchlayers: the forward of {call.title} in a stacked model draws random values "
                        f"({_name(func)}) made by {tag.reason}, whose rows batchlayers cannot assign to the models. "
                        "Stack with execution='model_by_model'"
                    )
            call.draws.append((_name(func), [(o.detach().clone(), get_tag(o)) for o in outs]))

    def _note(self, frame: FrameType, tracker: Any) -> _Call:
        tracker.refuse_checkpointing(f"the custom autograd.Function {frame.f_locals['cls'].__qualname__}")
        local = frame.f_locals
        call = _Call(
            cls=local["cls"],
            frame=frame,
            args=tuple(local["args"]),
            kwargs=dict(local.get("kwargs") or {}),
            tags={},
            versions=[],
            num_models=self.num_models,
        )
        for a in (*call.args, *call.kwargs.values()):
            for t in [a] if isinstance(a, Tensor) else a if isinstance(a, (list, tuple)) else []:
                if not isinstance(t, Tensor):
                    continue
                tag = get_tag(t)
                if isinstance(tag, Lost):
                    raise ValueError(
                        f"batchlayers: {call.title} in a stacked model is given a tensor made from the models' "
                        f"samples by {tag.reason}, whose rows batchlayers cannot assign to the models, as it must "
                        "to compute each model's backward. Stack with execution='model_by_model'"
                    )
                call.tags[id(t)] = tag
                call.known.add(id(t))
                call.versions.append((t, t._version))
        call.devices = sorted({t.device.index or 0 for t, _ in call.versions if t.device.type == "cuda"})
        call.autocast_state = [_autocast_state(device_type) for device_type in ("cpu", "cuda")]
        call.node = _context(frame)
        self.pending.append(call)
        self.noted = self.noted or call.cls.__qualname__
        return call

    def settle(self) -> None:
        """The noted calls have returned: hook each one's backward node, with what its outputs hold."""
        pending, self.pending = self.pending, []
        for call in pending:
            if any(t._version != v and id(t) not in call.before for t, v in call.versions):
                raise ValueError(
                    f"batchlayers: the forward of {call.title} in a stacked model writes in place into one of its "
                    "arguments that requires gradients (ctx.mark_dirty), or by code batchlayers does not see; "
                    "batchlayers, recomputing the Function per model in backward, cannot undo that. Write into a "
                    "copy, or stack with execution='model_by_model'"
                )
            for t in call.made:
                node = t.grad_fn
                if isinstance(node, _NODE) and getattr(node, "_forward_cls", None) is call.cls:
                    if call.node is None:
                        call.node = node
                    if node is call.node:
                        call.output_tags.setdefault(t.output_nr, get_tag(t))
                        if get_tag(t) is None:  # made from values every model shares (see untracked)
                            t._batchlayers_seen = True  # (syntax: see set_tag)
            node, call.node = call.node, None
            if node is not None:
                # Autograd runs node._forward_cls.backward (looked up on the node): each model's instead of the
                # Function's own on the folded gradient, which may not even run on it (a per-model argument's).
                node._batchlayers_call = call
                node._forward_cls = _EachModels
                node.set_materialize_grads(False)  # (an output that no gradient reached: None, not zeros)
            call.frame, call.made, call.known, call.versions = None, [], set(), []


def _left_alone(cls: type) -> bool:
    """batchlayers' own Functions and torch's, and a noted call's node (see :meth:`Calls.settle`)."""
    return cls is _EachModels or (getattr(cls, "__module__", "") or "").startswith(("batchlayers.", "torch."))


def _outermost_apply(frame: FrameType | None) -> FrameType | None:
    """The frame of the outermost ``Function.apply`` of a Function that is not batchlayers' own nor torch's,
    among ``frame`` and its callers (None: not inside one). torch's are left alone: ``torch.utils.checkpoint``'s
    (see ``Tracker.refuse_checkpointing``), the graphs ``torch.compile`` runs as Functions, and the rest, whose
    backward computes each row from its own (``torch.distributions``' Dirichlet draws)."""
    found = None
    while frame is not None:
        if frame.f_code is _APPLY:
            if not _left_alone(frame.f_locals.get("cls")):  # type: ignore[arg-type]
                found = frame
        frame = frame.f_back
    return found


def _context(apply: FrameType) -> Any:
    """The backward node of the call whose ``Function.apply`` runs in ``apply``: the ``ctx`` its forward was
    given (None for a Function with ``setup_context``, whose forward has none; found from its outputs)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_back is not apply:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_argcount:
        return None
    ctx = frame.f_locals.get(frame.f_code.co_varnames[0])
    return ctx if isinstance(ctx, _NODE) else None
