"""Strategy settings for layers that can compute their batched math in more than one way.

Like ``torch.backends.cudnn``: a global default, a ``benchmark`` flag and a cache of measured choices.

Convolutions (:class:`~batchlayers.conv.BatchedConv2d` and friends) have several strategies, all computing the
same result (see :func:`batchlayers.functional.conv`):

- ``"grouped"``: one grouped convolution for all models, the models packed along channels ``(B, M*C, *)``;
  a shared batch runs once against all models' weights stacked along output channels.
- ``"loop"``: one dense convolution per model.
- ``"grouped_channels_last"``, ``"loop_channels_last"``: the same in channels-last memory format (2-D and
  3-D convolutions; PyTorch has no channels-last format for 1-D, so there they equal the plain ones).

Which one is fastest depends on the device, the shapes and whether gradients are needed. The strategy a
layer uses is, in order: the layer's own ``strategy`` attribute unless it is ``"auto"``; else
``conv.strategy`` unless it is ``"auto"``; else the cached measurement for this call's key; else, with
``conv.benchmark = True``, a measurement made now and cached (never while ``torch.compile`` traces; a
strategy measured faster than the heuristic's returns its result in the heuristic's layout); else a fixed
heuristic (see :func:`batchlayers.functional._conv.heuristic_strategy`).

Examples::

    >>> import batchlayers
    >>> batchlayers.backends.conv.tune(step)           # time each convolution's strategies inside step()
    >>> with batchlayers.backends.conv.flags(strategy="loop"):
    ...     y = net(x)                                    # every convolution runs as a loop here
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import cast

import torch

from . import _workspace

__all__ = ["CONV_STRATEGIES", "ConvSettings", "CpuSettings", "conv", "cpu", "fastest"]

CONV_STRATEGIES = ("grouped", "grouped_channels_last", "loop", "loop_channels_last")


class ConvSettings:
    """Global convolution settings; the single instance is :data:`batchlayers.backends.conv`.

    Attributes:
        strategy: ``"auto"`` (default) or one of :data:`CONV_STRATEGIES`, used by every layer whose own
            ``strategy`` is ``"auto"``.
        benchmark: when ``True``, the first call for each key (device, dtype, shapes, convolution
            arguments, shared input or not, gradients needed or not) times every strategy, each with its
            result copied into the layout the heuristic's result has, and caches the fastest; a strategy
            chosen so returns its result in that layout (see :attr:`layouts`), so the layers after it run as
            they do without benchmarking. Default: ``False``. :meth:`tune` times inside the whole step.
        cache: the measured choices, ``key -> strategy``. :meth:`clear_cache` empties it.
        layouts: ``key -> dimension order`` (outermost first) for the choices ``benchmark`` made over the
            heuristic: the layout their results are copied into. Choices from :meth:`tune` keep their
            strategy's own layout; a choice written into :attr:`cache` by hand keeps its key's entry here, if
            there is one (delete it for the strategy's own layout).
        benchmark_repeats: timed runs per strategy (after one warm-up run); the median decides.
    """

    def __init__(self) -> None:
        self._strategy = "auto"
        self._benchmark = False
        self._benchmark_repeats = 3
        self.cache: dict[Hashable, str] = {}
        self.layouts: dict[Hashable, tuple[int, ...]] = {}
        # key -> candidate strategies of every convolution called while tune() records (None: not recording)
        self.recording: dict[Hashable, list[str]] | None = None

    @property
    def strategy(self) -> str:
        return self._strategy

    @strategy.setter
    def strategy(self, value: str) -> None:
        self._strategy = check_conv_strategy(value, "batchlayers.backends.conv")

    @property
    def benchmark(self) -> bool:
        return self._benchmark

    @benchmark.setter
    def benchmark(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"batchlayers.backends.conv: benchmark must be True or False, got {value!r}")
        self._benchmark = value

    @property
    def benchmark_repeats(self) -> int:
        return self._benchmark_repeats

    @benchmark_repeats.setter
    def benchmark_repeats(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batchlayers.backends.conv: benchmark_repeats must be an int >= 1, got {value!r}")
        self._benchmark_repeats = value

    def clear_cache(self) -> None:
        self.cache.clear()
        self.layouts.clear()

    def tune(self, step: Callable[[], object], repeats: int | None = None) -> dict[Hashable, str]:
        """Choose every convolution's strategy by timing the whole ``step``, not each layer in isolation.

        A strategy's cost is not only its own kernels: it decides the memory format of the layer's output,
        which every following layer (batch norm, pooling, the next convolution, their backward) reads. So
        ``tune`` runs ``step`` once to find the convolutions it calls (their cache keys), then, one key at
        a time in call order, times ``step`` with each candidate strategy for that key (the others at their
        current choice) and caches the fastest (median of ``repeats`` interleaved runs after one warm-up).

        ``step`` is called ``1 + sum over keys of candidates * (repeats + 1)`` times (2 convolutions: 33
        calls with 3 repeats). Give it what a training step computes, forward and backward; leave out
        ``optimizer.step()`` (or tune on a copy) unless the model may train while tuning. The choices stay
        in :attr:`cache`; :meth:`save_cache` keeps them for the next run.

        Args:
            step: a callable running one forward (and backward) of the model as training or inference
                will, with inputs of the real shapes.
            repeats: timed runs per candidate. Default: :attr:`benchmark_repeats`.

        Returns:
            ``{key: strategy}`` for every convolution ``step`` called with ``strategy="auto"``.

        Examples::

            >>> def step():
            ...     model.zero_grad(set_to_none=True)
            ...     loss_fn(model(x), y).sum().backward()
            >>> batchlayers.backends.conv.tune(step)
            >>> batchlayers.backends.conv.save_cache("conv_strategies.json")
        """
        if not callable(step):
            raise TypeError(f"batchlayers.backends.conv.tune: step must be callable, got {type(step).__name__}")
        repeats = self.benchmark_repeats if repeats is None else repeats
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"batchlayers.backends.conv.tune: repeats must be an int >= 1, got {repeats!r}")
        with self.flags(benchmark=False):  # no per-layer timing inside the timed steps
            self.recording = {}
            try:
                step()
                found = self.recording
            finally:
                self.recording = None
            chosen: dict[Hashable, str] = {}
            for key, names in found.items():

                def run(name: str, key: Hashable = key) -> None:
                    self.cache[key] = name
                    self.layouts.pop(key, None)  # (timed inside the step: in its own layout)
                    step()

                device = torch.device(cast(tuple, key)[0])  # the keys _resolve records: tuples, the device first
                winner = fastest({name: partial(run, name) for name in names}, device, repeats)
                self.cache[key] = chosen[key] = winner
        return chosen

    def save_cache(self, path: str | os.PathLike) -> None:
        """Write :attr:`cache` (the measured choices) to a JSON file, atomically; :meth:`load_cache` reads it."""
        entries = [
            [_encode_key(key), strategy, *([list(self.layouts[key])] if key in self.layouts else [])]
            for key, strategy in self.cache.items()
        ]
        text = json.dumps({"format": "batchlayers.backends.conv cache", "version": 1, "entries": entries})
        from .checkpoint import _replace_atomically  # (as checkpoints are written: a failed write leaves nothing)

        def write(temporary: str) -> None:
            with open(temporary, "w") as f:
                f.write(text)

        path = os.path.abspath(os.fspath(path))
        _replace_atomically(path, os.path.dirname(path), write)

    def load_cache(self, path: str | os.PathLike) -> int:
        """Add the choices saved by :meth:`save_cache` to :attr:`cache` (entries for other devices, dtypes or
        shapes are kept and simply never match). Returns how many entries were read. Nothing is added when
        the file is not such a cache (a ``ValueError`` naming it)."""
        path = os.fspath(path)
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as error:
                raise ValueError(f"batchlayers.backends.conv.load_cache: '{path}' is not JSON ({error})") from None
        if not isinstance(data, dict) or data.get("format") != "batchlayers.backends.conv cache":
            raise ValueError(f"batchlayers.backends.conv.load_cache: '{path}' is not a saved convolution cache")
        if data.get("version") != 1:
            raise ValueError(
                f"batchlayers.backends.conv.load_cache: '{path}' has cache version {data.get('version')!r}, "
                "this batchlayers reads version 1"
            )
        entries, layouts = {}, {}
        listed = data.get("entries")
        if not isinstance(listed, list) or not all(isinstance(e, list) and len(e) in (2, 3) for e in listed):
            raise ValueError(
                f"batchlayers.backends.conv.load_cache: '{path}' has entries that are not [key, strategy] or "
                "[key, strategy, layout] lists"
            )
        for key, strategy, *layout in listed:
            if strategy not in CONV_STRATEGIES:
                raise ValueError(
                    f"batchlayers.backends.conv.load_cache: '{path}' names the unknown strategy {strategy!r}"
                )
            decoded = _decode_key(key)
            entries[decoded] = strategy
            if layout:
                order = layout[0]
                if not isinstance(order, list) or sorted(order) != list(range(len(order))):
                    raise ValueError(
                        f"batchlayers.backends.conv.load_cache: '{path}' gives {strategy!r} the layout {layout!r}, "
                        "not an order of dimensions"
                    )
                layouts[decoded] = tuple(order)
        for decoded in entries:
            self.layouts.pop(decoded, None)
        self.cache.update(entries)
        self.layouts.update(layouts)
        return len(entries)

    @contextmanager
    def flags(self, strategy: str | None = None, benchmark: bool | None = None) -> Iterator[None]:
        """Set ``strategy`` and/or ``benchmark`` inside a ``with`` block, restoring them afterwards."""
        saved = self.strategy, self.benchmark
        try:
            if strategy is not None:
                self.strategy = strategy
            if benchmark is not None:
                self.benchmark = benchmark
            yield
        finally:
            self._strategy, self._benchmark = saved


def _encode_key(value: object) -> object:
    """A cache key as JSON: tuples as lists, dtypes as ``{"dtype": name}``."""
    if isinstance(value, tuple):
        return [_encode_key(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"batchlayers.backends.conv.save_cache: cannot store {value!r} of a cache key")


def _decode_key(value: object) -> object:
    if isinstance(value, list):
        return tuple(_decode_key(v) for v in value)
    if isinstance(value, dict):
        dtype = getattr(torch, str(value.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"batchlayers.backends.conv.load_cache: unknown dtype {value!r} in a cache key")
        return dtype
    return value


def check_conv_strategy(value: object, owner: str) -> str:
    if value != "auto" and value not in CONV_STRATEGIES:
        raise ValueError(f"{owner}: strategy must be 'auto' or one of {CONV_STRATEGIES}, got {value!r}")
    return value


conv = ConvSettings()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(candidates: Mapping[str, Callable[[], object]], device: torch.device, repeats: int = 3) -> str:
    """The name of the fastest candidate: one warm-up call each, then ``repeats`` interleaved timed calls
    (interleaved so that a slow moment of the machine hurts every candidate alike); the median decides."""
    for run in candidates.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, run in candidates.items():
            _synchronize(device)
            start = time.perf_counter()
            run()
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return min(times, key=lambda name: statistics.median(times[name]))


class CpuSettings:
    """CPU memory settings; the single instance is :data:`batchlayers.backends.cpu`. Importing batchlayers
    changes nothing: the process's allocator is only tuned when :meth:`keep_freed_memory` is called.

    PyTorch's CPU allocator does not cache: it asks glibc's ``malloc`` for every tensor, and glibc serves a
    block above its mmap threshold (128 KiB, raised dynamically to at most 32 MiB) with fresh pages from the
    system and returns them on ``free``. A training step then page-faults its largest activations and
    gradients in anew every step; on the 2-core VM this project is measured on a fault costs about 10-25 us,
    so a step moving 100 MB spends tens of milliseconds in the kernel.

    Examples::

        >>> import batchlayers
        >>> batchlayers.backends.cpu.keep_freed_memory()   # once, before training
        True
    """

    def __init__(self) -> None:
        self._keeps_freed_memory = False

    @property
    def reuse_workspace(self) -> bool:
        """Whether batchlayers' own CPU kernels keep their large scratch buffers between calls (default ``True``).

        The recurrent layers' kernels allocate every step's gates and cell states, and their gradients, as a few
        buffers of several MiB, and so does ``BatchedSequential``'s fused Linear-activation-Linear chain for its
        hidden activations at large M, the per-model convolution loops and LSTM kernels for their stacked
        outputs and gradients, and a stacked model for its own ReLU's and max pooling's results and gradients;
        kept (from 1 MiB on), they are not page-faulted in afresh each training step.
        A buffer is reused only once nothing holds it any more (not a pending backward, a view or a gradient),
        per thread; when the shapes change the free ones are dropped. The cost is memory: the last call's
        buffers stay allocated (:meth:`release_workspace` frees them). Unlike :meth:`keep_freed_memory`, no
        allocator setting changes.
        Measured on the benchmark's LSTM policies (M=32, 2-core CPU, three processes each, alternating):
        14.8-18.1 ms a training step with 2,500-4,100 page faults without it, 11.5-12.0 ms with 290-870; the
        10-20-2 MLP at M=1024: 8.4-9.2x one model's step without, 8.2-8.7x with in a two-contender script,
        where the quick benchmark's fresh processes measured no difference (3.31-3.39 against 3.28-3.36 ms a
        step; at M=64, below 1 MiB a buffer, nothing is kept).
        """
        return _workspace.enabled

    @reuse_workspace.setter
    def reuse_workspace(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"backends.cpu.reuse_workspace must be True or False, got {value!r}")
        _workspace.enabled = value and _workspace.AVAILABLE  # (a torch without the counts it needs: stays off)
        if not value:
            _workspace.release()

    def release_workspace(self) -> None:
        """Free the scratch buffers that :attr:`reuse_workspace` keeps for the calling thread."""
        _workspace.release()

    @property
    def native_optimizers(self) -> bool:
        """Whether ``batchlayers.optim.Adam``, ``AdamW``, ``SGD`` and ``RMSprop`` with ``fused=True`` may step
        contiguous float32 CPU parameters with batchlayers' own C kernel where torch's fused kernel does not
        serve (an ``(M,)`` hyperparameter, models at different steps, RMSprop): one pass over each parameter,
        every model with its own values (default ``True``). The kernel is compiled with the system's C
        compiler on first use (under a second), into ``$BATCHLAYERS_CACHE_DIR`` (default
        ``~/.cache/batchlayers``); where that fails the optimizers take their other kernels
        (:meth:`check_native_optimizers` says why). Measured against torch's fused Adam step with one float
        learning rate, one thread (``python -m benchmarks.optimizers``, docs/training.md): Adam with an
        ``(M,)`` learning rate 1.00-1.18x its time on the benchmark's parameter sets, where the kernels used
        before took 1.03-1.31x; RMSprop 0.74-0.95x, from 0.74-1.32x (compiled, after a first step of
        seconds).
        """
        from .optim import _native

        return _native.enabled

    @native_optimizers.setter
    def native_optimizers(self, value: bool) -> None:
        from .optim import _native

        if not isinstance(value, bool):
            raise TypeError(f"backends.cpu.native_optimizers must be True or False, got {value!r}")
        _native.enabled = value

    def check_native_optimizers(self) -> None:
        """Compile and load the kernel of :attr:`native_optimizers` now, if it is not yet; raise ``RuntimeError``
        with the compiler's message where that fails."""
        from .optim import _native

        if _native.library() is None:
            raise RuntimeError(f"batchlayers' native optimizer kernel is unavailable: {_native.unavailable_reason()}")

    @property
    def native_recurrent(self) -> bool:
        """Whether the LSTM and GRU layers' backward (``BatchedLSTM``, ``BatchedGRU``, converted ``nn.LSTM`` and
        ``nn.GRU``) may run each time step's elementwise part with batchlayers' own C kernel, one pass instead
        of about ten torch ops, the same arithmetic (default ``True``): float32 and float64 on the CPU, up to
        131k units a step (models x samples x hidden units; above, torch's ops on several threads were as
        fast). The kernels are compiled with the optimizers' (:attr:`native_optimizers`,
        :meth:`check_native_optimizers`); where that fails the backward takes torch's ops. Measured on a 2-core
        CPU (2 threads, float32, medians of 25 alternating rounds): the benchmark's LSTM policy (M=32, hidden
        64, B=8, T=16) 7.1 -> 5.9 ms a backward, 16.5 -> 15.2 ms a training step; a GRU of the same sizes
        14.5 -> 13.4 ms a step.
        """
        from .functional import _recurrent

        return _recurrent.native_kernel

    @native_recurrent.setter
    def native_recurrent(self, value: bool) -> None:
        from .functional import _recurrent

        if not isinstance(value, bool):
            raise TypeError(f"backends.cpu.native_recurrent must be True or False, got {value!r}")
        _recurrent.native_kernel = value

    @property
    def native_losses(self) -> bool:
        """Whether ``batchlayers.losses.cross_entropy`` of two classes, reduced per model (``'mean'`` or ``'sum'``,
        every target 0 or 1, class indices as int64), may compute the loss and its gradient with batchlayers' own
        C kernels: one call forward and one backward, where its formula in torch ops makes about twenty calls
        (default ``True``). float32 and float64 logits ``(M, B, 2)`` on the CPU with contiguous ``(B, 2)``
        rows. float32 computes ``exp`` and ``log1p`` with polynomials of its own (losses within 2.6 ulp of the
        exact values, probabilities within 1.7, over logit differences from -110 to 110; torch's softplus
        within 1) and sums each model's losses in float64; float64 calls the C library's. The kernels are
        compiled with the optimizers' (:attr:`native_optimizers`, :meth:`check_native_optimizers`); where that
        fails the formula runs in torch ops. Measured on a 2-core CPU (2 threads, float32, medians of
        alternating rounds, on and off): the loss forward and backward on ``(M, 64, 2)`` logits 376 -> 226 us
        at M=64 (1.78x) and 698 -> 493 us at M=1024 (1.44x); the benchmark's 10-20-2 MLP training step 1.11x
        at M=64 and 1.03x at M=1024 (single rounds 0.85-1.49x on a noisy VM).
        """
        from . import losses

        return losses.native_kernel

    @native_losses.setter
    def native_losses(self, value: bool) -> None:
        from . import losses

        if not isinstance(value, bool):
            raise TypeError(f"backends.cpu.native_losses must be True or False, got {value!r}")
        losses.native_kernel = value

    @property
    def native_chain(self) -> bool:
        """Whether ``BatchedSequential`` (and a stacked model's ``nn.Sequential``) may compute a run of small linear
        layers with ReLU between them with batchlayers' own C kernels: the whole run in one call forward and one
        backward, where torch's ops take a batched product, a bias add and an activation a layer, and autograd a
        node each (default ``True``). float32 and float64 on the CPU, inputs whose rows of features are
        contiguous, every layer at most 400 multiply-adds a sample (``in_features * out_features``; larger ones
        ran as fast or faster in torch's batched GEMM: see ``batchlayers.functional._mlp.NATIVE_MAX_LAYER_MACS``).
        Inside a model the kernels hold each tensor feature-major, so every product is vectorised over the
        samples. Results equal torch's up to each product's summation order. Such a run fuses at any size
        (``batchlayers.functional._mlp.CHAIN_MIN_MACS`` is for the other runs). The kernels are compiled with the
        optimizers' (:attr:`native_optimizers`, :meth:`check_native_optimizers`); where that fails the run takes
        torch's ops. Measured on a 2-core CPU (2 threads, float32, the benchmark's 10-20-2 MLP training step with
        64 samples a model, alternating on and off, medians of 40 rounds): 1.17x at M=64, 1.03x at M=1024
        (within its noise); against the layers run one by one 1.07x at M=1, 1.10x at M=4 and M=16.
        """
        from .functional import _mlp

        return _mlp.native_kernel

    @native_chain.setter
    def native_chain(self, value: bool) -> None:
        from .functional import _mlp

        if not isinstance(value, bool):
            raise TypeError(f"backends.cpu.native_chain must be True or False, got {value!r}")
        _mlp.native_kernel = value

    @property
    def explicit_attention_max_length(self) -> int:
        """The longest query or key sequence whose attention without a mask runs as explicit matrix products and
        a softmax on the CPU instead of torch's flash kernel while gradients are recorded, in
        ``BatchedMultiheadAttention`` and in a stacked model's own ``F.scaled_dot_product_attention`` (default 64;
        0 leaves every call to torch). The explicit
        ops save the ``heads x L x S`` probabilities for backward where the flash kernel saves ``L`` numbers a
        head. Measured on a 2-core CPU (float32, forward and backward of the op): 1.4-2.3x faster up to 64
        positions, 1.43x at 128 (16 samples, 8 heads of 64), 0.95x at 256, 0.56x at 512; the benchmark's stacked
        ``nn.TransformerEncoder`` (T=32) trains 3-10% faster. Causal attention, masks and dropout always take
        torch's call (see ``batchlayers/functional/_short_attention.py``)."""
        from .functional import _short_attention

        return _short_attention.MAX_LENGTH

    @explicit_attention_max_length.setter
    def explicit_attention_max_length(self, value: int) -> None:
        from .functional import _short_attention

        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"backends.cpu.explicit_attention_max_length must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"backends.cpu.explicit_attention_max_length must be 0 or more, got {value}")
        _short_attention.MAX_LENGTH = value

    @property
    def keeps_freed_memory(self) -> bool:
        """Whether :meth:`keep_freed_memory` was applied in this process."""
        return self._keeps_freed_memory

    def keep_freed_memory(self) -> bool:
        """Ask glibc to keep freed memory in the process for reuse: serve large blocks from the heap instead of
        ``mmap`` (``M_MMAP_THRESHOLD`` 1 GiB) and never give the heap's top back (``M_TRIM_THRESHOLD`` 2 GiB).

        Steady-state training then allocates no fresh pages: each step reuses the memory the previous step
        freed. The cost is memory: the process keeps its peak heap size (what it needed at its largest step)
        until it exits, as CUDA's caching allocator does. Process-wide and for the rest of the process (glibc
        has no way to read the old settings back); other allocators (jemalloc, tcmalloc, macOS, Windows)
        are left alone. In the environment,
        ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483648`` gives
        glibc the same settings at process start, without a code change.

        Returns:
            ``True`` when glibc accepted both settings, ``False`` where there is no glibc ``mallopt``.
        """
        mallopt = _glibc_mallopt()
        if mallopt is None:
            return False
        m_trim_threshold, m_mmap_threshold = -1, -3
        applied = bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 31))
        self._keeps_freed_memory = self._keeps_freed_memory or applied
        return applied


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` through ctypes, or ``None`` where the C library has none (other allocators, macOS,
    Windows)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


cpu = CpuSettings()
