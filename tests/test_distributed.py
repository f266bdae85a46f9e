"""batchlayers.distributed: a population sharded over 2, 3 and 4 gloo processes equals the single-process run.

Each test launches its ranks as new processes (forked from a forkserver that has imported torch and this
file, so a launch costs no imports), with the rendezvous in a file of the test's own ``tmp_path`` (no ports
to race for), a process-group timeout and a deadline on the whole launch: a hang fails the test within a
minute instead of stalling CI (the launcher kills the ranks), and every rank destroys its process group on
every path. The ranks save what they hold; the test compares it, model by model and bit for bit (float64, one
thread everywhere), with the single-process run of all the models computed here with
``batchlayers.population`` (``copy_model_``, ``keep_models_``) and an unsharded ``ModelTensorLoader``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import multiprocessing
import pathlib
import shutil
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import batchlayers as bl
from batchlayers.distributed import (
    ModelShard,
    build_shard,
    copy_model_across_ranks_,
    gather_models,
    gather_per_model,
    keep_models_across_ranks_,
    load_population_,
    model_seed,
    replicate_shard,
    save_population,
    saved_num_models,
    shard_data_,
    shard_models,
    top_k_models,
)
from batchlayers.optim.lr_scheduler import ReduceLROnPlateau

NUM_MODELS = 7  # uneven over 2 ranks (4, 3) and 3 ranks (3, 2, 2); 5 after halving: (3, 2) and (2, 2, 1)
KEEP = 5
SEED = 11
DATA_SEED = 3
LAUNCH_DEADLINE_S = 60.0  # the whole launch, start-up included (the ranks need about 5-10 s on 2 cores)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
SWAP_SRC, SWAP_DST = [0, 6, 1], [6, 0, 4]  # a swap across ranks (reads before writes) and one more copy


# ----------------------------------------------------------------------------------------------------------
# The population, its data and one epoch of training: shared by the ranks and the single-process reference


class RunningMean(nn.Module):
    """Buffers that training changes: each model's running mean of its features and its count of batches."""

    def __init__(self, num_models: int, features: int) -> None:
        super().__init__()
        self.num_models = num_models
        self.register_buffer("running_mean", torch.zeros(num_models, features))
        self.register_buffer("batches", torch.zeros(num_models, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(1))
            self.batches += 1
        return x


def factory(num_models: int) -> nn.Module:
    # Not BatchedBatchNorm1d: torch's CPU batch-norm backward rounds differently for different channel counts
    # (M * C), so its gradients agree with the single-process run only to ~1e-16, not bit for bit.
    return nn.Sequential(
        bl.BatchedLinear(num_models, 6, 8),
        RunningMean(num_models, 8),
        nn.Tanh(),
        bl.BatchedLinear(num_models, 8, 3),
    ).double()


def ddp_factory(num_models: int) -> nn.Module:
    # No BatchNorm: under DDP its batch statistics are each replica's own, as with torch.nn's.
    return nn.Sequential(bl.BatchedLinear(num_models, 6, 8), nn.Tanh(), bl.BatchedLinear(num_models, 8, 3)).double()


def data() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 6, generator=g, dtype=torch.float64), torch.randint(3, (20,), generator=g)
    x_val, y_val = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randint(3, (16,), generator=g)
    return x, y, x_val, y_val


def make_optimizer(model: nn.Module, positions: range | list[int]) -> torch.optim.Optimizer:
    lrs = torch.linspace(0.01, 0.07, NUM_MODELS, dtype=torch.float64)[list(positions)]
    return bl.optim.AdamW(model.parameters(), lr=lrs, betas=(0.8, 0.95), weight_decay=1e-2)


SCHEDULERS = ("StepLR", "ExponentialLR", "SequentialLR")  # the step-count schedule beside each model's plateau


def make_schedulers(optimizer: torch.optim.Optimizer, kind: str = "StepLR") -> list:
    """A torch.optim.lr_scheduler schedule over the per-model lr and batchlayers' per-model plateau."""
    lr_scheduler = torch.optim.lr_scheduler
    schedule = {
        "StepLR": lambda: lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        "ExponentialLR": lambda: lr_scheduler.ExponentialLR(optimizer, gamma=0.8),
        "SequentialLR": lambda: lr_scheduler.SequentialLR(
            optimizer,
            [lr_scheduler.LinearLR(optimizer, 0.5, total_iters=2), lr_scheduler.ExponentialLR(optimizer, gamma=0.8)],
            milestones=[2],
        ),
    }[kind]()
    return [schedule, ReduceLROnPlateau(optimizer, factor=0.5, patience=0)]


