"""transformers' mixture-of-experts layers in a stacked model: each model's own layer on its own tokens.

transformers (5.x) computes a mixture-of-experts layer in a class decorated with ``@use_experts_implementation``
(``MixtralExperts``, ``Qwen2MoeExperts``, ``GptOssExperts``, ...): ``forward(hidden_states, top_k_index,
top_k_weights)`` on rows of tokens, with the experts' weights in parameters shaped ``(num_experts, *)``, by the
implementation its configuration names. ``"eager"`` loops in Python over the experts that some token was routed
to and ``"grouped_mm"`` counts each expert's tokens: in a batched forward, where every model's tokens are rows of
one batch, each would read one answer for all models where every original model reads its own (the tracker
refuses both). ``"batched_mm"`` gathers every token's experts' weights and is followed as it is.

``stack`` swaps such a layer for a batched layer of its own class (:func:`batched_type`), which runs the
class's own ``forward`` once per model, on that model's rows of the three inputs with that model's slices of
the parameters: each original model's computation exactly, in the implementation its configuration names,
whatever it reads into Python. Where that implementation is one of transformers' own dense ones
(``grouped_mm``, ``batched_mm``), all models' tokens go through it in one call instead, as one layer of
``M * E`` experts (:func:`_all_models_at_once`). Like every batched layer it takes and returns ``(M, n, *)``
tensors; run model by model, the original class itself holds each model's slices.
"""

from __future__ import annotations

import copy
import sys
from types import CodeType
from typing import Any, cast

import torch
from torch import Tensor, nn

from ._architecture import tensor_table
from ._utils import layer_name

__all__ = ["batched_type", "claims"]

_BATCHED: dict[type, type] = {}  # transformers' experts class -> its batched counterpart
_DECORATED: list[CodeType | None] = []  # the code of use_experts_implementation's forward, once known


def _decorated_forward() -> CodeType | None:
    """The code object of the ``forward`` that ``use_experts_implementation`` gives every class it decorates
    (one function, a closure per class), or ``None`` while transformers' module is not loaded: a model made of
    transformers' classes has loaded it, and batchlayers never imports transformers itself."""
    if not _DECORATED:
        moe = sys.modules.get("transformers.integrations.moe")
        if moe is None:
            return None
        decorate = getattr(moe, "use_experts_implementation", None)
        code = None
        if callable(decorate):
            try:
                probe = decorate(type("_Probe", (nn.Module,), {"forward": lambda self, *args: None}))
                code = probe.forward.__code__
            except Exception:  # noqa: BLE001  (another transformers: nothing is recognised, the tracker decides)
                code = None
        _DECORATED.append(code)
    return _DECORATED[0]


def claims(torch_type: type) -> bool:
    """Whether ``torch_type`` is a transformers experts class (its ``forward`` is the decorator's dispatch);
    if so, its batched counterpart is registered."""
    code = _decorated_forward()
    forward = getattr(torch_type, "forward", None)
    if code is None or getattr(forward, "__code__", None) is not code:
        return False
    batched_type(torch_type)
    return True


def batched_type(torch_type: type) -> type:
    """The batched counterpart of the experts class ``torch_type`` (made and registered once per class): a
    subclass, so that everything the class's ``forward`` reads (``act_fn``, ``_apply_gate``, ``config``, ...)
    is there, whose ``forward`` runs the class's own once per model."""
    found = _BATCHED.get(torch_type)
    if found is None:
        from .registry import register

        found = _BATCHED[torch_type] = type(
            f"Batched{torch_type.__name__}",
            (_EachModelsLayer, torch_type),
            {"torch_module": torch_type, "__module__": __name__},
        )
        register(torch_type, found, to_batched=_to_batched, to_torch=_to_torch)
    return found


def _restore(torch_type: type) -> nn.Module:
    """Unpickling and deep-copying a batched experts layer: an empty instance of the (re-made) class."""
    return cast(nn.Module, object.__new__(batched_type(torch_type)))


