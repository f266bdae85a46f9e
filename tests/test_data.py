"""Per-model data streams against their meaning: permutations, bootstrap resamples, shared batches, torch's
own BatchSampler epoch layout, reproducibility, and the DataLoader path against the in-process path."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import BatchSampler, Dataset, TensorDataset

from batchlayers.data import MODES, ModelBatchSampler, ModelTensorLoader, model_data_loader


def epoch_streams(sampler: ModelBatchSampler) -> torch.Tensor:
    """``(M, samples per epoch)``: every model's indices of one epoch, batches concatenated."""
    return torch.cat(list(sampler), dim=1)


def chi_square_upper(dof: int) -> float:
    """A generous upper bound of the chi-square(dof) distribution (about the 1e-6 tail)."""
    return dof + 11 * math.sqrt(2 * dof) + 30


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_layout_matches_torch_batch_sampler(mode: str, drop_last: bool) -> None:
    sampler = ModelBatchSampler(3, num_samples=23, batch_size=5, mode=mode, drop_last=drop_last, seed=0)
    expected = [len(b) for b in BatchSampler(range(23), 5, drop_last)]
    for _ in range(2):
        sizes = []
        for index in sampler:
            assert index.shape[0] == 3 and index.dtype == torch.int64
            sizes.append(index.shape[1])
        assert sizes == expected
    assert len(sampler) == len(expected)


def test_shuffle_every_model_walks_a_permutation_of_its_own() -> None:
    sampler = ModelBatchSampler(5, num_samples=40, batch_size=7, seed=1)
    epochs = [epoch_streams(sampler) for _ in range(3)]
    for stream in epochs:
        for row in stream:
            assert torch.equal(row.sort().values, torch.arange(40))
        for i in range(5):
            for j in range(i):
                assert not torch.equal(stream[i], stream[j]), f"models {i} and {j} got the same order"
    assert not torch.equal(epochs[0], epochs[1]), "two epochs got the same order"


def test_shuffle_orders_are_uniform_and_models_independent() -> None:
    # 400 model-epochs of a 10-sample set: the first sample visited is uniform, and two models' orders
    # agree at a position 1 time in 10 (independent permutations).
    sampler = ModelBatchSampler(40, num_samples=10, batch_size=10, seed=2)
    streams = torch.cat([epoch_streams(sampler) for _ in range(10)])
    counts = torch.bincount(streams[:, 0], minlength=10).double()
    expected = streams.shape[0] / 10
    assert ((counts - expected) ** 2 / expected).sum() < chi_square_upper(9)
    agree = (streams[0::2] == streams[1::2]).double().mean().item()
    assert abs(agree - 0.1) < 0.05


def test_bootstrap_draws_with_replacement_with_binomial_counts() -> None:
    num_models, n = 200, 50
    sampler = ModelBatchSampler(num_models, num_samples=n, batch_size=8, mode="bootstrap", seed=3)
    stream = epoch_streams(sampler)
    counts = torch.stack([torch.bincount(row, minlength=n) for row in stream])
    # The times sample k appears in a model's resample is Binomial(N, 1/N).
    observed = torch.bincount(counts.flatten().clamp(max=4), minlength=5).double()
    pmf = [math.comb(n, k) * (1 / n) ** k * (1 - 1 / n) ** (n - k) for k in range(4)]
    expected = torch.tensor([*pmf, 1 - sum(pmf)], dtype=torch.float64) * counts.numel()
    assert ((observed - expected) ** 2 / expected).sum() < chi_square_upper(4)
    # The out-of-bag mask is exactly the samples a model never sees.
    assert torch.equal(sampler.out_of_bag_mask(), counts == 0)
    assert abs((counts == 0).double().mean().item() - (1 - 1 / n) ** n) < 0.02


def test_bootstrap_resample_is_fixed_across_epochs_but_reshuffled() -> None:
    sampler = ModelBatchSampler(4, num_samples=30, batch_size=4, mode="bootstrap", seed=4)
    first, second = epoch_streams(sampler), epoch_streams(sampler)
    assert torch.equal(first.sort(dim=1).values, second.sort(dim=1).values)
    assert torch.equal(first.sort(dim=1).values, sampler.bootstrap_indices().sort(dim=1).values)
    assert not torch.equal(first, second)


def test_shared_batches_are_one_stride0_expand() -> None:
    x = torch.randn(20, 3)
    loader = ModelTensorLoader(x, torch.arange(20), num_models=4, batch_size=6, mode="shared", seed=5)
    seen = []
    for xb, yb in loader:
        assert xb.stride(0) == 0 and yb.stride(0) == 0
        assert xb.shape == (4, yb.shape[1], 3)
        assert torch.equal(xb[0], x[yb[0]])
        seen.append(yb[0])
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(20))