def step_schedulers(schedulers: list, model: nn.Module, x_val, y_val, num_models: int) -> torch.Tensor:
    """An epoch's end: the schedule steps, the plateau steps on each model's validation loss (returned)."""
    losses = validation_losses(model, x_val, y_val, num_models)
    schedule, plateau = schedulers
    schedule.step()
    plateau.step(losses)
    return losses


def train_epoch(model: nn.Module, optimizer, loader, gather=lambda t: t) -> list[torch.Tensor]:
    """One epoch; returns every step's ``(M,)`` losses (gathered from all ranks by ``gather``)."""
    model.train()
    history = []
    for xb, yb in loader:
        losses = bl.losses.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
        history.append(gather(losses.detach()))
    return history


@torch.no_grad()
def validation_losses(model: nn.Module, x_val, y_val, num_models: int) -> torch.Tensor:
    model.eval()
    return bl.losses.cross_entropy(model(x_val.expand(num_models, *x_val.shape)), y_val.expand(num_models, -1))


def perturb_(optimizer, shard: ModelShard, positions: list[int]) -> None:
    for p in positions:
        if shard.owns(p):
            optimizer.param_groups[0]["lr"][shard.local_index(p)] *= 1.5


def scheduler_state(schedulers) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The schedulers' ``state_dict()``: its (M,) tensors and its other values, by path."""
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, object] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.clone()
        elif isinstance(value, dict):
            for key, v in value.items():
                walk(v, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}")
        else:
            others[path] = value

    for i, scheduler in enumerate(schedulers):
        walk(scheduler.state_dict(), f"scheduler/{i}")
    return tensors, others


def population_state(model: nn.Module, optimizer=None, schedulers=()) -> dict[str, torch.Tensor]:
    """Every per-model tensor: weights, buffers, optimizer state, (M,) hyperparameters and the schedulers' (M,)
    tensors, model first."""
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state.update(scheduler_state(schedulers)[0])
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups if optimizer is not None else ():
        for p in group["params"]:
            for key, value in optimizer.state[p].items():
                state[f"optim/{names[id(p)]}/{key}"] = value.clone()
        for key in ("lr", "initial_lr"):
            if key in group:
                state[f"group/{key}"] = group[key].as_subclass(torch.Tensor).clone()
    return state


# ----------------------------------------------------------------------------------------------------------
# What the ranks run


def sharded_sweep(rank: int, world_size: int, folder: pathlib.Path) -> dict:
    """Init, train, exploit across ranks, global halving, train, checkpoint; then DDP on the full population."""
    x, y, x_val, y_val = data()
    shard = ModelShard.from_group(NUM_MODELS)
    assert (shard.rank, shard.world_size) == (rank, world_size)
    model = build_shard(factory, shard, seed=SEED)
    result: dict = {"positions": list(shard.positions), "init": population_state(model)}
    optimizer = make_optimizer(model, shard.positions)
    schedulers = make_schedulers(optimizer)
    loader = shard_data_(bl.ModelTensorLoader(x, y, num_models=shard.num_local, batch_size=8, seed=DATA_SEED), shard)

    def gather(t):
        return gather_per_model(t, shard)

    history = train_epoch(model, optimizer, loader, gather)
    step_schedulers(schedulers, model, x_val, y_val, shard.num_local)
    result["nonfinite"] = gather(bl.nonfinite_models(history[-1][list(shard.positions)], model))
    copy_model_across_ranks_(model, optimizer, shard, SWAP_SRC, SWAP_DST, schedulers=schedulers)
    perturb_(optimizer, shard, SWAP_DST)
    history += train_epoch(model, optimizer, loader, gather)
    losses = step_schedulers(schedulers, model, x_val, y_val, shard.num_local)
    keep = top_k_models(losses, shard, KEEP, largest=False)
    shard = keep_models_across_ranks_(model, optimizer, shard, keep, schedulers=schedulers)
    shard_data_(loader, shard)
    history += train_epoch(model, optimizer, loader, gather)
    step_schedulers(schedulers, model, x_val, y_val, shard.num_local)
    save_population(
        folder / "population", model, shard, optimizer, schedulers=schedulers, extra={"epoch": loader.sampler.epoch}
    )
    result.update(keep=keep, history=history, model_ids=shard.model_ids, positions_after=list(shard.positions))
    result["final"] = population_state(model, optimizer, schedulers)
    result["ddp"] = ddp_on_full_population(rank, world_size)
    return result


def ddp_on_full_population(rank: int, world_size: int) -> dict:
    """Both ranks hold all the models (one shard, two data-parallel replicas), each half of every batch."""
    model = build_shard(ddp_factory, ModelShard(3), seed=SEED)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = bl.optim.SGD(ddp.parameters(), lr=torch.tensor([0.1, 0.2, 0.3]), momentum=0.9)
    x, y = ddp_batches()
    half = x.shape[2] // world_size
    for step in range(2):
        xb, yb = x[step][:, rank * half : (rank + 1) * half], y[step][:, rank * half : (rank + 1) * half]
        optimizer.zero_grad()
        bl.losses.cross_entropy(ddp(xb), yb).sum().backward()
        optimizer.step()
    return population_state(model, optimizer)


