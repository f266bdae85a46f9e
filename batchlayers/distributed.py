r"""Shard a population of models across processes with ``torch.distributed``: every rank trains its own models.

The models of a batched model are independent, so the natural way to scale past one device is to split the
model dimension: rank ``r`` of ``R`` holds a contiguous slice of the ``M`` models and trains it alone, with
no gradient traffic at all. Communication happens only where the population meets: gathering per-model
metrics, choosing survivors, copying a model from one rank to another (population-based training), and
checkpoints. Everything here is built on ``torch.distributed`` (gloo on CPU, nccl on GPUs).

Positions and model ids. The population is ``M`` models at *positions* ``0 .. M-1``; rank ``r`` holds the
positions ``shard.start .. shard.stop - 1`` (``torch.tensor_split`` sizes: the first ``M mod R`` ranks hold
one model more). Every function here takes global positions, as the single-process
:func:`~batchlayers.population.keep_models_` takes indices, and gives every rank the same answer. Each
position also carries a *model id*, ``shard.model_ids[p]`` (``arange(M)`` at the start), which follows a
model through selections: it names the model in reports, seeds its initialisation (:func:`build_shard`) and
picks its data stream (:func:`shard_data_`).

Exactness. A sharded run gives, model by model, the single-process run of all ``M`` models, bit for bit in
float64, when the per-model arithmetic runs with one intra-op thread in both (``torch.set_num_threads(1)``,
one process per core on CPU): with several threads torch splits some kernels' work by the number of models,
which changes the order of floating-point sums (measured: a 1-model slice of a 7-model CNN differs in the
last bits with 2 threads, and is identical with 1). The exception measured is batch norm's backward on the
CPU: torch's kernel rounds its per-channel sums differently for different numbers of channels (``M * C``),
so the gradients of a model with a batch norm agree with the single-process run to about 1e-16, not bit for
bit. Everything that crosses ranks is copied bytes, never arithmetic. ``tests/test_distributed.py`` checks
weights, optimizer and scheduler state and losses against the single-process run after training, a cross-rank
exploit, global successive halving and a resume on another number of ranks.

A sharded sweep::

    dist.init_process_group("gloo")                                     # torchrun sets rank and world size
    shard = ModelShard.from_group(64)                                   # this rank's slice of 64 models
    model = build_shard(lambda n: nn.Sequential(BatchedLinear(n, 64, 32), nn.ReLU(),
                                                BatchedLinear(n, 32, 10)), shard, seed=0)
    optimizer = batchlayers.optim.AdamW(model.parameters(), lr=lrs[shard.start:shard.stop])
    loader = shard_data_(ModelTensorLoader(x, y, num_models=shard.num_local, batch_size=32, seed=0), shard)
    for rung in range(3):
        train(model, optimizer, loader)
        scores = gather_per_model(validation_accuracy(model), shard)    # (M,) on every rank
        best = top_k_models(scores, shard, k=shard.num_models // 2)
        shard = keep_models_across_ranks_(model, optimizer, shard, best)  # survivors rebalanced over ranks
        shard_data_(loader, shard)

Data parallel inside a shard. When one model's batch is too large for one device, give each shard several
ranks and wrap the shard's model in :class:`~torch.nn.parallel.DistributedDataParallel` over those ranks
(``init_device_mesh(device, (R_models, R_data), mesh_dim_names=("models", "data"))``, the shard from
``mesh["models"].get_group()``, DDP with ``process_group=mesh["data"].get_group()``). DDP all-reduces the
``(M, *)`` gradients elementwise and divides them by the number of data ranks, so model ``m``'s gradient is
the mean over the data ranks of the gradient of its own loss. With per-model *mean* losses (every
``batchlayers.losses`` function) and equal local batches, that is exactly the gradient of model ``m``'s
mean loss over the whole batch, as a single process computes it on the concatenated batch; no model's
gradient mixes with another's. Keep summing the per-model losses (``losses.sum().backward()``): the sum over
models is what keeps each model's gradient its own, and DDP's division is over data ranks, not models. A
per-model loss with ``reduction="sum"`` would come out divided by the number of data ranks. The per-model
losses each data rank sees are its local batch's; average them over the data group
(``dist.all_reduce(losses, group=data_group); losses /= R_data``) before gathering them over the model
group. FSDP2's ``fully_shard`` would shard the ``(M, *)`` parameters along the model dimension too, but
all-gather them for every forward: with independent models, :class:`ModelShard` gets the same memory split
with no parameter traffic at all.

NCCL: call ``torch.cuda.set_device(local_rank)`` before the first collective, as torch asks; tensors are
staged on that device for nccl and on the CPU for gloo, wherever the model lives.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .amp import stepping_scalers
from .convert import replicate, select, shared_buffers
from .data import ModelBatchSampler
from .population import (
    _check_schedulers,
    _scheduler_lists,
    _scheduler_state,
    _unlisted_live_schedulers,
    copy_model_,
    index_models_,
    keep_models_,
)

__all__ = [
    "ModelShard",
    "build_shard",
    "copy_model_across_ranks_",
    "gather_models",
    "gather_per_model",
    "keep_models_across_ranks_",
    "load_population_",
    "model_seed",
    "replicate_shard",
    "save_population",
    "saved_num_models",
    "shard_data_",
    "shard_models",
    "top_k_models",
]

Positions = int | Sequence[int] | Tensor

_MASK64 = (1 << 64) - 1
_FORMAT = "batchlayers.distributed.population/1"


# ----------------------------------------------------------------------------------------------------------
# Which rank holds which model


@dataclass(frozen=True)
class ModelShard:
    r"""This rank's contiguous slice of a population of ``num_models`` models split over ``world_size`` ranks.

    Rank ``r`` holds the positions ``start .. stop - 1``; the first ``num_models mod world_size`` ranks hold
    one model more than the others (``torch.tensor_split`` sizes), so every rank holds at least one model.
    A shard is immutable: functions that change the population return a new one.

    Args:
        num_models: the number of models ``M`` in the whole population.
        rank: this rank, in ``group``. Default: ``0``.
        world_size: the number of ranks ``R`` of ``group``, at most ``M``. Default: ``1`` (one process
            holding every model, where nothing is communicated).
        model_ids: the id of the model at each position (its initial position, kept through selections).
            Default: ``range(M)``.
        group: the process group the models are split over. Default: ``None``, the default group.

    Attributes:
        sizes: models held by each rank, ``(R,)``.
        start, stop: this rank's positions are ``range(start, stop)``.
        num_local: ``stop - start``, the ``num_models`` of this rank's batched model.
        local_model_ids: the model ids of this rank's models.

    Examples::

        >>> shard = ModelShard(10, rank=1, world_size=4)
        >>> shard.sizes, shard.start, shard.stop
        ((3, 3, 2, 2), 3, 6)
        >>> shard.rank_of(7), shard.locate(7)
        (2, (2, 1))
    """

    num_models: int
    rank: int = 0
    world_size: int = 1
    model_ids: tuple[int, ...] = None  # type: ignore[assignment]
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_models", "rank", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ModelShard: {name} must be an int, got {type(value).__name__}")
        if self.world_size < 1:
            raise ValueError(f"ModelShard: world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ModelShard: rank {self.rank} is out of range for world_size {self.world_size}")
        if self.num_models < self.world_size:
            raise ValueError(
                f"ModelShard: {self.num_models} models cannot be split over {self.world_size} ranks; every rank "
                "needs at least one model (use fewer ranks, or gather the models with gather_models)"
            )
        ids = tuple(range(self.num_models)) if self.model_ids is None else self.model_ids
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        ids = tuple(ids)
        if len(ids) != self.num_models or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"ModelShard: model_ids must be {self.num_models} ints, got {ids!r}")
        object.__setattr__(self, "model_ids", ids)

    @classmethod
    def from_group(cls, num_models: int, group: Any = None, model_ids: Sequence[int] | None = None) -> ModelShard:
        """The shard of this process in ``group`` (the default group if ``None``); a single-process shard of
        all ``num_models`` models when ``torch.distributed`` is not initialised."""
        ids = cast("tuple[int, ...]", model_ids)  # (any sequence or None: __post_init__ makes the tuple)
        if not (dist.is_available() and dist.is_initialized()):
            return cls(num_models, model_ids=ids)
        return cls(num_models, dist.get_rank(group), dist.get_world_size(group), model_ids=ids, group=group)

    @property
    def sizes(self) -> tuple[int, ...]:
        base, extra = divmod(self.num_models, self.world_size)
        return tuple(base + (r < extra) for r in range(self.world_size))

    def _start_of(self, rank: int) -> int:
        base, extra = divmod(self.num_models, self.world_size)
        return rank * base + min(rank, extra)

    @property
    def start(self) -> int:
        return self._start_of(self.rank)

    @property
    def stop(self) -> int:
        return self._start_of(self.rank + 1)

    @property
    def num_local(self) -> int:
        return self.stop - self.start

    @property
    def positions(self) -> range:
        """This rank's global positions."""
        return range(self.start, self.stop)

    @property
    def local_model_ids(self) -> tuple[int, ...]:
        return self.model_ids[self.start : self.stop]

    def _check_position(self, position: int) -> int:
        if isinstance(position, Tensor) and position.numel() == 1:
            position = int(position)
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"ModelShard: a position must be an int, got {position!r}")
        if not 0 <= position < self.num_models:
            raise IndexError(f"ModelShard: position {position} is out of range for {self.num_models} models")
        return position

    def rank_of(self, position: int) -> int:
        """The rank holding the model at global ``position``."""
        position = self._check_position(position)
        base, extra = divmod(self.num_models, self.world_size)
        big = extra * (base + 1)  # positions held by the ranks with one model more
        return position // (base + 1) if position < big else extra + (position - big) // base

    def locate(self, position: int) -> tuple[int, int]:
        """``(rank, local index)`` of the model at global ``position``."""
        rank = self.rank_of(position)
        return rank, position - self._start_of(rank)

    def owns(self, position: int) -> bool:
        """Whether this rank holds the model at global ``position``."""
        return self.rank_of(position) == self.rank

    def local_index(self, position: int) -> int:
        """The index in this rank's batched model of the model at global ``position`` (held here)."""
        rank, index = self.locate(position)
        if rank != self.rank:
            raise ValueError(f"ModelShard: position {position} is held by rank {rank}, not by rank {self.rank}")
        return index

    def position(self, local_index: int) -> int:
        """The global position of this rank's model ``local_index``."""
        if isinstance(local_index, bool) or not isinstance(local_index, int):
            raise TypeError(f"ModelShard: a local index must be an int, got {local_index!r}")
        if not 0 <= local_index < self.num_local:
            raise IndexError(f"ModelShard: local index {local_index} is out of range for {self.num_local} models")
        return self.start + local_index

    def kept(self, positions: Positions) -> ModelShard:
        """The shard of the population made of the models at ``positions`` (in that order), on the same
        ranks; their model ids go with them. This only computes the layout: see
        :func:`keep_models_across_ranks_`."""
        index = _as_positions(positions, self.num_models, "positions", "ModelShard.kept", allow_mask=True)
        return ModelShard(
            len(index), self.rank, self.world_size, tuple(self.model_ids[i] for i in index), group=self.group
        )


