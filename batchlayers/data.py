"""Per-model minibatch streams: every model its own shuffle, its own bootstrap resample, or one shared batch.

Three ways to feed ``M`` models, chosen with ``mode``:

- ``"shuffle"``: every model walks through the whole dataset each epoch in its own random order (models of
  a sweep or an ensemble see different minibatches, which decorrelates them).
- ``"bootstrap"``: every model draws its own bootstrap resample of the dataset (``N`` draws with
  replacement, bagging) once, and walks through that resample in a new random order each epoch. About
  36.8% of the samples are left out of each model's resample; :meth:`ModelBatchSampler.out_of_bag_mask`
  says which, for out-of-bag evaluation.
- ``"shared"``: one random order per epoch for all models; each batch is fetched once and handed to the
  models as a stride-0 ``expand``, never copied ``M`` times.

Epochs. Each epoch every model sees ``N`` samples (its permutation or its resample) in ``ceil(N / B)``
batches; the last batch is smaller (``N mod B`` samples, the same size for every model) unless
``drop_last=True`` drops it. Every ``iter()`` is a new epoch; :meth:`ModelBatchSampler.set_epoch` picks the
next one, which is all a resume from a checkpoint needs.

Reproducibility. Model ``i``'s stream depends only on ``(seed, i, epoch)`` and the dataset and batch sizes,
never on the number of models: the first 8 models of a 64-model run see exactly the batches of an 8-model
run with the same seed, and a model kept by :meth:`ModelBatchSampler.keep_models_` (successive halving)
goes on with its own stream. Each model's order in an epoch is ``torch.randperm`` from a generator seeded
from ``(seed, i, epoch)``.

Exact resume. :class:`ModelBatchSampler`, :class:`ModelTensorLoader` and the loader of
:func:`model_data_loader` have ``state_dict()`` / ``load_state_dict()``: the state holds the seed, the epoch,
the batches of it already handed out, and the models (``model_ids``, and those of the epoch in progress). A
resumed stream yields exactly the remaining batches of the uninterrupted one, also in the middle of an epoch
and with ``DataLoader`` workers (the loader counts the batches it handed to the caller, not those its
workers prefetched). The three states are the same dict, so a state moves freely between them.

Random numbers while fetching. :func:`model_data_loader` fetches and collates batch ``k`` of epoch ``e``
with torch's CPU generator and Python's ``random`` seeded with ``s = sampler.fetch_seed(e, k)``, and
numpy's global generator (when numpy is installed) with ``s % 2**32``; with ``num_workers=0`` it puts the
training process' generators back as they were afterwards. A dataset or ``collate_fn`` drawing random
augmentations from them therefore draws the same numbers whatever ``num_workers`` is, whichever worker gets
the batch, and wherever a run resumed; torch's per-worker seeds (drawn from torch's global generator) play
no part, and the loader never draws from the global generators of the training process.

In-memory tensors go through :class:`ModelTensorLoader`: one ``(M, B)`` index tensor and one
``index_select`` per tensor and batch, no per-sample Python work; keep the tensors on the device the models
run on. Any map-style :class:`~torch.utils.data.Dataset` goes through :func:`model_data_loader`, a plain
:class:`~torch.utils.data.DataLoader` (workers, ``pin_memory``, ...) whose batches are ``(M, B, *)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info
from torch.utils.data._utils.collate import default_collate

__all__ = ["MODES", "ModelBatchSampler", "ModelTensorLoader", "model_data_loader"]

MODES = ("shuffle", "bootstrap", "shared")

_MASK64 = (1 << 64) - 1
# Stream tags keep the generators of the different draws apart.
_SHUFFLE, _BOOTSTRAP, _SHARED, _FETCH, _LOADER = 1, 2, 3, 4, 5
_STATE_KEYS = (
    "num_models",
    "num_samples",
    "batch_size",
    "mode",
    "drop_last",
    "seed",
    "epoch",
    "batches_yielded",
    "model_ids",
    "epoch_model_ids",
)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _hash(*keys: int) -> int:
    """A 64-bit hash of ``keys``: nearby keys give unrelated seeds."""
    state = 0
    for key in keys:
        state = _splitmix64(state ^ (key & _MASK64))
    return state


def _generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded with a hash of ``keys``."""
    return torch.Generator().manual_seed(_hash(*keys))