def ddp_batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 3, 8, 6, generator=g, dtype=torch.float64), torch.randint(3, (2, 3, 8), generator=g)


def resume_population(path: pathlib.Path) -> tuple[dict, tuple]:
    """Load a saved population on this process's ranks (one process without a process group), train two more
    epochs with its schedulers, exploit across ranks."""
    x, y, x_val, y_val = data()
    shard = ModelShard.from_group(saved_num_models(path))
    model = build_shard(factory, shard, seed=SEED + 1)  # other weights: everything must come from the checkpoint
    optimizer = make_optimizer(model, shard.positions)  # lr, state: replaced by the checkpoint's
    schedulers = make_schedulers(optimizer)  # their state too
    extra = {"epoch": 0}
    shard = load_population_(path, model, shard, optimizer, schedulers=schedulers, extra=extra)
    result = {
        "positions": list(shard.positions),
        "model_ids": shard.model_ids,
        "loaded": population_state(model, optimizer, schedulers),
        "loaded_scheduler_values": scheduler_state(schedulers)[1],
    }
    loader = shard_data_(bl.ModelTensorLoader(x, y, num_models=shard.num_local, batch_size=8, seed=DATA_SEED), shard)
    loader.set_epoch(extra["epoch"])

    def gather(t):
        return gather_per_model(t, shard)

    result["history"] = train_epoch(model, optimizer, loader, gather)
    step_schedulers(schedulers, model, x_val, y_val, shard.num_local)
    result["history"] += train_epoch(model, optimizer, loader, gather)
    copy_model_across_ranks_(model, optimizer, shard, [4, 0], [0, 2], schedulers=schedulers)
    result["final"] = population_state(model, optimizer, schedulers)
    result["final_scheduler_values"] = scheduler_state(schedulers)[1]
    return result, (model, optimizer, shard)


def resumed_sweep(rank: int, world_size: int, folder: pathlib.Path) -> dict:
    """Resume the 2-rank run's checkpoint and the one-process run's on 3 ranks, train on, export models."""
    result, (model, optimizer, shard) = resume_population(folder / "population")
    result["from_one_process"] = resume_population(folder / "one_process_population")[0]
    result["exported"] = gather_models(model, shard, [4, 1, 4], dst=1)
    try:  # rank 2 without its optimizer: every rank must refuse (none may wait for a message never sent)
        copy_model_across_ranks_(model, optimizer if rank < 2 else None, shard, [4], [0], schedulers=[])
    except ValueError as error:
        result["mismatch"] = str(error)
    return result


def hang(rank: int, world_size: int, folder: pathlib.Path) -> dict:
    if rank == 1:
        time.sleep(600)
    return {}


MESH_MODELS, MESH_STEPS = 5, 2


def mesh_lrs() -> torch.Tensor:
    return torch.linspace(0.1, 0.5, MESH_MODELS, dtype=torch.float64)


def mesh_batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(MESH_STEPS, MESH_MODELS, 8, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(3, (MESH_STEPS, MESH_MODELS, 8), generator=g)


def mesh_sweep(rank: int, world_size: int, folder: pathlib.Path) -> dict:
    """2 x 2 ranks: the models split over 2 shards, each shard's model in DDP over 2 data-parallel ranks."""
    model_ranks, data_ranks = 2, world_size // 2
    model_rank, data_rank = divmod(rank, data_ranks)
    # Every rank creates every group, in the same order, as torch.distributed.new_group requires.
    models_groups = [dist.new_group([m * data_ranks + d for m in range(model_ranks)]) for d in range(data_ranks)]
    data_groups = [dist.new_group([m * data_ranks + d for d in range(data_ranks)]) for m in range(model_ranks)]
    shard = ModelShard.from_group(MESH_MODELS, group=models_groups[data_rank])
    assert shard.rank == model_rank and shard.world_size == model_ranks
    model = build_shard(ddp_factory, shard, seed=SEED)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=data_groups[model_rank])
    optimizer = bl.optim.SGD(ddp.parameters(), lr=mesh_lrs()[shard.start : shard.stop], momentum=0.9)
    x, y = mesh_batches()
    half = x.shape[2] // data_ranks
    mine, batch = slice(shard.start, shard.stop), slice(data_rank * half, (data_rank + 1) * half)
    history = []
    for step in range(MESH_STEPS):
        losses = bl.losses.cross_entropy(ddp(x[step][mine, batch]), y[step][mine, batch])
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
        full_batch = losses.detach().clone()  # each model's loss on the whole batch: the data ranks' mean
        dist.all_reduce(full_batch, group=data_groups[model_rank])
        history.append(gather_per_model(full_batch / data_ranks, shard))
    copy_model_across_ranks_(model, optimizer, shard, [4], [0], schedulers=[])  # within each data column
    save_population(folder / "mesh_population", model, shard, optimizer)  # all 4 ranks: replicas write once
    return {"positions": list(shard.positions), "history": history, "final": population_state(model, optimizer)}


EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_ARGS = {"num_models": 12, "keep": 3, "first_epochs": 1, "hidden": 32}


def example_sweep(rank: int, world_size: int, folder: pathlib.Path):
    import sys

    sys.path.insert(0, str(EXAMPLES))  # as `python examples/distributed_sweep.py` sees its neighbours
    import distributed_sweep

    return distributed_sweep.run_sweep(**EXAMPLE_ARGS, out=folder / "example")


SCENARIOS = {
    "sharded_sweep": sharded_sweep,
    "resumed_sweep": resumed_sweep,
    "mesh_sweep": mesh_sweep,
    "example": example_sweep,
    "hang": hang,
}


def _rank_main(rank: int, world_size: int, scenario: str, folder: str) -> None:
    """One rank: its own process group, torn down on every path; an error is written for the test to show."""
    torch.set_num_threads(1)  # bit-identity with the single-process run needs the same thread count
    warnings.simplefilter("error")  # as pytest's filterwarnings=error does in the test process
    path = pathlib.Path(folder)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{path / f'{scenario}.store'}",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        try:
            result = SCENARIOS[scenario](rank, world_size, path)
            # No rank tears down while another may still be connecting or reading: measured, a rank that
            # destroyed its group right after init_process_group made its peer's gloo connectFullMesh fail.
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(result, path / f"{scenario}.{rank}.pt")
    except BaseException:
        (path / f"{scenario}.{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def launch(scenario: str, world_size: int, folder: pathlib.Path, deadline_s: float = LAUNCH_DEADLINE_S) -> list[dict]:
    """Run ``scenario`` on ``world_size`` new processes; fail (and kill them) if they pass the deadline."""
    # Forked from a server that has imported torch and this file once (and run no torch op, so no threads):
    # each launch then costs no imports (several seconds per process on a loaded 2-core machine).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed.checkpoint", __name__])
    procs = [
        context.Process(target=_rank_main, args=(rank, world_size, scenario, str(folder)), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + deadline_s
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    errors = "\n".join(p.read_text() for p in sorted(folder.glob(f"{scenario}.*.err")))
    if hung:
        pytest.fail(f"{scenario}: ranks {hung} of {world_size} still ran after {deadline_s} s\n{errors}")
    codes = [proc.exitcode for proc in procs]
    if any(codes):
        pytest.fail(f"{scenario}: exit codes {codes}\n{errors}")
    return [torch.load(folder / f"{scenario}.{rank}.pt", weights_only=False) for rank in range(world_size)]


# ----------------------------------------------------------------------------------------------------------
# The single-process reference


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_init(num_models: int, seed: int) -> nn.Module:
    """All models in one process: model i is factory(1) under torch.manual_seed(model_seed(seed, i))."""
    model = factory(num_models)
    with torch.no_grad(), torch.random.fork_rng():  # (leaves the test process's generator as it was)
        for i in range(num_models):
            torch.manual_seed(model_seed(seed, i))
            one = factory(1)
            for t, u in zip([*model.parameters(), *model.buffers()], [*one.parameters(), *one.buffers()]):
                t[i] = u[0]
    return model


def reference_sweep(folder: pathlib.Path) -> dict:
    """All models in one process; also saved there, at the point where the 2-rank run saves them."""
    x, y, x_val, y_val = data()
    model = reference_init(NUM_MODELS, SEED)
    result = {"init": population_state(model)}
    optimizer = make_optimizer(model, range(NUM_MODELS))
    schedulers = make_schedulers(optimizer)
    loader = bl.ModelTensorLoader(x, y, num_models=NUM_MODELS, batch_size=8, seed=DATA_SEED)
    history = train_epoch(model, optimizer, loader)
    step_schedulers(schedulers, model, x_val, y_val, NUM_MODELS)
    result["nonfinite"] = bl.nonfinite_models(history[-1], model)
    bl.copy_model_(model, optimizer, SWAP_SRC, SWAP_DST, schedulers=schedulers)
    for d in SWAP_DST:
        optimizer.param_groups[0]["lr"][d] *= 1.5
    history += train_epoch(model, optimizer, loader)
    keep = step_schedulers(schedulers, model, x_val, y_val, NUM_MODELS).argsort(stable=True)[:KEEP]
    bl.keep_models_(model, optimizer, keep, schedulers=schedulers)
    loader.keep_models_(keep)
    history += train_epoch(model, optimizer, loader)
    step_schedulers(schedulers, model, x_val, y_val, KEEP)
    result.update(keep=keep, history=history, final=population_state(model, optimizer, schedulers))
    result["final_scheduler_values"] = scheduler_state(schedulers)[1]
    result["checkpoint"] = folder / "one_process_population"
    shard = ModelShard(KEEP, model_ids=keep.tolist())
    save_population(
        result["checkpoint"], model, shard, optimizer, schedulers=schedulers, extra={"epoch": loader.sampler.epoch}
    )
    # Resumed on other ranks, schedulers and all.
    history = train_epoch(model, optimizer, loader)
    step_schedulers(schedulers, model, x_val, y_val, KEEP)
    history += train_epoch(model, optimizer, loader)
    bl.copy_model_(model, optimizer, [4, 0], [0, 2], schedulers=schedulers)
    result["resumed"] = {
        "history": history,
        "final": population_state(model, optimizer, schedulers),
        "final_scheduler_values": scheduler_state(schedulers)[1],
    }
    result["model"] = model
    return result


@pytest.fixture
def load_example(monkeypatch: pytest.MonkeyPatch):
    """Import ``examples/<name>.py`` the way ``python examples/<name>.py`` sees its neighbours."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    with one_thread():
        return reference_sweep(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    folder = tmp_path_factory.mktemp("two_ranks")
    return launch("sharded_sweep", 2, folder), folder


def assert_identical(actual: dict, expected: dict, positions: list[int], what: str) -> None:
    """``actual`` holds the models at ``positions`` of ``expected``'s, bit for bit."""
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual.keys() ^ expected.keys())}"
    for key, value in expected.items():
        want = value[positions]
        if not torch.equal(actual[key], want):
            diff = (
                (actual[key].double() - want.double()).abs().max().item() if actual[key].shape == want.shape else None
            )
            raise AssertionError(f"{what}: '{key}' of models {positions} differs (largest difference {diff})")


# ----------------------------------------------------------------------------------------------------------
# Tests


def test_model_shard_layout() -> None:
    shard = ModelShard(10, rank=1, world_size=4)
    assert shard.sizes == (3, 3, 2, 2) and (shard.start, shard.stop) == (3, 6)
    owners = [ModelShard(10, rank=0, world_size=4).locate(p) for p in range(10)]
    expected = [(r, i) for r, size in enumerate(shard.sizes) for i in range(size)]
    assert owners == expected
    assert [shard.position(i) for i in range(shard.num_local)] == list(shard.positions)
    assert shard.kept([9, 3, 0, 5, 5]).model_ids == (9, 3, 0, 5, 5)
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        ModelShard(3, rank=0, world_size=4)
    with pytest.raises(ValueError, match="held by rank 2"):
        shard.local_index(7)


def test_build_shard_equals_every_other_split() -> None:
    whole = build_shard(factory, ModelShard(NUM_MODELS), seed=SEED)
    expected = reference_init(NUM_MODELS, SEED)
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            shard = ModelShard(NUM_MODELS, rank, world_size)
            part = build_shard(factory, shard, seed=SEED)
            for (name, t), u, w in zip(part.state_dict().items(), whole.state_dict().values(),
                                       expected.state_dict().values()):  # fmt: skip
                assert torch.equal(t, u[shard.start : shard.stop]) and torch.equal(t, w[shard.start : shard.stop]), name
            sliced = shard_models(whole, shard)
            assert all(torch.equal(a, b) for a, b in zip(sliced.state_dict().values(), part.state_dict().values()))


def test_replicate_shard_builds_each_model_from_its_own_seed() -> None:
    shard = ModelShard(5, rank=1, world_size=2)
    stacked = replicate_shard(lambda: nn.Linear(4, 3), shard, seed=2)
    for index, position in enumerate(shard.positions):
        with torch.random.fork_rng():
            torch.manual_seed(model_seed(2, position))
            own = nn.Linear(4, 3)
        assert torch.equal(stacked.weight[index], own.weight) and torch.equal(stacked.bias[index], own.bias)


def test_sharded_run_equals_single_process_run(two_ranks, reference) -> None:
    ranks, _ = two_ranks
    for rank, result in enumerate(ranks):
        assert_identical(result["init"], reference["init"], result["positions"], f"rank {rank} init")
        assert torch.equal(result["keep"], reference["keep"])
        assert torch.equal(result["nonfinite"], reference["nonfinite"])
        assert len(result["history"]) == len(reference["history"])
        for step, (losses, expected) in enumerate(zip(result["history"], reference["history"])):
            assert torch.equal(losses, expected), f"rank {rank}, step {step}: gathered losses differ"
        # After the cross-rank exploit, the global halving (5 survivors rebalanced 3 + 2) and a third epoch.
        assert result["positions_after"] == [[0, 1, 2], [3, 4]][rank]
        assert result["model_ids"] == tuple(reference["keep"].tolist())
        assert_identical(result["final"], reference["final"], result["positions_after"], f"rank {rank} final")


def test_ddp_over_a_batched_model_averages_each_models_gradient(two_ranks) -> None:
    """Two data-parallel ranks on half batches = one process on the whole batch (per-model mean losses)."""
    ranks, _ = two_ranks
    with one_thread():
        model = build_shard(ddp_factory, ModelShard(3), seed=SEED)
        optimizer = bl.optim.SGD(model.parameters(), lr=torch.tensor([0.1, 0.2, 0.3]), momentum=0.9)
        x, y = ddp_batches()
        for step in range(2):
            optimizer.zero_grad()
            bl.losses.cross_entropy(model(x[step]), y[step]).sum().backward()
            optimizer.step()
    expected = population_state(model, optimizer)
    for rank, result in enumerate(ranks):
        assert result["ddp"].keys() == expected.keys()
        for key, value in expected.items():
            # Not bit for bit: the batch mean is summed in two halves and averaged by DDP.
            torch.testing.assert_close(result["ddp"][key], value, rtol=1e-12, atol=1e-12, msg=f"rank {rank} {key}")


def test_ddp_inside_each_shard_on_a_2x2_mesh(tmp_path) -> None:
    """4 ranks: 2 shards of the models x 2 data-parallel replicas = one process with every model and batch."""
    ranks = launch("mesh_sweep", 4, tmp_path)
    with one_thread():
        model = build_shard(ddp_factory, ModelShard(MESH_MODELS), seed=SEED)
        optimizer = bl.optim.SGD(model.parameters(), lr=mesh_lrs(), momentum=0.9)
        x, y = mesh_batches()
        history = []
        for step in range(MESH_STEPS):
            losses = bl.losses.cross_entropy(model(x[step]), y[step])
            optimizer.zero_grad()
            losses.sum().backward()
            optimizer.step()
            history.append(losses.detach())
        bl.copy_model_(model, optimizer, [4], [0], schedulers=[])
    expected = population_state(model, optimizer)
    for rank, result in enumerate(ranks):
        assert result["positions"] == [[0, 1, 2], [3, 4]][rank // 2]
        for losses, want in zip(result["history"], history, strict=True):
            torch.testing.assert_close(losses, want, rtol=1e-12, atol=1e-12)
        for key, value in expected.items():
            # Not bit for bit: each batch mean is summed in two halves and averaged by DDP.
            got, want = result["final"][key], value[result["positions"]]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank} {key}")
        if rank % 2:  # the two data-parallel replicas of a shard hold the same models, bit for bit
            local = list(range(len(result["positions"])))
            assert_identical(result["final"], ranks[rank - 1]["final"], local, f"rank {rank} vs its replica")
    loaded = ddp_factory(MESH_MODELS)
    loaded_optimizer = bl.optim.SGD(loaded.parameters(), lr=torch.zeros(MESH_MODELS), momentum=0.9)
    load_population_(tmp_path / "mesh_population", loaded, ModelShard(MESH_MODELS), loaded_optimizer)
    state = population_state(loaded, loaded_optimizer)
    for rank in (0, 2):  # one replica of each shard
        assert_identical(ranks[rank]["final"], state, ranks[rank]["positions"], f"rank {rank}, loaded in one process")


def assert_resumed(result: dict, reference: dict, what: str) -> None:
    """A resumed run (``resume_population``) loaded the reference's models and their schedulers at their positions
    and continued exactly as the reference did without the checkpoint."""
    positions = result["positions"]
    assert result["model_ids"] == tuple(reference["keep"].tolist()), what
    assert_identical(result["loaded"], reference["final"], positions, f"{what} loaded")
    assert result["loaded_scheduler_values"] == reference["final_scheduler_values"], what
    for losses, expected in zip(result["history"], reference["resumed"]["history"], strict=True):
        assert torch.equal(losses, expected), what
    assert_identical(result["final"], reference["resumed"]["final"], positions, f"{what} final")
    assert result["final_scheduler_values"] == reference["resumed"]["final_scheduler_values"], what


def test_resume_on_three_ranks_and_on_one(two_ranks, reference) -> None:
    """Saved on 2 ranks and in one process, with a StepLR over the per-model lr and a per-model plateau: resumed
    on 3 ranks and in one process, every model (weights, Adam state, lr, schedulers) continues exactly."""
    _, folder = two_ranks
    shutil.copytree(reference["checkpoint"], folder / "one_process_population", dirs_exist_ok=True)
    ranks = launch("resumed_sweep", 3, folder)
    for rank, result in enumerate(ranks):
        assert result["positions"] == [[0, 1], [2, 3], [4]][rank]
        assert_resumed(result, reference, f"rank {rank}, saved on 2 ranks")
        assert_resumed(result["from_one_process"], reference, f"rank {rank}, saved in one process")
        assert "holds other per-model tensors than rank" in result["mismatch"]
    exported = ranks[1]["exported"]
    assert ranks[0]["exported"] is None and ranks[2]["exported"] is None
    expected_model = reference["resumed"]["final"]
    for name, value in exported.items():
        assert torch.equal(value, expected_model[f"model/{name}"][[4, 1, 4]]), name
    # One process, no process group: the 2-rank checkpoint holds the whole population.
    with one_thread():
        result = resume_population(folder / "population")[0]
    assert result["positions"] == list(range(KEEP))
    assert_resumed(result, reference, "one process, saved on 2 ranks")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_schedulers_saved_in_one_process_continue_on_more_ranks(kind, world_size, tmp_path) -> None:
    """Each rank's load of a population saved in one process, run here rank by rank (no process group is
    needed to load): its models, lr and schedulers continue as the models trained without the checkpoint."""
    x, y, x_val, y_val = data()
    with one_thread():
        model = reference_init(NUM_MODELS, SEED)
        optimizer = make_optimizer(model, range(NUM_MODELS))
        schedulers = make_schedulers(optimizer, kind)
        loader = bl.ModelTensorLoader(x, y, num_models=NUM_MODELS, batch_size=8, seed=DATA_SEED)
        for epoch in range(5):
            if epoch == 3:
                extra = {"epoch": loader.sampler.epoch}
                save_population(tmp_path / "population", model, ModelShard(NUM_MODELS), optimizer,
                                schedulers=schedulers, extra=extra)  # fmt: skip
            train_epoch(model, optimizer, loader)
            step_schedulers(schedulers, model, x_val, y_val, NUM_MODELS)
        expected, expected_values = population_state(model, optimizer, schedulers), scheduler_state(schedulers)[1]
        for rank in range(world_size):
            shard = ModelShard(NUM_MODELS, rank, world_size)
            part = build_shard(factory, shard, seed=SEED + 1)
            part_optimizer = make_optimizer(part, shard.positions)
            part_schedulers = make_schedulers(part_optimizer, kind)
            extra = {"epoch": 0}
            load_population_(tmp_path / "population", part, shard, part_optimizer, schedulers=part_schedulers,
                             extra=extra)  # fmt: skip
            part_loader = bl.ModelTensorLoader(x, y, num_models=shard.num_local, batch_size=8, seed=DATA_SEED)
            shard_data_(part_loader, shard).set_epoch(extra["epoch"])
            for _ in range(2):
                train_epoch(part, part_optimizer, part_loader)
                step_schedulers(part_schedulers, part, x_val, y_val, shard.num_local)
            state = population_state(part, part_optimizer, part_schedulers)
            assert_identical(state, expected, list(shard.positions), f"rank {rank} of {world_size}")
            assert scheduler_state(part_schedulers)[1] == expected_values


def test_a_hanging_rank_fails_the_launch_and_is_killed(tmp_path) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] of 2 still ran after 3"):
        launch("hang", 2, tmp_path, deadline_s=3.0)