def _as_positions(positions: Positions, num_models: int, what: str, caller: str, allow_mask: bool = False) -> list:
    """Global positions as a list of ints in ``[0, M)``; negative ones count from the end, as in Python."""
    if isinstance(positions, Tensor):
        index = positions.detach().cpu()
        if index.dtype == torch.bool and allow_mask:
            if index.shape != (num_models,):
                shape = tuple(index.shape)
                raise ValueError(f"{caller}: a bool mask for {what} must have shape ({num_models},), got {shape}")
            index = index.nonzero().flatten()
        elif index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise TypeError(f"{caller}: {what} must be integers, got a {positions.dtype} tensor")
        values = index.reshape(-1).tolist()
    else:
        values = [positions] if isinstance(positions, int) else list(positions)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
            raise TypeError(f"{caller}: {what} must be integers, got {values!r}")
    if not values:
        raise ValueError(f"{caller}: {what} selects no model")
    bad = [i for i in values if not -num_models <= i < num_models]
    if bad:
        raise ValueError(f"{caller}: {what} {bad} out of range for {num_models} models")
    return [i % num_models for i in values]


# ----------------------------------------------------------------------------------------------------------
# Building a rank's models


def model_seed(seed: int, model_id: int) -> int:
    """The seed of model ``model_id``'s own initialisation in a population seeded with ``seed``: a hash
    (splitmix64) of both, so nearby ids give unrelated streams. In ``[0, 2**63)``."""
    state = 0
    for key in (seed, model_id):
        z = ((state ^ (int(key) & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


class _SeededRNG:
    """Seeds torch's generators (CPU and, where given, one CUDA device) with ``seed`` and puts back their
    previous states on exit, so building models here changes no other random stream."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.devices = [device] if device.type == "cuda" else []

    def __enter__(self) -> None:
        self.fork = torch.random.fork_rng(devices=self.devices)
        self.fork.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        self.fork.__exit__(*exc)


def _local_tensors(module: nn.Module) -> dict[str, Tensor]:
    shared = set(shared_buffers(module))
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: t for name, t in named if name not in shared}


@torch.no_grad()
def build_shard(
    factory: Callable[[int], nn.Module], shard: ModelShard, *, seed: int, device: torch.device | str | None = None
) -> nn.Module:
    r"""This rank's models of a population built by ``factory(num_models)``, without building the others.

    The batched model is created on the meta device (no memory) and materialised for ``shard.num_local``
    models only; then each local model is initialised on its own: ``factory(1)`` is called under
    ``torch.manual_seed(model_seed(seed, model_id))`` and its single model copied in. Model ``i``'s initial
    weights therefore depend only on ``(seed, i)``: every rank count, including one process holding all
    ``M`` (``ModelShard(M)``), builds exactly the same models. torch's random state is left as it was.

    This is not the initialisation of ``factory(M)`` under one ``torch.manual_seed``, where model ``i``'s
    draws follow those of models ``0 .. i-1``: reproducing that needs all ``M`` models' draws, so build the
    full model and use :func:`shard_models` if you need it.

    Args:
        factory: ``num_models -> batched module``, e.g. ``lambda n: nn.Sequential(BatchedLinear(n, 10, 2))``;
            every parameter and buffer ``(num_models, *)``, created by torch factory functions (so that the
            meta device applies).
        shard: this rank's :class:`ModelShard`.
        seed: the population's seed.
        device: where the models live. Default: the current default device.

    Returns:
        The batched module holding ``shard.num_local`` models.
    """
    device = torch.get_default_device() if device is None else torch.device(device)
    with torch.device("meta"):
        model = factory(shard.num_local)
    model = model.to_empty(device=device)
    tensors = _local_tensors(model)
    for index, model_id in enumerate(shard.local_model_ids):
        with _SeededRNG(model_seed(seed, model_id), device), torch.device(device):
            one = factory(1)
        ones = _local_tensors(one)
        if ones.keys() != tensors.keys():
            raise ValueError(
                f"build_shard: factory(1) and factory({shard.num_local}) hold different tensors: "
                f"{sorted(ones.keys() ^ tensors.keys())}"
            )
        for name, t in tensors.items():
            if ones[name].shape != (1, *t.shape[1:]):
                raise ValueError(
                    f"build_shard: '{name}' of factory(1) has shape {tuple(ones[name].shape)}, expected "
                    f"(1, {', '.join(map(str, t.shape[1:]))}): every tensor needs the model dimension first"
                )
            t[index].copy_(ones[name][0])
    return model


def replicate_shard(factory: Callable[[], nn.Module], shard: ModelShard, *, seed: int) -> nn.Module:
    r"""This rank's models of a population of ordinary models made by ``factory()``, stacked.

    :func:`~batchlayers.replicate` over this rank's models, each made by ``factory()`` under
    ``torch.manual_seed(model_seed(seed, model_id))``: model ``i`` is exactly the ordinary model
    ``factory()`` builds from that seed, on every number of ranks, and no other rank's models are built.
    torch's random state is left as it was.

    Args:
        factory: builds one ordinary model (your own ``nn.Module`` class, a torch.nn model).
        shard: this rank's :class:`ModelShard`.
        seed: the population's seed.

    Returns:
        The stacked model of ``shard.num_local`` models (see :func:`~batchlayers.stack`).
    """
    ids = iter(shard.local_model_ids)

    def seeded() -> nn.Module:
        with _SeededRNG(model_seed(seed, next(ids)), torch.get_default_device()):
            return factory()

    return replicate(seeded, shard.num_local)


def shard_models(model: nn.Module, shard: ModelShard) -> nn.Module:
    """A copy of this rank's slice of a batched or stacked ``model`` holding all ``M`` models.

    Exact for any initialisation, but every rank builds all ``M`` models first; :func:`build_shard` and
    :func:`replicate_shard` build only the rank's own. A stacked model is sliced with
    :func:`~batchlayers.select`, a batched one (batched layers) with
    :func:`~batchlayers.population.index_models_` on a copy.
    """
    num_models = _tensor_num_models(model, "shard_models")
    if num_models != shard.num_models:
        raise ValueError(f"shard_models: the model holds {num_models} models, the shard splits {shard.num_models}")
    positions = list(shard.positions)
    if isinstance(getattr(model, "num_models", None), int):
        return select(model, positions)  # a stacked model or a batched layer: copies only the selected slices
    return index_models_(copy.deepcopy(model), positions)


def _tensor_num_models(model: nn.Module, caller: str) -> int:
    sizes = {t.shape[0] if t.dim() else None for t in _local_tensors(model).values()}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"{caller}: every parameter and buffer needs the same model dimension first, got {sizes}")
    return cast(int, sizes.pop())  # (None refused above)


def shard_data_(loader: Any, shard: ModelShard) -> Any:
    r"""Make a per-model data loader feed this rank's models their own streams, whatever the number of ranks.

    A :class:`~batchlayers.ModelBatchSampler` draws model ``i``'s batches from ``(seed, model_ids[i],
    epoch)`` only; this sets its ``model_ids`` to the rank's :attr:`ModelShard.local_model_ids`, so model
    ``i`` sees exactly the batches it sees in a single-process run of all models with the same seed. Build
    the loader on every rank with the same explicit ``seed``; call again with the new shard after a
    selection (it takes effect at the next epoch).

    Args:
        loader: a :class:`~batchlayers.ModelTensorLoader`, a :class:`~batchlayers.ModelBatchSampler` or a
            loader from :func:`~batchlayers.model_data_loader`.
        shard: this rank's :class:`ModelShard`.

    Returns:
        ``loader``.
    """
    candidates = [
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    sampler = next((c for c in candidates if isinstance(c, ModelBatchSampler)), None)
    if sampler is None:
        raise TypeError(
            f"shard_data_: expected a ModelTensorLoader, a ModelBatchSampler or a model_data_loader, got "
            f"{type(loader).__name__}"
        )
    sampler.model_ids = torch.tensor(shard.local_model_ids, dtype=torch.long)
    return loader


# ----------------------------------------------------------------------------------------------------------
# Collectives over the population


def _comm_device(shard: ModelShard) -> torch.device:
    """Where tensors are staged for the group's backend: the current CUDA device for nccl, else the CPU."""
    backend = str(dist.get_backend(shard.group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(shard: ModelShard, rank: int) -> int:
    return rank if shard.group is None else dist.get_global_rank(shard.group, rank)


@torch.no_grad()
def gather_per_model(tensor: Tensor, shard: ModelShard) -> Tensor:
    r"""Every rank's per-model values, in position order, on every rank.

    Args:
        tensor: this rank's ``(num_local, *)`` values (losses, scores, ``nonfinite_models``...), with the
            same trailing shape and dtype on every rank.
        shard: this rank's :class:`ModelShard`.

    Returns:
        ``(M, *)``, detached, on ``tensor``'s device; entry ``p`` is the model at position ``p``'s.
    """
    if not isinstance(tensor, Tensor) or tensor.dim() == 0 or tensor.shape[0] != shard.num_local:
        got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(f"gather_per_model: expected this rank's ({shard.num_local}, *) values, got {got}")
    if shard.world_size == 1:
        return tensor.detach().clone()
    device = _comm_device(shard)
    rows = max(shard.sizes)  # all_gather needs equal shapes: pad every rank's values to the largest shard
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    padded[: shard.num_local].copy_(tensor.detach())
    parts = [torch.empty_like(padded) for _ in range(shard.world_size)]
    dist.all_gather(parts, padded, group=shard.group)
    return torch.cat([part[:size] for part, size in zip(parts, shard.sizes)]).to(tensor.device)


def top_k_models(scores: Tensor, shard: ModelShard, k: int, *, largest: bool = True) -> Tensor:
    r"""The global positions of the ``k`` best models, best first, the same on every rank.

    Ties keep position order (a stable sort); ``nan`` scores rank last. Pass the result to
    :func:`keep_models_across_ranks_` for successive halving, or take its head and tail for PBT's exploit.

    Args:
        scores: this rank's ``(num_local,)`` scores.
        shard: this rank's :class:`ModelShard`.
        k: how many models, ``1 .. M``.
        largest: higher scores are better (accuracy); ``False`` for losses. Default: ``True``.

    Returns:
        ``(k,)`` int64 positions on the CPU.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= shard.num_models:
        raise ValueError(f"top_k_models: k must be an int in [1, {shard.num_models}], got {k!r}")
    if scores.dim() != 1:
        raise ValueError(f"top_k_models: expected ({shard.num_local},) scores, got {tuple(scores.shape)}")
    values = gather_per_model(scores, shard).cpu()
    worst = float("-inf") if largest else float("inf")
    values = torch.where(values.isnan(), torch.full_like(values, worst), values)
    return values.argsort(descending=largest, stable=True)[:k]


def _population_checks(model, optimizer, schedulers, caller: str, copy_hyperparameters: bool = True) -> list[Any]:
    """``batchlayers.population``'s own checks (an optimizer over this model, every scheduler holding
    per-model values given, or ``schedulers=[]``), by copying model 0 onto itself, which changes nothing.
    Returns the schedulers to carry along: those given, in their order, the same on every rank.

    The local tools also carry the optimizer's live ``batchlayers.optim.lr_scheduler`` schedulers found through
    their registry; across ranks that would need every rank to find them in one order, so they must be given:
    one left out would keep each position's old model's state (best metric, bad epochs) without an error."""
    carried = None if schedulers is None else list(schedulers)
    if optimizer is not None and stepping_scalers(optimizer):
        raise ValueError(
            f"{caller}: the optimizer is stepped by a batchlayers.amp.GradScaler, whose per-model scales and growth "
            f"trackers {caller} does not move between ranks (each model would be scaled, skipped and grown by "
            "another model's state). Not supported yet: select the models within each rank "
            "(batchlayers.population.keep_models_/copy_model_ with scalers=[scaler]), or drop the scaler and make "
            "a new one after the selection"
        )
    copy_model_(model, optimizer, 0, 0, copy_hyperparameters=copy_hyperparameters, schedulers=carried)
    if optimizer is not None:
        missing = _unlisted_live_schedulers(optimizer, carried or ())
        if missing:
            raise ValueError(
                f"{caller}: the optimizer has {len(missing)} per-model scheduler(s) not in schedulers= "
                f"({', '.join(type(s).__name__ for s in missing)}), whose per-model state must move with the "
                f"models; pass every scheduler of the optimizer, in the same order on every rank: "
                f"{caller}(..., schedulers=[...])"
            )
    return carried or []


def _per_model_tensors(
    model: nn.Module,
    optimizer: Optimizer | None,
    num_models: int,
    caller: str,
    *,
    grads: bool = True,
    optimizer_state: bool = True,
    hyperparameters: bool = True,
    schedulers: Iterable[Any] = (),
) -> list[tuple[str, Tensor]]:
    """``(label, tensor)`` for every tensor holding one slice per model, in an order every rank agrees on:
    parameters and buffers (a stacked model's shared buffers excepted), gradients, every per-model optimizer
    state tensor, the ``(M,)`` hyperparameters of the optimizer's groups and of ``schedulers``. Writing into
    a returned tensor writes into the live one."""
    names: dict[int, str] = {}
    found: list[tuple[str, Tensor]] = []
    shared = set(shared_buffers(model))
    for name, p in model.named_parameters():
        names[id(p)] = name
        found.append((f"model/{name}", p.data))
        if grads and p.grad is not None:
            found.append((f"grad/{name}", p.grad))
    found += [(f"model/{name}", b) for name, b in model.named_buffers() if name not in shared]
    for label, t in found:
        if t.dim() == 0 or t.shape[0] != num_models:
            raise ValueError(
                f"{caller}: '{label}' has shape {tuple(t.shape)}; every parameter and buffer needs this rank's "
                f"{num_models} models first"
            )
    if optimizer is not None:
        for index, group in enumerate(optimizer.param_groups):
            inside = [id(p) in names for p in group["params"]]
            if any(inside) and not all(inside):
                raise ValueError(
                    f"{caller}: param_groups[{index}] of the optimizer mixes the model's parameters with other "
                    "tensors; its per-model values could not be kept consistent"
                )
            if not any(inside):
                continue
            for p in group["params"] if optimizer_state else ():
                state = optimizer.state.get(p, {})
                for key in sorted(state, key=str):
                    value = state[key]
                    if isinstance(value, Tensor) and value.dim() > 0:
                        if value.shape[0] != num_models:
                            raise ValueError(
                                f"{caller}: optimizer state '{key}' of '{names[id(p)]}' holds {value.shape[0]} "
                                f"models, the model {num_models}"
                            )
                        found.append((f"optim/{names[id(p)]}/{key}", value))
            for key, value in group.items() if hyperparameters else ():
                values = value if isinstance(value, tuple) else (value,)
                for pos, v in enumerate(values):
                    if key != "params" and isinstance(v, Tensor) and v.shape == (num_models,):
                        suffix = f"/{pos}" if isinstance(value, tuple) else ""
                        found.append((f"hyper/{index}/{key}{suffix}", v.as_subclass(Tensor)))
    for s, scheduler in enumerate(schedulers):
        found += _scheduler_tensors(scheduler, s, num_models, hyperparameters=hyperparameters)
    return found


def _scheduler_tensors(
    scheduler: Any, index: int, num_models: int, *, hyperparameters: bool = True
) -> list[tuple[str, Tensor]]:
    """``(label, tensor)`` for every ``(M,)`` tensor of ``schedulers[index]``, found as
    ``batchlayers.population`` finds them: its per-model state (``best``...), and with ``hyperparameters`` the
    per-model entries of its per-group lists (``base_lrs``, ``_last_lr``...), also in nested schedulers."""
    found = [
        (f"scheduler/{index}/state/{i}/{name}", value)
        for i, (_, name, value) in enumerate(_scheduler_state(scheduler, num_models))
    ]
    for li, entries in enumerate(_scheduler_lists(scheduler) if hyperparameters else ()):
        for vi, v in enumerate(entries):
            if isinstance(v, Tensor) and v.shape == (num_models,):
                found.append((f"scheduler/{index}/{li}/{vi}", v))
    return found


def _agreed_tensors(shard: ModelShard, caller: str, prepare: Callable[[], list[tuple[str, Tensor]]]):
    """``prepare()`` (checks, then the per-model tensors) on every rank, and one collective in which the ranks
    compare what they hold before any point-to-point exchange: the same per-model tensors (labels, dtypes,
    one model's shapes), or else every rank raises, rather than some of them waiting for messages that never
    come (or receiving bytes that do not fit)."""
    try:
        entries, error = prepare(), None
    except (TypeError, ValueError) as exc:
        if shard.world_size == 1:
            raise
        entries, error = [], exc
    if shard.world_size == 1:
        return entries
    layout = [(label, str(t.dtype), tuple(t.shape[1:])) for label, t in entries]
    reports: list[Any] = [None] * shard.world_size
    refusal = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(reports, (layout, refusal), group=shard.group)
    if error is not None:
        raise error
    for rank, (other, other_error) in enumerate(reports):
        if other_error is not None:
            raise ValueError(f"{caller}: rank {rank} refused: {other_error}")
        if other != layout:
            only = sorted(set(map(str, other)) ^ set(map(str, layout)))[:4]
            raise ValueError(
                f"{caller}: rank {rank} holds other per-model tensors than rank {shard.rank} (the models, "
                f"optimizers, their state and the schedulers passed must be alike on every rank; differences: {only})"
            )
    return entries


def _pack(tensors: list[Tensor], device: torch.device) -> Tensor:
    """One byte buffer of all ``tensors`` (any dtypes): one message per peer, not one per tensor."""
    chunks = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)


def _unpack(buffer: Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    out, offset = [], 0
    for shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        # A copy starts at offset 0, so the dtype view is aligned whatever came before it in the buffer.
        out.append(buffer[offset : offset + nbytes].clone().view(dtype).view(shape))
        offset += nbytes
    return out


def _exchange(
    shard: ModelShard,
    entries: list[tuple[str, Tensor]],
    sends: dict[int, list[int]],
    receives: dict[int, int],
) -> dict[int, list[Tensor]]:
    """Send to each peer the slices ``sends[peer]`` (local indices) of every entry, and receive from each peer
    ``receives[peer]`` models' slices of every entry; returns ``{peer: [one tensor per entry]}``."""
    if not sends and not receives:  # e.g. one process: no process group needed
        return {}
    device = _comm_device(shard)
    ops, buffers, specs = [], {}, {}
    for peer, indices in sorted(sends.items()):
        payload = _pack([t.index_select(0, torch.tensor(indices, device=t.device)) for _, t in entries], device)
        ops.append(dist.P2POp(dist.isend, payload, _global_rank(shard, peer), shard.group))
    for peer, count in sorted(receives.items()):
        specs[peer] = [((count, *t.shape[1:]), t.dtype) for _, t in entries]
        nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs[peer])
        buffers[peer] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, buffers[peer], _global_rank(shard, peer), shard.group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {peer: _unpack(buffers[peer], specs[peer]) for peer in buffers}


def _write(entries: list[tuple[str, Tensor]], indices: list[int], values: list[Tensor]) -> None:
    for (_, t), value in zip(entries, values):
        t.index_copy_(0, torch.tensor(indices, device=t.device), value.to(t.device))


@torch.no_grad()
def copy_model_across_ranks_(
    model: nn.Module,
    optimizer: Optimizer | None,
    shard: ModelShard,
    src: Positions,
    dst: Positions,
    *,
    copy_hyperparameters: bool = True,
    schedulers: Iterable[Any] | None = None,
) -> None:
    r"""Copy the models at global positions ``src`` onto those at ``dst``, wherever they live: PBT's exploit.

    The distributed :func:`~batchlayers.copy_model_`: model ``dst`` gets ``src``'s parameters, buffers,
    gradients and optimizer state (and by default its ``(M,)`` hyperparameters), so it continues exactly as
    ``src`` would. The owner of ``src`` sends one message (all tensors of all copied models, as bytes) to
    each rank it copies to; copies within a rank are local. All reads happen before the writes. Every rank
    of the group calls this with the same arguments. Then perturb on the rank that owns ``dst``, e.g.
    ``if shard.owns(d): optimizer.param_groups[0]["lr"][shard.local_index(d)] *= 1.2``.

    Args:
        model: this rank's batched module.
        optimizer: the optimizer over ``model``'s parameters, or ``None``.
        shard: this rank's :class:`ModelShard`.
        src: global position(s) to copy from.
        dst: global position(s) to overwrite, as many as ``src``, without repeats.
        copy_hyperparameters: also copy the optimizer's (and ``schedulers``') ``(M,)`` hyperparameters.
            Default: ``True``.
        schedulers: the learning-rate schedulers of ``optimizer``, as in :func:`~batchlayers.copy_model_`:
            their per-model state is copied, and with ``copy_hyperparameters`` their per-model base learning
            rates. Not given, the call is refused when the optimizer has a scheduler whose per-model values
            would be left behind (``schedulers=[]`` if none is used any more). Unlike the local tools, every
            :class:`batchlayers.optim.lr_scheduler.ReduceLROnPlateau` of the optimizer must be listed too (in
            one order on every rank), or the call is refused.
    """
    caller = "copy_model_across_ranks_"
    src_pos = _as_positions(src, shard.num_models, "src", caller)
    dst_pos = _as_positions(dst, shard.num_models, "dst", caller)
    if len(src_pos) != len(dst_pos):
        raise ValueError(f"{caller}: src {src_pos} and dst {dst_pos} differ in length")
    if len(set(dst_pos)) != len(dst_pos):
        raise ValueError(f"{caller}: dst {dst_pos} repeats a model")

    def prepare():
        carried = _population_checks(model, optimizer, schedulers, caller, copy_hyperparameters)
        return _per_model_tensors(
            model, optimizer, shard.num_local, caller, hyperparameters=copy_hyperparameters, schedulers=carried
        )

    entries = _agreed_tensors(shard, caller, prepare)
    sends: dict[int, list[int]] = {}
    receives: dict[int, list[int]] = {}
    local_src, local_dst = [], []
    for s, d in zip(src_pos, dst_pos):
        (src_rank, src_index), (dst_rank, dst_index) = shard.locate(s), shard.locate(d)
        if src_rank == shard.rank and dst_rank == shard.rank:
            local_src.append(src_index)
            local_dst.append(dst_index)
        elif src_rank == shard.rank:
            sends.setdefault(dst_rank, []).append(src_index)
        elif dst_rank == shard.rank:
            receives.setdefault(src_rank, []).append(dst_index)
    local = [t.index_select(0, torch.tensor(local_src, device=t.device)) for _, t in entries] if local_src else []
    received = _exchange(shard, entries, sends, {peer: len(ix) for peer, ix in receives.items()})
    if local_dst:
        _write(entries, local_dst, local)
    for peer, values in received.items():
        _write(entries, receives[peer], values)


@torch.no_grad()
def keep_models_across_ranks_(
    model: nn.Module,
    optimizer: Optimizer | None,
    shard: ModelShard,
    positions: Positions,
    *,
    schedulers: Iterable[Any] | None = None,
) -> ModelShard:
    r"""Keep the models at global ``positions`` (in that order) and spread them evenly over the ranks again.

    The distributed :func:`~batchlayers.keep_models_` (successive halving): the new population is the
    models at ``positions``, and rank ``r`` ends up holding its contiguous slice of it, with parameters,
    buffers, gradients, optimizer state and ``(M,)`` hyperparameters (and those of ``schedulers``). Models
    that change rank travel as one message per pair of ranks. Every rank of the group calls this with the
    same ``positions``, e.g. from :func:`top_k_models`.

    Args:
        model: this rank's batched module; changed in place (the ``nn.Parameter`` objects stay).
        optimizer: the optimizer over ``model``'s parameters, or ``None``.
        shard: this rank's :class:`ModelShard`.
        positions: the global positions to keep, in the new order (at least one per rank), or an ``(M,)``
            bool mask.
        schedulers: the learning-rate schedulers of ``optimizer``, whose per-model values follow, as in
            :func:`~batchlayers.keep_models_` (not given, the call is refused when the optimizer has a
            scheduler holding per-model values; ``schedulers=[]`` if none is used any more). Unlike
            :func:`~batchlayers.keep_models_`, every :class:`batchlayers.optim.lr_scheduler.ReduceLROnPlateau` of
            the optimizer must be listed too (in one order on every rank), or the call is refused.

    Returns:
        The new :class:`ModelShard`; its ``model_ids`` follow the kept models.
    """
    caller = "keep_models_across_ranks_"
    keep = _as_positions(positions, shard.num_models, "positions", caller, allow_mask=True)
    if len(keep) < shard.world_size:
        raise ValueError(
            f"{caller}: {len(keep)} models cannot be spread over {shard.world_size} ranks; every rank needs at "
            "least one (gather the survivors to fewer ranks with gather_models)"
        )
    new = shard.kept(keep)
    carried: list[Any] = []

    def prepare():
        carried.extend(_population_checks(model, optimizer, schedulers, caller))
        return _per_model_tensors(model, optimizer, shard.num_local, caller, schedulers=carried)

    entries = _agreed_tensors(shard, caller, prepare)
    sends: dict[int, list[int]] = {}
    receives: dict[int, list[int]] = {}
    placeholder = []  # what keep_models_ puts in each new local slot; slots filled from other ranks come later
    for new_position, old_position in enumerate(keep):
        old_rank, old_index = shard.locate(old_position)
        new_rank, new_index = new.locate(new_position)
        if new_rank == shard.rank:
            placeholder.append(old_index if old_rank == shard.rank else 0)
            if old_rank != shard.rank:
                receives.setdefault(old_rank, []).append(new_index)
        elif old_rank == shard.rank:
            sends.setdefault(new_rank, []).append(old_index)
    received = _exchange(shard, entries, sends, {peer: len(ix) for peer, ix in receives.items()})
    keep_models_(model, optimizer, placeholder, schedulers=carried)
    entries = _per_model_tensors(model, optimizer, new.num_local, caller, schedulers=carried)
    for peer, values in received.items():
        _write(entries, receives[peer], values)
    return new


@torch.no_grad()
def gather_models(model: nn.Module, shard: ModelShard, positions: Positions, *, dst: int = 0) -> dict | None:
    r"""The models at global ``positions``, from whichever ranks hold them, as one stacked state dict on ``dst``.

    Export any subset of the population: on rank ``dst`` the result holds every parameter and buffer shaped
    ``(len(positions), *)`` (a stacked model's shared buffers as a stride-0 expand, as its ``state_dict()``
    shows them); :func:`~batchlayers.unstack_state_dict` turns it into ordinary per-model state dicts, and
    it loads into a batched model of ``len(positions)`` models. Every rank of the group calls this.

    Args:
        model: this rank's batched module.
        shard: this rank's :class:`ModelShard`.
        positions: global positions, in the order wanted (repeats allowed).
        dst: the rank (in ``shard.group``) that receives the models. Default: ``0``.

    Returns:
        The state dict on rank ``dst``, ``None`` on the others.
    """
    caller = "gather_models"
    wanted = _as_positions(positions, shard.num_models, "positions", caller)
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < shard.world_size:
        raise ValueError(f"{caller}: dst must be a rank in [0, {shard.world_size}), got {dst!r}")
    entries = _agreed_tensors(
        shard, caller, lambda: _per_model_tensors(model, None, shard.num_local, caller, grads=False)
    )
    sends: dict[int, list[int]] = {}
    receives: dict[int, list[int]] = {}  # on dst: peer -> result rows it fills
    local_rows, local_indices = [], []
    for row, position in enumerate(wanted):
        rank, index = shard.locate(position)
        if shard.rank == dst and rank == dst:
            local_rows.append(row)
            local_indices.append(index)
        elif shard.rank == dst:
            receives.setdefault(rank, []).append(row)
        elif rank == shard.rank:
            sends.setdefault(dst, []).append(index)
    received = _exchange(shard, entries, sends, {peer: len(rows) for peer, rows in receives.items()})
    if shard.rank != dst:
        return None
    result = {}
    for i, (label, t) in enumerate(entries):
        out = t.new_empty((len(wanted), *t.shape[1:]))
        if local_rows:
            mine = t.index_select(0, torch.tensor(local_indices, device=t.device))
            out.index_copy_(0, torch.tensor(local_rows, device=t.device), mine)
        for peer, rows in receives.items():
            out.index_copy_(0, torch.tensor(rows, device=t.device), received[peer][i].to(t.device))
        result[label.removeprefix("model/")] = out
    buffers = dict(model.named_buffers())
    for name in shared_buffers(model):
        result[name] = buffers[name].expand(len(wanted), *buffers[name].shape)
    order = {key: i for i, key in enumerate(model.state_dict().keys())}
    return dict(sorted(result.items(), key=lambda item: order.get(item[0], len(order))))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: torch.distributed.checkpoint, one entry per model, so any number of ranks can load them


def _json_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) or v is None for v in value):
        return list(value)
    return _SKIP


_SKIP = object()

# In a saved scheduler state: a value the JSON metadata does not hold (a tensor, saved per model; a function), which
# the loading scheduler keeps as its own (its per-model tensors are then overwritten with the saved ones).
_KEPT = {"batchlayers.distributed": "kept"}
_MISSING = object()


def _given_schedulers(schedulers: Any, optimizer: Optimizer | None, caller: str) -> list[Any] | None:
    """``schedulers`` as a list, each checked to be a learning-rate scheduler of ``optimizer``; ``None`` stays."""
    if schedulers is None:
        return None
    if isinstance(schedulers, Iterable) and not isinstance(schedulers, (str, bytes)):
        schedulers = list(schedulers)
    _check_schedulers(schedulers, optimizer, [], caller, silent=False)  # (raises for anything else)
    return list(schedulers)


def _json_tree(value: Any, where: str, tensors: list[tuple[str, Tensor]]) -> Any:
    """``value`` (a scheduler's state) as JSON, tensors and objects replaced by ``_KEPT``; tensors listed."""
    if isinstance(value, Tensor):
        tensors.append((where, value))
        return _KEPT
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_tree(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_tree(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
    return _KEPT  # a function, a callable object: the loading scheduler's own, as torch's state_dict leaves them


def _scheduler_record(scheduler: Any, index: int, num_models: int, caller: str) -> dict[str, Any]:
    """The metadata of ``schedulers[index]``: its type and its ``state_dict()`` less its per-model tensors."""
    tensors: list[tuple[str, Tensor]] = []
    state = _json_tree(scheduler.state_dict(), "state_dict()", tensors)
    name = type(scheduler).__name__
    for where, t in tensors:
        if t.shape != (num_models,):
            raise ValueError(
                f"{caller}: schedulers[{index}] ({name}) holds {where} of shape {tuple(t.shape)}; only per-model "
                f"({num_models},) tensors (one value per model of this rank) and JSON values can be saved"
            )
    found = len(_scheduler_tensors(scheduler, index, num_models))
    if len(tensors) != found:
        raise ValueError(
            f"{caller}: schedulers[{index}] ({name}) holds {len(tensors)} per-model tensors in its state_dict(), of "
            f"which {found} are where the per-model values of a scheduler are found (its own attributes and its "
            "per-group lists); the others could not be saved per model"
        )
    return {"type": name, "state": state}


def _restored(live: Any, saved: Any, where: str, caller: str) -> Any:
    """The saved state ``saved`` (from :func:`_json_tree`), where it kept a value the ``live`` state's value (a
    tensor copied: a new scheduler may hold one tensor in two places, e.g. ``SequentialLR``'s ``_last_lr`` and its
    first scheduler's, which the saved one holds apart); tuples where ``live`` has them. Raises where the checkpoint
    kept a value this scheduler lacks."""
    if saved == _KEPT:
        if live is _MISSING:
            raise ValueError(f"{caller}: the checkpoint's {where} is a tensor or an object, this scheduler has none")
        return live.clone() if isinstance(live, Tensor) else live
    if isinstance(saved, dict):
        base = live if isinstance(live, dict) else {}
        return {**base, **{k: _restored(base.get(k, _MISSING), v, f"{where}[{k!r}]", caller) for k, v in saved.items()}}
    if isinstance(saved, list):
        same = isinstance(live, (list, tuple)) and len(live) == len(saved)
        items = [_restored(live[i] if same else _MISSING, v, f"{where}[{i}]", caller) for i, v in enumerate(saved)]
        return tuple(items) if isinstance(live, tuple) else items
    return saved


def _scheduler_plan(
    schedulers: list[Any] | None, records: list[dict[str, Any]] | None, labels: Iterable[str], num_models: int
) -> tuple[list[dict[str, Any]], dict[str, Tensor]]:
    """Before anything is loaded: check that ``schedulers`` are those the checkpoint holds; return the state dict
    each one loads (its per-model tensors still its own) and its per-model tensors, by label."""
    caller = "load_population_"
    if schedulers is None:
        return [], {}
    names = [type(s).__name__ for s in schedulers]
    if records is None:
        if schedulers:
            raise ValueError(
                f"{caller}: the checkpoint was saved without schedulers, but schedulers= has {len(schedulers)} "
                f"({', '.join(names)}); load it with schedulers=None (the schedulers keep their own state)"
            )
        return [], {}
    if len(records) != len(schedulers):
        raise ValueError(
            f"{caller}: the checkpoint holds {len(records)} schedulers ({', '.join(r['type'] for r in records)}), "
            f"schedulers= has {len(schedulers)} ({', '.join(names)}); pass the schedulers that were saved, in the "
            "same order"
        )
    states: list[dict[str, Any]] = []
    live: dict[str, Tensor] = {}
    for index, (scheduler, record, name) in enumerate(zip(schedulers, records, names)):
        if record["type"] != name:
            raise ValueError(
                f"{caller}: schedulers[{index}] is {name}, the checkpoint's schedulers[{index}] is {record['type']}"
            )
        live.update(_scheduler_tensors(scheduler, index, num_models))
        states.append(_restored(scheduler.state_dict(), record["state"], f"schedulers[{index}].state_dict()", caller))
    saved = {label for label in labels if label.startswith("scheduler/")}
    if saved != live.keys():
        counts = [
            f"schedulers[{i}] ({name}) {sum(lb.startswith(f'scheduler/{i}/') for lb in saved)} in the checkpoint, "
            f"{sum(lb.startswith(f'scheduler/{i}/') for lb in live)} here"
            for i, name in enumerate(names)
        ]
        raise ValueError(
            f"{caller}: the checkpoint's schedulers and these hold different per-model (M,) tensors: "
            f"{'; '.join(counts)} (a per-model learning rate in one, a float in the other?)"
        )
    return states, live


def save_population(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    shard: ModelShard,
    optimizer: Optimizer | None = None,
    *,
    schedulers: Sequence[Any] | None = None,
    extra: dict[str, Any] | None = None,
    process_group: Any = None,
) -> None:
    r"""Save a sharded population with :mod:`torch.distributed.checkpoint`; any number of ranks can load it.

    Every model's tensors are saved under its global position (``models/<position>/model/<name>``,
    ``.../optim/<parameter>/<state>``, ``.../hyper/<group>/<name>``, ``.../scheduler/<index>/...``), each rank
    writing its own models, so :func:`load_population_` on ``R'`` ranks reads exactly the models each new rank
    holds. Also saved: the model ids, the optimizer's other (scalar) hyperparameters and state, the schedulers'
    other state (``last_epoch``, ``_step_count``...), a stacked model's shared buffers, and ``extra`` (the same
    on every rank: an epoch counter, an RNG seed).

    Args:
        checkpoint_id: the checkpoint's folder (``torch.distributed.checkpoint``'s ``checkpoint_id``).
        model: this rank's batched module.
        shard: this rank's :class:`ModelShard`.
        optimizer: the optimizer over ``model``'s parameters, or ``None``.
        schedulers: the learning-rate schedulers of ``optimizer`` to save (``torch.optim.lr_scheduler`` ones
            over per-model or float learning rates, :class:`batchlayers.optim.lr_scheduler.ReduceLROnPlateau`):
            their ``(M,)`` tensors (``base_lrs``, ``best``...) per model, the rest of their ``state_dict()``
            (JSON values) once; functions (``LambdaLR``'s) are not saved, as with torch. Default: ``None``, none
            saved. Pass every scheduler of the optimizer whose state should be saved, including a
            ``ReduceLROnPlateau``: only those passed are saved.
        extra: more entries, the same on every rank: tensors, ints, floats, strings.
        process_group: the group that saves together: every rank holding models. Default: the default group
            (with data-parallel replicas of a shard, the replicas' identical entries are written once).
    """
    import torch.distributed.checkpoint as dcp

    caller = "save_population"
    given = _given_schedulers(schedulers, optimizer, caller)
    entries = _per_model_tensors(model, optimizer, shard.num_local, caller, grads=False, schedulers=given or ())
    records = None if given is None else [_scheduler_record(s, i, shard.num_local, caller) for i, s in enumerate(given)]
    state: dict[str, Any] = {}
    for label, t in entries:
        for index, position in enumerate(shard.positions):
            state[f"models/{position}/{label}"] = t[index]
    buffers = dict(model.named_buffers())
    for name in shared_buffers(model):
        state[f"shared/model/{name}"] = buffers[name]
    groups = []
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            scalars = ((key, _json_value(value)) for key, value in group.items() if key != "params")
            groups.append({key: value for key, value in scalars if value is not _SKIP})
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, Tensor) and value.dim() == 0:  # e.g. torch.optim's shared step count
                        state[f"shared/optim/{names[id(p)]}/{key}"] = value
    meta: dict[str, Any] = {"format": _FORMAT, "num_models": shard.num_models, "model_ids": list(shard.model_ids)}
    if records is not None:
        meta["schedulers"] = records
    state["shared/meta"] = json.dumps({**meta, "param_groups": groups})
    for key, value in (extra or {}).items():
        state[f"extra/{key}"] = value
    _without_process_group_warning(dcp.save, state, checkpoint_id, process_group)


def _without_process_group_warning(function, state, checkpoint_id, process_group) -> None:
    """``dcp.save``/``dcp.load``; in a process without a process group (a single-process shard, which is a
    supported case here), in torch's single-process mode, without its warning that it assumes so."""
    if dist.is_available() and dist.is_initialized():
        function(state, checkpoint_id=checkpoint_id, process_group=process_group)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
        )
        function(state, checkpoint_id=checkpoint_id, no_dist=True)


def _read_metadata(checkpoint_id: str | os.PathLike) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata


def _saved_positions(metadata: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """``{position: {label: storage metadata}}`` of the per-model entries of a saved population."""
    found: dict[int, dict[str, Any]] = {}
    for key, value in metadata.items():
        if key.startswith("models/"):
            position, label = key[len("models/") :].split("/", 1)
            found.setdefault(int(position), {})[label] = value
    return found


def saved_num_models(checkpoint_id: str | os.PathLike) -> int:
    """The number of models in a population saved by :func:`save_population` (reads its metadata only), to
    build the :class:`ModelShard` to load it into."""
    positions = _saved_positions(_read_metadata(checkpoint_id))
    if not positions:
        raise ValueError(f"saved_num_models: {os.fspath(checkpoint_id)!r} holds no population of models")
    return max(positions) + 1


@torch.no_grad()
def load_population_(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    shard: ModelShard,
    optimizer: Optimizer | None = None,
    *,
    schedulers: Sequence[Any] | None = None,
    extra: dict[str, Any] | None = None,
    process_group: Any = None,
) -> ModelShard:
    r"""Load this rank's models, optimizer and scheduler state from a population saved by :func:`save_population`.

    The population may have been saved on any number of ranks: each rank reads the models at its own
    positions. ``model`` (and ``optimizer``, ``schedulers``) must be built for ``shard.num_local`` models of the
    same architecture, e.g. with :func:`build_shard` and ``ModelShard.from_group(saved_num_models(path))``;
    their values are replaced in place (the optimizer and the schedulers through their ``load_state_dict``, so
    state the optimizer has not created yet is created). Each scheduler then continues exactly as the saved one
    would have: its models' ``(M,)`` values (``base_lrs``, ``best``, ``num_bad_epochs``...) and its saved
    ``last_epoch``, ``_step_count``... The checkpoint, the schedulers and the models are checked against each
    other before anything is loaded.

    Args:
        checkpoint_id: the checkpoint's folder.
        model: this rank's batched module.
        shard: this rank's :class:`ModelShard` of the saved number of models.
        optimizer: the optimizer over ``model``'s parameters, or ``None`` (its saved state is then ignored).
        schedulers: the learning-rate schedulers of ``optimizer`` to load, of the types saved and in the order
            they were passed to :func:`save_population`; build them over ``optimizer`` as for a new run (create
            them before this call: a new scheduler sets the optimizer's learning rates). Default: ``None``, the
            saved schedulers (if any) are ignored.
        extra: the entries saved as ``extra`` that are wanted, each key with a placeholder of the saved
            value's kind (a tensor of its shape, or any object); replaced in place by the saved values, as
            :func:`torch.distributed.checkpoint.load` does.
        process_group: the group that loads together. Default: the default group.

    Returns:
        The shard with the saved ``model_ids``.
    """
    import torch.distributed.checkpoint as dcp

    caller = "load_population_"
    metadata = _read_metadata(checkpoint_id)
    saved = _saved_positions(metadata)
    if not saved or max(saved) + 1 != shard.num_models:
        raise ValueError(
            f"{caller}: the checkpoint holds {max(saved) + 1 if saved else 0} models, the shard splits "
            f"{shard.num_models}; build it with ModelShard.from_group(saved_num_models(checkpoint_id))"
        )
    given = _given_schedulers(schedulers, optimizer, caller)
    labels = saved[shard.start]
    live = dict(_per_model_tensors(model, None, shard.num_local, caller, grads=False))
    saved_model = {label for label in labels if label.startswith("model/")}
    if saved_model != live.keys():
        raise ValueError(
            f"{caller}: the checkpoint's models and this model hold different tensors: "
            f"{sorted(saved_model ^ live.keys())[:6]}"
        )
    head: dict[str, Any] = {"shared/meta": ""}  # the metadata first: checked before anything is loaded
    _without_process_group_warning(dcp.load, head, checkpoint_id, process_group)
    meta = json.loads(head["shared/meta"])
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{caller}: {os.fspath(checkpoint_id)!r} is not a population saved by save_population")
    scheduler_states, scheduler_tensors = _scheduler_plan(given, meta.get("schedulers"), labels, shard.num_local)
    targets: dict[str, Tensor] = dict(live)
    if optimizer is not None:
        device = next(model.parameters()).device
        for label, info in labels.items():
            if label.startswith(("optim/", "hyper/")):
                dtype = info.properties.dtype
                targets[label] = torch.empty((shard.num_local, *info.size), dtype=dtype, device=device)
    for label, t in scheduler_tensors.items():
        targets[label] = torch.empty((shard.num_local,), dtype=labels[label].properties.dtype, device=t.device)
    state: dict[str, Any] = {}
    for label, t in targets.items():
        for index, position in enumerate(shard.positions):
            state[f"models/{position}/{label}"] = t[index]
    buffers = dict(model.named_buffers())
    for name in shared_buffers(model):
        state[f"shared/model/{name}"] = buffers[name]
    shared_optim = {}
    if optimizer is not None:
        for key, info in metadata.items():
            if key.startswith("shared/optim/"):
                shared_optim[key] = torch.empty(info.size, dtype=info.properties.dtype)
        state.update(shared_optim)
    for key, value in (extra or {}).items():
        state[f"extra/{key}"] = value
    _without_process_group_warning(dcp.load, state, checkpoint_id, process_group)
    for key in extra or {}:
        extra[key] = state[f"extra/{key}"]  # type: ignore[index]
    if optimizer is not None:
        _load_optimizer(optimizer, model, targets, shared_optim, meta["param_groups"])
    for index, (scheduler, scheduler_state) in enumerate(zip(given or (), scheduler_states)):
        scheduler.load_state_dict(scheduler_state)
        for label, t in _scheduler_tensors(scheduler, index, shard.num_local):
            t.copy_(targets[label])
    return ModelShard(shard.num_models, shard.rank, shard.world_size, meta["model_ids"], group=shard.group)


def _load_optimizer(optimizer, model, targets, shared_optim, saved_groups) -> None:
    """Put the loaded per-model and shared values into ``optimizer`` through its own ``load_state_dict``."""
    names = {id(p): n for n, p in model.named_parameters()}
    template = optimizer.state_dict()
    if len(saved_groups) != len(template["param_groups"]):
        raise ValueError(
            f"load_population_: the checkpoint's optimizer has {len(saved_groups)} param groups, this one "
            f"{len(template['param_groups'])}"
        )
    new_state: dict[int, dict[str, Any]] = {}
    new_groups = []
    for index, (group, live_group, saved_group) in enumerate(
        zip(template["param_groups"], optimizer.param_groups, saved_groups)
    ):
        group = dict(group)
        for key, value in saved_group.items():
            group[key] = tuple(value) if isinstance(value, list) and isinstance(group.get(key), tuple) else value
        for label, t in targets.items():
            prefix = f"hyper/{index}/"
            if label.startswith(prefix):
                key, _, pos = label[len(prefix) :].partition("/")
                if pos:
                    items = list(group[key])
                    items[int(pos)] = t
                    group[key] = tuple(items)
                else:
                    group[key] = t
        for param_index, p in zip(group["params"], live_group["params"]):
            name = names[id(p)]
            entries = {label.rsplit("/", 1)[1]: t for label, t in targets.items() if label.startswith(f"optim/{name}/")}
            entries.update(
                {key.rsplit("/", 1)[1]: t for key, t in shared_optim.items() if key.startswith(f"shared/optim/{name}/")}
            )
            if entries:
                new_state[param_index] = entries
        new_groups.append(group)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
