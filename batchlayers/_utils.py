"""Validation and initialisation helpers shared by every batched layer."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

__all__ = [
    "check_call_input",
    "check_num_models",
    "check_device",
    "check_input",
    "check_layout",
    "check_norm_dtypes",
    "check_parameter",
    "check_size",
    "check_sizes",
    "check_weight",
    "autocast_enabled",
    "in_order",
    "init_per_model_",
    "is_shared",
    "layer_name",
    "model_count_holders",
    "set_num_models_",
    "stride_order",
]


def layer_name(module: nn.Module, name: str | None = None) -> str:
    """The name used in error messages: ``name`` (default: the class name), with the module path when the
    layer knows it."""
    path = getattr(module, "_batchlayers_path", None)
    name = type(module).__name__ if name is None else name
    return f"{name} at '{path}'" if path else name


def check_num_models(num_models: int, cls: type) -> int:
    if isinstance(num_models, bool) or not isinstance(num_models, int):
        raise TypeError(f"{cls.__name__}: num_models must be an int, got {type(num_models).__name__}")
    if num_models < 1:
        raise ValueError(f"{cls.__name__}: num_models must be at least 1, got {num_models}")
    return num_models


def _fmt(shape: Sequence[object]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def check_input(
    module: nn.Module,
    x: Tensor,
    *,
    channels: tuple[str, int] | None = None,
    trailing: Sequence[tuple[str, int]] = (),
    ndims: Sequence[int] | None = None,
    min_ndim: int = 2,
    what: str = "input",
    layout: str = "(M, B, *)",
    check_dtype: bool = True,
) -> None:
    """Check that ``x`` is ``(M, ...)`` with the given sizes; raise naming the layer otherwise.

    ``channels`` is the ``(name, size)`` of dimension 2, the channel dimension of ``(M, B, C, *)`` inputs
    (e.g. ``("C_in", 3)``); ``trailing`` lists ``(name, size)`` pairs for the last dimensions (e.g.
    ``[("in_features", 20)]``); ``ndims`` the allowed total numbers of dimensions (``None``: any number
    >= ``min_ndim``). ``check_dtype``: also refuse an input whose dtype differs from the layer's floating-point
    parameters outside autocast, as torch's kernels do (norms, which take mixed precision, and index inputs
    pass ``False``).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer_name(module)}: expected the {what} to be a Tensor, got {type(x).__name__}")
    check_device(module, x, what)
    check_layout(module, cast(int, module.num_models), x, channels, trailing, ndims, min_ndim, what, layout)
    if check_dtype:
        _check_input_dtype(module, x, what)