def test_one_process_shard_needs_no_process_group(reference) -> None:
    """World size 1: the cross-rank functions are the single-process ones, without torch.distributed."""
    model = reference_init(NUM_MODELS, SEED)
    optimizer = make_optimizer(model, range(NUM_MODELS))
    x, y, _, _ = data()
    train_epoch(model, optimizer, bl.ModelTensorLoader(x, y, num_models=NUM_MODELS, batch_size=8, seed=DATA_SEED))
    expected_model, expected_optimizer = copy.deepcopy(model), None
    expected_optimizer = make_optimizer(expected_model, range(NUM_MODELS))
    expected_optimizer.load_state_dict(optimizer.state_dict())
    shard = ModelShard.from_group(NUM_MODELS)
    assert not dist.is_initialized() and shard.world_size == 1
    copy_model_across_ranks_(model, optimizer, shard, SWAP_SRC, SWAP_DST)
    bl.copy_model_(expected_model, expected_optimizer, SWAP_SRC, SWAP_DST)
    shard = keep_models_across_ranks_(model, optimizer, shard, [5, 2, 3])
    bl.keep_models_(expected_model, expected_optimizer, [5, 2, 3])
    assert shard.model_ids == (5, 2, 3)
    assert_identical(
        population_state(model, optimizer), population_state(expected_model, expected_optimizer), [0, 1, 2], ""
    )
    exported = gather_models(model, shard, [2, 0])
    assert all(torch.equal(v, expected_model.state_dict()[k][[2, 0]]) for k, v in exported.items())


