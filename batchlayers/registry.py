"""The extension point: which batched layer stands for which torch.nn leaf type.

The converters swap every module whose type is registered here for its batched counterpart (and back).
batchlayers' own layers register themselves through their ``torch_module`` attribute on first use; users
add their own leaf types with :func:`register`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["constructor_kwargs", "isinstance_torch", "register"]


@dataclass(frozen=True)
class _Counterpart:
    torch_type: type
    batched_type: type
    to_batched: Callable[[nn.Module, int], nn.Module]
    to_torch: Callable[[nn.Module], nn.Module]


_BY_TORCH: dict[type, _Counterpart] = {}
_BY_BATCHED: dict[type, _Counterpart] = {}
_builtins_loaded = False


def constructor_kwargs(module: nn.Module, torch_type: type[object]) -> dict[str, object]:
    """The arguments of ``torch_type.__init__`` read back from ``module``'s attributes of the same names.

    torch.nn layers (and batchlayers' counterparts) keep their constructor arguments as attributes, except
    ``bias``, kept as a tensor or ``None``. Arguments whose names start with ``_`` and ``device``/``dtype``
    are left out.
    """
    kwargs = {}
    for name, param in inspect.signature(torch_type.__init__).parameters.items():
        if name in ("self", "device", "dtype") or name.startswith("_") or param.kind in (param.VAR_POSITIONAL,):
            continue
        if param.kind is param.VAR_KEYWORD:
            continue
        if not hasattr(module, name):
            raise TypeError(
                f"cannot read {torch_type.__name__}'s constructor argument '{name}' back from a "
                f"{type(module).__name__}: pass to_batched= and to_torch= functions to batchlayers.register"
            )
        value = getattr(module, name)
        if isinstance(param.default, bool) and (value is None or isinstance(value, Tensor)):
            value = value is not None  # e.g. bias=True is kept as the bias parameter itself
        kwargs[name] = value
    return kwargs


def _accepts_device(cls: type[object]) -> bool:
    return "device" in inspect.signature(cls.__init__).parameters


def register(
    torch_type: type,
    batched_type: type,
    *,
    to_batched: Callable[[nn.Module, int], nn.Module] | None = None,
    to_torch: Callable[[nn.Module], nn.Module] | None = None,
) -> None:
    """Tell the converters that ``batched_type`` stands for ``torch_type`` (the extension point).

    ``stack`` then swaps every module of exactly ``torch_type`` (not its subclasses: a subclass may compute
    something else) for a ``batched_type``, and ``unstack`` swaps back. The batched layer must follow the
    batchlayers contract: called with ``(M, B, *)`` tensors, parameters and buffers with ``torch_type``'s
    names shaped ``(M, *torch shape)``.

    Args:
        torch_type: the ordinary module type, e.g. your own ``MyNorm``.
        batched_type: its batched counterpart, e.g. ``BatchedMyNorm``.
        to_batched: ``(module, num_models) -> batched module`` with the module's configuration; its tensors'
            values do not matter (they are replaced). Default: ``batched_type(num_models, **args)`` with
            ``torch_type``'s constructor arguments read from the module's attributes of the same names.
        to_torch: ``(batched module) -> torch_type module`` with that configuration. Default: the same way.
    """
    for t, what in ((torch_type, "torch_type"), (batched_type, "batched_type")):
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register: {what} must be an nn.Module subclass, got {t!r}")

    def default_to_batched(module: nn.Module, num_models: int) -> nn.Module:
        device = {"device": "meta"} if _accepts_device(batched_type) else {}
        return batched_type(num_models, **constructor_kwargs(module, torch_type), **device)

    def default_to_torch(module: nn.Module) -> nn.Module:
        device = {"device": "meta"} if _accepts_device(torch_type) else {}
        return torch_type(**constructor_kwargs(module, torch_type), **device)

    entry = _Counterpart(torch_type, batched_type, to_batched or default_to_batched, to_torch or default_to_torch)
    _BY_TORCH[torch_type] = entry
    _BY_BATCHED[batched_type] = entry


def load_builtins() -> None:
    """Register every batchlayers layer (a class with ``torch_module``) for its torch.nn type."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    from . import activation, batchnorm, conv, linear, normalization, sparse  # (need not load with the registry)

    for module in (linear, conv, batchnorm, normalization, sparse, activation):
        for attr in module.__all__:
            cls = getattr(module, attr)
            torch_type = getattr(cls, "torch_module", None)
            if isinstance(cls, type) and torch_type is not None and torch_type not in _BY_TORCH:
                register(torch_type, cls)
    _builtins_loaded = True


def counterpart_of(torch_type: type) -> _Counterpart | None:
    load_builtins()
    found = _BY_TORCH.get(torch_type)
    if found is None:
        from . import _experts  # transformers' mixture-of-experts layers: registered when first seen

        if _experts.claims(torch_type):
            found = _BY_TORCH[torch_type]
    return found


def counterpart_of_batched(batched_type: type) -> _Counterpart | None:
    load_builtins()
    return _BY_BATCHED.get(batched_type)


def isinstance_torch(module: nn.Module, classinfo: type | tuple[type, ...]) -> bool:
    """``isinstance`` that also counts a batched layer as an instance of the torch.nn type it stands for.

    Batched layers do not subclass their torch.nn counterparts, on purpose: code that tests
    ``isinstance(m, nn.Linear)`` and then reads ``m.weight`` as a 2-D matrix (``nn.init`` schemes, optimizer
    group builders) would silently compute wrong things on ``(M, out, in)`` weights. In a stacked model
    ``isinstance(m, nn.Linear)`` is therefore ``False``; code that only needs to know what a module is (e.g.
    to put its weight in a weight-decay group) uses ``isinstance_torch(m, nn.Linear)`` instead.

    A batched layer stands for the type it was registered for (:func:`register`), else for the type named
    by its class's ``torch_module`` attribute.
    """
    types = classinfo if isinstance(classinfo, tuple) else (classinfo,)
    if not all(isinstance(t, type) for t in types):
        raise TypeError(
            f"isinstance_torch: classinfo must be a type or a tuple of types (e.g. nn.Linear), got {classinfo!r}"
        )
    if isinstance(module, classinfo):
        return True
    registered = counterpart_of_batched(type(module))
    torch_type = registered.torch_type if registered else getattr(type(module), "torch_module", None)
    return torch_type is not None and issubclass(torch_type, classinfo)
