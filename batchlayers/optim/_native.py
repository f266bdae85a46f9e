"""batchlayers' hand-written CPU optimizer kernels, ``_native.c``: one pass of Adam, AdamW, SGD or RMSprop over
float32 parameters stacked ``(M, *)``, every model with its own hyperparameters.

torch's fused CPU kernels (``torch._fused_adam_``) take one float learning rate for every tensor; with an
``(M,)`` one, ``fused=True`` otherwise runs torch's kernel at a unit rate on scratch tensors (two passes
more) or a ``torch.compile``'d kernel (dynamo's call around it costs tens of microseconds a step). This one
reads each model's hyperparameters as it goes and makes a single pass, like torch's own.

The source is compiled on first use, with batchlayers' other C kernels, into one library
(:mod:`batchlayers._native`: where no compiler works, :func:`library` is ``None`` and the optimizers take their
other kernels; :func:`unavailable_reason` says why, ``batchlayers.backends.cpu.check_native_optimizers()``
raises it). ``batchlayers.backends.cpu.native_optimizers = False`` turns it off.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import math
from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from .._native import _load, library, unavailable_reason  # noqa: F401  (re-exported: the optimizers' and tests' names)

__all__ = [
    "ADAM_VALUES",
    "DECAY_DECOUPLED",
    "DECAY_L2",
    "DECAY_NONE",
    "NESTEROV",
    "NESTEROV_PLAIN_WITHOUT_MOMENTUM",
    "RMSPROP_VALUES",
    "SGD_VALUES",
    "Operands",
    "adam_f32",
    "countable",
    "library",
    "operands",
    "rmsprop_f32",
    "sgd_f32",
]

# The values _native.c reads, in its order: lr, beta1, beta2, eps, weight_decay, 1 - beta1**t and
# (1 - beta2**t) ** 0.5 (t: each model's step count, this step included).
ADAM_VALUES = 7
# SGD's: lr, momentum, weight_decay and the momentum buffer's factors this step (buf = a * buf + b * grad).
SGD_VALUES = 5
# RMSprop's: lr, alpha, eps, weight_decay, momentum.
RMSPROP_VALUES = 5
DECAY_NONE, DECAY_L2, DECAY_DECOUPLED = 0, 1, 2
NESTEROV, NESTEROV_PLAIN_WITHOUT_MOMENTUM = 1, 2

enabled = True


_PLAIN = frozenset({Tensor, torch.nn.Parameter})
_type_of, _dtype_of, _shape_of = type, attrgetter("dtype"), attrgetter("shape")
_on_cpu, _is_contiguous, _data_ptr, _is_inference, _is_neg = (
    attrgetter("is_cpu"),
    Tensor.is_contiguous,
    Tensor.data_ptr,
    Tensor.is_inference,
    Tensor.is_neg,
)


class Operands(NamedTuple):
    """What :func:`adam_f32` passes the kernel for a step's tensors (from :func:`operands`)."""

    library: ctypes.CDLL
    tensor_lists: Sequence[Sequence[Tensor]]
    pointers: array.array  # every tensor's data, list after list (an array.array: 3 us for 80 against 9 for ctypes')
    row_numel: ctypes.Array  # the elements of one model's slice of each parameter
    numel: int  # the elements of all parameters