@pytest.mark.parametrize("given", [None, "schedule only"])
@pytest.mark.parametrize("call", ["copy", "keep"])
def test_cross_rank_calls_refuse_a_plateau_scheduler_left_out(call, given) -> None:
    """Across ranks only the schedulers given move with the models (every rank must list them in one order): a
    live per-model ReduceLROnPlateau left out would keep each position's old model's best metric and bad-epoch
    count, so the call is refused before anything changes; listed, the models' plateau state moves with them."""
    model = reference_init(NUM_MODELS, SEED)
    optimizer = make_optimizer(model, range(NUM_MODELS))
    schedule, plateau = make_schedulers(optimizer)
    plateau.step(torch.arange(NUM_MODELS, dtype=torch.float64))
    weights, best = copy.deepcopy(model.state_dict()), plateau.best.clone()
    shard = ModelShard.from_group(NUM_MODELS)
    schedulers = None if given is None else [schedule]
    with pytest.raises(
        ValueError,
        match=r"(across_ranks_: the optimizer has 1 per-model scheduler\(s\) not in "
        r"schedulers= \(ReduceLROnPlateau\))|(would be left behind|initial_lr)",
    ):
        if call == "copy":
            copy_model_across_ranks_(model, optimizer, shard, [1], [0], schedulers=schedulers)
        else:
            keep_models_across_ranks_(model, optimizer, shard, [2, 1, 0], schedulers=schedulers)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()) and torch.equal(plateau.best, best)
    if call == "copy":
        copy_model_across_ranks_(model, optimizer, shard, [1], [0], schedulers=[schedule, plateau])
        assert plateau.best.tolist() == [1.0, 1.0] + list(range(2, NUM_MODELS))
    else:
        keep_models_across_ranks_(model, optimizer, shard, [2, 1, 0], schedulers=[schedule, plateau])
        assert plateau.best.tolist() == [2.0, 1.0, 0.0]


