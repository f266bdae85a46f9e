"""What every batched optimizer shares: per-model hyperparameters, the active mask, state handling."""

from __future__ import annotations

import functools
import math
import numbers
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import _native

__all__ = ["PerModelValue"]

Hyperparameter = float | Tensor


class PerModelValue(Tensor):
    r"""An ``(M,)`` hyperparameter tensor as stored in a batched optimizer's ``param_groups``.

    A plain tensor in every respect (operations on it return plain tensors) except ``fill_``, which also
    accepts an ``(M,)`` tensor and copies it. ``torch.optim.lr_scheduler`` writes a new learning rate into an
    existing tensor with ``group["lr"].fill_(new_lr)``; for a per-model learning rate ``new_lr`` is the
    ``(M,)`` tensor the schedule computed, which a plain ``fill_`` rejects.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # (stubs: a classmethod)

    def fill_(self, value):
        if isinstance(value, Tensor) and value.dim() > 0:
            if value.shape != self.shape:
                raise ValueError(
                    f"cannot set a per-model hyperparameter of shape {tuple(self.shape)} to a value of shape "
                    f"{tuple(value.shape)} (a scheduler left behind by keep_models_? pass it as "
                    "keep_models_(..., schedulers=[scheduler]))"
                )
            return self.copy_(value)
        return super().fill_(value)

    def __float__(self) -> float:
        if self.numel() != 1:
            raise ValueError(
                f"a per-model hyperparameter of shape {tuple(self.shape)} has no single float value (torch's "
                "ReduceLROnPlateau reads one for all models); for one metric per model use "
                "batchlayers.optim.lr_scheduler.ReduceLROnPlateau, which reduces each model's lr on its own plateau"
            )
        return super().__float__()

    def plain(self) -> Tensor:
        """This tensor as a plain :class:`torch.Tensor` (the same memory), made once and kept while it stays
        that: ``as_subclass`` makes a new alias each call, about 5 us of a 100 us optimizer step on a tiny MLP."""
        alias = self.__dict__.get("_plain")
        if (
            alias is None
            or alias.data_ptr() != self.data_ptr()
            or alias.dtype != self.dtype
            or alias.shape != self.shape
            or alias.stride() != self.stride()
        ):
            alias = self.__dict__["_plain"] = self.as_subclass(Tensor)
        return alias

    def __deepcopy__(self, memo: dict) -> PerModelValue:
        return self.as_subclass(Tensor).clone().as_subclass(PerModelValue)

    def __reduce_ex__(self, protocol):
        # Pickle as a plain tensor and wrap again on load, so checkpoints load with ``weights_only=True``.
        return _as_per_model_value, (self.as_subclass(Tensor).clone(),)


def _as_per_model_value(tensor: Tensor) -> PerModelValue:
    return tensor.as_subclass(PerModelValue)


def hyperparameter_dtype(device: torch.device) -> torch.dtype:
    # Per-model arithmetic (bias corrections, schedules) runs in float64 like torch's Python-float
    # hyperparameters, where the device has float64.
    return torch.float32 if device.type == "mps" else torch.float64


def broadcast_per_model(value: float | Tensor, like: Sequence[Tensor]) -> float | list[Tensor]:
    """A float stays a float. An ``(M,)`` tensor becomes, for each tensor in ``like``, an ``(M, 1, ..., 1)``
    view in its dtype, so a ``torch._foreach_*`` op applies model ``m``'s value to slice ``m``; row ``i`` of a
    ``(len(like), M)`` tensor (a value that depends on each parameter's own step counts) goes to ``like[i]``."""
    if not isinstance(value, Tensor):
        return value
    values = value.to(like[0].dtype)
    if values.dim() == 2:
        return [row.view(-1, *([1] * (t.dim() - 1))) for row, t in zip(values, like)]
    return [values.view(-1, *([1] * (t.dim() - 1))) for t in like]


# Each helper below rounds as the torch op that torch.optim calls with a float does, for a float or a
# per-model ``scale``: on CPU ``add(alpha=s)`` and ``addcmul`` round once (an FMA), ``addcdiv(value=s)``
# computes ``(s * a) / b``. So every model's slice equals its own torch.optim step bit for bit (float64
# and float32, tests/test_optim.py); ``a + mul(b, s)`` would round twice and differ in the last bit.


def foreach_add_scaled(tensors: list[Tensor], others: list[Tensor], scale: float | list[Tensor]) -> tuple[Tensor, ...]:
    """``tensors + scale * others`` as ``torch.add(tensors, others, alpha=scale)`` rounds it."""
    if isinstance(scale, list):
        return torch._foreach_addcmul(tensors, others, scale)
    return torch._foreach_add(tensors, others, alpha=scale)


def foreach_add_scaled_(tensors: list[Tensor], others: list[Tensor], scale: float | list[Tensor]) -> None:
    """``tensors += scale * others``, in place."""
    if isinstance(scale, list):
        torch._foreach_addcmul_(tensors, others, scale)
    else:
        torch._foreach_add_(tensors, others, alpha=scale)


def foreach_addcmul_scaled_(
    tensors: list[Tensor], factors: list[Tensor], others: list[Tensor], scale: float | list[Tensor]
) -> None:
    """``tensors += scale * factors * others`` as ``addcmul_(factors, others, value=scale)`` rounds it."""
    if isinstance(scale, list):
        _per_model_scaled_(torch._foreach_addcmul_, tensors, factors, others, scale)
    else:
        torch._foreach_addcmul_(tensors, factors, others, value=scale)


def foreach_addcdiv_scaled_(
    tensors: list[Tensor],
    numerators: list[Tensor],
    denominators: list[Tensor] | tuple[Tensor, ...],
    scale: float | list[Tensor],
) -> None:
    """``tensors += scale * numerators / denominators`` as ``addcdiv_(..., value=scale)`` rounds it."""
    if isinstance(scale, list):
        _per_model_scaled_(torch._foreach_addcdiv_, tensors, numerators, list(denominators), scale)
    else:
        torch._foreach_addcdiv_(tensors, numerators, denominators, value=scale)


# From this many elements a model slice, a per-model scale is applied slice by slice with one float each (the
# op torch.optim runs on that model, with its ``value=``) rather than by first multiplying the whole first
# operand by the ``(M, 1, ...)`` scale, a copy as large as the parameter: an allocation that glibc serves with
# fresh pages every step once it passes its mmap threshold (32 MiB at most). Measured on 2 CPU cores (float32
# addcdiv_, medians of 20 calls, whole tensor -> slices): 65,536 elements a slice 0.47 -> 0.50 ms at M=16,
# 4.5 -> 4.3 ms at M=64, 56 -> 17 ms at M=256; 16,384 a slice 0.56 -> 1.6 ms (M=64) and 4.6 -> 7.8 ms (M=256),
# each slice costing about 11 us of its own. One step over a 784-256-256-10 MLP's parameters (M=64, two of
# its six tensors sliced) with an (M,) learning rate, as a ratio to torch's foreach step in the same run
# (``python -m benchmarks.optimizers --sets mlp-wide-64``): Adam 1.40x -> 1.01x, AdamW 1.17x -> 0.95x.
SLICED_SCALE_MIN_NUMEL = 1 << 16
_SLICED_DTYPES = (torch.float32, torch.float64)


def _per_model_scaled_(
    op: Callable[..., None], tensors: list[Tensor], first: list[Tensor], second: list[Tensor], scale: list[Tensor]
) -> None:
    """``op(tensors, first, second)`` with ``first`` scaled by each model's value in ``scale`` (``(M, 1, ...)``
    views in each tensor's dtype), rounding as ``op`` with that model's float ``value=`` would."""
    whole: list[int] = []
    sliced: list[int] = []
    for i, t in enumerate(tensors):
        large = t.dim() > 0 and t.numel() >= SLICED_SCALE_MIN_NUMEL * t.shape[0]
        (sliced if large and t.device.type == "cpu" and t.dtype in _SLICED_DTYPES else whole).append(i)
    if not sliced:  # (small models: no list copies)
        op(tensors, torch._foreach_mul(first, scale), second)
        return
    if whole:
        scaled = torch._foreach_mul([first[i] for i in whole], [scale[i] for i in whole])
        op([tensors[i] for i in whole], scaled, [second[i] for i in whole])
    values = [value for i in sliced for value in scale[i].reshape(-1).tolist()]
    slices = [[t[i][m] for i in sliced for m in range(tensors[i].shape[0])] for t in (tensors, first, second)]
    op(*slices, values)


def new_step_counts(param: Tensor) -> Tensor:
    """Steps taken by each model, ``(M,)``: models may be at different steps (``step(active=...)``)."""
    return torch.zeros(param.shape[0], dtype=torch.float32, device=param.device)


def increment_steps(steps: list[Tensor]) -> None:
    """Count one step for every model of every parameter in ``steps``: one add on the tensor whose rows they
    are, where they are all its rows in order (as :meth:`BatchedOptimizer.step` creates them, one row per
    parameter), else a foreach add (a parameter without a gradient, or counts loaded or replaced one by one).
    One add instead of one per parameter: 3 us against 10 (4 parameters) and 44 (20), 1 thread."""
    base = rows_of_one_tensor(steps)
    if base is not None:
        base.add_(1.0)
    else:
        torch._foreach_add_(steps, 1.0)


def remember(cache: dict, key: Any, value: Any, size: int = 64) -> None:
    """``cache[key] = value``, emptying the cache first when it holds ``size`` entries: entries keyed by the
    ids of state tensors stay behind when a state dict is loaded, and hold those tensors."""
    if len(cache) >= size and key not in cache:
        cache.clear()
    cache[key] = value


def rows_of_one_tensor(steps: list[Tensor]) -> Tensor | None:
    """The tensor whose rows ``steps`` are, all of them in order, or ``None``."""
    base = None if torch.compiler.is_compiling() else steps[0]._base
    if base is not None and base.dim() == 2 and base.shape[0] == len(steps):
        width, start = base.shape[1], base.storage_offset()
        if base.stride() == (width, 1) and all(
            s._base is base and s.storage_offset() == start + i * width and s.shape == (width,) and s.stride() == (1,)
            for i, s in enumerate(steps)
        ):
            return base
    return None


def _traced_or_profiled() -> bool:
    """Whether torch.optim's ``record_function`` labels would be seen: dynamo traces the call (asked first: it
    cannot trace the profiler's state) or a profiler runs."""
    return torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled()


def _step_with_hooks(step: Callable) -> Callable:
    """An optimizer's ``step`` as torch.optim wraps it (:meth:`Optimizer.profile_hook_step`: step pre- and
    post-hooks, global ones included, run inside a ``record_function`` named ``Optimizer.step#<class>.step``),
    calling ``step`` directly while nothing would see that wrapper: no step hook registered, not traced by
    dynamo, no profiler running (:func:`_traced_or_profiled`). Entering and leaving the empty label alone
    costs about 20 us, where torch's fused Adam kernel takes 11 us on the 10-20-2 MLP at M=64 (1 thread)."""
    hooked = Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def wrapper(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        if (
            _traced_or_profiled()
            or self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
        ):
            return hooked(self, *args, **kwargs)
        return step(self, *args, **kwargs)

    return wrapper


def steps_after_increment(steps: list[Tensor]) -> float | Tensor:
    """Each model's step count including the step being taken, as torch's Adam reads it (a Python float).

    One float when every model of every parameter is at the same step (the usual case); an ``(M,)`` tensor
    in the hyperparameter dtype when only the models differ (after ``step(active=...)``); a
    ``(len(steps), M)`` one when parameters of one model differ too (some had no gradient). The fewer
    distinct values, the fewer ``pow`` calls for the bias corrections.
    """
    stacked = torch.stack(steps)
    if stacked.numel() == 0:
        return 1.0
    if torch.compiler.is_compiling():
        # Comparing the counts would read tensor values, which a compiled graph cannot branch on.
        return stacked.to(hyperparameter_dtype(stacked.device)) + 1
    row = stacked[0]
    if torch.equal(stacked, row.expand_as(stacked)):
        if torch.equal(row, row[:1].expand_as(row)):
            return row[0].item() + 1
        stacked = row
    return stacked.to(hyperparameter_dtype(stacked.device)) + 1


def power(base: float | Tensor, exponent: float | Tensor, device: torch.device) -> float | Tensor:
    """``base ** exponent`` as Python computes it for floats (the C library's ``pow``), element-wise.

    torch's vectorised CPU ``pow`` (SLEEF) differs from the C library's in the last bit for some inputs
    (measured: ``beta ** step`` and ``x ** 0.5`` on random float64 values), and ``sqrt`` differs from
    ``x ** 0.5``. A strided output keeps TensorIterator on its element-by-element loop, which calls
    ``std::pow``: per-model bias corrections then equal torch.optim's Python-float ones.
    """
    if not isinstance(base, Tensor) and not isinstance(exponent, Tensor):
        return base**exponent
    dtype = hyperparameter_dtype(device)
    base = torch.as_tensor(base, dtype=dtype, device=device)
    exponent = torch.as_tensor(exponent, dtype=dtype, device=device)
    if torch.compiler.is_compiling():
        return torch.pow(base, exponent)  # a compiled step computes pow with its own kernel (ulps apart)
    shape = torch.broadcast_shapes(base.shape, exponent.shape)
    out = torch.empty(*shape, 2, dtype=dtype, device=device)[..., 0]
    return torch.pow(base, exponent, out=out).contiguous()


def divide(numerator: float | Tensor, denominator: float | Tensor, device: torch.device) -> float | Tensor:
    """``numerator / denominator`` for floats or tensors, as a true division (``float / tensor`` in Python
    multiplies by the reciprocal, which rounds differently)."""
    if not isinstance(numerator, Tensor) and not isinstance(denominator, Tensor):
        return numerator / denominator
    return torch.div(torch.as_tensor(numerator, dtype=hyperparameter_dtype(device), device=device), denominator)


def is_zero(value: Hyperparameter) -> bool:
    return not isinstance(value, Tensor) and value == 0


def zero_models(value: Hyperparameter) -> Tensor | None:
    """The indices of the models whose per-model ``value`` is 0, or ``None`` for a float or when none is."""
    if not isinstance(value, Tensor):
        return None
    indices = (value == 0).nonzero().squeeze(1)
    return indices if indices.numel() else None


def save_models(tensors: Iterable[Tensor], models: Tensor | None) -> list[tuple[Tensor, Tensor]]:
    """Copies of the ``models`` slices of each tensor, for :func:`restore_models`."""
    return [] if models is None else [(t, t.index_select(0, models)) for t in tensors]


def restore_models(saved: list[tuple[Tensor, Tensor]], models: Tensor | None) -> None:
    """Put the slices :func:`save_models` copied back, exactly."""
    for tensor, old in saved:
        tensor.index_copy_(0, cast(Tensor, models), old)


# -- compiled kernels (``fused=True``) ---------------------------------------------------------------------
#
# A kernel is a plain function over the parameter list that ``torch.compile`` turns into one loop per
# parameter (inductor: C++/OpenMP on CPU, Triton on GPU). The helpers below make it round as the foreach
# path does: inductor computes ``a * b + c`` with two roundings on CPU (``-ffp-contract=off``), so where
# torch's eager kernel uses an FMA (``add(alpha=)``, ``addcmul``, ``lerp``) the kernel asks for one. Run
# uncompiled (e.g. past dynamo's recompile limit) the helpers are the eager ops themselves.


# The dtypes in which ``fused=True`` with float hyperparameters, every model at one step, runs torch's own
# fused kernel over the stacked tensors (one call, nothing to compile; the models share every value, so it
# is torch's ``fused=True`` step on each). float64 keeps the compiled kernel, which equals the foreach path
# bit for bit (torch's kernel rounds the bias corrections and the square root its own way), and so do
# float16 and bfloat16: torch 2.13's CPU fused SGD is wrong in them (4 steps on 1000 elements against
# float64: momentum buffers off by 6.3 in bfloat16 and inf in float16, where the foreach path is off by
# 0.05 and 0.004).
TORCH_FUSED_DTYPES = frozenset({torch.float32})


def torch_fused_kernel(name: str, tensors: Sequence[Sequence[Tensor]], *values: float | Tensor) -> Callable | None:
    """``torch._fused_<name>_`` where it serves these tensor lists (of one dtype and device, as the optimizer
    buckets them), or ``None``: a per-model (tensor) value or step among ``values``, a dtype outside
    :data:`TORCH_FUSED_DTYPES`, a device other than CPU and CUDA, or a tensor that is not contiguous (torch
    2.13's CPU kernel steps a transposed or channels-last parameter wrongly when its gradient is contiguous:
    off by 0.06 after 3 Adam steps on 30 elements)."""
    for value in values:
        if isinstance(value, Tensor):
            return None
    first = tensors[0][0]
    if first.dtype not in TORCH_FUSED_DTYPES or first.device.type not in ("cpu", "cuda"):
        return None
    for ts in tensors:
        for t in ts:
            if not t.is_contiguous():
                return None
    return getattr(torch, f"_fused_{name}_", None)


# Up to this many elements in a bucket, ``fused=True`` with a per-model learning rate or weight decay (the
# other values floats, every model at one step) runs torch's fused kernel at a unit learning rate on zeroed
# scratch tensors, then adds those, each model's slice scaled by its own rate, to the parameters; weight
# decay is applied before, as the foreach path does. Two passes more than the compiled kernel, but no
# dynamo call (about 34 us of a 113 us step on the tiny MLP) and nothing to compile. One step with an (M,)
# lr against torch's fused step with a float one (python -m benchmarks.optimizers, 1 thread, CPU time; unit
# rate vs compiled): Adam on the 10-20-2 MLP (13k elements at M=64) 1.59x vs 2.25x, at M=1024 (268k) 1.52x
# vs 1.88x, SGD there 2.16x vs 2.55x; the small ResNet at M=16 (320k, 20 tensors) 1.39x vs 1.38x (Adam) and
# 2.27x vs 2.20x (SGD); Adam on a 784-16-16-10 MLP at M=64 (832k) 1.58x vs 1.29x; on the 784-256-256-10 one
# (17M; 2 threads, wall time, the unit-rate ops alone against the whole compiled step) 1.58x vs 1.02x.
UNIT_RATE_MAX_NUMEL = 1 << 19


def unit_rate_kernel(name: str, tensors: Sequence[Sequence[Tensor]], *values: float | Tensor) -> Callable | None:
    """``torch._fused_<name>_`` to run at a unit learning rate on scratch tensors (see
    :data:`UNIT_RATE_MAX_NUMEL`), where it serves these tensor lists, or ``None``. ``values``: the kernel's
    other hyperparameters and the step, which must be floats (the learning rate and weight decay are
    applied outside the kernel, so may be per model)."""
    if sum(t.numel() for t in tensors[0]) > UNIT_RATE_MAX_NUMEL:
        return None
    return torch_fused_kernel(name, tensors, *values)


def pack_kernel_inputs(device: torch.device, *values: float | Tensor) -> dict[str, Any]:
    """Hyperparameters (floats, ``(M,)`` or ``(P, M)`` tensors) as a kernel's inputs: the floats in one tensor
    (one copy to the device per step), the tensors as they are, and where each value went. A compiled
    kernel then takes new values (a schedule's learning rate, each step's bias corrections) without
    recompiling: dynamo would specialise on a float argument until it changed once."""
    floats: list[float] = []
    tensors: list[Tensor] = []
    layout: list[int] = []
    for value in values:
        if isinstance(value, Tensor):
            layout.append(len(tensors))
            tensors.append(value)
        else:
            layout.append(-1 - len(floats))
            floats.append(value)
    scalars = torch.tensor(floats, dtype=hyperparameter_dtype(device), device=device)
    return {"scalars": scalars, "tensors": tensors, "layout": tuple(layout)}


def per_model_inputs(num_models: int, device: torch.device, *values: float | Tensor) -> list[Tensor]:
    """Step-dependent values as tensors: a float (every model at one step) as an ``(M,)`` tensor, so that the
    kernel compiled for it also serves models at different steps (after ``step(active=...)``), which
    make these values ``(M,)`` tensors."""
    dtype = hyperparameter_dtype(device)
    return [v if isinstance(v, Tensor) else torch.full((num_models,), v, dtype=dtype, device=device) for v in values]


def unpack_kernel_inputs(scalars: Tensor, tensors: list[Tensor], layout: tuple[int, ...]) -> list[Tensor]:
    """In a kernel: the values :func:`pack_kernel_inputs` packed, in their order (floats as 0-d tensors)."""
    return [tensors[j] if j >= 0 else scalars[-1 - j] for j in layout]


def kernel_value(value: Tensor, like: Tensor, index: int) -> Tensor:
    """In a kernel: a 0-d or ``(M,)`` tensor, or row ``index`` of a ``(P, M)`` one, as an ``(M, 1, ..., 1)`` (or
    ``(1, ..., 1)``) view in ``like``'s dtype."""
    if value.dim() == 2:
        value = value[index]
    return value.to(like.dtype).view((-1,) + (1,) * (like.dim() - 1))


def fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a * b + c`` rounded once, as torch's CPU ``add(alpha=)`` and ``addcmul`` compute it."""
    if torch.compiler.is_compiling():
        return torch.ops.prims.fma(a, b, c)
    return torch.addcmul(c, a, b)


def lerp(start: Tensor, end: Tensor, weight: Tensor, form: str | None = None) -> Tensor:
    """``torch.lerp`` as ATen's CPU kernel rounds it: ``fma(weight, end - start, start)`` for ``|weight| <
    0.5``, else ``fma(weight - 1, end - start, end)``; ``form`` (:func:`lerp_form`) names the one every weight
    takes, where the host knows it."""
    if torch.compiler.is_compiling():
        if form == "start":
            return fma(weight, end - start, start)
        if form == "end":
            return fma(weight - 1, end - start, end)
        small = weight.abs() < 0.5
        return fma(torch.where(small, weight, weight - 1), end - start, torch.where(small, start, end))
    return torch.lerp(start, end, weight)


def lerp_form(weight: float | Tensor) -> str | None:
    """Which of :func:`lerp`'s two formulas a float ``weight`` takes, ``"start"`` (``|weight| < 0.5``) or
    ``"end"``, for a compiled kernel to compute that one alone rather than both and a select per element.
    ``None`` for an ``(M,)`` weight, or a float so close to 0.5 that rounding it to the parameters' dtype
    (bfloat16: steps of 2**-9) decides: the kernel then picks per element."""
    if isinstance(weight, Tensor):
        return None
    return "start" if abs(weight) < 0.49 else "end" if abs(weight) > 0.51 else None


# The dtypes in which a compiled kernel takes its square root from torch's own sqrt kernel, between two
# compiled loops (about twice the memory traffic), so that it equals the foreach path bit for bit.
EXACT_SQRT_DTYPES = frozenset({torch.float64})


def kernel_sqrt(x: Tensor) -> Tensor:
    """``torch.sqrt``, and in :data:`EXACT_SQRT_DTYPES` torch's own sqrt kernel.

    torch's CPU sqrt (MKL's vectorised one) is not correctly rounded: 0.6-0.8% of random float32 and
    float64 inputs come out 1 ulp from the correctly rounded root, which a compiled kernel computes. In
    float64 the kernel therefore calls torch's sqrt (bit-exact); in other dtypes it keeps one loop, and a
    parameter may then differ from the foreach path's by a few ulps (measured on 1.85M float32 elements, 5
    steps from the same state: 0.02-0.15% of them, at most 4 ulps of the parameter for Adam, AdamW and
    RMSprop, 11 for centered RMSprop with momentum; torch's own fused Adam differs from its for-loop Adam
    the same way: 0.02%, 4 ulps). How many differ depends on the CPU: on an AVX2-only AMD EPYC, RMSprop with
    momentum moved 4.4% of them, by up to 31 ulps.
    """
    if torch.compiler.is_compiling() and x.dtype in EXACT_SQRT_DTYPES:
        return torch.ops.batchlayers.eager_sqrt(x)
    return torch.sqrt(x)


@functools.cache
def _register_kernel_ops() -> None:
    with warnings.catch_warnings():
        # torch 2.13's inductor imports torch.utils.mkldnn, whose class bodies call the deprecated
        # torch.jit.script_method: torch's own warning about torch's own code, once per process.
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.inductor_prims  # noqa: F401  (defines torch.ops.prims.fma)

    @torch.library.custom_op("batchlayers::eager_sqrt", mutates_args=())
    def eager_sqrt(x: Tensor) -> Tensor:
        return torch.sqrt(x)

    @eager_sqrt.register_fake
    def _(x: Tensor) -> Tensor:
        return torch.empty_like(x)


class BatchedOptimizer(Optimizer):
    """Base class: ``torch.optim.Optimizer`` over parameters shaped ``(M, *)``, one model per slice.

    Subclasses list their numeric hyperparameters in ``per_model_hyperparameters`` (a name, or
    ``("betas", i)`` for an entry of a tuple), create their state in ``_init_state`` and update one
    device/dtype bucket of tensors in ``_update`` (foreach kernels) and ``_update_fused`` (a compiled
    kernel, for ``fused=True``).

    Two implementations, the same arithmetic:

    - ``fused=None`` / ``False`` (default): a few ``torch._foreach_*`` ops over the parameter list, each
      rounding as the op torch.optim applies to one model; every model's slice is bit-for-bit its own
      ``torch.optim`` step on CPU (float64 and float32).
    - ``fused=True``: in float32 with float hyperparameters, every model at one step and contiguous
      tensors, torch's own fused kernel over the stacked tensors (``torch._fused_adam_``,
      ``_fused_adamw_``, ``_fused_sgd_``; nothing to compile): each model gets the step torch's
      ``fused=True`` takes on it, but for some last bits (torch's kernel rounds its vectorised loop and its
      tail differently, and a slice's tail is not the whole tensor's). Otherwise, on contiguous float32 CPU
      tensors, batchlayers' own C kernel (``batchlayers/optim/_native.c``: one pass, built with the
      system's C compiler on first use; SGD bit for bit the foreach path, Adam and RMSprop but for the
      square root below; see :attr:`batchlayers.backends.CpuSettings.native_optimizers`). Otherwise
      (or without a compiler) torch's kernel at a unit rate on small parameter lists, else one
      ``torch.compile``'d kernel (one pass over each parameter's memory, like torch's ``fused=True``),
      compiled on first use (seconds) and again for new shapes, dtypes or flags. In float64 it equals the
      foreach path bit for bit (SGD: in every dtype). In other dtypes Adam's and RMSprop's square root is
      correctly rounded in the kernel and torch's CPU ``sqrt`` is not (1 ulp off for under 1% of inputs): a
      few elements per step may differ by a few ulps, as torch's own ``fused=True`` differs from its
      for-loop implementation (see ``kernel_sqrt``).
    """

    per_model_hyperparameters: tuple[str | tuple[str, int], ...] = ()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; with ``set_to_none`` (the default) and no profiler running,
        without its ``record_function`` label, which cost 7.6 of its 8.7 us on four tensors (1 thread)."""
        if not set_to_none or _traced_or_profiled():
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None

    def _patch_step_function(self) -> None:
        # torch.optim wraps a class's step once, to run step hooks inside a profiler label
        # (Optimizer.profile_hook_step); this wraps it so that the label and hooks cost nothing while none
        # is there (see _step_with_hooks).
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        cls = type(self)
        if not getattr(cls.step, "hooked", None):
            cls.step = _step_with_hooks(cls.step)  # type: ignore[method-assign]
            cls.step.hooked = True  # type: ignore[attr-defined]

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        for flag in ("differentiable", "capturable"):
            if defaults.get(flag):
                raise ValueError(f"{type(self).__name__}: {flag}=True is not supported")
        if defaults.get("fused") not in (None, False, True):
            raise ValueError(f"{type(self).__name__}: fused must be None, False or True, got {defaults['fused']!r}")
        super().__init__(params, defaults)

    # -- hyperparameters -------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._adopt_hyperparameters(self.param_groups[-1])
        if self.param_groups[-1].get("fused"):
            _register_kernel_ops()  # now: a compiled training step cannot run it (torch.compile(optimizer.step))

    def _group_num_models(self, group: dict[str, Any]) -> int:
        sizes = {p.shape[0] if p.dim() > 0 else None for p in group["params"]}
        if None in sizes:
            raise ValueError(
                f"{type(self).__name__}: every parameter needs the model dimension first, got a 0-d parameter"
            )
        if len(sizes) != 1:
            raise ValueError(
                f"{type(self).__name__}: all parameters of a group need the same number of models "
                f"(size of dimension 0), got sizes {sorted(cast('set[int]', sizes))}"
            )
        return cast(int, sizes.pop())  # (None refused above)

    def _get(self, group: dict[str, Any], key: str | tuple[str, int]) -> Any:
        return group[key] if isinstance(key, str) else group[key[0]][key[1]]

    def _set(self, group: dict[str, Any], key: str | tuple[str, int], value: Any) -> None:
        if isinstance(key, str):
            group[key] = value
        else:
            entries = list(group[key[0]])
            entries[key[1]] = value
            group[key[0]] = tuple(entries)

    @staticmethod
    def _key_name(key: str | tuple[str, int]) -> str:
        return key if isinstance(key, str) else f"{key[0]}[{key[1]}]"

    def _adopt_hyperparameters(self, group: dict[str, Any]) -> None:
        """Check every hyperparameter and store tensor ones as this group's own ``PerModelValue``."""
        num_models = self._group_num_models(group)
        device = group["params"][0].device
        for key in self.per_model_hyperparameters:
            value = self._get(group, key)
            name = self._key_name(key)
            if not isinstance(value, (Tensor, numbers.Real)):
                got = (
                    f"a {type(value).__name__} of {len(value)} values"
                    if isinstance(value, (list, tuple))
                    else f"a {type(value).__name__}"
                )
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a float or a tensor of shape (M,) = ({num_models},), "
                    f"one value per model, got {got}"
                    + ("; pass torch.tensor([...]) for per-model values" if isinstance(value, (list, tuple)) else "")
                )
            if isinstance(value, Tensor):
                if value.is_meta:
                    raise ValueError(
                        f"{type(self).__name__}: {name} is a tensor on the meta device, which holds no values; "
                        f"expected a float or an (M,) = ({num_models},) tensor with values (on any device: it is "
                        f"copied to the parameters' device {device})"
                    )
                if value.dim() == 0:
                    value = value.item()
                elif value.shape != (num_models,):
                    raise ValueError(
                        f"{type(self).__name__}: {name} must be a float or a tensor of shape (M,) = "
                        f"({num_models},), one value per model, got shape {tuple(value.shape)}"
                    )
                elif value.is_complex() or value.dtype == torch.bool:
                    raise TypeError(f"{type(self).__name__}: {name} must be a real tensor, got {value.dtype}")
                else:
                    # A copy: the user's tensor is never changed by schedulers, and groups never alias.
                    dtype = hyperparameter_dtype(device)
                    value = value.detach().to(device=device, dtype=dtype, copy=True).as_subclass(PerModelValue)
            self._check_value(name, value)
            self._set(group, key, value)

    def _check_value(self, name: str, value: Hyperparameter) -> None:
        values = value.as_subclass(Tensor) if isinstance(value, Tensor) else torch.tensor([float(value)])
        ok = values.isfinite() & (values >= 0)
        if name.startswith("betas"):
            ok &= values < 1  # [0, 1) as in torch
        if not bool(ok.all()):
            allowed = "in [0, 1)" if name.startswith("betas") else "finite and >= 0"
            raise ValueError(f"{type(self).__name__}: invalid {name} {values[~ok].tolist()}: must be {allowed}")

    def hyperparameter(self, group: dict[str, Any], key: str | tuple[str, int], num_models: int) -> Hyperparameter:
        """The value to compute with: a float, or an ``(M,)`` tensor (checked against the current ``M``)."""
        value = group[key] if type(key) is str else group[key[0]][key[1]]
        if type(value) is float:  # the common case first: a few us a step on small models
            if math.isfinite(value) and value >= 0 and (value < 1 or type(key) is str or key[0] != "betas"):
                return value
        elif isinstance(value, Tensor):
            if value.dim() == 0:
                return value.item()
            if value.shape != (num_models,):
                raise ValueError(
                    f"{type(self).__name__}: {self._key_name(key)} has shape {tuple(value.shape)} but the "
                    f"parameters hold {num_models} models; keep or select models with "
                    "batchlayers.population.keep_models_(model, optimizer, ...) so both change together"
                )
            if not isinstance(value, PerModelValue):
                # A tensor put in by hand or by a scheduler (a float lr times an (M,) factor): check it and
                # keep a PerModelValue copy, so the next scheduler step can fill it and the caller's tensor
                # is never written to.
                self._adopt_hyperparameters(group)
                value = self._get(group, key)
            if torch.compiler.is_compiling():
                return value  # dynamo cannot trace as_subclass; PerModelValue computes as a plain tensor anyway
            return value.plain()
        if not isinstance(value, numbers.Real):
            self._adopt_hyperparameters(group)  # raises: names the hyperparameter and what it got
        name = self._key_name(key)
        if not (math.isfinite(value) and value >= 0 and (value < 1 or not name.startswith("betas"))):
            self._check_value(name, value)  # a float put in by hand: raises, naming it
        return value

    # -- state dict ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # Plain tensor copies: the checkpoint does not change when a scheduler later fills the live values,
        # and loads with weights_only=True.
        for group in state["param_groups"]:
            for key, value in list(group.items()):
                if isinstance(value, Tensor):
                    group[key] = value.as_subclass(Tensor).clone()
                elif isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
                    group[key] = tuple(v.as_subclass(Tensor).clone() if isinstance(v, Tensor) else v for v in value)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_num_models(state_dict)  # before anything changes: torch's load replaces state and groups
        # How this optimizer runs (``fused``, ``foreach``) stays its own: a checkpoint carries training state,
        # and every path computes the same numbers.
        implementation: list[dict[str, Any]] = [
            {k: g[k] for k in ("fused", "foreach") if k in g} for g in self.param_groups
        ]
        super().load_state_dict(state_dict)
        for group, own in zip(self.param_groups, implementation):
            group.update(own)
        for group in self.param_groups:
            self._adopt_hyperparameters(group)
            for p in group["params"]:
                step = self.state.get(p, {}).get("step")
                if isinstance(step, Tensor):
                    self.state[p]["step"] = step.to(p.device)

    def _check_num_models(self, state_dict: dict[str, Any]) -> None:
        """Refuse a state dict saved for a different number of models than each group's parameters hold."""
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            return  # torch's load_state_dict reports this
        saved_state = state_dict.get("state", {})
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved.get("params", ())) != len(group["params"]):
                return  # torch's load_state_dict reports this
            num_models = self._group_num_models(group)
            found: list[tuple[str, int]] = []
            for key in self.per_model_hyperparameters:
                try:
                    value = self._get(saved, key)
                except (KeyError, IndexError, TypeError):
                    continue
                if isinstance(value, Tensor) and value.dim() > 0:
                    found.append((self._key_name(key), value.shape[0]))
            for saved_id, p in zip(saved["params"], group["params"]):
                entries = saved_state.get(saved_id, {})
                for name, value in entries.items() if isinstance(entries, dict) else ():
                    if isinstance(value, Tensor) and value.dim() > 0 and p.dim() > 0:
                        found.append((f"state '{name}' of a parameter of shape {tuple(p.shape)}", value.shape[0]))
            for what, saved_models in found:
                if saved_models != num_models:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the state dict was saved for M = {saved_models} "
                        f"models ({what} in param group {index}), but this optimizer's parameters hold "
                        f"M = {num_models}; nothing was loaded. Select the saved models first, or build the "
                        f"optimizer for a model of {saved_models} models"
                    )

    # -- stepping --------------------------------------------------------------------------------------

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        raise NotImplementedError

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: list[dict[str, Tensor]],
        num_models: int,
    ) -> None:
        raise NotImplementedError

    def _update_fused(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: list[dict[str, Tensor]],
        num_models: int,
    ) -> None:
        raise NotImplementedError

    def _steps_after_increment(self, steps: list[Tensor]) -> float | Tensor:
        """:func:`steps_after_increment`, without reading the step counts when this optimizer's last step left
        them all at one value and nothing has written to them since (their version counters tell)."""
        known = self.__dict__.get("_uniform_steps", {}).get(id(steps[0]))
        if known is not None and not torch.compiler.is_compiling():
            tensors, versions, value = known
            if len(tensors) == len(steps) and all(
                a is b and a._version == v for a, b, v in zip(tensors, steps, versions)
            ):
                return value
        return steps_after_increment(steps)

    def _counted(self, steps: list[Tensor], step: float | Tensor) -> None:
        """Note the step counts after an update that counted ``step`` for every model: the next one is
        ``step + 1``, as long as the tensors' versions stay (a frozen model's restored count changes them)."""
        uniform = self.__dict__.setdefault("_uniform_steps", {})
        # (Inference tensors, a state made by a step under torch.inference_mode(), have no version counter.)
        if isinstance(step, Tensor) or torch.compiler.is_compiling() or steps[0].is_inference():
            uniform.pop(id(steps[0]), None)
        else:
            remember(uniform, id(steps[0]), (list(steps), [s._version for s in steps], step + 1))

    def _increment_steps(self, steps: list[Tensor]) -> None:
        """:func:`increment_steps`, remembering the tensor whose rows these step counts are: a view keeps its
        place in its base, so the next step only checks that the counts are the same tensors (one check of
        each row's place costs about 1.5 us, 30 us a step for a ResNet's 20 parameters)."""
        if torch.compiler.is_compiling():
            increment_steps(steps)
            return
        base = self._rows_base(steps)
        if base is None:
            torch._foreach_add_(steps, 1.0)
        else:
            base.add_(1.0)

    def _rows_base(self, steps: list[Tensor]) -> Tensor | None:
        """:func:`rows_of_one_tensor`, remembered for these step counts (see :meth:`_increment_steps`)."""
        rows = self.__dict__.setdefault("_step_rows", {})
        known = rows.get(id(steps[0]))
        if known is not None and len(known[0]) == len(steps) and all(a is b for a, b in zip(known[0], steps)):
            return known[1]
        base = rows_of_one_tensor(steps)
        if base is not None:
            remember(rows, id(steps[0]), (list(steps), base))
        return base

    def _steps_for_native_kernel(self, steps: list[Tensor]) -> Tensor | None:
        """The tensor whose rows ``steps`` are, for a native kernel (:mod:`._native`) to count this step in;
        where the kernels cannot (the counts are not the rows of one contiguous float32 tensor, as after
        loading a state dict), the step counted here and ``None``. A torch add costs 3 us in a loop of adds
        but about 20 us in a step (1 thread, 2-core VM: a step of the 10-20-2 MLP at M=64, Adam with an
        ``(M,)`` lr, took 105 us with it and 85 without); counted in the kernel's call, the step took 96-98
        instead of 112-140 us, against 92-99 us for torch's fused step in the same runs."""
        base = None if torch.compiler.is_compiling() else self._rows_base(steps)
        if base is not None and _native.countable(base):
            return base
        self._increment_steps(steps)
        return None

    def _unit_rate_targets(self, params: list[Tensor]) -> list[Tensor]:
        """Zeroed contiguous tensors like ``params`` for :func:`unit_rate_kernel` to step, kept between steps
        (not saved or copied: only one step's values are ever in them)."""
        cache = self.__dict__.setdefault("_unit_rate_scratch", {})
        key = tuple(id(p) for p in params)
        targets = cache.get(key)
        if targets is not None and all(
            t.shape == p.shape and t.dtype == p.dtype and t.device == p.device for t, p in zip(targets, params)
        ):
            torch._foreach_zero_(targets)
            return targets
        targets = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p in params]
        remember(cache, key, targets, size=8)  # (one entry per group and dtype, as a rule)
        return targets

    @staticmethod
    def _decayed_gradients(
        grads: list[Tensor], params: list[Tensor], weight_decay: Hyperparameter, maximize: bool
    ) -> tuple[list[Tensor] | tuple[Tensor, ...], bool]:
        """For a fused kernel run without weight decay (:func:`unit_rate_kernel`): the gradients with torch's L2
        decay added, negated first where the objective is maximized (torch negates before adding the decay), and
        whether the kernel still has to negate them."""
        if is_zero(weight_decay):
            return grads, maximize
        signed = list(torch._foreach_neg(grads)) if maximize else grads
        return foreach_add_scaled(signed, params, broadcast_per_model(weight_decay, params)), False

    def _add_unit_rate_steps(self, params: list[Tensor], targets: list[Tensor], lr: Hyperparameter) -> None:
        """The parameters plus the steps :func:`unit_rate_kernel` took at a unit rate, each model's scaled by its
        learning rate."""
        foreach_add_scaled_(params, targets, self._per_model_scales("lr", lr, params) if isinstance(lr, Tensor) else lr)

    def _per_model_scales(
        self, name: Any, value: Tensor, like: list[Tensor], derive: Callable[[Tensor], Tensor] | None = None
    ) -> list[Tensor]:
        """:func:`broadcast_per_model` of the ``(M,)`` hyperparameter ``value`` (or of ``derive(value)``, which
        ``name`` describes with every float it uses), kept for the tensors ``like`` while the value's memory and
        version stay (the entry holds the value: no other tensor takes its memory meanwhile)."""
        cache = self.__dict__.setdefault("_scales", {})
        key = (name, id(like[0]), len(like))
        known = cache.get(key)
        if (
            known is not None
            and known[0].data_ptr() == value.data_ptr()
            and known[1] == value._version
            and known[0].shape == value.shape
            and known[0].dtype == value.dtype
            and known[2] == tuple((t.dtype, t.dim()) for t in like)
        ):
            return known[3]
        scales = cast("list[Tensor]", broadcast_per_model(value if derive is None else derive(value), like))
        cache[key] = (value, value._version, tuple((t.dtype, t.dim()) for t in like), scales)
        return scales

    def _compiled(self, kernel: Callable) -> Callable:
        """``kernel`` compiled with ``torch.compile``, once per optimizer (not pickled or deep-copied); inside
        a graph being compiled (a compiled training step), ``kernel`` itself, which that graph takes in."""
        if torch.compiler.is_compiling():
            return kernel  # (its ops registered when the group with fused=True was added)
        kernels = self.__dict__.setdefault("_compiled_kernels", {})
        if kernel not in kernels:
            _register_kernel_ops()
            # A copy with its own code object: dynamo keeps compiled graphs, and counts recompilations
            # against its limit, per code object, so other optimizers' shapes and flags never use up this
            # one's. fullgraph: a graph break would silently run part of the kernel uncompiled. No size
            # asserts: dynamo's guards already check every input's shape and strides, and the asserts cost
            # 12 us of a 50 us call (tiny MLP, M=64, 1 thread). (Inductor's threading threshold stays: ATen's
            # 32768-element grain size was slower at M=1024, 2 threads, 298 vs 261 us per kernel call.)
            own = types.FunctionType(
                kernel.__code__.replace(), kernel.__globals__, kernel.__name__, kernel.__defaults__, kernel.__closure__
            )
            own.__kwdefaults__ = kernel.__kwdefaults__
            kernels[kernel] = torch.compile(own, fullgraph=True, options={"size_asserts": False})
        return kernels[kernel]

    def step(self, closure: Callable[[], Any] | None = None, *, active: Tensor | None = None) -> Any:
        """Perform one optimization step for every model, or only for the ``active`` ones.

        Args:
            closure: re-evaluates the model and returns the loss, as in ``torch.optim``.
            active: optional bool tensor of shape ``(M,)``. Models with ``False`` do not change at all:
                not their parameters, not their optimizer state (momentum, moments, step count). Use it to
                freeze finished models, or to skip models with a non-finite loss
                (``active=~batchlayers.nonfinite_models(losses, model)``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # (as torch.no_grad() but for its decorator's 3 us a step)
        try:
            self._step_models(active)
        finally:
            torch.set_grad_enabled(grad_enabled)
        return loss

    def _step_models(self, active: Tensor | None) -> None:
        self._check_step(active)
        # One pass over the parameters, the checks included: on small models this loop is a good part of the step.
        for group in self.param_groups:
            params, grads = [], []
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    if grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    if p.is_complex():
                        raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
                    params.append(p)
                    grads.append(grad)
            if not params:
                continue
            num_models = self._group_num_models(group)
            inactive = None if active is None else self._inactive_models(active, num_models, params[0].device)
            if inactive is not None and inactive.numel() == num_models:
                continue
            states, fresh = [], []
            for p in params:
                state = self.state[p]
                if not state:  # before the snapshot below, so new state is masked too
                    state.update(self._init_state(p, group))
                    fresh.append(state)
                states.append(state)
            self._count_steps_in_one_tensor(fresh)
            # Put inactive models' slices back afterwards: exact, and it covers every state entry.
            idle = inactive if inactive is not None and inactive.numel() > 0 else None
            saved = save_models(
                (t for p, s in zip(params, states) for t in (p, *s.values()) if isinstance(t, Tensor)), idle
            )
            update = self._update_fused if group.get("fused") else self._update
            device, dtype = params[0].device, params[0].dtype
            if all(p.dtype == dtype and p.device == device for p in params):
                update(group, params, grads, states, num_models)
            else:
                buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
                for i, p in enumerate(params):
                    buckets.setdefault((p.device, p.dtype), []).append(i)
                for indices in buckets.values():
                    update(
                        group,
                        [params[i] for i in indices],
                        [grads[i] for i in indices],
                        [states[i] for i in indices],
                        num_models,
                    )
            restore_models(saved, idle)

    @staticmethod
    def _count_steps_in_one_tensor(states: list[dict[str, Any]]) -> None:
        """Make new states' ``(M,)`` step counts the rows of one tensor, which :func:`increment_steps` counts
        with one add (they are each still a state's own tensor, saved and loaded as such)."""
        counted = [s for s in states if isinstance(s.get("step"), Tensor)]
        if len(counted) > 1 and len({(s["step"].shape, s["step"].dtype, s["step"].device) for s in counted}) == 1:
            for state, row in zip(counted, torch.stack([s["step"] for s in counted]).unbind(0)):
                state["step"] = row

    def _check_step(self, active: Tensor | None) -> None:
        """Refuse a step before anything changes (after the closure): none by default."""

    def _inactive_models(self, active: Tensor | None, num_models: int, device: torch.device) -> Tensor | None:
        if active is None:
            return None
        if not isinstance(active, Tensor) or active.dtype != torch.bool:
            raise TypeError(
                f"{type(self).__name__}.step: active must be a bool tensor of shape (M,), got "
                f"{active.dtype if isinstance(active, Tensor) else type(active).__name__}"
            )
        if active.shape != (num_models,):
            raise ValueError(
                f"{type(self).__name__}.step: active must have shape (M,) = ({num_models},), got {tuple(active.shape)}"
            )
        return (~active).nonzero().squeeze(1).to(device)
