"""Every way a forward can use its batch size ``B = x.size(0)`` other than as the size of the samples: in a
stacked model's batched forward ``B`` is ``M * B``, so each use must give each original model's result or be
refused with batchlayers' message, never a silent wrong result. The sizes are chosen so that ``M * B`` equals
another size or literal of the model (6, or an index that exists in both), where a guess from sizes would err.
Model by model every pattern is exact."""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
from convert_harness import assert_exact_or_refused, rows, seeded
from harness import assert_close
from torch import nn

from batchlayers import verify
from batchlayers.convert import stack

FEATURES = 8


class _Uses(nn.Module):
    """``fc`` gives ``h`` of shape (B, 8); ``table`` and ``scale`` are per-model values; the pattern is one
    expression of ``B`` (6 in the folded batch of M=2, B=3 and M=3, B=2)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, FEATURES)
        self.table = nn.Parameter(torch.randn(FEATURES, FEATURES))
        self.scale = nn.Parameter(torch.randn(FEATURES))

    def forward(self, x):
        B = x.shape[0]
        h = self.fc(x)
        return {**PATTERNS, **NOT_FOLLOWED}[self.pattern](self, x, h, B)


def _write(h, index, value=0.0):
    h = h.clone()
    h[index] = value
    return h


PATTERNS = {
    # comparisons with a plain number that equals M * B
    "B == a feature size": lambda m, x, h, B: h * 2 if B == h[:, :6].shape[1] else h,
    "B != a literal": lambda m, x, h, B: h if B != 6 else h * 2,
    "B >= a literal": lambda m, x, h, B: h * 2 if B >= 6 else h,
    "B <= a literal": lambda m, x, h, B: h * 2 if B <= 5 else h,
    "shape == a tuple": lambda m, x, h, B: h * 2 if x.shape == (6, 4) else h,
    "B == a parameter's size": lambda m, x, h, B: h * 2 if B == m.table[:6].shape[0] else h,
    # B as an index into a dimension that does not hold the samples
    "h[:, B]": lambda m, x, h, B: h[:, B, None] * h,
    "h[..., B]": lambda m, x, h, B: h[..., B, None] * h,
    "h[:, [B]]": lambda m, x, h, B: h[:, [B]] * h,
    "h[:, B // 2]": lambda m, x, h, B: h[:, B // 2, None] * h,
    "h.T[B]": lambda m, x, h, B: h.T[B][:, None] * h,
    "h[:, B] = 0": lambda m, x, h, B: _write(h, (slice(None), B)),
    "h.select(1, B)": lambda m, x, h, B: h.select(1, B)[:, None] * h,
    "h.narrow(1, B, 1)": lambda m, x, h, B: h.narrow(1, B, 1) * h,
    # a per-model value sliced or indexed by B
    "table[:B]": lambda m, x, h, B: h + m.table[:B].sum(0),
    "table[B]": lambda m, x, h, B: h + m.table[B],
    "scale[B]": lambda m, x, h, B: h * m.scale[B],
    "table.narrow(0, 0, B)": lambda m, x, h, B: h + m.table.narrow(0, 0, B).sum(0),
    "table.select(0, B)": lambda m, x, h, B: h + m.table.select(0, B),
    "table.split(B)[0]": lambda m, x, h, B: h + m.table.split(B)[0].sum(0),
    "table[arange(B)]": lambda m, x, h, B: h + m.table[torch.arange(B)].sum(0),
    "table.reshape(-1)[:B]": lambda m, x, h, B: h + m.table.reshape(-1)[:B].sum(),
    # a tensor made from B, reduced to a value
    "scale * arange(B).max()": lambda m, x, h, B: h * (m.scale * torch.arange(B).max()),
    "scale * arange(B)[-1]": lambda m, x, h, B: h * (m.scale * torch.arange(B)[-1]),
    "fc(ones * arange(B).mean())": lambda m, x, h, B: (
        h + m.fc(torch.ones(4, dtype=h.dtype) * torch.arange(B, dtype=h.dtype).mean())
    ),
    "len(arange(B))": lambda m, x, h, B: h / len(torch.arange(B)),
    "arange(B).type_as(h).mean()": lambda m, x, h, B: h * torch.arange(B).type_as(h).mean(),
    "arange(B).to(h).mean()": lambda m, x, h, B: h * torch.arange(B).to(h).mean(),
    "arange(h.numel()).view_as(h).mean()": lambda m, x, h, B: (
        h * torch.arange(h.numel(), dtype=h.dtype).view_as(h).mean()
    ),
    "arange(h.numel()).reshape_as(h).mean()": lambda m, x, h, B: (
        h * torch.arange(h.numel(), dtype=h.dtype).reshape_as(h).mean()
    ),
    # Python's own protocols on B
    "str(B)": lambda m, x, h, B: h * len(str(B * 2)),
    "f-string of B": lambda m, x, h, B: h * float(f"{B}"),
    "B.bit_length()": lambda m, x, h, B: h * B.bit_length(),
    "B.numerator": lambda m, x, h, B: h * B.numerator,
    "B.to_bytes": lambda m, x, h, B: h * B.to_bytes(2, "little")[0],
    "copy.copy(B)": lambda m, x, h, B: h * copy.copy(B),
    "copy.deepcopy(B - 1)": lambda m, x, h, B: h * copy.deepcopy(B - 1),
    "a dict keyed by B": lambda m, x, h, B: h * {1: 0.5, 2: 1.0, 3: 2.0, 6: 3.0}[B],
    "h.unbind(1)[B]": lambda m, x, h, B: h.unbind(1)[B][:, None] * h,
    "h.chunk(8, 1)[B]": lambda m, x, h, B: h.chunk(FEATURES, 1)[B] * h,
    # the size of a tensor whose rows are no model's (sorted, rolled, summed along the samples)
    "h / sort(h, 0).values.shape[0]": lambda m, x, h, B: h / torch.sort(h, 0).values.shape[0],
    "h * h.cumsum(0).numel()": lambda m, x, h, B: h * h.cumsum(0).numel(),
    "h * h.roll(1, 0).size(0)": lambda m, x, h, B: h * h.roll(1, 0).size(0),
    "arange(h.flip(0).shape[0])": lambda m, x, h, B: h * torch.arange(h.flip(0).shape[0], dtype=h.dtype)[:, None],
    "h * (sort(h, 0).values.detach() + 1).relu().shape[0]": lambda m, x, h, B: (
        h * (torch.sort(h, 0).values.detach() + 1).relu().shape[0]
    ),
}


# What Python computes without asking the number (batchlayers._numbers): plain numbers that batchlayers cannot
# follow, so not refused. ``batchlayers.verify`` against the original models finds each.
NOT_FOLLOWED = {
    "%d of B": lambda m, x, h, B: h * float("%d" % B),  # noqa: UP031 (the pattern itself)
    "operator.index(B)": lambda m, x, h, B: h * operator.index(B),
    "math.log(B)": lambda m, x, h, B: h * math.log(B),
    "1.0 / B": lambda m, x, h, B: h * (1.0 / B),
    "0.5 * B": lambda m, x, h, B: h * (0.5 * B),
    "range(B)": lambda m, x, h, B: h * len(range(B)),
    "a list indexed by B": lambda m, x, h, B: h * [float(i) for i in range(FEATURES)][B],
    "torch.Size([B, 2]).numel()": lambda m, x, h, B: h * torch.Size([B, 2]).numel(),
    "torch.LongTensor([B])": lambda m, x, h, B: h * torch.LongTensor([B]).to(h),
    "list(h.T)[B]": lambda m, x, h, B: list(h.T)[B][:, None] * h,
}


def _originals(pattern: str, num_models: int) -> list[nn.Module]:
    return [seeded(lambda: _Uses(pattern), i) for i in range(num_models)]


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2), (2, 1)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_each_use_of_the_batch_size_is_exact_or_refused(pattern: str, num_models: int, batch: int) -> None:
    assert_exact_or_refused(lambda: _Uses(pattern), num_models, rows, batch)


@pytest.mark.parametrize("pattern", [*PATTERNS, *NOT_FOLLOWED])
def test_each_use_of_the_batch_size_is_exact_model_by_model(pattern: str) -> None:
    models = _originals(pattern, 2)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(stack(models, execution="model_by_model")(x), expected, msg=pattern)


class _SortedSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h, torch.sort(h, dim=0).values.shape[0], h.cumsum(0).numel()


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2)], ids=lambda n: str(n))
def test_a_returned_size_of_samples_sorted_along_their_dimension_is_each_models(num_models: int, batch: int) -> None:
    """Sorting (or a cumulative sum) along the samples' dimension makes rows that are no model's, but that
    dimension still counts the samples: its size comes back as each original model's ``B``, not ``M * B``."""
    models = [seeded(_SortedSize, i) for i in range(num_models)]
    x = rows((num_models, batch))
    _, size, numel = stack(models)(x)
    assert (size, numel) == models[0](x[0])[1:] == (batch, batch * 3)


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(NOT_FOLLOWED))
def test_uses_that_cannot_be_followed_are_found_by_verify(pattern: str, num_models: int, batch: int) -> None:
    """A plain number Python computes from ``B`` without asking it (``1.0 / B``, ``range(B)``) is not refused
    in the batched forward: :func:`batchlayers.verify` against the originals reports the models it is wrong
    for, and model by model it is exact (``test_each_use_of_the_batch_size_is_exact_model_by_model``)."""
    models = _originals(pattern, num_models)
    x = torch.randn(num_models, batch, 4, dtype=torch.float64)
    assert not verify(models, stack(models), x).passed.any(), pattern