def check_call_input(
    function: str,
    x: object,
    num_models: int,
    *,
    channels: tuple[str, int] | None = None,
    trailing: Sequence[tuple[str, int]] = (),
    ndims: Sequence[int] | None = None,
    min_ndim: int = 2,
    what: str = "input",
    layout: str = "(M, B, *)",
) -> None:
    """:func:`check_input` for a call of ``batchlayers.functional``: ``num_models`` comes from the weights."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{function}: expected the {what} to be a Tensor, got {type(x).__name__}")
    check_layout(function, num_models, x, channels, trailing, ndims, min_ndim, what, layout)


def check_layout(
    name: str | nn.Module,
    num_models: int,
    x: Tensor,
    channels: tuple[str, int] | None,
    trailing: Sequence[tuple[str, int]],
    ndims: Sequence[int] | None,
    min_ndim: int,
    what: str,
    layout: str,
) -> None:
    """Raise naming ``name`` (a layer: its :func:`layer_name`) where ``x``'s dimensions are not the layout's.
    Every batched layer checks every call, so the message is only written for an input that fails."""
    dim, shape = x.dim(), x.shape

    def expected(article: str = "") -> str:  # the message's start, written only for an input that fails
        named = [channels, *trailing] if channels is not None else list(trailing)
        label = layer_name(name) if isinstance(name, nn.Module) else name
        return f"{label}: expected {article}{what} {layout} with M={num_models}" + "".join(
            f", {n}={s}" for n, s in named
        )

    if ndims is not None and dim not in ndims:
        allowed = " or ".join(str(n) for n in ndims)
        raise ValueError(expected(f"a {allowed}-D ") + f", got {dim}-D shape {_fmt(shape)}")
    if dim < max(min_ndim, 1 + len(trailing), 3 if channels is not None else 0):
        raise ValueError(expected() + f", got too few dimensions: shape {_fmt(shape)}")
    if shape[0] != num_models:
        raise ValueError(
            expected() + f", but dimension 0 (models) is {shape[0]}, not {num_models}: shape {_fmt(shape)}"
        )
    if channels is not None and shape[2] != channels[1]:
        raise ValueError(expected() + f", but dimension 2 (channels) is {shape[2]}: shape {_fmt(shape)}")
    for k, (dim_name, size) in enumerate(reversed(trailing)):
        d = dim - 1 - k
        if shape[d] != size:
            raise ValueError(expected() + f", but dimension {d} ({dim_name}) is {shape[d]}: shape {_fmt(shape)}")


def _check_input_dtype(module: nn.Module, x: Tensor, what: str) -> None:
    # torch.nn's Linear, Conv*, PReLU and attention raise for an input whose dtype is not their weights' (outside
    # autocast), with messages about "batch1", "bias type" or "scalar type Double" that name no layer.
    reference = _first_tensor(module)
    if reference is None or not reference.is_floating_point() or x.dtype == reference.dtype:
        return
    if autocast_enabled(x):
        return  # autocast casts the operands of the ops on its lists; torch decides
    hint = f" or the layer (.to({x.dtype}))" if x.is_floating_point() else ""
    raise RuntimeError(
        f"{layer_name(module)}: expected the {what} in the parameters' dtype {reference.dtype}, got {x.dtype}; "
        f"convert the {what} (.to({reference.dtype})){hint}"
    )


def check_weight(function: str, what: str, t: object, ndim: int, layout: str) -> torch.Size:
    """The shape of a ``batchlayers.functional`` call's ``ndim``-D parameter ``t`` (``layout``, e.g.
    ``"(M, out_features, in_features)"``), or a ``TypeError``/``ValueError`` naming the call."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{function}: expected {what} {layout} to be a Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{function}: expected a {ndim}-D {what} {layout}, got {t.dim()}-D shape {_fmt(t.shape)}")
    return t.shape


def check_parameter(
    function: str, what: str, t: object, expected: Sequence[int], layout: str, input: Tensor | None = None
) -> None:
    """Refuse an optional per-model parameter ``t`` (``None`` passes) that is not exactly ``expected``: a bias
    ``(1, out)`` or ``(out,)`` would broadcast over the models, giving every model the same values. ``input``:
    the tensor ``expected`` was read from, named in the message."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{function}: expected {what} {layout} to be a Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(expected):
        source = "" if input is None else f" for the input of shape {_fmt(input.shape)}"
        raise ValueError(f"{function}: expected {what} {layout} = {_fmt(expected)}{source}, got shape {_fmt(t.shape)}")


def check_size(owner: str, name: str, value: object, minimum: int = 0) -> int:
    """A layer's size argument (``in_features``, ``num_channels``...): an int of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")
    return int(value)


def check_sizes(owner: str, name: str, value: object, n: int, minimum: int) -> tuple[int, ...]:
    """An int or a tuple of ``n`` ints, each at least ``minimum`` (``kernel_size``, ``stride``...), as a tuple;
    ``torch.nn.modules.utils._ntuple`` keeps a sequence of the wrong length as it is."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    if len(values) != n or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TypeError(f"{owner}: {name} must be an int or a tuple of {n} ints, got {value!r}")
    ints = cast("tuple[int, ...]", values)  # (checked above)
    if any(v < minimum for v in ints):
        raise ValueError(f"{owner}: every entry of {name} must be >= {minimum}, got {value!r}")
    return ints


def _first_tensor(module: nn.Module) -> Tensor | None:
    """The layer's first parameter or buffer (its own first, then its submodules'), or ``None``."""
    for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
            if t is not None:
                return t
    for t in (*module.parameters(), *module.buffers()):
        return t
    return None


def check_device(module: nn.Module, x: Tensor, what: str) -> None:
    """Raise naming the layer when ``x`` is not on the device of the layer's parameters (if it has any)."""
    # torch.nn raises for most mixes (a meta input with CPU weights, a CUDA input with CPU weights), but some
    # of its kernels silently return uninitialised memory for them (F.conv*d with meta weights and a CPU input,
    # F.embedding with meta indices); so every batched layer refuses every mix.
    reference = _first_tensor(module)
    if reference is not None and x.device != reference.device:
        raise RuntimeError(
            f"{layer_name(module)}: expected the {what} on {reference.device}, where the layer's parameters are, "
            f"got it on {x.device}; move the {what} (.to({str(reference.device)!r})) or the layer"
        )