@pytest.mark.parametrize("mode", MODES)
def test_streams_depend_on_seed_model_and_epoch_only(mode: str) -> None:
    def first_epochs(num_models: int, seed: int) -> list[torch.Tensor]:
        sampler = ModelBatchSampler(num_models, num_samples=17, batch_size=4, mode=mode, seed=seed)
        return [epoch_streams(sampler) for _ in range(2)]

    big, small, again, other = first_epochs(6, 7), first_epochs(2, 7), first_epochs(6, 7), first_epochs(6, 8)
    for e in range(2):
        assert torch.equal(big[e], again[e]), "same seed, different batches"
        assert torch.equal(big[e][:2], small[e]), "model i's stream depends on the number of models"
        assert not torch.equal(big[e], other[e]), "different seeds, same batches"


def test_set_epoch_and_global_seed_reproduce_a_run() -> None:
    torch.manual_seed(0)
    run = ModelBatchSampler(3, num_samples=12, batch_size=5)
    epochs = [epoch_streams(run) for _ in range(3)]
    torch.manual_seed(0)
    resumed = ModelBatchSampler(3, num_samples=12, batch_size=5)
    assert resumed.seed == run.seed
    resumed.set_epoch(2)
    assert torch.equal(epoch_streams(resumed), epochs[2])
    assert resumed.epoch == 3


def test_kept_models_go_on_with_their_own_streams() -> None:
    x = torch.arange(30.0).unsqueeze(1)
    full = ModelTensorLoader(x, num_models=5, batch_size=4, seed=9)
    pruned = ModelTensorLoader(x, num_models=5, batch_size=4, seed=9)
    list(full), list(pruned)  # epoch 0 with all five models
    pruned.keep_models_([3, 1])
    assert pruned.num_models == 2
    reference = torch.cat([b[0] for b in full], dim=1)
    assert torch.equal(torch.cat([b[0] for b in pruned], dim=1), reference[[3, 1]])
    pruned.keep_models_(torch.tensor([False, True]))
    assert pruned.sampler.model_ids.tolist() == [1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "steps",
    [
        [[2, 0, 3], [1, 2]],
        [[2, 0, 3], torch.tensor([False, True, True])],
        [[4, 1, 3, 0], [3, 0, 2], [2, 0]],
        [[3, 3, 1], [2, 0, 1]],
    ],
    ids=["positions-differ", "then-mask", "three-drops", "duplicates"],
)
def test_successive_keep_models_compose_stream_ids(mode: str, steps: list) -> None:
    """After several keep_models_ calls, each surviving model draws exactly the batches of its original stream:
    the stream ids compose (a later index is a position among the models kept before), checked against a fresh
    sampler of all five streams, indexed by the original ids."""
    num_models, seed = 5, 21
    sampler = ModelBatchSampler(num_models, num_samples=13, batch_size=4, mode=mode, seed=seed)
    reference = ModelBatchSampler(num_models, num_samples=13, batch_size=4, mode=mode, seed=seed)
    ids = list(range(num_models))
    for epoch, step in enumerate([None, *steps]):
        if step is not None:
            sampler.keep_models_(step)
            positions = step.nonzero().flatten().tolist() if isinstance(step, torch.Tensor) else step
            ids = [ids[p] for p in positions]
        assert sampler.model_ids.tolist() == ids
        assert sampler.num_models == len(ids)
        reference.set_epoch(epoch)
        expected = epoch_streams(reference)
        got = epoch_streams(sampler)
        assert torch.equal(got, expected[ids] if mode != "shared" else expected[[0] * len(ids)]), f"epoch {epoch}"
        if mode == "bootstrap":
            assert torch.equal(sampler.bootstrap_indices(), reference.bootstrap_indices()[ids])
    loader = ModelTensorLoader(torch.arange(13.0), num_models=num_models, batch_size=4, mode=mode, seed=seed)
    for step in steps:
        loader.keep_models_(step)
    assert loader.sampler.model_ids.tolist() == ids
    reference.set_epoch(0)
    expected = epoch_streams(reference)
    got = torch.cat([b[0] for b in loader], dim=1).long()
    assert torch.equal(got, expected[ids] if mode != "shared" else expected[[0] * len(ids)])