def operands(tensor_lists: Sequence[Sequence[Tensor]]) -> Operands | None:
    """The kernel's operands for these lists (parameters first, then gradients and states, each tensor the
    parameter's shape), or ``None`` where it does not serve them: it takes plain, contiguous float32 CPU
    tensors shaped ``(M, *)``, outside a ``torch.compile`` trace, once the library is built. Checked every
    step, as tensors may change, with C-level loops over the tensors (about 0.4 us a tensor on the 2-core VM
    against 0.6-0.9 us for a Python loop over the same checks; a non-strided tensor's data pointer raises)."""
    if not enabled or torch.compiler.is_compiling():
        return None
    shapes = list(map(_shape_of, tensor_lists[0]))
    if not shapes[0] or not shapes[0][0] or any(not shape or shape[0] != shapes[0][0] for shape in shapes):
        return None  # (0-d parameters, no models, or models disagreeing)
    tensors = list(itertools.chain.from_iterable(tensor_lists))
    try:
        if (
            not set(map(_type_of, tensors)) <= _PLAIN
            or set(map(_dtype_of, tensors)) != {torch.float32}
            or not all(map(_on_cpu, tensors))
            or not all(map(_is_contiguous, tensors))
            or any(map(_is_neg, tensors))  # (a negative view: its memory holds the values' negatives)
            or list(map(_shape_of, tensors)) != shapes * len(tensor_lists)
        ):
            return None
        pointers = list(map(_data_ptr, tensors))
    except RuntimeError:  # (sparse and mkldnn tensors have no data pointer; CSR ones no contiguity)
        return None
    lib = library()
    if lib is None:
        return None
    layout = _layouts.get(tuple(shapes))
    if layout is None:
        numel = [math.prod(shape) for shape in shapes]
        if len(_layouts) >= 64:
            _layouts.clear()
        row_numel = (ctypes.c_int64 * len(shapes))(*[n // shapes[0][0] for n in numel])
        layout = _layouts[tuple(shapes)] = (row_numel, sum(numel))
    return Operands(lib, tensor_lists, array.array("Q", pointers), *layout)


# From this many elements in all, the step's elements are split between torch.get_num_threads() threads,
# started for the call (about 0.1 ms on the 2-core VM). Measured there, one (16, n/16) parameter, Adam with an
# (M,) lr, wall time, medians of 3 runs (one thread, two, torch's fused kernel on its own two): n = 512k
# 0.27, 0.30 and 0.14 ms; 1M 0.52, 0.43 and 0.37 ms; 2M 1.13, 0.68 and 0.59 ms; 4M 3.6, 2.0 and 2.0 ms.
THREADS_MIN_NUMEL = 1 << 20
_layouts: dict[tuple, tuple[ctypes.Array, int]] = {}


def _values(
    operands: Operands, values: Sequence[float | Tensor]
) -> tuple[ctypes.Array, ctypes.Array, list[Tensor], ctypes.Array]:
    """The kernel's value pointers and strides (``_native.c``): a float through an array of doubles, an
    ``(M,)`` or ``(len(params), M)`` tensor as contiguous float64 CPU memory; and what must stay alive during
    the call."""
    count, num_models = len(operands.tensor_lists[0]), operands.tensor_lists[0][0].shape[0]
    scalars = (ctypes.c_double * len(values))()
    pointers = (ctypes.c_void_p * len(values))()
    strides = (ctypes.c_int64 * (2 * len(values)))()
    held = []
    for k, value in enumerate(values):
        if isinstance(value, Tensor):
            # Exactly (M,) or (P, M), float64 in memory the kernel can read, contiguous: it reads it by those
            # strides.
            shape = (count, num_models) if value.dim() == 2 else (num_models,)
            if (
                value.dtype is not torch.float64
                or not value.is_cpu
                or value.shape != shape
                or not value.is_contiguous()
                or type(value) not in _PLAIN
            ):
                value = value.to("cpu", torch.float64).expand(shape).contiguous().as_subclass(Tensor)
            held.append(value)
            pointers[k] = value.data_ptr()
            strides[2 * k], strides[2 * k + 1] = (num_models if len(shape) == 2 else 0), 1
        else:
            scalars[k] = value
            pointers[k] = ctypes.addressof(scalars) + k * ctypes.sizeof(ctypes.c_double)
    return pointers, strides, held, scalars


def _written(operands: Operands, counts: Tensor | None) -> None:
    """Count the kernel's writes in the version counters of every tensor but the gradients, as torch's in-place
    ops do: autograd then refuses a backward through a parameter the step changed, as after a torch.optim
    step, instead of computing with the new values."""
    written = [*operands.tensor_lists[0], *itertools.chain.from_iterable(operands.tensor_lists[2:])]
    if counts is not None:
        written.append(counts)
    if any(map(_is_inference, written)):  # (inference tensors have no version)
        written = [t for t in written if not t.is_inference()]
    increment_version(written)


def countable(counts: Tensor) -> bool:
    """Whether the kernels can count a step in ``counts`` (a plain, contiguous float32 CPU tensor)."""
    return type(counts) in _PLAIN and counts.dtype is torch.float32 and counts.is_cpu and counts.is_contiguous()


def _run(kernel: str, operands: Operands, values: Sequence[float | Tensor], *flags: int, counts: Tensor | None) -> None:
    params = operands.tensor_lists[0]
    pointers, strides, _held, _scalars = _values(operands, values)
    threads = torch.get_num_threads() if operands.numel >= THREADS_MIN_NUMEL else 1
    if counts is not None and not countable(counts):
        raise ValueError(f"the native optimizer kernels count steps in contiguous float32 CPU tensors, got {counts!r}")
    getattr(operands.library, kernel)(
        len(params),
        params[0].shape[0],
        operands.pointers.buffer_info()[0],
        operands.row_numel,
        pointers,
        strides,
        *flags,
        None if counts is None else counts.data_ptr(),
        0 if counts is None else counts.numel(),
        threads,
    )
    _written(operands, counts)


def adam_f32(
    operands: Operands, values: Sequence[float | Tensor], *, maximize: bool, decay: int, counts: Tensor | None = None
) -> None:
    """One Adam step in place over the parameters, gradients, ``exp_avg``, ``exp_avg_sq`` and (amsgrad)
    ``max_exp_avg_sq`` lists of :func:`operands`; ``values`` the :data:`ADAM_VALUES` values of ``_native.c``
    in its order, each a float, an ``(M,)`` tensor or a ``(len(params), M)`` one; ``decay`` :data:`DECAY_NONE`,
    :data:`DECAY_L2` or :data:`DECAY_DECOUPLED`; ``counts``, where given, a :func:`countable` tensor to add 1 to
    in the same call (the step counts)."""
    assert len(values) == ADAM_VALUES
    amsgrad = len(operands.tensor_lists) == 5
    _run("batchlayers_adam_f32", operands, values, int(maximize), decay, int(amsgrad), counts=counts)


def sgd_f32(
    operands: Operands,
    values: Sequence[float | Tensor],
    *,
    maximize: bool,
    decay: int,
    nesterov: int,
    counts: Tensor | None = None,
) -> None:
    """One SGD step in place over the parameters, gradients and (with momentum) ``momentum_buffer`` lists of
    :func:`operands`; ``values`` the :data:`SGD_VALUES` values of ``_native.c`` in its order (lr, momentum,
    weight decay and the buffer's factors this step, :func:`batchlayers.optim.sgd.momentum_factors`);
    ``decay`` :data:`DECAY_NONE` or :data:`DECAY_L2`; ``nesterov`` 0, :data:`NESTEROV` or
    :data:`NESTEROV_PLAIN_WITHOUT_MOMENTUM` (some model's momentum is 0: it takes its plain gradient); ``counts`` as
    for :func:`adam_f32`."""
    assert len(values) == SGD_VALUES
    momentum = len(operands.tensor_lists) == 3
    _run("batchlayers_sgd_f32", operands, values, int(maximize), decay, int(momentum), nesterov, counts=counts)


def rmsprop_f32(
    operands: Operands,
    values: Sequence[float | Tensor],
    *,
    maximize: bool,
    decay: int,
    centered: bool,
    momentum: bool,
    per_model_momentum: bool,
    counts: Tensor | None = None,
) -> None:
    """One RMSprop step in place over the parameters, gradients, ``square_avg``, (centered) ``grad_avg`` and
    (``momentum``) ``momentum_buffer`` lists of :func:`operands`; ``values`` the :data:`RMSPROP_VALUES` values
    of ``_native.c`` in its order; ``decay`` :data:`DECAY_NONE` or :data:`DECAY_L2`; ``per_model_momentum``: a
    model whose momentum is 0 takes the plain step; ``counts`` as for :func:`adam_f32`."""
    assert len(values) == RMSPROP_VALUES and len(operands.tensor_lists) == 3 + centered + momentum
    flags = (int(maximize), decay, int(centered), int(momentum), int(per_model_momentum))
    _run("batchlayers_rmsprop_f32", operands, values, *flags, counts=counts)
