"""Exact resume against the uninterrupted run: a sampler or loader stopped anywhere (mid-epoch, after
keep_models_, with DataLoader workers prefetching ahead) and resumed from its saved state yields exactly the
remaining batches; a TrainState brings back weights, optimizer, scheduler, data stream and random generators;
bad states raise and change nothing."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import batchlayers as bl
from batchlayers.data import MODES, ModelBatchSampler, ModelTensorLoader, model_data_loader

NUM_MODELS, NUM_SAMPLES, BATCH_SIZE, EPOCHS, SEED = 3, 14, 4, 3, 7
PER_EPOCH = -(-NUM_SAMPLES // BATCH_SIZE)  # 4 batches, the last of 2 samples
KINDS = ["sampler", "tensor-loader", "data-loader-0-workers", "data-loader-2-workers"]
OWNERS = {
    "sampler": "ModelBatchSampler",
    "tensor-loader": "ModelTensorLoader",
    "data-loader-0-workers": "model_data_loader",
    "data-loader-2-workers": "model_data_loader",
}
X = torch.randn(NUM_SAMPLES, 2, generator=torch.Generator().manual_seed(0))
Y = torch.arange(NUM_SAMPLES)


class AugmentedDataset(Dataset):
    """Draws a random augmentation from torch, ``random`` and numpy for every sample it hands out."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(self.x.shape[1]) + random.random() + float(np.random.rand())
        return self.x[i] + noise, self.y[i]