def test_tensor_loader_gathers_each_models_indices() -> None:
    x, y = torch.randn(25, 2, 3), torch.randint(5, (25,))
    loader = ModelTensorLoader(x, y, num_models=3, batch_size=8, mode="bootstrap", seed=10)
    indices = list(ModelBatchSampler(3, num_samples=25, batch_size=8, mode="bootstrap", seed=10))
    for (xb, yb), index in zip(loader, indices, strict=True):
        assert xb.shape == (3, index.shape[1], 2, 3)
        assert torch.equal(xb, x[index]) and torch.equal(yb, y[index])


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_tensor_loader_batches_on_the_tensors_device(device: str, mode: str) -> None:
    x = torch.randn(20, 3)
    on_device = ModelTensorLoader(x.to(device), num_models=3, batch_size=6, mode=mode, seed=13)
    on_cpu = ModelTensorLoader(x, num_models=3, batch_size=6, mode=mode, seed=13)
    assert on_device.sampler.epoch == 0
    batches = iter(on_device)
    assert on_device.sampler.epoch == 1, "iter() starts the epoch"
    for (xb,), (xr,) in zip(batches, on_cpu, strict=True):
        assert xb.device.type == device
        assert torch.equal(xb.cpu(), xr)
        assert (xb.stride(0) == 0) == (mode == "shared")


@pytest.mark.parametrize("device", DEVICES)
def test_keep_models_takes_indices_from_the_models_device(device: str) -> None:
    """Survivors are picked from scores computed where the models run (docs/training.md's successive halving)."""
    x = torch.randn(20, 3)
    loader = ModelTensorLoader(x.to(device), num_models=3, batch_size=6, seed=13)
    reference = ModelTensorLoader(x, num_models=3, batch_size=6, seed=13)
    scores = torch.tensor([0.1, 0.9, 0.5], device=device)
    loader.keep_models_(scores.argsort(descending=True)[:2])
    reference.keep_models_([1, 2])
    loader.keep_models_(torch.tensor([False, True], device=device))
    reference.keep_models_([1])
    for (xb,), (xr,) in zip(loader, reference, strict=True):
        assert torch.equal(xb.cpu(), xr)