class _EpochProgress:
    """Where a pass through one epoch stands: the epoch, the models it started with, batches handed out, and
    whether the pass ended (its iterator raised StopIteration)."""

    __slots__ = ("epoch", "model_ids", "batches", "finished")

    def __init__(self, epoch: int, model_ids: Tensor, batches: int, finished: bool = False) -> None:
        self.epoch = epoch
        self.model_ids = model_ids
        self.batches = batches
        self.finished = finished


def _check_positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{owner}: {name} must be at least 1, got {value}")
    return value


class ModelBatchSampler(Sampler[Tensor]):
    r"""Yields, per step, one minibatch of sample indices for each of ``num_models`` models.

    Args:
        num_models: number of models ``M``.
        num_samples: size ``N`` of the dataset the indices point into.
        batch_size: samples per model and step ``B``.
        mode: ``"shuffle"`` (own order per model), ``"bootstrap"`` (own resample with replacement per
            model) or ``"shared"`` (one batch for all models). Default: ``"shuffle"``.
        drop_last: drop each epoch's last, smaller batch. Default: ``False``.
        seed: seed of every stream, an int in ``[0, 2**64 - 1]`` (the seeds ``torch.Generator.manual_seed``
            tells apart). Default: ``None``, drawn once from torch's global generator (so
            ``torch.manual_seed`` makes it reproducible); the seed used is kept in :attr:`seed`.

    Shape:
        - Each item: ``(M, B)`` int64 indices; ``(M, N mod B)`` for an epoch's last batch. In ``"shared"``
          mode a stride-0 expand of one ``(B,)`` batch.

    Attributes:
        seed: the seed of the streams.
        epoch: the epoch the next ``iter()`` produces (counted from 0); after :meth:`load_state_dict` of a
            state taken in the middle of an epoch, that epoch, which the next ``iter()`` finishes.
        model_ids: ``(M,)`` the stream each current model follows (``arange(M)`` until
            :meth:`keep_models_`).

    Examples::

        >>> sampler = ModelBatchSampler(4, num_samples=10, batch_size=3, seed=0)
        >>> [idx.shape for idx in sampler]
        [torch.Size([4, 3]), torch.Size([4, 3]), torch.Size([4, 3]), torch.Size([4, 1])]
        >>> batches = iter(sampler)
        >>> first = next(batches)
        >>> state = sampler.state_dict()  # epoch 1, one batch handed out
        >>> resumed = ModelBatchSampler(4, num_samples=10, batch_size=3)
        >>> resumed.load_state_dict(state)
        >>> all(torch.equal(a, b) for a, b in zip(resumed, batches, strict=True))
        True
    """

    def __init__(
        self,
        num_models: int,
        num_samples: int,
        batch_size: int,
        mode: str = "shuffle",
        drop_last: bool = False,
        seed: int | None = None,
    ) -> None:
        name = type(self).__name__
        _check_positive_int(name, "num_models", num_models)
        self.num_samples = _check_positive_int(name, "num_samples", num_samples)
        self.batch_size = _check_positive_int(name, "batch_size", batch_size)
        if mode not in MODES:
            raise ValueError(f"{name}: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"{name}: with drop_last=True and batch_size={batch_size} larger than the {num_samples} "
                "samples, every epoch would be empty"
            )
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{name}: seed must be an int or None, got {type(seed).__name__}")
        elif not 0 <= seed <= _MASK64:
            # The streams hash the seed's 64 bits, as torch.Generator.manual_seed keeps them (a negative seed is
            # its two's complement there): any other int would silently give the stream of another seed.
            raise ValueError(f"{name}: seed must be in [0, 2**64 - 1], got {seed}")
        self.mode = mode
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.model_ids = torch.arange(num_models)
        # The pass the latest iter() started (its batches counted as they are handed out), and a mid-epoch
        # position from load_state_dict that the next iter() picks up.
        self._progress: _EpochProgress | None = None
        self._resume: _EpochProgress | None = None

    @property
    def num_models(self) -> int:
        return len(self.model_ids)

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` produce epoch ``epoch`` (e.g. when resuming from a checkpoint)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"{type(self).__name__}: epoch must be a non-negative int, got {epoch!r}")
        self.epoch = epoch
        self._progress = self._resume = None

    def keep_models_(self, indices: Sequence[int] | Tensor) -> ModelBatchSampler:
        """Keep only the models ``indices`` (integer positions or an ``(M,)`` bool mask), in that order.

        Each kept model goes on with its own stream, so a run that drops models mid-training feeds the
        survivors exactly the batches they would have seen without the drop. Takes effect at the next
        ``iter()`` that starts an epoch; an epoch already started (or loaded mid-way by
        :meth:`load_state_dict`) goes on with the models it started with.
        """
        # On the CPU, where model_ids is: survivors are often picked from scores on the models' device.
        index = torch.as_tensor(indices).cpu()
        name = type(self).__name__
        if index.dtype == torch.bool:
            if index.shape != (self.num_models,):
                raise ValueError(
                    f"{name}: expected a bool mask of shape ({self.num_models},), got shape {tuple(index.shape)}"
                )
            index = index.nonzero().flatten()
        if index.dim() != 1 or index.is_floating_point() or index.is_complex():
            raise ValueError(f"{name}: expected 1-D integer model indices or a bool mask, got {indices!r}")
        if index.numel() == 0:
            raise ValueError(f"{name}: cannot keep zero models")
        if bool(((index < -self.num_models) | (index >= self.num_models)).any()):
            raise ValueError(f"{name}: model indices {index.tolist()} out of range for {self.num_models} models")
        self.model_ids = self.model_ids[index]
        return self

    def bootstrap_indices(self) -> Tensor:
        """``(M, N)``: each model's bootstrap resample (``"bootstrap"`` mode only), in draw order."""
        if self.mode != "bootstrap":
            raise ValueError(f"{type(self).__name__}: bootstrap_indices() needs mode='bootstrap', not {self.mode!r}")
        return torch.stack([self._resample(int(i)) for i in self.model_ids])

    def out_of_bag_mask(self) -> Tensor:
        """``(M, N)`` bool: ``True`` where a sample is in no batch of that model (``"bootstrap"`` mode)."""
        drawn = self.bootstrap_indices()
        mask = torch.ones(self.num_models, self.num_samples, dtype=torch.bool)
        return mask.scatter_(1, drawn, False)

    def _resample(self, model_id: int) -> Tensor:
        generator = _generator(self.seed, _BOOTSTRAP, model_id)
        return torch.randint(self.num_samples, (self.num_samples,), generator=generator)

    def epoch_order(self, epoch: int) -> Tensor:
        """``(M, N)`` indices every model visits in epoch ``epoch``, in order (``(1, N)`` when shared)."""
        return self._order(epoch, self.model_ids)

    def _order(self, epoch: int, model_ids: Tensor) -> Tensor:
        n = self.num_samples
        if self.mode == "shared":
            return torch.randperm(n, generator=_generator(self.seed, _SHARED, epoch)).unsqueeze(0)
        orders = [torch.randperm(n, generator=_generator(self.seed, _SHUFFLE, int(i), epoch)) for i in model_ids]
        if self.mode == "bootstrap":
            orders = [self._resample(int(i))[order] for i, order in zip(model_ids, orders)]
        return torch.stack(orders)

    def fetch_seed(self, epoch: int, batch: int) -> int:
        """The seed the random generators get while :func:`model_data_loader` fetches batch ``batch`` (counted
        from 0) of epoch ``epoch``; an int in ``[0, 2**64 - 1]`` that depends only on :attr:`seed`, ``epoch``
        and ``batch``."""
        return _hash(self.seed, _FETCH, epoch, batch)

    def __iter__(self) -> Iterator[Tensor]:
        return (index for _, index in self._iter_epoch(None))

    def _iter_epoch(self, device: torch.device | None) -> Iterator[tuple[int, Tensor]]:
        """Starts the next epoch (or the rest of a loaded one): ``(batch number, (M, B) indices)`` pairs."""
        # The epoch's whole order is drawn now (not lazily at the first next()), so the epoch counter
        # advances exactly once per iter(); it moves to ``device`` once per epoch, not once per batch.
        progress = self._resume or _EpochProgress(self.epoch, self.model_ids, 0)
        self._progress, self._resume = progress, None
        self.epoch = progress.epoch + 1
        order = self._order(progress.epoch, progress.model_ids)
        if device is not None:
            order = order.to(device)
        return self._batches(order, progress)

    def _batches(self, order: Tensor, progress: _EpochProgress) -> Iterator[tuple[int, Tensor]]:
        num_models = len(progress.model_ids)
        for number in range(progress.batches, len(self)):
            batch = order[:, number * self.batch_size : (number + 1) * self.batch_size]
            # Counted before it is handed out: a state taken while the caller holds batch k resumes at k + 1.
            progress.batches = number + 1
            # Expanded after any device move: a copy to another device would materialise the expand.
            yield number, batch.expand(num_models, -1) if self.mode == "shared" else batch
        progress.finished = True

    def state_dict(self) -> dict[str, Any]:
        r"""The stream's position, for :meth:`load_state_dict`: a dict of ints, strings and tensors.

        Keys: the configuration (``num_models``, ``num_samples``, ``batch_size``, ``mode``, ``drop_last``,
        ``seed``), ``epoch`` (the epoch in progress, or the next one between epochs), ``batches_yielded``
        (batches of ``epoch`` already handed out), ``model_ids`` (the streams of the current models) and
        ``epoch_model_ids`` (the streams of the epoch in progress, which differ from ``model_ids`` after a
        :meth:`keep_models_` in the middle of an epoch).

        An epoch is in progress from ``iter()`` until its iterator is exhausted: a state taken after the
        epoch's last batch but inside the loop over it has ``batches_yielded == len(self)``, and a run
        resumed from it ends that epoch at once, so the code after the loop (a scheduler step, ...) runs as
        it would have.
        """
        return self._state(self._progress)

    def _state(self, progress: _EpochProgress | None) -> dict[str, Any]:
        if self._resume is not None:
            progress = self._resume
        elif progress is None or progress.finished:
            progress = _EpochProgress(self.epoch, self.model_ids, 0)
        return {
            "num_models": self.num_models,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "mode": self.mode,
            "drop_last": self.drop_last,
            "seed": self.seed,
            "epoch": progress.epoch,
            "batches_yielded": progress.batches,
            "model_ids": self.model_ids.clone(),
            "epoch_model_ids": progress.model_ids.clone(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        r"""Continue the stream from a :meth:`state_dict`: the next ``iter()`` yields the rest of its epoch.

        The sampler must have the state's configuration (``num_models``, ``num_samples``, ``batch_size``,
        ``mode``, ``drop_last``); the seed, the epoch, the position in it and the models' streams are taken
        from the state. After a :meth:`keep_models_`, build the sampler with the number of models kept.

        Raises:
            ValueError: the state is not a sampler state of this configuration (missing or unexpected keys,
                another number of models or samples, ...). Nothing is changed then.
        """
        self._load_state(state_dict, type(self).__name__)

    def _load_state(self, state: Mapping[str, Any], owner: str) -> None:
        # Everything is checked before anything is assigned: a rejected state changes nothing.
        where = f"{owner}.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: expected a state dict (a Mapping), got {type(state).__name__}")
        missing = [key for key in _STATE_KEYS if key not in state]
        unexpected = sorted(str(key) for key in state if key not in _STATE_KEYS)
        if missing or unexpected:
            problems = ([f"missing keys {missing}"] if missing else []) + (
                [f"unexpected keys {unexpected}"] if unexpected else []
            )
            raise ValueError(f"{where}: {' and '.join(problems)}; expected the keys {list(_STATE_KEYS)}")
        for name in ("num_models", "num_samples", "batch_size", "mode", "drop_last"):
            expected, got = getattr(self, name), state[name]
            if type(got) is not type(expected) or got != expected:
                raise ValueError(f"{where}: expected {name}={expected!r}, got {name}={got!r}")
        seed, epoch, batches = state["seed"], state["epoch"], state["batches_yielded"]
        if type(seed) is not int or not 0 <= seed <= _MASK64:
            raise ValueError(f"{where}: expected seed to be an int in [0, 2**64 - 1], got {seed!r}")
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"{where}: expected epoch to be a non-negative int, got {epoch!r}")
        if type(batches) is not int or not 0 <= batches <= len(self):
            raise ValueError(
                f"{where}: expected batches_yielded to be an int in [0, {len(self)}] (batches per epoch), "
                f"got {batches!r}"
            )
        model_ids = _check_model_ids(where, "model_ids", state["model_ids"], self.num_models)
        epoch_model_ids = _check_model_ids(where, "epoch_model_ids", state["epoch_model_ids"], None)
        self.seed, self.epoch, self.model_ids, self._progress = seed, epoch, model_ids, None
        same_models = torch.equal(epoch_model_ids, model_ids)
        self._resume = _EpochProgress(epoch, epoch_model_ids, batches) if batches or not same_models else None

    def extra_repr(self) -> str:
        parts = [f"num_models={self.num_models}", f"num_samples={self.num_samples}", f"batch_size={self.batch_size}"]
        if self.mode != "shuffle":
            parts.append(f"mode={self.mode!r}")
        if self.drop_last:
            parts.append("drop_last=True")
        return ", ".join(parts + [f"seed={self.seed}"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def _check_model_ids(where: str, name: str, ids: object, num_models: int | None) -> Tensor:
    """A state's model ids as a fresh CPU int64 tensor, or a ValueError saying what is wrong with them."""
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.is_sparse:
        got = f"shape {tuple(ids.shape)}, dtype {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{where}: expected {name} to be a 1-D integer tensor, got {got}")
    if ids.dtype == torch.bool:
        raise ValueError(f"{where}: expected {name} to be a 1-D integer tensor, got dtype torch.bool")
    if num_models is not None and len(ids) != num_models:
        raise ValueError(f"{where}: expected {name} of length num_models={num_models}, got length {len(ids)}")
    if len(ids) == 0 or bool((ids < 0).any()):
        raise ValueError(f"{where}: expected {name} to be non-empty stream ids >= 0, got {ids.tolist()}")
    return ids.detach().to("cpu", torch.int64, copy=True)


def _gather(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor[index]`` for an ``(M, b)`` index: one ``index_select``; a shared index is fetched once."""
    num_models, batch = index.shape
    if num_models > 1 and index.stride(0) == 0:
        rows = tensor.index_select(0, index[0])
        return rows.expand(num_models, *rows.shape)
    return tensor.index_select(0, index.reshape(-1)).view(num_models, batch, *tensor.shape[1:])


class ModelTensorLoader:
    r"""Per-model minibatches of in-memory tensors, like ``DataLoader(TensorDataset(*tensors))`` for M models.

    Each step is one ``(M, B)`` index tensor from a :class:`ModelBatchSampler` and one ``index_select`` per
    tensor: no per-sample Python work. The index lives on the tensors' device, so tensors kept on the GPU
    are batched on the GPU.

    Args:
        *tensors: tensors with the same first (sample) dimension ``N``, e.g. inputs and targets.
        num_models: number of models ``M``.
        batch_size: samples per model and step ``B``.
        mode: ``"shuffle"``, ``"bootstrap"`` or ``"shared"``, see :class:`ModelBatchSampler`.
            Default: ``"shuffle"``.
        drop_last: drop each epoch's last, smaller batch. Default: ``False``.
        seed: seed of every stream. Default: ``None`` (drawn from torch's global generator).

    Shape:
        - Each item: a tuple with one ``(M, B, *)`` tensor per input tensor of shape ``(N, *)``; in
          ``"shared"`` mode each is a stride-0 expand of one ``(B, *)`` batch.

    Attributes:
        sampler: the :class:`ModelBatchSampler` (epochs, :meth:`~ModelBatchSampler.keep_models_`, ...).
            :meth:`state_dict` and :meth:`load_state_dict` are the sampler's: a pass over an epoch hands out
            batches exactly as the sampler yields them.

    Examples::

        >>> x, y = torch.randn(100, 64), torch.randint(10, (100,))
        >>> loader = ModelTensorLoader(x, y, num_models=8, batch_size=32, seed=0)
        >>> xb, yb = next(iter(loader))
        >>> xb.shape, yb.shape
        (torch.Size([8, 32, 64]), torch.Size([8, 32]))
    """

    def __init__(
        self,
        *tensors: Tensor,
        num_models: int,
        batch_size: int,
        mode: str = "shuffle",
        drop_last: bool = False,
        seed: int | None = None,
    ) -> None:
        name = type(self).__name__
        if not tensors:
            raise ValueError(f"{name}: expected at least one tensor")
        for k, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}: expected tensors, but argument {k} is a {type(t).__name__}")
            if t.dim() == 0:
                raise ValueError(f"{name}: tensor {k} is 0-D; expected a first (sample) dimension")
        sizes = [t.shape[0] for t in tensors]
        if len(set(sizes)) > 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"{name}: all tensors need the same first (sample) dimension, got shapes {shapes}")
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
        self.tensors = tensors
        self.device = tensors[0].device
        self.sampler = ModelBatchSampler(num_models, sizes[0], batch_size, mode, drop_last, seed)

    @property
    def num_models(self) -> int:
        return self.sampler.num_models

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def keep_models_(self, indices: Sequence[int] | Tensor) -> ModelTensorLoader:
        """Keep only the models ``indices``; see :meth:`ModelBatchSampler.keep_models_`."""
        self.sampler.keep_models_(indices)
        return self

    def state_dict(self) -> dict[str, Any]:
        """The stream's position (the sampler's state); see :meth:`ModelBatchSampler.state_dict`."""
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; see :meth:`ModelBatchSampler.load_state_dict`."""
        self.sampler._load_state(state_dict, type(self).__name__)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        return self._gather_batches(self.sampler._iter_epoch(self.device))

    def _gather_batches(self, indices: Iterator[tuple[int, Tensor]]) -> Iterator[tuple[Tensor, ...]]:
        for _, index in indices:
            yield tuple(_gather(t, index) for t in self.tensors)


class _BatchRequest(NamedTuple):
    """What a DataLoader worker receives per step: flat sample indices (model-major), how to fold them, and the
    seed of the random generators while fetching them."""

    indices: list[int]
    num_models: int
    shared: bool
    seed: int


class _Pass:
    """One ``iter()`` of a model data loader: the sampler epoch it walks (set when it starts) and the batches
    handed to the caller, which trail the sampler's count by the batches the workers prefetched."""

    __slots__ = ("progress", "handed_out", "finished")

    def __init__(self) -> None:
        self.progress: _EpochProgress | None = None
        self.handed_out = 0
        self.finished = False


class _RequestSampler(Sampler[_BatchRequest]):
    """The DataLoader's ``batch_sampler``: turns each ``(M, B)`` index tensor into a :class:`_BatchRequest`."""

    def __init__(self, sampler: ModelBatchSampler) -> None:
        self.sampler = sampler
        self.current_pass: _Pass | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[_BatchRequest]:
        # Lazy: a multi-worker DataLoader iterator calls iter() twice for its first epoch and walks only the
        # second; the epoch starts at the first request.
        return self._requests(self.current_pass)

    def _requests(self, current_pass: _Pass | None) -> Iterator[_BatchRequest]:
        batches = self.sampler._iter_epoch(None)
        progress = self.sampler._progress
        assert progress is not None  # (_iter_epoch has just started the epoch)
        if current_pass is not None:
            current_pass.progress, current_pass.handed_out = progress, progress.batches
        shared = self.sampler.mode == "shared"
        for number, index in batches:
            # A shared batch is fetched once (B samples), not M times.
            flat = index[0] if shared else index.reshape(-1)
            seed = self.sampler.fetch_seed(progress.epoch, number)
            yield _BatchRequest(flat.tolist(), index.shape[0], shared, seed)


@functools.cache
def _numpy() -> ModuleType | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


@contextlib.contextmanager
def _seeded_generators(seed: int) -> Iterator[None]:
    """Seeds torch's CPU generator, ``random`` and numpy's global generator; in the training process (no
    workers) also puts them back on exit, so that fetching draws nothing from the training's generators."""
    numpy = _numpy()
    # In a worker the generators serve only the fetches, each of which seeds them anew: nothing to put back.
    # Saving and restoring costs about 150 us a batch (numpy's get_state and set_state 50 and 80 us, the
    # rest 20 us; 2-core Xeon VM), against about 5 us for seeding alone.
    restore = get_worker_info() is None
    if restore:
        torch_state, python_state = torch.default_generator.get_state(), random.getstate()
        numpy_state = numpy.random.get_state() if numpy is not None else None
    # The CPU generator alone: torch.manual_seed would also reseed (and not restore) every CUDA generator.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    try:
        yield
    finally:
        if restore:
            torch.default_generator.set_state(torch_state)
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


class _ModelBatchDataset(Dataset):
    """Wraps the user's dataset so that the DataLoader hands each whole :class:`_BatchRequest` to it, which
    fetches, collates and folds the batch with seeded random generators."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, request: _BatchRequest) -> Any:
        with _seeded_generators(request.seed):
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems is not None:
                samples = getitems(request.indices)
            else:
                samples = [self.dataset[i] for i in request.indices]
            batch = self.collate_fn(samples)
        return _fold_models(batch, request.num_models, len(request.indices), request.shared)


def _collated(batch: Any) -> Any:
    """The DataLoader's ``collate_fn``: the batch arrives collated and folded from ``__getitems__``."""
    return batch


def _fold_models(batch: Any, num_models: int, num_samples: int, shared: bool, where: str = "batch") -> Any:
    """Reshape every tensor of a collated batch from ``(M * B, *)`` to ``(M, B, *)`` (from ``(B, *)``, expanded,
    when shared); ``num_samples`` is ``M * B`` (``B`` when shared), the number of samples fetched."""
    if isinstance(batch, Tensor):
        # Checked, not inferred from the shape: a collate whose tensors are not sample-major (pad_sequence's
        # default is time-major, (T, M * B)) would otherwise be folded along another axis, each model getting
        # pieces of every model's samples.
        if batch.dim() == 0 or batch.shape[0] != num_samples:
            expected = f"(B, *) = ({num_samples}, *)" if shared else f"(M * B, *) = ({num_samples}, *)"
            raise ValueError(
                f"model_data_loader: collate_fn returned {where} without the samples first: every tensor of the "
                f"collated batch must be {expected} to be folded to (M, B, *) with M = {num_models}, got shape "
                f"{tuple(batch.shape)}; a time-major collate (e.g. pad_sequence without batch_first=True) must "
                "put the samples first"
            )
        if shared:
            return batch.expand(num_models, *batch.shape)
        return batch.view(num_models, num_samples // num_models, *batch.shape[1:])

    def fold(value: Any, key: Any) -> Any:
        return _fold_models(value, num_models, num_samples, shared, f"{where}[{key!r}]")

    if isinstance(batch, Mapping):
        return cast(Any, type(batch))({k: fold(v, k) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(fold(v, i) for i, v in enumerate(batch)))
    if isinstance(batch, (tuple, list)):
        return type(batch)(fold(v, i) for i, v in enumerate(batch))
    raise TypeError(
        f"model_data_loader: the collated batch holds a {type(batch).__name__} at {where}; expected tensors "
        "(possibly in tuples, lists or dicts) that can be folded to (M, B, *)"
    )


class _ModelDataLoader(DataLoader):
    """The DataLoader of :func:`model_data_loader`: counts the batches it hands out, for ``state_dict``."""

    def __init__(
        self, dataset: Dataset, sampler: ModelBatchSampler, collate_fn: Callable[[list[Any]], Any], **kwargs: Any
    ) -> None:
        self._pass: _Pass | None = None
        super().__init__(
            _ModelBatchDataset(dataset, collate_fn),
            batch_sampler=_RequestSampler(sampler),  # type: ignore[arg-type]  # of _BatchRequests, not lists
            collate_fn=_collated,
            **kwargs,
        )

    @property
    def _request_sampler(self) -> _RequestSampler:
        return cast(_RequestSampler, self.batch_sampler)  # (the one __init__ passed)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # not a _BaseDataLoaderIter: counts what it yields
        current = self._pass = self._request_sampler.current_pass = _Pass()
        return _CountedIterator(super().__iter__(), current)

    def state_dict(self) -> dict[str, Any]:
        """The position of the batches handed out (not of those prefetched); see
        :meth:`ModelBatchSampler.state_dict`."""
        sampler: ModelBatchSampler = self._request_sampler.sampler
        current = self._pass
        if current is None or current.progress is None or current.progress is not sampler._progress:
            return sampler.state_dict()
        progress = current.progress
        return sampler._state(_EpochProgress(progress.epoch, progress.model_ids, current.handed_out, current.finished))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` at the next ``iter()``; see :meth:`ModelBatchSampler.load_state_dict`."""
        self._request_sampler.sampler._load_state(state_dict, "model_data_loader")
        self._pass = None


class _CountedIterator:
    """A DataLoader iterator that counts the batches it hands out."""

    def __init__(self, iterator: Iterator[Any], current: _Pass) -> None:
        self.iterator = iterator
        self.current = current

    def __iter__(self) -> _CountedIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.iterator)
        except StopIteration:
            self.current.finished = True
            raise
        self.current.handed_out += 1
        return batch

    def __len__(self) -> int:
        return len(self.iterator)  # type: ignore[arg-type]


def model_data_loader(
    dataset: Dataset,
    num_models: int,
    batch_size: int,
    *,
    mode: str = "shuffle",
    drop_last: bool = False,
    seed: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    r"""A :class:`~torch.utils.data.DataLoader` over any map-style dataset that yields ``(M, B, *)`` batches.

    Each step fetches the ``M * B`` samples of one :class:`ModelBatchSampler` item (only ``B`` in
    ``"shared"`` mode) in a worker, collates them with ``collate_fn`` and folds every tensor of the result
    to ``(M, B, *)``. With the same seed it yields exactly the batches of :class:`ModelTensorLoader` over
    the same data.

    Args:
        dataset: a map-style dataset of ``N`` samples (``__getitems__`` is used when it has one).
        num_models: number of models ``M``.
        batch_size: samples per model and step ``B``.
        mode: ``"shuffle"``, ``"bootstrap"`` or ``"shared"``, see :class:`ModelBatchSampler`.
        drop_last: drop each epoch's last, smaller batch. Default: ``False``.
        seed: seed of every stream. Default: ``None`` (drawn from torch's global generator).
        collate_fn: merges a list of samples into a batch. Default: torch's ``default_collate``. Every tensor
            it returns must hold the samples first, ``(M * B, *)`` (``(B, *)`` in ``"shared"`` mode), or a
            ``ValueError`` is raised: e.g. ``pad_sequence(samples, batch_first=True)``, not the time-major
            default. (A time-major tensor whose length happens to equal ``M * B`` cannot be told apart.)
        **loader_kwargs: passed to :class:`~torch.utils.data.DataLoader` (``num_workers``, ``pin_memory``,
            ``persistent_workers``, ...). ``batch_size``, ``shuffle``, ``sampler`` and ``batch_sampler`` are
            set here; ``generator`` defaults to one seeded from ``seed``, so that starting an epoch draws
            nothing from torch's global generator (``DataLoader`` draws its worker base seed from it).

    Returns:
        The DataLoader; ``loader.batch_sampler.sampler`` is its :class:`ModelBatchSampler` (epochs,
        :meth:`~ModelBatchSampler.keep_models_`). ``loader.state_dict()`` and ``loader.load_state_dict()``
        save and restore the position of the batches handed out so far (those the workers prefetched do not
        count), in the sampler's format: a run resumed from it yields exactly the remaining batches, with the
        same random augmentations (see the module's "Random numbers while fetching").

    Examples::

        >>> loader = model_data_loader(dataset, num_models=8, batch_size=32, mode="bootstrap", seed=0,
        ...                            num_workers=2, pin_memory=torch.cuda.is_available())
        >>> for x, y in loader:  # (8, 32, *) each
        ...     ...
    """
    clashing = sorted({"batch_size", "shuffle", "sampler", "batch_sampler"} & loader_kwargs.keys())
    if clashing:
        raise TypeError(f"model_data_loader: {', '.join(clashing)} cannot be passed; the model sampler sets them")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            "model_data_loader: expected a map-style dataset (with __len__ and __getitem__: each model draws its "
            f"own indices into it), got {type(dataset).__name__}"
        )
    sampler = ModelBatchSampler(num_models, len(dataset), batch_size, mode, drop_last, seed)
    if loader_kwargs.get("generator") is None:
        loader_kwargs["generator"] = _generator(sampler.seed, _LOADER)
    return _ModelDataLoader(dataset, sampler, collate_fn or default_collate, **loader_kwargs)
