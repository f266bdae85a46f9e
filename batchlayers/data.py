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

In-memory tensors go through :class:`ModelTensorLoader`: one ``(M, B)`` index tensor and one
``index_select`` per tensor and batch, no per-sample Python work; keep the tensors on the device the models
run on. Any map-style :class:`~torch.utils.data.Dataset` goes through :func:`model_data_loader`, a plain
:class:`~torch.utils.data.DataLoader` (workers, ``pin_memory``, ...) whose batches are ``(M, B, *)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

__all__ = ["MODES", "ModelBatchSampler", "ModelTensorLoader", "model_data_loader"]

MODES = ("shuffle", "bootstrap", "shared")

_MASK64 = (1 << 64) - 1
# Stream tags keep the generators of the different draws apart.
_SHUFFLE, _BOOTSTRAP, _SHARED = 1, 2, 3


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _generator(*keys: int) -> torch.Generator:
    """A CPU generator whose seed is a hash of ``keys``: nearby keys give unrelated streams."""
    state = 0
    for key in keys:
        state = _splitmix64(state ^ (key & _MASK64))
    return torch.Generator().manual_seed(state)


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
        epoch: the epoch the next ``iter()`` produces (counted from 0).
        model_ids: ``(M,)`` the stream each current model follows (``arange(M)`` until
            :meth:`keep_models_`).

    Examples::

        >>> sampler = ModelBatchSampler(4, num_samples=10, batch_size=3, seed=0)
        >>> [idx.shape for idx in sampler]
        [torch.Size([4, 3]), torch.Size([4, 3]), torch.Size([4, 3]), torch.Size([4, 1])]
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

    def keep_models_(self, indices: Sequence[int] | Tensor) -> ModelBatchSampler:
        """Keep only the models ``indices`` (integer positions or an ``(M,)`` bool mask), in that order.

        Each kept model goes on with its own stream, so a run that drops models mid-training feeds the
        survivors exactly the batches they would have seen without the drop. Takes effect at the next
        ``iter()`` (the next epoch); an epoch already started goes on with the models it started with.
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
        n = self.num_samples
        if self.mode == "shared":
            return torch.randperm(n, generator=_generator(self.seed, _SHARED, epoch)).unsqueeze(0)
        orders = [torch.randperm(n, generator=_generator(self.seed, _SHUFFLE, int(i), epoch)) for i in self.model_ids]
        if self.mode == "bootstrap":
            orders = [self._resample(int(i))[order] for i, order in zip(self.model_ids, orders)]
        return torch.stack(orders)

    def __iter__(self) -> Iterator[Tensor]:
        return self._iter_epoch(None)

    def _iter_epoch(self, device: torch.device | None) -> Iterator[Tensor]:
        # The epoch's whole order is drawn now (not lazily at the first next()), so the epoch counter
        # advances exactly once per iter(); it moves to ``device`` once per epoch, not once per batch.
        order = self.epoch_order(self.epoch)
        self.epoch += 1
        if device is not None:
            order = order.to(device)
        return self._batches(order, self.num_models)

    def _batches(self, order: Tensor, num_models: int) -> Iterator[Tensor]:
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = order[:, start : start + self.batch_size]
            # Expanded after any device move: a copy to another device would materialise the expand.
            yield batch.expand(num_models, -1) if self.mode == "shared" else batch

    def extra_repr(self) -> str:
        parts = [f"num_models={self.num_models}", f"num_samples={self.num_samples}", f"batch_size={self.batch_size}"]
        if self.mode != "shuffle":
            parts.append(f"mode={self.mode!r}")
        if self.drop_last:
            parts.append("drop_last=True")
        return ", ".join(parts + [f"seed={self.seed}"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


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

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        return self._gather_batches(self.sampler._iter_epoch(self.device))

    def _gather_batches(self, indices: Iterator[Tensor]) -> Iterator[tuple[Tensor, ...]]:
        for index in indices:
            yield tuple(_gather(t, index) for t in self.tensors)


class _BatchRequest(NamedTuple):
    """What a DataLoader worker receives per step: flat sample indices (model-major) and how to fold them."""

    indices: list[int]
    num_models: int
    shared: bool


class _RequestSampler(Sampler[_BatchRequest]):
    """The DataLoader's ``batch_sampler``: turns each ``(M, B)`` index tensor into a :class:`_BatchRequest`."""

    def __init__(self, sampler: ModelBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[_BatchRequest]:
        shared = self.sampler.mode == "shared"
        for index in self.sampler:
            # A shared batch is fetched once (B samples), not M times.
            flat = index[0] if shared else index.reshape(-1)
            yield _BatchRequest(flat.tolist(), index.shape[0], shared)


class _Fetched(NamedTuple):
    samples: Any
    num_models: int
    shared: bool


class _ModelBatchDataset(Dataset):
    """Wraps the user's dataset so that the DataLoader hands each whole :class:`_BatchRequest` to it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, request: _BatchRequest) -> _Fetched:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            samples = getitems(request.indices)
        else:
            samples = [self.dataset[i] for i in request.indices]
        return _Fetched(samples, request.num_models, request.shared)


def _fold_models(batch: Any, num_models: int, shared: bool) -> Any:
    """Reshape every tensor of a collated batch from ``(M * B, *)`` to ``(M, B, *)`` (expand when shared)."""
    if isinstance(batch, Tensor):
        if shared:
            return batch.expand(num_models, *batch.shape)
        return batch.view(num_models, batch.shape[0] // num_models, *batch.shape[1:])
    if isinstance(batch, Mapping):
        return type(batch)({k: _fold_models(v, num_models, shared) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_fold_models(v, num_models, shared) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_fold_models(v, num_models, shared) for v in batch)
    raise TypeError(
        f"model_data_loader: the collated batch holds a {type(batch).__name__}; expected tensors "
        "(possibly in tuples, lists or dicts) that can be folded to (M, B, *)"
    )


class _ModelCollate:
    """Collates a fetched flat list of samples with ``collate_fn`` and folds the result to ``(M, B, *)``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, fetched: _Fetched) -> Any:
        return _fold_models(self.collate_fn(fetched.samples), fetched.num_models, fetched.shared)


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
        collate_fn: merges a list of samples into a batch. Default: torch's ``default_collate``.
        **loader_kwargs: passed to :class:`~torch.utils.data.DataLoader` (``num_workers``, ``pin_memory``,
            ``persistent_workers``, ...). ``batch_size``, ``shuffle``, ``sampler`` and ``batch_sampler`` are
            set here.

    Returns:
        The DataLoader; ``loader.batch_sampler.sampler`` is its :class:`ModelBatchSampler` (epochs,
        :meth:`~ModelBatchSampler.keep_models_`).

    Examples::

        >>> loader = model_data_loader(dataset, num_models=8, batch_size=32, mode="bootstrap", seed=0,
        ...                            num_workers=2, pin_memory=torch.cuda.is_available())
        >>> for x, y in loader:  # (8, 32, *) each
        ...     ...
    """
    clashing = sorted({"batch_size", "shuffle", "sampler", "batch_sampler"} & loader_kwargs.keys())
    if clashing:
        raise TypeError(f"model_data_loader: {', '.join(clashing)} cannot be passed; the model sampler sets them")
    sampler = ModelBatchSampler(num_models, len(dataset), batch_size, mode, drop_last, seed)  # type: ignore[arg-type]
    return DataLoader(
        _ModelBatchDataset(dataset),
        batch_sampler=_RequestSampler(sampler),
        collate_fn=_ModelCollate(collate_fn or default_collate),
        **loader_kwargs,
    )