class _EachModelsLayer(nn.Module):
    """The ``forward`` of a batched experts layer: the class's own, once per model (see the module docstring)."""

    torch_module: type
    _samples_in_every_input = True  # hidden states, expert indices and weights: each a row per token

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # the class is made at run time: pickles (torch.save of a stacked model) and copies name its torch class
        return (_restore, (type(self).torch_module,), self.__dict__)

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        return _each_model(self, args, kwargs)


@torch.compiler.disable  # views made with object.__new__ and data-dependent experts loops: run eagerly
def _each_model(self: _EachModelsLayer, args: tuple, kwargs: dict) -> Tensor:
    """The experts layer's class's own ``forward``, once per model, on model ``m``'s rows and slices."""
    torch_type = cast("type[nn.Module]", type(self).torch_module)
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    if not inputs or inputs[0].dim() < 2:
        raise ValueError(
            f"{layer_name(self)}: expected (M, n, *) inputs (M models' rows of tokens), got shapes "
            f"{[tuple(t.shape) for t in inputs]}"
        )
    num_models = inputs[0].shape[0]
    for t in inputs:
        if t.dim() < 2 or t.shape[:2] != inputs[0].shape[:2]:
            raise ValueError(
                f"{layer_name(self)}: every input must be (M, n, *) with the same M and n, got shapes "
                f"{[tuple(i.shape) for i in inputs]}"
            )
    tensors = tensor_table(self, remove_duplicate=True)
    together = _all_models_at_once(self, torch_type, args, kwargs, tensors)
    if together is not None:
        return together
    for name, t in tensors.items():
        if t.dim() == 0 or t.shape[0] != num_models:
            raise ValueError(
                f"{layer_name(self)}: its inputs hold {num_models} models, but '{name}' has shape {tuple(t.shape)}"
            )
    slices = {id(t): t.unbind(0) for t in tensors.values()}  # one autograd node per tensor, not M
    rows = {id(t): t.unbind(0) for t in inputs}
    outputs = []
    for m in range(num_models):
        one = _model_view(self, torch_type, slices, m)
        model_args = [rows[id(a)][m] if isinstance(a, Tensor) else a for a in args]
        model_kwargs = {k: rows[id(v)][m] if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        out = torch_type.forward(one, *model_args, **model_kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"{layer_name(self)}: expected one tensor from {torch_type.__name__}.forward, got {type(out).__name__}"
            )
        _check_unchanged(one, slices, m, layer_name(self))
        outputs.append(out)
    return torch.stack(outputs)


def _all_models_at_once(
    self: nn.Module, torch_type: type[nn.Module], args: tuple, kwargs: dict, tensors: dict[str, Tensor]
) -> Tensor | None:
    """Where the configuration names transformers' ``grouped_mm`` (its default), every model's tokens in one
    call, as one layer of ``M * E`` experts: model ``m``'s expert ``e`` is expert ``m * E + e`` of the stacked
    weights viewed ``(M * E, *)``. ``grouped_mm`` sorts the tokens by expert and computes each from its own
    experts' weights alone, so each model's tokens get exactly its own experts (measured with a scratch
    script: 1.35x the loop in training at M=8, against 1.22x one model at a time; ``batched_mm``, which
    gathers every token's experts' weights, stays per model: in one call for all models it inferred at 0.61x
    the loop, per model 1.02x). ``None``
    (each model on its own) for anything else: an ``eager`` loop (the class's own code), a post-expert norm,
    expert parallelism, tensors without the experts dimension, or an expert index outside ``[0, E)`` (which
    the original treats its own way)."""
    moe = sys.modules.get("transformers.integrations.moe")
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
    experts = getattr(self, "num_experts", None)
    if moe is None or kwargs or len(args) != 3 or not isinstance(experts, int) or not isinstance(implementation, str):
        return None
    interface = _dispatch(torch_type)
    grouped = getattr(moe, "grouped_mm_experts_forward", None)
    if interface is None or grouped is None or interface.get_interface(implementation, None) is not grouped:
        return None
    if getattr(self, "has_post_expert_norm", True) or getattr(self, "_is_expert_parallel", True) or self._buffers:
        return None
    hidden, index, weights = args
    num_models, rows = hidden.shape[:2]
    own = self._parameters.values()
    if len(own) != len(tensors) or any(t is None or t.dim() < 2 or t.shape[:2] != (num_models, experts) for t in own):
        return None
    if not isinstance(index, Tensor) or index.is_floating_point() or bool(((index < 0) | (index >= experts)).any()):
        return None
    view = _model_view(self, torch_type, {id(t): (t.flatten(0, 1),) for t in tensors.values()}, 0)
    view.__dict__["num_experts"] = num_models * experts
    shift = torch.arange(num_models, device=index.device).mul_(experts).view(num_models, *[1] * (index.dim() - 1))
    flat = [hidden.flatten(0, 1), (index + shift).flatten(0, 1), cast(Tensor, weights).flatten(0, 1)]
    out = torch_type.forward(view, *flat)
    return out.unflatten(0, (num_models, rows))


def _dispatch(torch_type: type) -> Any:
    """The experts interface the decorated ``forward`` of ``torch_type`` dispatches through (its closure's
    ``experts_interface``), or ``None``."""
    forward = getattr(torch_type, "forward", None)
    closure = getattr(forward, "__closure__", None) or ()
    cells = dict(zip(getattr(getattr(forward, "__code__", None), "co_freevars", ()), closure))
    cell = cells.get("experts_interface")
    interface = cell.cell_contents if cell is not None else None
    return interface if callable(getattr(interface, "get_interface", None)) else None


def _model_view(module: nn.Module, cls: type, slices: dict[int, tuple[Tensor, ...]], m: int) -> nn.Module:
    """``module`` as model ``m``'s: an instance of ``cls`` sharing its attributes, holding slice ``m`` of every
    parameter and buffer (its children's too). Nothing of ``module`` changes."""
    view = cast(nn.Module, object.__new__(cls))
    view.__dict__.update(module.__dict__)
    view.__dict__["_parameters"] = {k: None if t is None else slices[id(t)][m] for k, t in module._parameters.items()}
    view.__dict__["_buffers"] = {k: None if t is None else slices[id(t)][m] for k, t in module._buffers.items()}
    view.__dict__["_modules"] = {
        k: None if c is None else _model_view(c, type(c), slices, m) for k, c in module._modules.items()
    }
    return view


def _check_unchanged(view: nn.Module, slices: dict[int, tuple[Tensor, ...]], m: int, where: str) -> None:
    """A ``forward`` that assigned a parameter or buffer anew would have changed only a view: refused."""
    for module in view.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None and not any(t is s[m] for s in slices.values()):
                    raise ValueError(
                        f"{where}: its forward assigned '{name}' anew; a batched experts layer runs each model on "
                        "views of the stacked tensors and cannot keep such an assignment. Stack with "
                        "execution='model_by_model'"
                    )


def _to_batched(module: nn.Module, num_models: int) -> nn.Module:
    """A batched copy of the experts layer ``module``: its tensors ``(M, *)`` placeholders (``stack`` fills
    them), everything else deep-copied."""
    memo: dict[int, Any] = {}
    for t in tensor_table(module).values():
        if id(t) not in memo:
            data = torch.empty((num_models, *t.shape), dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
    batched = copy.deepcopy(module, memo)
    batched.__class__ = batched_type(type(module))
    return batched


def _to_torch(module: nn.Module) -> nn.Module:
    """The experts layer of transformers' own class with ``module``'s configuration and tensors (``unstack`` and
    a model-by-model pass put one model's in)."""
    from ._fold import detach_hooks

    plain = copy.deepcopy(module, {id(t): t for t in tensor_table(module).values()})
    plain.__class__ = cast(_EachModelsLayer, module).torch_module
    detach_hooks(plain)
    return plain