def make(kind: str, mode: str, num_models: int = NUM_MODELS, seed: int = SEED) -> Any:
    if kind == "sampler":
        return ModelBatchSampler(num_models, NUM_SAMPLES, BATCH_SIZE, mode, seed=seed)
    if kind == "tensor-loader":
        return ModelTensorLoader(X, Y, num_models=num_models, batch_size=BATCH_SIZE, mode=mode, seed=seed)
    workers = int(kind.split("-")[2])
    # Persistent workers: their own generators run on across epochs, which must not matter.
    options = {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": "fork"} if workers else {}
    return model_data_loader(AugmentedDataset(X, Y), num_models, BATCH_SIZE, mode=mode, seed=seed, **options)


def sampler_of(obj: Any) -> ModelBatchSampler:
    if isinstance(obj, ModelBatchSampler):
        return obj
    return obj.sampler if isinstance(obj, ModelTensorLoader) else obj.batch_sampler.sampler


def stream(obj: Any, epochs: int = EPOCHS) -> Iterator[Any]:
    """Every batch until epoch ``epochs`` - 1 ends, going on from wherever ``obj`` stands (mid-epoch after a
    resume): the training loop ``while epoch < epochs: for batch in loader``."""
    while sampler_of(obj).epoch < epochs:
        yield from obj


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Equal to the bit: tensors with torch.equal (and the same dtype), containers element by element."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: a {type(actual).__name__}, expected a tensor"
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{where}: tensors differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and list(actual) == list(expected), f"{where}: keys differ"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(actual, expected), f"{where}: arrays differ"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def run_and_stop(obj: Any, stop: int, keep: tuple[int, list[int]] | None = None) -> tuple[list[Any], Iterator[Any]]:
    """The first ``stop`` batches of ``obj``'s stream (calling keep_models_ after ``keep[0]`` batches), and the
    stream, suspended there."""
    batches, head = stream(obj), []
    for _ in range(stop):
        if keep is not None and len(head) == keep[0]:
            sampler_of(obj).keep_models_(keep[1])
        head.append(next(batches))
    return head, batches


def save_and_load(state: Any, tmp_path) -> Any:
    path = tmp_path / "state.pt"
    bl.save(state, path)
    return bl.load(path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_resume_anywhere_yields_the_remaining_batches(kind: str, mode: str, tmp_path) -> None:
    reference_run = make(kind, mode)
    reference = list(stream(reference_run))
    assert len(reference) == EPOCHS * PER_EPOCH
    for stop in [1, PER_EPOCH - 1, PER_EPOCH, PER_EPOCH + 2]:
        run = make(kind, mode)
        head, batches = run_and_stop(run, stop)
        state = save_and_load(run.state_dict(), tmp_path)
        batches.close()  # the interrupted run's workers go away
        # Inside the loop over an epoch, even after its last batch: the code after the loop is yet to run.
        position = (stop - 1) // PER_EPOCH, (stop - 1) % PER_EPOCH + 1
        assert (state["epoch"], state["batches_yielded"]) == position, "prefetched batches counted"
        resumed = make(kind, mode, seed=SEED + 1)  # the seed comes from the state
        resumed.load_state_dict(state)
        assert_same(head + list(stream(resumed)), reference, f"stopped after {stop} batches")
        assert_same(resumed.state_dict(), reference_run.state_dict(), f"final state, stopped after {stop}")


# With workers in one mode only: a worker's process is the slow part, and the keep logic is the sampler's.
KEEP_CASES = [(kind, mode) for kind in KINDS[:3] for mode in MODES] + [("data-loader-2-workers", "bootstrap")]


@pytest.mark.parametrize("kind, mode", KEEP_CASES)
@pytest.mark.parametrize("keep_at", [PER_EPOCH, PER_EPOCH + 1], ids=["between-epochs", "mid-epoch"])
def test_resume_after_keep_models(kind: str, mode: str, keep_at: int) -> None:
    """keep_models_ takes effect at the next epoch, so a state saved between a mid-epoch keep_models_ and the
    end of that epoch resumes the epoch with all models and the next ones with the survivors."""
    keep = (keep_at, [2, 0])
    reference, _ = run_and_stop(make(kind, mode), EPOCHS * PER_EPOCH, keep)
    for stop in [keep_at, keep_at + 1, 2 * PER_EPOCH + 1]:
        run = make(kind, mode)
        head, batches = run_and_stop(run, stop, keep)
        if stop == keep_at:  # keep_models_ after the last batch taken, before the state is saved
            sampler_of(run).keep_models_(keep[1])
        state = copy.deepcopy(run.state_dict())
        batches.close()
        resumed = make(kind, mode, num_models=len(keep[1]))  # built with the models kept, as the model is
        resumed.load_state_dict(state)
        assert sampler_of(resumed).model_ids.tolist() == keep[1]
        assert_same(head + list(stream(resumed)), reference, f"stopped after {stop} batches")


@pytest.mark.parametrize("mode", MODES)
def test_fetch_random_numbers_come_from_the_stream_not_the_workers(mode: str) -> None:
    """A dataset's random augmentations depend on the seed, epoch and batch only: the same for any number of
    workers, and iterating the loader leaves the training process' generators alone."""
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()
    in_process = list(stream(make("data-loader-0-workers", mode)))
    assert_same((torch.get_rng_state(), random.getstate(), np.random.get_state()), before, "global generators")
    with_workers = list(stream(make("data-loader-2-workers", mode)))
    assert_same(with_workers, in_process, "0 vs 2 workers")
    other_seed = list(stream(make("data-loader-0-workers", mode, seed=SEED + 1)))
    tensor_batches = list(stream(make("tensor-loader", mode)))
    for (xb, yb), (x_other, _), (_, y_plain) in zip(in_process, other_seed, tensor_batches, strict=True):
        assert torch.equal(yb, y_plain), "the augmented loader walks another stream than the tensor loader"
        assert not torch.equal(xb, X[yb]), "no augmentation drawn"
        assert not torch.equal(xb, x_other), "another seed drew the same augmentations"


def corrupt(key: str, value: Any) -> Callable[[dict], None]:
    def apply(state: dict) -> None:
        if value is None:
            del state[key]
        else:
            state[key] = value

    return apply


BAD_STATES = {
    "num_models": (corrupt("num_models", 5), r"expected num_models=3, got num_models=5"),
    "num_samples": (corrupt("num_samples", 20), r"expected num_samples=14, got num_samples=20"),
    "batch_size": (corrupt("batch_size", 5), r"expected batch_size=4, got batch_size=5"),
    "mode": (corrupt("mode", "bootstrap"), r"expected mode='shuffle', got mode='bootstrap'"),
    "drop_last": (corrupt("drop_last", True), r"expected drop_last=False, got drop_last=True"),
    "missing-key": (corrupt("seed", None), r"missing keys \['seed'\]"),
    "unexpected-key": (corrupt("step", 3), r"unexpected keys \['step'\]"),
    "position": (corrupt("batches_yielded", PER_EPOCH + 1), rf"batches_yielded .* \[0, {PER_EPOCH}\].*got 5"),
    "epoch": (corrupt("epoch", -1), r"epoch to be a non-negative int, got -1"),
    "seed": (corrupt("seed", 2**64), r"seed to be an int in \[0, 2\*\*64 - 1\], got 18446744073709551616"),
    "model_ids": (corrupt("model_ids", torch.tensor([0, 1])), r"model_ids of length num_models=3, got length 2"),
    "epoch_model_ids": (corrupt("epoch_model_ids", torch.tensor([-1])), r"epoch_model_ids to be .* >= 0, got \[-1\]"),
}


@pytest.mark.parametrize("kind", KINDS[:3])
@pytest.mark.parametrize("bad", BAD_STATES.values(), ids=BAD_STATES.keys())
def test_bad_states_raise_clearly_and_change_nothing(kind: str, bad: tuple) -> None:
    apply, message = bad
    reference = list(stream(make(kind, "shuffle")))
    run = make(kind, "shuffle")
    head, batches = run_and_stop(run, PER_EPOCH + 1)
    before = copy.deepcopy(run.state_dict())
    state = make(kind, "shuffle", seed=SEED + 1).state_dict()
    apply(state)
    with pytest.raises(ValueError, match=rf"^{OWNERS[kind]}\.load_state_dict: .*{message}"):
        run.load_state_dict(state)
    assert_same(run.state_dict(), before, "state after a rejected load")
    assert_same(head + list(batches), reference, "stream after a rejected load")


def test_a_state_that_is_no_dict_raises() -> None:
    with pytest.raises(TypeError, match=r"ModelBatchSampler.load_state_dict: expected a state dict .* got list"):
        make("sampler", "shuffle").load_state_dict([])


def build_training(kind: str, init_seed: int) -> tuple[bl.TrainState, Any]:
    torch.manual_seed(init_seed), random.seed(init_seed), np.random.seed(init_seed)
    model = nn.Sequential(
        bl.BatchedLinear(NUM_MODELS, 2, 8), nn.Dropout(0.25), nn.Tanh(), bl.BatchedLinear(NUM_MODELS, 8, 3)
    )
    optimizer = bl.optim.Adam(model.parameters(), lr=torch.logspace(-3, -1, NUM_MODELS))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = make(kind, "bootstrap")
    return bl.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader), loader


def train(state: bl.TrainState, stop: int | None = None) -> None:
    """Train until the last epoch ends, or until the loader's state says ``stop`` steps were taken."""
    model, optimizer, scheduler, loader = state.objects.values()
    while sampler_of(loader).epoch < EPOCHS:
        for xb, yb in loader:
            # Dropout draws from torch's generator, the input noise from random's and numpy's.
            xb = xb * random.uniform(0.5, 1.5) + float(np.random.rand())
            losses = bl.losses.cross_entropy(model(xb), yb % 3)
            optimizer.zero_grad()
            losses.sum().backward()
            optimizer.step()
            position = loader.state_dict()
            if position["epoch"] * PER_EPOCH + position["batches_yielded"] == stop:
                return
        scheduler.step()


# Resumed after an epoch's last step, the loop's scheduler.step() comes before the new process' first
# optimizer.step(), which torch's scheduler warns about although the loaded schedule is exact.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
@pytest.mark.parametrize(
    "kind, stop",
    [("tensor-loader", stop) for stop in [PER_EPOCH - 1, PER_EPOCH, 2 * PER_EPOCH + 2]]
    + [("data-loader-2-workers", stop) for stop in [PER_EPOCH, 2 * PER_EPOCH + 2]],
)
def test_train_state_resumes_bit_for_bit(kind: str, stop: int, tmp_path) -> None:
    reference, _ = build_training(kind, init_seed=0)
    train(reference)
    run, _ = build_training(kind, init_seed=0)
    train(run, stop)
    saved = save_and_load(run.state_dict(), tmp_path)
    resumed, _ = build_training(kind, init_seed=1)  # a new process: other weights, other generators
    resumed.load_state_dict(saved)
    train(resumed)
    assert_same(resumed.state_dict(), reference.state_dict(), "TrainState")


def draw_from_every_generator() -> list:
    cuda = [torch.rand(3, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    return [torch.rand(3), random.random(), np.random.rand(), *cuda]


def test_train_state_restores_every_generator() -> None:
    state = bl.TrainState()
    saved = copy.deepcopy(state.state_dict())
    assert ("cuda" in saved["rng"]) == torch.cuda.is_available()
    drawn = draw_from_every_generator()
    state.load_state_dict(saved)
    assert_same(state.state_dict(), saved)
    assert_same(draw_from_every_generator(), drawn, "draws after the restore")
    assert "rng" not in bl.TrainState(rng=False).state_dict()


def test_train_state_bad_states_raise_before_loading_anything() -> None:
    sampler = make("sampler", "shuffle")
    state = bl.TrainState(sampler=sampler, pair=[make("sampler", "shared"), make("sampler", "bootstrap")])
    good = copy.deepcopy(state.state_dict())
    other = make("sampler", "shuffle", seed=SEED + 1).state_dict()
    before = copy.deepcopy(sampler.state_dict())
    bad = [
        ({k: v for k, v in good.items() if k != "pair"}, r"missing keys \['pair'\]"),
        ({**good, "sampler": other, "model": {}}, r"unexpected keys \['model'\]"),
        (
            {**good, "sampler": other, "pair": good["pair"][:1]},
            r"expected 'pair' to be a list of 2 states, got length 1",
        ),
        (
            {**good, "sampler": other, "rng": {"torch": good["rng"]["torch"]}},
            r"expected 'rng' to be a dict with at least the keys \['python', 'torch'\], got \['torch'\]",
        ),
    ]
    for wrong, message in bad:
        with pytest.raises(ValueError, match=rf"^TrainState\.load_state_dict: {message}"):
            state.load_state_dict(wrong)
        assert_same(sampler.state_dict(), before, message)
    with pytest.raises(TypeError, match=r"TrainState: 'seed' must have state_dict\(\) and load_state_dict\(\)"):
        bl.TrainState(seed=3)