class DictDataset(Dataset):
    """Samples as dicts of a tensor and an int, read one at a time (no ``__getitems__``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": int(self.y[i])}


@pytest.mark.parametrize("mode", MODES)
def test_data_loader_with_workers_matches_in_process_loader(mode: str) -> None:
    x, y = torch.randn(30, 4), torch.randint(3, (30,))
    reference = ModelTensorLoader(x, y, num_models=3, batch_size=8, mode=mode, seed=11)
    loader = model_data_loader(
        DictDataset(x, y),
        3,
        8,
        mode=mode,
        seed=11,
        num_workers=2,
        persistent_workers=True,
        pin_memory=torch.cuda.is_available(),
    )
    assert len(loader) == len(reference) == 4
    for _ in range(2):  # two epochs through the same workers
        batches = list(loader)
        expected = list(reference)
        assert len(batches) == len(expected)
        for got, (xb, yb) in zip(batches, expected):
            assert torch.equal(got["x"].cpu(), xb) and torch.equal(got["y"].cpu(), yb)
            if mode == "shared":
                assert got["x"].stride(0) == 0, "a shared batch came back copied M times"
    # Dropping models while the workers live: the survivors keep their streams.
    loader.batch_sampler.sampler.keep_models_([2, 0])
    reference.keep_models_([2, 0])
    for got, (xb, _) in zip(loader, reference, strict=True):
        assert torch.equal(got["x"].cpu(), xb)


def test_data_loader_uses_getitems_and_tensor_dataset_tuples() -> None:
    x, y = torch.randn(10, 2), torch.arange(10)
    loader = model_data_loader(TensorDataset(x, y), 2, 4, seed=12)
    for (xb, yb), (xr, yr) in zip(loader, ModelTensorLoader(x, y, num_models=2, batch_size=4, seed=12), strict=True):
        assert torch.equal(xb, xr) and torch.equal(yb, yr)


class Sequences(Dataset):
    """Sample ``i`` is a sequence of ``length`` copies of ``i``: every value names the sample it came from."""

    def __init__(self, num_samples: int, length: int) -> None:
        self.num_samples, self.length = num_samples, length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.length,), float(i))


def _time_major(samples: list) -> torch.Tensor:
    return pad_sequence(samples)  # torch's default: (T, M*B)


BAD_COLLATES = [
    # (id, mode, collate_fn, pattern): M = 3, B = 3, T = 6, so M*B = 9 and the first batch needs (9, *).
    ("time-major", "shuffle", _time_major, r"\(M \* B, \*\) = \(9, \*\).*shape \(6, 9\)"),
    ("time-major-bootstrap", "bootstrap", _time_major, r"\(9, \*\).*shape \(6, 9\)"),
    ("time-major-shared", "shared", _time_major, r"\(B, \*\) = \(3, \*\).*shape \(6, 3\)"),
    ("one-dict-entry", "shuffle", lambda s: {"x": torch.stack(s), "mask": _time_major(s) > 0},
     r"batch\['mask'\].*\(9, \*\).*shape \(6, 9\)"),
    ("0-d", "shuffle", lambda s: (torch.stack(s), torch.tensor(len(s))), r"batch\[1\].*\(9, \*\).*shape \(\)"),
]  # fmt: skip


@pytest.mark.parametrize("row", BAD_COLLATES, ids=[r[0] for r in BAD_COLLATES])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_data_loader_refuses_a_batch_that_is_not_sample_major(row, num_workers: int) -> None:
    """Every tensor of the collated batch must hold the M*B samples first (B in shared mode): a time-major collate
    (pad_sequence's default) would otherwise be folded along time, each model getting every model's samples."""
    _, mode, collate, pattern = row
    loader = model_data_loader(Sequences(12, 6), 3, 3, mode=mode, seed=0, collate_fn=collate, num_workers=num_workers)
    with pytest.raises(ValueError, match=r"model_data_loader: collate_fn returned .*" + pattern):
        next(iter(loader))


@pytest.mark.parametrize("mode", MODES)
def test_data_loader_with_a_sample_major_collate_matches_the_tensor_loader(mode: str) -> None:
    """pad_sequence(batch_first=True): model m's batch holds exactly its own samples, the last smaller batch too."""
    loader = model_data_loader(Sequences(12, 6), 3, 5, mode=mode, seed=0,
                               collate_fn=lambda s: pad_sequence(s, batch_first=True))  # fmt: skip
    reference = ModelTensorLoader(torch.arange(12.0), num_models=3, batch_size=5, mode=mode, seed=0)
    for got, (ids,) in zip(loader, reference, strict=True):
        assert torch.equal(got, ids[..., None].expand(*ids.shape, 6))


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(1, 4),
    num_samples=st.integers(1, 30),
    batch_size=st.integers(1, 12),
    mode=st.sampled_from(MODES),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_streams_property(num_models, num_samples, batch_size, mode, drop_last, seed) -> None:
    if drop_last and num_samples < batch_size:
        with pytest.raises(ValueError, match="every epoch would be empty"):
            ModelBatchSampler(num_models, num_samples, batch_size, mode, drop_last, seed)
        return
    x = torch.randn(num_samples, 2)
    loader = ModelTensorLoader(
        x, num_models=num_models, batch_size=batch_size, mode=mode, drop_last=drop_last, seed=seed
    )
    sampler = ModelBatchSampler(num_models, num_samples, batch_size, mode, drop_last, seed)
    stream = epoch_streams(sampler)
    visited = (num_samples // batch_size) * batch_size if drop_last else num_samples
    assert stream.shape == (num_models, visited)
    for m in range(num_models):
        count = collections.Counter(stream[m].tolist())
        if mode == "bootstrap":
            full = collections.Counter(sampler.bootstrap_indices()[m].tolist())
            assert not count - full, "model visited samples outside its resample"
        else:
            assert max(count.values()) == 1, "a sample visited twice in an epoch without replacement"
        if mode == "shared":
            assert torch.equal(stream[m], stream[0])
    batches = torch.cat([xb for (xb,) in loader], dim=1)
    assert torch.equal(batches, x[stream])


def test_bad_arguments_raise_clearly() -> None:
    with pytest.raises(ValueError, match="mode must be one of .*'bagging'"):
        ModelBatchSampler(2, 10, 3, mode="bagging")
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        ModelBatchSampler(2, 10, 0)
    with pytest.raises(TypeError, match="num_models must be an int, got float"):
        ModelBatchSampler(2.0, 10, 3)
    with pytest.raises(ValueError, match=r"same first \(sample\) dimension, got shapes \(10, 2\), \(9,\)"):
        ModelTensorLoader(torch.zeros(10, 2), torch.zeros(9), num_models=2, batch_size=3)
    with pytest.raises(ValueError, match="every epoch would be empty"):
        ModelTensorLoader(torch.zeros(3), num_models=2, batch_size=4, drop_last=True)
    sampler = ModelBatchSampler(3, 10, 3)
    with pytest.raises(ValueError, match=r"out of range for 3 models"):
        sampler.keep_models_([0, 3])
    with pytest.raises(ValueError, match=r"bool mask of shape \(3,\), got shape \(2,\)"):
        sampler.keep_models_(torch.tensor([True, False]))
    with pytest.raises(ValueError, match="needs mode='bootstrap'"):
        sampler.out_of_bag_mask()
    with pytest.raises(TypeError, match="shuffle cannot be passed"):
        model_data_loader(TensorDataset(torch.zeros(4)), 2, 2, shuffle=True)
