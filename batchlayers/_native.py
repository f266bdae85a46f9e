"""batchlayers' hand-written CPU kernels, compiled into one library: the optimizers' (``optim/_native.c``, see
:mod:`batchlayers.optim._native`), the LSTM and GRU backward's time step (``functional/_recurrent_native.c``,
see :mod:`batchlayers.functional._recurrent`), the two-class cross entropy (``_losses_native.c``, see
:mod:`batchlayers.losses`) and the small ReLU MLPs' linear chain (``functional/_mlp_native.c``, see
:mod:`batchlayers.functional._mlp`).

The sources are compiled on first use with the system's C compiler (``$CC``, else ``cc``; under a second here)
into ``$BATCHLAYERS_CACHE_DIR`` (default ``$XDG_CACHE_HOME/batchlayers`` or ``~/.cache/batchlayers``), keyed by
a hash of the sources, the command and the machine, and loaded with :mod:`ctypes` (no Python or torch
headers). Where no compiler works, :func:`library` is ``None`` and every caller takes its other kernels;
:func:`unavailable_reason` says why (``batchlayers.backends.cpu.check_native_optimizers()`` raises it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shlex
import subprocess
import tempfile
import threading
from typing import Any

import torch

__all__ = ["FLAGS", "HEADER", "SOURCES", "kernel", "library", "unavailable_reason"]

_PACKAGE = pathlib.Path(__file__).parent
SOURCES = (
    _PACKAGE / "optim" / "_native.c",
    _PACKAGE / "functional" / "_recurrent_native.c",
    _PACKAGE / "_losses_native.c",
    _PACKAGE / "functional" / "_mlp_native.c",
)
HEADER = _PACKAGE / "_native.h"  # (included by all)
# -ffp-contract=off: no product fused into an add but the sources' own fmaf (torch's rounding, op for op);
# -fno-math-errno: sqrtf as one instruction, so the loop vectorises; -fno-trapping-math: a loop with a
# comparison or a float-to-int conversion vectorises too (no floating-point exception is ever read; results
# are unchanged); -fopenmp-simd: the loss's ``omp simd`` reduction vectorises (no OpenMP runtime).
FLAGS = (
    "-O3",
    "-std=gnu99",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-fPIC",
    "-shared",
    "-pthread",
)

_lock = threading.Lock()
_reason = ""


def _cache_dir() -> pathlib.Path:
    configured = os.environ.get("BATCHLAYERS_CACHE_DIR")
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "batchlayers"


class _CompilerFailed(Exception):
    """The compiler did not run or failed (its error is the ``__cause__``): another directory would not help."""


def _compile(path: pathlib.Path, command: list[str]) -> None:
    """Compile :data:`SOURCES` to ``path``, as checkpoints are written (a temporary file beside it, renamed):
    processes compiling at once never load a half-written library. An :class:`OSError` is the directory's."""
    from .checkpoint import _replace_atomically

    def write(temporary: str) -> None:
        try:
            subprocess.run([*command, "-o", temporary], check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as error:
            raise _CompilerFailed from error

    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomically(str(path), str(path.parent), write)


def library() -> ctypes.CDLL | None:
    """The compiled kernels, compiling them on first use; ``None`` where that fails (see
    :func:`unavailable_reason`)."""
    with _lock:
        return _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    global _reason
    compiler = shlex.split(os.environ.get("CC") or "cc")
    command = [*compiler, *FLAGS, *map(str, SOURCES), "-lm"]
    try:
        texts = [source.read_text() for source in (*SOURCES, HEADER)]  # (a broken install may lack one: OSError)
        build = [*command[: -len(SOURCES) - 1], platform.machine()]  # (the command without the sources' paths)
        key = hashlib.sha256("\0".join([*texts, *build]).encode()).hexdigest()
        path = _cache_dir() / f"native-{key[:16]}.so"
        if not path.exists():
            try:
                _compile(path, command)
            except OSError:  # a cache directory that cannot be written: one for this process
                path = pathlib.Path(tempfile.mkdtemp(prefix="batchlayers-")) / path.name
                _compile(path, command)
        lib = ctypes.CDLL(str(path))
        _reason = ""
    except (OSError, _CompilerFailed) as failed:
        error = failed.__cause__ if isinstance(failed, _CompilerFailed) else failed
        detail = getattr(error, "stderr", b"") or b""
        _reason = f"{type(error).__name__}: {error} {detail.decode(errors='replace')[-500:]}".strip()
        return None
    pointers, sizes = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)
    # (The tensors' pointers by address: an array.array of them, see optim/_native.py's operands().)
    operand_types: list[Any] = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, sizes, pointers, sizes]
    for name, flags in (("adam", 3), ("sgd", 4), ("rmsprop", 5)):
        kernel = getattr(lib, f"batchlayers_{name}_f32")
        kernel.restype = None
        # (then the step counts to count in, their elements and the thread count)
        kernel.argtypes = [*operand_types, *[ctypes.c_int] * flags, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    for suffix in ("f32", "f64"):
        kernel = getattr(lib, f"batchlayers_lstm_backward_step_{suffix}")
        kernel.restype = None
        # models, batch, hidden, then eight (pointer, model stride) pairs
        kernel.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] * 8
        kernel = getattr(lib, f"batchlayers_gru_backward_step_{suffix}")
        kernel.restype = None
        # models, batch, hidden, then the inputs' and outputs' pointers and their strides (array addresses)
        kernel.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
    for suffix, value in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        kernel = getattr(lib, f"batchlayers_two_class_forward_{suffix}")
        kernel.restype = ctypes.c_int
        # models, batch, the logits and their model stride, the targets and theirs, the divisor, two outputs
        kernel.argtypes = [*[ctypes.c_int64] * 2, *[ctypes.c_void_p, ctypes.c_int64] * 2, value, *[ctypes.c_void_p] * 2]
        kernel = getattr(lib, f"batchlayers_two_class_backward_{suffix}")
        kernel.restype = None
        # models, batch, the signed probabilities, the gradient and its stride, the divisor, the output
        kernel.argtypes = [*[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 2, ctypes.c_int64, value, ctypes.c_void_p]
        for direction in ("forward", "backward"):
            kernel = getattr(lib, f"batchlayers_chain_{direction}_{suffix}")
            kernel.restype = None
            kernel.argtypes = [ctypes.c_void_p]  # the address of a chain (_mlp._Chain)
    return lib


_SUFFIXES = {torch.float32: "f32", torch.float64: "f64"}


def kernel(name: str, dtype: torch.dtype) -> Any:
    """The compiled ``batchlayers_<name>_f32`` or ``_f64`` for a float32 or float64 ``dtype``; ``None`` for
    another dtype, or where no library is built (:func:`unavailable_reason`)."""
    suffix = _SUFFIXES.get(dtype)
    if suffix is None:
        return None
    lib = library()
    return None if lib is None else getattr(lib, f"batchlayers_{name}_{suffix}")


def unavailable_reason() -> str:
    """Why :func:`library` is ``None`` (the compiler's error), or ``""``."""
    return _reason