_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def check_norm_dtypes(owner: nn.Module | str, x: Tensor, params: Sequence[Tensor | None]) -> bool:
    """torch's dtype rule for a normalization's parameters (weight, bias, running statistics); returns whether
    the call is mixed-precision.

    As torch.nn's norm kernels do: parameters of the input's dtype, or float32 parameters with a float16 or
    bfloat16 input (mixed precision: computed in float32, the result in the input's dtype); any other mix
    raises a ``RuntimeError``, as torch's does.
    """
    dtypes = {p.dtype for p in params if p is not None}
    if not dtypes or dtypes == {x.dtype}:
        return False
    if x.dtype in _REDUCED_FLOATS and dtypes == {torch.float32}:
        return True
    name = layer_name(owner) if isinstance(owner, nn.Module) else owner
    found = ", ".join(sorted(str(d) for d in dtypes))
    raise RuntimeError(
        f"{name}: input dtype {x.dtype} does not match the parameters' ({found}); like torch.nn's norms, this "
        "layer takes parameters of the input's dtype, or float32 parameters with a float16/bfloat16 input"
    )


def function_transform_active() -> bool:
    """A ``torch.func`` transform (``vmap``, ``grad``, ...) is active: tensor values cannot be read (under
    ``vmap``) and batchlayers' own autograd Functions have no rule."""
    return torch._C._are_functorch_transforms_active()


_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def global_module_hooks() -> bool:
    """Whether a hook registered for every module (``nn.modules.module.register_module_forward_hook``, ...) is
    set: it sees each layer's own tensors."""
    return any(getattr(_module, name) for name in _GLOBAL_HOOKS)


def no_function_transforms() -> bool:
    """Neither a ``torch.func`` transform nor forward-mode AD is active: batchlayers' own autograd Functions, which
    have no vmap or jvp rule, may run."""
    return not function_transform_active() and torch.autograd.forward_ad._current_level < 0


def autocast_enabled(x: Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type (``False`` for a device autocast does not know, e.g. meta,
    where ``torch.is_autocast_enabled`` raises)."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except RuntimeError:
        return False


def stride_order(t: Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from the largest stride to the smallest (ties, as of size-1 dimensions, in order)."""
    strides = t.stride()
    return tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))


def in_order(t: Tensor, order: Sequence[int]) -> Tensor:
    """``t`` with its dimensions laid out in ``order`` (outermost first), copied only where they are not so
    already; autograd records the copy."""
    ordered = t.permute(tuple(order))
    if ordered.is_contiguous():
        return t
    return ordered.contiguous().permute(sorted(range(len(order)), key=list(order).__getitem__))


def is_shared(x: Tensor) -> bool:
    """True when ``x`` is one batch shared by every model, passed as ``batch.expand(M, *batch.shape)``."""
    return x.dim() > 0 and x.shape[0] > 1 and x.stride(0) == 0


@torch.no_grad()
def init_per_model_(tensor: Tensor, init_fn: Callable[[Tensor], object]) -> Tensor:
    """Apply a ``torch.nn.init``-style function to each model's slice on its own.

    Calling ``torch.nn.init`` on the stacked ``(M, *shape)`` tensor would compute the fan from the wrong
    dimensions; a slice per model has exactly the shape the torch.nn layer initialises.
    """
    for model_slice in tensor.unbind(0):
        init_fn(model_slice)
    return tensor


def model_count_holders(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules that record how many models they hold (an int ``num_models``)."""
    return [
        m
        for m in module.modules()
        if isinstance(getattr(m, "num_models", None), int) and not isinstance(m.num_models, bool)
    ]


def set_num_models_(module: nn.Module, num_models: int) -> None:
    """Record a new number of models on every submodule that keeps one, after its tensors were indexed."""
    for m in model_count_holders(module):
        m.num_models = num_models  # type: ignore[assignment]  # torch's stubs allow only tensors and modules