def test_example_on_two_ranks_equals_one_process(tmp_path, load_example) -> None:
    ranks = launch("example", 2, tmp_path)
    with one_thread():
        expected = load_example("distributed_sweep").run_sweep(**EXAMPLE_ARGS)
    assert [len(r.model_ids) for r in expected.rungs] == [12, 6, 3]
    assert ranks[1].exported_test is None and ranks[0].exported_test == expected.exported_test
    for result in ranks:
        assert result.world_size == 2 and expected.world_size == 1
        assert result.rungs == expected.rungs and result.final_ids == expected.final_ids
        assert result.final_test == expected.final_test
    assert expected.exported_test == expected.final_test[0] > 0.8  # chance is 0.1
    assert (tmp_path / "example" / "best_model.pt").stat().st_size > 0


def test_shard_data_feeds_each_model_its_own_stream() -> None:
    x, y, _, _ = data()
    whole = [xb for xb, _ in bl.ModelTensorLoader(x, y, num_models=NUM_MODELS, batch_size=8, seed=DATA_SEED)]
    dataset = torch.utils.data.TensorDataset(x, y)
    for rank in range(3):
        shard = ModelShard(NUM_MODELS, rank, 3)
        mine = slice(shard.start, shard.stop)
        tensor_loader = bl.ModelTensorLoader(x, y, num_models=1, batch_size=8, seed=DATA_SEED)
        loader = bl.model_data_loader(dataset, num_models=1, batch_size=8, seed=DATA_SEED)
        sampler = bl.ModelBatchSampler(1, len(x), 8, seed=DATA_SEED)
        for sharded in (tensor_loader, loader, sampler):
            assert shard_data_(sharded, shard) is sharded
        for expected, (a, _), (b, _), index in zip(whole, tensor_loader, loader, sampler, strict=True):
            assert torch.equal(a, expected[mine]) and torch.equal(b, expected[mine])
            assert torch.equal(x[index], expected[mine])
    with pytest.raises(TypeError, match="expected a ModelTensorLoader"):
        shard_data_([x], ModelShard(2))


@pytest.mark.parametrize("caller", ["keep_models_across_ranks_", "copy_model_across_ranks_"])
def test_selection_across_ranks_refuses_a_scaler_it_cannot_carry(caller: str) -> None:
    """The per-model scales of a batchlayers.amp.GradScaler do not travel between ranks: a selection across
    ranks of an optimizer a scaler steps is refused in its checks (before anything moves), naming why."""
    from batchlayers.distributed import _population_checks

    model = bl.BatchedLinear(3, 4, 2)
    optimizer = bl.optim.SGD(model.parameters(), lr=0.1)
    scaler = bl.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 5, 4)).sum(dim=(1, 2))).sum().backward()
    scaler.step(optimizer)
    scaler.update()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{caller}: .*GradScaler.*does not move between ranks"):
        _population_checks(model, optimizer, None, caller)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
