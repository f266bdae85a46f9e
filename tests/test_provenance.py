"""The trap suite: code patterns where a tensor's size says nothing about whether it carries the models'
samples. Each must be exact against the N original models, or refused with a clear error: never a silent
wrong result (batchlayers._provenance knows which tensors carry samples instead of guessing from sizes)."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import pickle
import random

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from convert_harness import assert_exact_or_refused, assert_threads_get_their_own, compare_training, rows, seeded
from harness import assert_close
from torch import nn

from batchlayers._numbers import FoldedInt, FoldedSize, FoldedValue, close_call, open_call
from batchlayers.convert import stack


class RelativeBias(nn.Module):
    """A batchless (T, T) relative-position index looked up in an embedding (Swin, T5-style bias)."""

    def __init__(self, seq: int = 6, features: int = 4, read_sizes: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.table = nn.Embedding(2 * seq - 1, 1)
        index = torch.arange(seq)[:, None] - torch.arange(seq)[None, :] + seq - 1
        self.register_buffer("rel_index", index)
        self.read_sizes = read_sizes

    def forward(self, x):
        if self.read_sizes:
            B, T, C = x.shape  # noqa: F841 (the folded batch size now lives in plain ints)
        scores = self.proj(x) @ x.transpose(1, 2)
        bias = self.table(self.rel_index).squeeze(-1)
        return torch.softmax(scores + bias, -1) @ x


class FlatTokens(nn.Module):
    """Tokens flattened to (B*T, C) around the layers, as HF's Conv1D and many MLP blocks do."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 2 * features)
        self.norm = nn.LayerNorm(2 * features)
        self.emb = nn.Embedding(5, 2 * features)

    def forward(self, x):
        B, T, C = x.shape
        ids = (x.detach().reshape(-1, C)[:, 0] > 0).long()  # (B*T,) ids computed from the samples
        h = self.norm(self.fc(x.reshape(-1, C)) + self.emb(ids))
        return h.view(B, T, -1)


class TimeMajor(nn.Module):
    """Layers applied to a time-major (T, B, C) view, the seq2seq / RNN-era layout."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.norm = nn.LayerNorm(features)

    def forward(self, x):
        h = x.transpose(0, 1)  # (T, B, C)
        h = self.norm(self.fc(h) + h)
        return h.transpose(0, 1)


class CausalMask(nn.Module):
    """Attention with a ``(T, T)`` causal mask built in forward from the sizes read (GPT-style)."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.qk = nn.Linear(features, 2 * features)

    def forward(self, x):
        B, T, C = x.shape
        q, k = self.qk(x).split(C, -1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        return (q @ k.transpose(1, 2)).masked_fill(mask, float("-inf")).softmax(-1) @ x


class TransposedPReLU(nn.Module):
    """A single-slope PReLU (elementwise) on the samples transposed to the last dimension."""

    def __init__(self, features: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(4, features)
        self.act = nn.PReLU(init=-0.5)

    def forward(self, x):
        return self.act(self.fc(x).T).T


def _sequences(seq: int):
    return lambda lead: torch.randn(*lead, seq, 4, dtype=torch.float64)


# (factory, input maker, batch): M=2 models throughout, so M*B = 6 equals the sequence length 6 where B=3.
EXACT = {
    "relative-index T == M*B": (RelativeBias, _sequences(6), 3),
    "relative-index T != M*B": (RelativeBias, _sequences(6), 2),
    "flattened tokens": (FlatTokens, _sequences(5), 3),
    "flattened tokens T == M*B": (FlatTokens, _sequences(6), 3),
    "time-major": (TimeMajor, _sequences(5), 3),
    "time-major T == M*B": (TimeMajor, _sequences(6), 3),
    "causal mask T != M*B": (CausalMask, _sequences(5), 3),
    "causal mask T == M*B": (CausalMask, _sequences(6), 3),
    "single-slope PReLU on h.T": (TransposedPReLU, lambda lead: torch.randn(*lead, 4, dtype=torch.float64), 3),
    "GPT length-1 sequence, (T,) positions": (lambda: zoo.GPT(zoo.GPTConfig(position_indices="T")), None, 3),
    "GPT length-1 sequence, (1, T) positions": (lambda: zoo.GPT(zoo.GPTConfig(position_indices="1T")), None, 3),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_exact_where_sizes_coincide(case: str) -> None:
    factory, make_input, batch = EXACT[case]
    kwargs = {}
    if make_input is None:  # the GPTs: one token per sequence
        make_input, kwargs = (lambda lead: torch.randint(0, 11, (*lead, 1))), {"logits": lambda out: out.logits}
    models = [seeded(factory, i) for i in range(2)]
    compare_training(stack(models), [seeded(factory, i) for i in range(2)], make_input, batch=batch, **kwargs)


def _matches_originals(stacked: nn.Module, models: list[nn.Module], *inputs: torch.Tensor, msg: str = "") -> None:
    """``stacked(*inputs)`` equals the original models' outputs on their slices, and so do the parameters'
    gradients of ``.sum().backward()`` (None where the originals' are None)."""
    out = stacked(*inputs)
    expected = torch.stack([m(*(t[i] for t in inputs)) for i, m in enumerate(models)])
    assert_close(out, expected, msg=msg)
    out.sum().backward()
    expected.sum().backward()
    for key, p in stacked.named_parameters():
        grads = [dict(m.named_parameters())[key].grad for m in models]
        assert (p.grad is None) == (grads[0] is None), key
        if p.grad is not None:
            assert_close(p.grad, torch.stack(grads), msg=key)


def _refused(model: nn.Module, x: torch.Tensor, match: str, error: type[Exception] = ValueError) -> None:
    with pytest.raises(error, match=match):
        model(x)
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.parametrize("batch", [3, 2], ids=["T == M*B", "T != M*B"])
def test_batchless_index_after_reading_sizes_is_exact(batch: int) -> None:
    """After ``B, T, C = x.shape``, a (T, T) index buffer is what it is, also where T == M*B: the tracker
    knows that no tensor was made from ``B``, so nothing is guessed from sizes."""
    factory = lambda: RelativeBias(read_sizes=True)  # noqa: E731
    batched = stack([seeded(factory, i) for i in range(2)])
    compare_training(batched, [seeded(factory, i) for i in range(2)], _sequences(6), batch=batch)


class _Pattern(nn.Module):
    """A linear layer around one code pattern of ``forward``, chosen by name."""

    def __init__(self, pattern: str, out_features: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(4, out_features)
        self.pattern = pattern


class _Mixes(_Pattern):
    """Forward code that mixes or loses the models' rows before a layer or at the output."""

    def forward(self, x):
        B = x.size(0)
        if self.pattern == "roll over the batch":
            return self.fc(torch.roll(x, 1, 0))
        if self.pattern == "first sample for everyone":
            return self.fc(x[0].expand_as(x))
        if self.pattern == "per-sample arange":
            return self.fc(x + torch.arange(B, dtype=x.dtype)[:, None])
        if self.pattern == "batch-sized arange output":
            return self.fc(x), torch.arange(B)
        if self.pattern == "gather last token by arange":
            return self.fc(x)[torch.arange(B), 0]
        if self.pattern == "time-major flattened":
            return self.fc(x.unsqueeze(0).transpose(0, 1).reshape(-1, 4))
        if self.pattern == "unknown op":
            return self.fc(torch.special.bessel_j0(x))
        if self.pattern == "Fourier transform over the batch":
            return self.fc(torch.fft.fft(x, dim=0).real)
        if self.pattern == "diff over the batch":
            return self.fc(torch.diff(x, dim=0, append=x.new_zeros(1, 4)))
        if self.pattern == "triangular solve over the batch":
            system = torch.ones(4, 4, dtype=x.dtype).tril()  # the samples as the columns of the right side
            return self.fc(torch.linalg.solve_triangular(system, x.t(), upper=False).t())
        if self.pattern == "diff with a per-sample column prepended":
            return self.fc(torch.diff(x, dim=1, prepend=torch.arange(B, dtype=x.dtype)[:, None]))
        if self.pattern == "a batch-long table looked up by the samples":
            table = torch.linspace(0, 1, B, dtype=x.dtype)[:, None].expand(B, 4)
            return self.fc(x + table.index_select(0, (x[:, 0] > 0).long()))
        if self.pattern == "bucketized by batch-long boundaries":
            return self.fc(x + torch.bucketize(x, torch.linspace(-1, 1, B, dtype=x.dtype)).to(x.dtype))
        if self.pattern == "pad over the batch":
            return self.fc(F.pad(x, (0, 0, 1, 0)))
        if self.pattern == "Fourier transform over every dimension":
            return self.fc(torch.fft.fftn(x).real)
        if self.pattern == "per-sample arange written into samples":
            x = x.clone()
            x[:, 0] = torch.arange(B, dtype=x.dtype)
            return self.fc(x)
        if self.pattern == "rolled rows copied into a view":
            h = self.fc(x)
            h[:, :2].copy_(torch.roll(h, 1, 0)[:, :2].detach())
            return self.fc(h)
        if self.pattern == "per-sample arange copied into a view":
            z = torch.zeros(B, 4, dtype=x.dtype)
            z[:, 0].copy_(torch.arange(B, dtype=x.dtype))
            return self.fc(x + z)
        if self.pattern == "arange out= a view":
            z = torch.zeros(B, 4, dtype=x.dtype)
            torch.arange(B, out=z[:, 0])
            return self.fc(x + z)
        if self.pattern == "msort over the batch":
            return self.fc(torch.msort(x))
        if self.pattern == "gather by per-sample positions":
            return self.fc(x.gather(1, (torch.arange(B)[:, None] % 4).expand(-1, 4)))
        if self.pattern == "scatter of per-sample positions":
            return self.fc(x.scatter(1, torch.zeros(B, 1, dtype=torch.long), torch.arange(B, dtype=x.dtype)[:, None]))
        if self.pattern == "index_add of per-sample positions":
            return self.fc(x.index_add(1, torch.tensor([0]), torch.arange(B, dtype=x.dtype)[:, None]))
        if self.pattern == "gather by an index of another number of rows":  # pairs: 2 rows per sample
            return self.fc(x + x.reshape(-1, 2).gather(1, (x[:, :1] > 0).long()))
        if self.pattern == "scatter by an index built for one model's batch":  # 3 rows: the originals' B
            return self.fc(x + torch.zeros_like(x).scatter_(1, torch.zeros(3, 1, dtype=torch.long), 1.0))
        if self.pattern == "features selected by the samples":
            return self.fc(x + x.index_select(1, (x[:, 0] > 0).long()).sum(-1, keepdim=True))
        if self.pattern == "features added at positions picked by the samples":
            picked = (x[:, 0] > 0).long()  # one position per sample of every model, for every row
            return self.fc(x.index_add(1, picked % 4, torch.ones(B, picked.shape[0], dtype=x.dtype)))
        if self.pattern == "scatter in place over the batch":
            return self.fc(torch.zeros_like(x).scatter_(0, (x > 0).long(), x))
        if self.pattern == "per-sample targets, reduction='none'":
            return F.cross_entropy(self.fc(x), torch.arange(B) % 4, reduction="none")
        if self.pattern == "per-sample targets, mean":
            return F.cross_entropy(self.fc(x), torch.arange(B) % 4)
        if self.pattern == "einsum pairs summed over the samples":
            h = self.fc(x)
            return self.fc(x + torch.einsum("nc,kc->c", h, h)[None])
        if self.pattern == "arange(B) targets written in place":
            targets = torch.arange(B)
            targets //= 2  # each model's [0, 0, 1]; folded [0, 0, 1, 1, 2, 2], no longer counting per model
            return F.cross_entropy(self.fc(x), targets)
        if self.pattern == "pairs of samples along another dimension than the rows":
            h = self.fc(x)
            return self.fc((h[:, None, :] @ h.t()).squeeze(1)[:, :4])
        if self.pattern == "triplet loss of unbatched vectors, reduction='none'":  # each model's B values: one vector
            h = self.fc(x)
            return F.triplet_margin_loss(h[:, 0], h[:, 1], h[:, 2], reduction="none")
        if self.pattern == "shared tensor clamped in place by all models' max":
            floor = torch.zeros(4, dtype=x.dtype).clamp_(min=x.max())
            return self.fc(x + floor)
        raise AssertionError(self.pattern)


REFUSED = {
    "roll over the batch": r"fc.*torch.roll along the dimension that holds the models' samples",
    "first sample for everyone": r"fc.*indexing into the dimension that holds the models' samples",
    "per-sample arange": r"fc.*combines the models' samples with a value that differs along the models",
    "batch-sized arange output": r"output\[1\] is ambiguous.*\(6,\)",
    "unknown op": r"fc.*bessel_j0 \(batchlayers has no rule for it\)",
    "Fourier transform over the batch": r"fc.*torch.fft.fft along the dimension that holds the models' samples",
    "Fourier transform over every dimension": r"fc.*torch.fft.fftn over every dimension",
    "pad over the batch": r"fc.*F.pad over the dimension that holds the models' samples",
    "diff with a per-sample column prepended": r"fc.*torch.diff combines the models' samples with a value that",
    "a batch-long table looked up by the samples": r"fc.*index_select of a shared table as long as the folded batch",
    "bucketized by batch-long boundaries": r"fc.*torch.bucketize by boundaries as long as the folded batch",
    "diff over the batch": r"fc.*torch.diff along the dimension that holds the models' samples",
    "triangular solve over the batch": r"fc.*torch.linalg.solve_triangular over the dimensions of its matrices",
    "per-sample arange written into samples": r"fc.*__setitem__ combines the models' samples with a value that differs",
    "shared tensor clamped in place by all models' max": r"Tensor.clamp_ .*writes per-model values into a tensor all",
    "msort over the batch": r"fc.*torch.msort along the dimension that holds the models' samples",
    "rolled rows copied into a view": r"Tensor.copy_ writes values made by torch.roll .* into part of a tensor",
    "per-sample arange copied into a view": r"Tensor.copy_ writes values that differ along the models into part of",
    "arange out= a view": r"torch.arange writes values made by .* into part of a tensor that holds",
    "gather by per-sample positions": r"fc.*Tensor.gather combines the models' samples with a value that differs",
    "scatter of per-sample positions": r"fc.*Tensor.scatter combines the models' samples with a value that differs",
    "index_add of per-sample positions": r"fc.*Tensor.index_add combines the models' samples with a value that",
    "gather by an index of another number of rows": r"fc.*Tensor.gather of tensors with different numbers of rows",
    "scatter by an index built for one model's batch": r"fc.*Tensor.scatter_ of tensors with different numbers of rows",
    "features selected by the samples": r"fc.*Tensor.index_select by an index computed from the models' samples",
    # (the source is torch.ones(B, B): its second dimension, sized by the folded batch, is refused first)
    "features added at positions picked by the samples": r"fc.*torch.ones given the size 6, .* for dimension 1 of",
    "scatter in place over the batch": r"fc.*Tensor.scatter_ along the dimension that holds the models' samples",
    "per-sample targets, reduction='none'": r"output.*F.cross_entropy of the models' samples with targets that differ",
    "per-sample targets, mean": r"F.cross_entropy.*targets that differ",
    "pairs of samples along another dimension than the rows": r"fc.*matmul combines the models' samples along two",
    "einsum pairs summed over the samples": r"fc.*torch.einsum combines the models' samples along two different",
    "arange(B) targets written in place": r"F.cross_entropy.*targets that differ",
    "triplet loss of unbatched vectors, reduction='none'": r"output.*F.triplet_margin_loss of one unbatched vector",
}


class _Pairs(nn.Module):
    """Scores over pairs of one model's samples (CLIP's ``text @ image.T``, a Gram matrix, per-head pair
    scores): each model pairs its own samples with its own, never with another model's."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)
        self.scale = nn.Parameter(torch.tensor(0.3))
        self.pattern = pattern

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        B = x.size(0)
        if self.pattern == "a @ b.T":
            return a @ b.T * self.scale.exp()
        if self.pattern == "torch.mm(a, b.t()), transposed":
            return (torch.mm(a, b.t()).t() * self.scale).softmax(-1)
        if self.pattern == "Gram matrix":
            h = a + b
            return torch.matmul(h, h.transpose(0, 1)) + self.scale
        if self.pattern == "per head":
            q = a.view(B, 2, 3).transpose(0, 1)  # (heads, B, 3)
            k = b.view(B, 2, 3).permute(1, 2, 0)  # (heads, 3, B)
            return torch.bmm(q * self.scale, k).transpose(0, 1)  # (B, heads, B)
        if self.pattern == "einsum pairs (MoCo's 'nc,kc->nk')":
            heads = torch.einsum("hnc,kc->hnk", a.view(1, B, 6), b)[0] * self.scale
            return torch.einsum("nc,kc->nk", a, b) + heads + torch.einsum("nc,kc->kn", b, a).t()
        if self.pattern == "cdist between the samples":
            return torch.cdist(a, b) * self.scale + torch.cdist(a[None], b[None], p=1.0)[0]
        if self.pattern == "cdist to shared and to per-model prototypes":
            shared = torch.linspace(-1, 1, 12, dtype=a.dtype).view(2, 6)
            return torch.cdist(a, shared) + torch.cdist(self.a.weight.t()[:2] * self.scale, b).t()
        if self.pattern == "pairwise distances by broadcasting":
            return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) * self.scale
        if self.pattern == "pairwise differences, then a shared weight":
            return (b.unsqueeze(0) - a.unsqueeze(1)) * torch.linspace(0, 1, 6, dtype=a.dtype) * self.scale
        if self.pattern == "cosine similarities (linalg norms)":
            a = a / torch.linalg.norm(a, ord=2, dim=-1, keepdim=True)
            b = b / torch.linalg.vector_norm(b, dim=-1, keepdim=True)
            return torch.matmul(a, b.t()) * self.scale.exp()
        if self.pattern == "symmetric contrastive loss, arange(B) targets":
            scores = a @ b.T * self.scale.exp()
            texts = F.cross_entropy(scores, torch.arange(a.size(0)))
            images = F.nll_loss(scores.t().log_softmax(-1), torch.arange(0, scores.shape[1]))
            return (texts + images) / 2
        if self.pattern == "CLIP's loss: logits and logits.T against one arange(B)":
            logits, labels = a @ b.T * self.scale.exp(), torch.arange(B)
            return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        if self.pattern == "contrastive loss per sample":
            return F.cross_entropy(a @ b.T * self.scale, torch.arange(B), reduction="none")
        if self.pattern == "per-model mean of pair scores":
            return (a @ b.T).mean() + (self.scale * a @ b.T).log_softmax(0).mean()
        raise AssertionError(self.pattern)


PAIRS = [
    "a @ b.T",
    "torch.mm(a, b.t()), transposed",
    "Gram matrix",
    "per head",
    "einsum pairs (MoCo's 'nc,kc->nk')",
    "cdist between the samples",
    "cdist to shared and to per-model prototypes",
    "pairwise distances by broadcasting",
    "pairwise differences, then a shared weight",
    "cosine similarities (linalg norms)",
    "symmetric contrastive loss, arange(B) targets",
    "CLIP's loss: logits and logits.T against one arange(B)",
    "contrastive loss per sample",
    "per-model mean of pair scores",
]


@pytest.mark.parametrize("shared", [False, True], ids=["own batches", "shared batch"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B == 1", "B == 3"])
@pytest.mark.parametrize("pattern", PAIRS)
def test_scores_over_pairs_of_samples_are_each_models_own(pattern: str, batch: int, shared: bool) -> None:
    """(M*B, k) @ (k, M*B) would pair every sample with every model's: each model gets its own (B, B)."""
    models = [seeded(lambda: _Pairs(pattern), i) for i in range(3)]
    references = [seeded(lambda: _Pairs(pattern), i) for i in range(3)]
    compare_training(stack(models), references, rows, batch=batch, shared=shared)


class _TextsAndImages(nn.Module):
    """Two inputs with their own numbers of samples, scored pairwise (zero-shot classification: B_t class
    prompts against B_i images)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Linear(4, 6)
        self.image = nn.Linear(5, 6)

    def forward(self, texts, images):
        t, i = self.text(texts), self.image(images)
        scores = F.normalize(i, dim=-1) @ F.normalize(t, dim=-1).t()  # (B_i, B_t)
        return scores.softmax(-1), torch.zeros(texts.size(0), 2) + t[:, :2], torch.ones(images.size(0)) * i[:, 0]


@pytest.mark.parametrize("texts,images", [(3, 5), (4, 2), (2, 4), (1, 3)], ids=str)
def test_inputs_with_different_numbers_of_samples(texts: int, images: int) -> None:
    """M * B_images == B_texts and the other way round included (M = 2): each input folds by its own B."""
    models = [seeded(_TextsAndImages, i).double() for i in range(2)]
    batched = stack([seeded(_TextsAndImages, i).double() for i in range(2)])
    t, i = torch.randn(2, texts, 4, dtype=torch.float64), torch.randn(2, images, 5, dtype=torch.float64)
    outs = batched(t, i)
    refs = [m(t[k], i[k]) for k, m in enumerate(models)]
    for n, out in enumerate(outs):
        assert_close(out, torch.stack([r[n] for r in refs]), msg=f"output {n}")
    sum(o.sum() for o in outs).backward()
    sum(o.sum() for r in refs for o in r).backward()
    for key, p in batched.named_parameters():
        assert_close(p.grad, torch.stack([dict(m.named_parameters())[key].grad for m in models]), msg=key)


GRAD_MODES = [contextlib.nullcontext, torch.no_grad, torch.inference_mode]  # (inference: no version counters)


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("pattern", list(REFUSED))
def test_refused_where_rows_cannot_be_assigned(pattern: str, mode: type) -> None:
    batched = stack([_Mixes(pattern), _Mixes(pattern)])
    with mode():
        _refused(batched, torch.randn(2, 3, 4), REFUSED[pattern])


class _AttentionOverTheBatch(nn.Module):
    """Each sample attends to its model's other samples: ``(B, B)`` scores times ``(B, F)`` values, valid for each
    original model; on the folded batch torch itself rejects ``(M * B, B) @ (M * B, F)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return (h @ h.t()).softmax(-1) @ h


def test_torch_shape_errors_on_the_folded_batch_say_why() -> None:
    """torch's own error for a shape that only the folded batch has keeps its type and message and adds where
    the sizes come from and what runs instead; model by model: exact."""
    models = [seeded(_AttentionOverTheBatch, i) for i in range(2)]
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    match = r"(?s)mat1 and mat2.*batchlayers: in a stacked model's batched forward.*M \* B = 2 \* 3.*model_by_model"
    _refused(stack(models), x, match, RuntimeError)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(stack(models, execution="model_by_model")(x), expected, msg="attention over the batch")


def test_refused_patterns_are_exact_for_one_model() -> None:
    """With M=1 every row is the one model's: nothing to assign, so nothing is refused."""
    for pattern in ("roll over the batch", "first sample for everyone"):
        model = _Mixes(pattern).double()
        x = torch.randn(1, 3, 4, dtype=torch.float64)
        assert_close(stack([model])(x), model(x[0]).unsqueeze(0), msg=pattern)


class _Interrupted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.error: BaseException | None = None

    def forward(self, x):
        h = self.fc1(x)
        if self.error is not None:
            raise self.error
        return self.fc2(h)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")], ids=lambda e: type(e).__name__)
def test_an_interrupted_forward_leaves_nothing_behind(error: BaseException) -> None:
    models = [seeded(_Interrupted, i) for i in range(2)]
    batched = stack(models)
    batched.error = error
    with pytest.raises(type(error)):
        batched(torch.randn(2, 3, 4, dtype=torch.float64))
    batched.error = None
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(xi) for m, xi in zip(models, x)]), msg="output after the interruption")
    assert torch.overrides._get_current_function_mode_stack() == []


def test_threads_each_run_their_own_call() -> None:
    factory = lambda: zoo.GPT(zoo.GPTConfig(position_indices="1T"))  # noqa: E731
    models = [seeded(factory, i) for i in range(2)]
    batched = stack(models)
    inputs = [torch.randint(0, 11, (2, b, 8)) for b in (1, 2, 3, 4)]
    assert_threads_get_their_own(batched, models, inputs, output=lambda out: out.logits)


def test_flat_output_is_split_per_model() -> None:
    """An output flattened to (M*B*out,) is model-major: model i's own flattened output."""
    models = [seeded(lambda: nn.Sequential(nn.Linear(4, 3), nn.Flatten(0)), i) for i in range(2)]
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    out = stack(models)(x)
    assert out.shape == (2, 15)
    assert_close(out, torch.stack([m(xi) for m, xi in zip(models, x)]), msg="flattened output")


class _Reduces(_Pattern):
    """Forward code that reduces over the batch: each model reduces over its own samples."""

    def forward(self, x):
        if self.pattern == "x - x.mean(0)":
            return self.fc(x - x.mean(0))
        if self.pattern == "standardised over the batch":
            return self.fc((x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True))
        if self.pattern == "x - x.max(0).values":
            return self.fc(x - x.max(0).values)
        if self.pattern == "max over the batch, values only":
            values, _ = x.max(0)
            return self.fc(x - values)
        if self.pattern == "x - x.median()":
            return self.fc(x - x.median())
        if self.pattern == "scaled by a soft-target loss":
            return self.fc(x * F.cross_entropy(x, x.detach().softmax(-1)))
        if self.pattern == "batch std and mean added back":
            h = self.fc(x)
            return h + h.std() * h.mean(0)
        raise AssertionError(self.pattern)


REDUCES = ["x - x.mean(0)", "standardised over the batch", "x - x.max(0).values", "max over the batch, values only",
           "x - x.median()", "scaled by a soft-target loss", "batch std and mean added back"]  # fmt: skip


@pytest.mark.parametrize("pattern", REDUCES)
def test_reductions_over_the_samples_are_per_model(pattern: str) -> None:
    """A reduction over the folded batch reduces each model's own samples: ``x.mean(0)``, a loss, a 0-dim
    output are per-model values, ``(M, *)`` at the output."""
    factory = lambda: _Reduces(pattern)  # noqa: E731
    models, references = [seeded(factory, i) for i in range(3)], [seeded(factory, i) for i in range(3)]
    compare_training(stack(models), references, lambda lead: torch.randn(*lead, 4, dtype=torch.float64))


class _InForwardLoss(nn.Module):
    def __init__(self, loss, out_features: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(4, out_features)
        self.loss = loss

    def forward(self, x, y):
        return self.loss(self.fc(x), y)


def _classes(lead, ignored: bool = True) -> torch.Tensor:
    """Class indices for (*lead, T) tokens, with different numbers of ignored (-1) targets per model."""
    y = torch.randint(0, 3, (*lead, 5))
    if ignored and len(lead) > 1:
        y[0, :2] = -1
        y[1, 0, :3] = -1
    return y


_W = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
_reals = lambda lead: torch.randn(*lead, 5, 3, dtype=torch.float64)  # noqa: E731
_probs = lambda lead: torch.rand(*lead, 5, 3, dtype=torch.float64)  # noqa: E731


def _flat_rows(t):  # (..., C) as (N, C), the rows of every leading dimension
    return t.reshape(-1, t.shape[-1])


def _labels(y):  # multi-label targets, one row per row of _flat_rows
    return (_flat_rows(y) > 0).to(y.dtype)


def _signs(y):  # one +1/-1 per row of rows
    return y[..., 0].reshape(-1).sign()


def _hinge(h, y, **kw):
    return F.hinge_embedding_loss(h, y.sign(), margin=0.5, **kw)


def _ranking(h, y, **kw):
    return F.margin_ranking_loss(h[..., 0], h[..., 1], y[..., 0].sign(), **kw)


def _multilabel_soft(h, y, **kw):
    return F.multilabel_soft_margin_loss(_flat_rows(h), _labels(y), _W, **kw)


def _multi_margin(h, y, **kw):
    return F.multi_margin_loss(_flat_rows(h), y.reshape(-1).clamp(min=0), weight=_W, **kw)


def _multilabel_margin(h, y, **kw):
    return F.multilabel_margin_loss(_flat_rows(h), _flat_rows(y.argsort(-1)), **kw)


def _cosine(h, y, **kw):
    return F.cosine_embedding_loss(_flat_rows(h), _flat_rows(y), _signs(y), **kw)


def _triplet(h, y, **kw):
    return F.triplet_margin_loss(_flat_rows(h), _flat_rows(y), _flat_rows(y).flip(-1), swap=True, **kw)


def _tokens_ce(h, y, **kwargs):  # tokens flattened to (N, C) as LMs do, -1 targets ignored
    return F.cross_entropy(h.view(-1, 3), y.view(-1), ignore_index=-1, **kwargs)


# name: (loss(h, y) with h (..., 5, 3) logits, targets for a lead shape)
LOSSES = {
    "cross_entropy ignore_index": (_tokens_ce, _classes),
    "cross_entropy weight": (lambda h, y: _tokens_ce(h, y, weight=_W), _classes),
    "cross_entropy smoothing+weight": (lambda h, y: _tokens_ce(h, y, weight=_W, label_smoothing=0.2), _classes),
    "cross_entropy (N, C, T)": (lambda h, y: F.cross_entropy(h.transpose(1, 2), y, ignore_index=-1), _classes),
    "cross_entropy soft targets": (lambda h, y: F.cross_entropy(h, y.softmax(-1), label_smoothing=0.1), _reals),
    "nll_loss weight": (lambda h, y: F.nll_loss(h.log_softmax(-1).transpose(1, 2), y, _W, ignore_index=-1), _classes),
    "mse_loss": (F.mse_loss, _reals),
    "mse_loss legacy size_average=True": (lambda h, y: F.mse_loss(h, y, size_average=True), _reals),
    "smooth_l1_loss": (lambda h, y: F.smooth_l1_loss(h, y, beta=0.5), _reals),
    "huber_loss": (lambda h, y: F.huber_loss(h, y, delta=0.5), _reals),
    "binary_cross_entropy weight": (lambda h, y: F.binary_cross_entropy(h.sigmoid(), y, weight=_W), _probs),
    "bce_with_logits pos_weight": (lambda h, y: F.binary_cross_entropy_with_logits(h, y, pos_weight=_W), _probs),
    "kl_div batchmean": (lambda h, y: F.kl_div(h.log_softmax(-1), y.softmax(-1), reduction="batchmean"), _reals),
    "soft_margin_loss": (lambda h, y: F.soft_margin_loss(h, y.sign()), _reals),
    "poisson_nll_loss (per model)": (lambda h, y: F.poisson_nll_loss(h, y.abs()), _reals),
    "gaussian_nll_loss (per model)": (lambda h, y: F.gaussian_nll_loss(h, y, torch.ones_like(h)), _reals),
    "hinge_embedding_loss": (_hinge, _reals),
    "margin_ranking_loss": (_ranking, _reals),
    "multilabel_soft_margin_loss": (_multilabel_soft, _reals),
    "multi_margin_loss": (_multi_margin, _classes),
    "multilabel_margin_loss": (_multilabel_margin, _reals),
    "cosine_embedding_loss": (_cosine, _reals),
    "triplet_margin_loss": (_triplet, _reals),
}  # fmt: skip


@pytest.mark.parametrize("shared_target", [False, True], ids=["own-targets", "shared-target"])
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.filterwarnings("ignore:size_average")) if "legacy" in n else n for n in LOSSES],
)
def test_in_forward_losses_are_each_models_own(name: str, shared_target: bool) -> None:
    """A loss computed in forward comes back as ``(M,)``, entry i model i's own loss (ignore_index, class
    weights and the mean over each model's own valid targets included), and ``.sum().backward()`` gives every
    model exactly its own gradient: no scaling."""
    loss, make_target = LOSSES[name]
    factory = lambda: _InForwardLoss(loss)  # noqa: E731
    batched, references = stack([seeded(factory, i) for i in range(3)]), [seeded(factory, i) for i in range(3)]
    x = torch.randn(3, 4, 5, 4, dtype=torch.float64)
    if shared_target:
        y = make_target((4,))
        y = y.expand(3, *y.shape)
    else:
        y = make_target((3, 4))
    out = batched(x, y)
    expected = torch.stack([r(x[i], y[i]) for i, r in enumerate(references)])
    assert out.shape == (3,)
    assert_close(out, expected, msg="losses")
    out.sum().backward()
    expected.sum().backward()
    for key, p in batched.named_parameters():
        assert_close(p.grad, torch.stack([dict(r.named_parameters())[key].grad for r in references]), msg=key)


PER_SAMPLE_LOSSES = [
    "hinge_embedding_loss", "margin_ranking_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss", "cosine_embedding_loss", "triplet_margin_loss",
]  # fmt: skip


@pytest.mark.parametrize("name", PER_SAMPLE_LOSSES)
def test_in_forward_losses_without_reduction_are_each_samples_own(name: str) -> None:
    """``reduction='none'``: one loss per sample (per row), folded back to each model's ``(M, N, *)``."""
    loss, make_target = LOSSES[name]
    factory = lambda: _InForwardLoss(lambda h, y: loss(h, y, reduction="none"))  # noqa: E731
    batched, references = stack([seeded(factory, i) for i in range(3)]), [seeded(factory, i) for i in range(3)]
    x, y = torch.randn(3, 4, 5, 4, dtype=torch.float64), make_target((3, 4))
    assert_close(batched(x, y), torch.stack([r(x[i], y[i]) for i, r in enumerate(references)]), msg=name)


class _Sums(_Pattern):
    """Sums, counts, norms and indices over the folded batch."""

    def forward(self, x, y):
        h = self.fc(x)
        if self.pattern == "sum / x.size(0)":
            return (h - y).pow(2).sum() / x.size(0)
        if self.pattern == "sum / x.numel()":
            return (h - y).pow(2).sum() / h.numel()
        if self.pattern == "masked sum / mask.sum()":
            mask = y > 0
            return ((h - y).pow(2) * mask).sum() / mask.sum()
        if self.pattern == "per-feature sum(0) / (B - 1)":
            return h * (h.sum(0) / (x.shape[0] - 1))
        if self.pattern == "loss with reduction='sum'":
            return F.l1_loss(h, y, reduction="sum")
        if self.pattern == "legacy size_average=False":
            return F.l1_loss(h, y, size_average=False)
        if self.pattern == "cross entropy summed, over a count":
            target = (y > 0).long().sum(1).clamp(max=2)
            return F.cross_entropy(h, target, reduction="sum") / target.count_nonzero()
        if self.pattern == "x / x.norm()":
            return self.fc(x / x.norm())
        if self.pattern == "x / linalg.vector_norm(x)":
            return self.fc(x / torch.linalg.vector_norm(x))
        if self.pattern == "logsumexp and prod over the batch":
            return h - torch.logsumexp(h, 0) + torch.sigmoid(h).prod(0)
        if self.pattern == "count == numel (transformers' fast_all)":
            positive = x[:, 0] > -10
            return h * 2 if positive.sum() == positive.numel() else h
        if self.pattern == "covariance h.T @ h / (B - 1)":
            c = h - h.mean(0)
            return self.fc(x) @ (c.T @ c / (x.size(0) - 1))
        if self.pattern == "cross-correlation torch.mm(h.t(), y) / B":
            return torch.mm(h.t(), y) / x.size(0)
        if self.pattern == "Barlow Twins' loss":
            z1, z2 = (h - h.mean(0)) / h.std(0), (y - y.mean(0)) / y.std(0)
            c = torch.matmul(z1.transpose(0, 1), z2) / x.shape[0]
            return (torch.diagonal(c) - 1).pow(2).sum() + 0.005 * (c - torch.diag(torch.diagonal(c))).pow(2).sum()
        if self.pattern == "einsum's cross-correlation over the batch":
            return torch.einsum("bc,bd->cd", h, y) / x.size(0)
        if self.pattern == "bmm over heads":
            heads = h.T.reshape(1, 3, -1).expand(2, -1, -1)
            return torch.bmm(heads, y.expand(2, -1, -1))
        if self.pattern == "count == a literal equal to M * B":
            return h * 2 if (x[:, 0] > -10).sum() == 6 else h
        if self.pattern == "indices of the batch max":
            return h[h[:, 0].argmax()]
        if self.pattern == "indices from max(dim)":
            return h[h.max(0).indices]
        raise AssertionError(self.pattern)


PER_MODEL_SUMS = [
    "sum / x.size(0)",
    "sum / x.numel()",
    "masked sum / mask.sum()",
    "per-feature sum(0) / (B - 1)",
    "loss with reduction='sum'",
    "legacy size_average=False",
    "cross entropy summed, over a count",
    "x / x.norm()",
    "x / linalg.vector_norm(x)",
    "logsumexp and prod over the batch",
    "count == numel (transformers' fast_all)",
    "count == a literal equal to M * B",
    "covariance h.T @ h / (B - 1)",
    "cross-correlation torch.mm(h.t(), y) / B",
    "Barlow Twins' loss",
    "bmm over heads",
    "einsum's cross-correlation over the batch",
]


@pytest.mark.filterwarnings("ignore:size_average")
@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("pattern", PER_MODEL_SUMS)
def test_sums_over_the_samples_are_each_models_own(pattern: str, batch: int) -> None:
    """A sum, count or norm over the folded batch is each model's own (a per-model value), and so is a matrix
    product that contracts the samples (``h.T @ h``); a size read from the samples that code pairs it with is
    each model's own size: exact against the originals, outputs and gradients. (B = 2 makes M * B = 6, the
    literal, for 3 models.)"""
    models = [seeded(lambda: _Sums(pattern, 3), i) for i in range(3)]
    x, y = torch.randn(3, batch, 4, dtype=torch.float64), torch.randn(3, batch, 3, dtype=torch.float64)
    _matches_originals(stack(models), models, x, y, msg=pattern)


SUMS = {
    "indices of the batch max": r"output .*Tensor.argmax over the models' samples",
    "indices from max(dim)": r"output .*the indices of Tensor.max over the models' samples",
}


@pytest.mark.parametrize("pattern", list(SUMS))
def test_indices_over_the_samples_are_refused(pattern: str) -> None:
    """An index over the folded batch is a position among every model's samples: refused, never read as one
    model's."""
    batched = stack([_Sums(pattern, 3), _Sums(pattern, 3)])
    with pytest.raises(ValueError, match=SUMS[pattern]):
        batched(torch.randn(2, 3, 4), torch.randn(2, 3, 3))
    assert torch.overrides._get_current_function_mode_stack() == []


class _Picked(_Pattern):
    """Rows picked from the samples by a boolean mask, ``h[mask]`` (masked losses, masked means, a head on the
    picked rows)."""

    def __init__(self, pattern: str, out_features: int = 3) -> None:
        super().__init__(pattern, out_features)
        self.norm = nn.LayerNorm(out_features)
        self.bn = nn.BatchNorm1d(out_features)
        self.scale = nn.Parameter(torch.randn(out_features))

    def forward(self, x, y):
        h, m = self.fc(x), y[:, 0] > 0
        t = torch.where(m, (y[:, 1] > 0).long(), -100)
        if self.pattern == "mean of picked rows":
            return h[m].mean()
        if self.pattern == "cross entropy of picked rows, the mask computed twice":
            return F.cross_entropy(h[t != -100], t[t != -100])
        if self.pattern == "mse of picked rows":
            return F.mse_loss(h[m], y[m])
        if self.pattern == "squared error of picked rows, summed per row, averaged":
            return ((h - y)[m] ** 2).sum(-1).mean()
        if self.pattern == "log_softmax then nll of picked rows":
            return F.nll_loss(F.log_softmax(h[m], -1), t[m])
        if self.pattern == "per-row losses summed over the count":
            return F.cross_entropy(h[m], t[m], reduction="none").sum() / m.sum()
        if self.pattern == "picked rows scaled in place":
            v = h[m]
            v *= torch.tensor([1.0, 2.0, 3.0], dtype=v.dtype)
            return v.mean(0)
        if self.pattern == "a mask over two dimensions":
            return h.unsqueeze(1).expand(-1, 2, -1)[y[:, :2] > 0].mean()
        if self.pattern == "sum over picked rows / count":
            return h[m].sum(0) / m.sum()
        if self.pattern == "picked rows written back, doubled":
            g = h.clone()
            g[m] = g[m] * 2
            return g
        if self.pattern == "rows of another tensor written by the same mask":
            g = h.clone()
            g[t != -100] = y[t != -100]
            return g
        if self.pattern == "masked_select's elements, averaged":
            return (h - y).abs().masked_select(y > 0).mean()
        if self.pattern == "masked_select's elements written back":
            g = h.clone()
            g[y > 0] = h.masked_select(y > 0) * 2
            return g
        if self.pattern == "picked rows written back reversed":
            g = h.clone()
            g[m] = g[m].flip(0)
            return g
        if self.pattern == "cumsum over picked rows":
            return h[m].cumsum(0).mean()
        if self.pattern == "a picked row overwritten":
            v = h[m].clone()
            v[0] = 0.0
            return v.mean()
        if self.pattern == "softmax over the picked rows":
            return h[m].softmax(0).mean()
        if self.pattern == "max over picked rows, with indices":
            return h[m].max(0).values
        if self.pattern == "picked rows into a layer":
            return self.fc(x[m]).mean()
        if self.pattern == "a loss of a layer's output on picked rows":
            return F.cross_entropy(self.fc(x[t != -100]), t[t != -100])
        if self.pattern == "picked rows through two layers, summed":
            return self.norm(torch.relu(self.fc(x[m]))).sum(0)
        if self.pattern == "a layer's output on picked rows written back":
            g = h.clone()
            g[m] = self.norm(self.fc(x[m]))
            return g
        if self.pattern == "a layer given picked rows and a shared value":
            return self.norm(self.fc(x[m]) + torch.ones(3, dtype=x.dtype)).mean(0)
        if self.pattern == "picked rows unsqueezed and squeezed into a layer":
            return self.fc(x[m].unsqueeze(1).squeeze(1)).sum(0)
        if self.pattern == "a layer's output on picked rows, reshaped and transposed, in a loss":
            return F.mse_loss(self.fc(x[m]).unsqueeze(-1).transpose(1, 2).reshape(-1, 3), y[m])
        if self.pattern == "a layer's output on picked rows permuted and flattened":
            return F.mse_loss(self.fc(x[m]).unsqueeze(1).permute(0, 2, 1).flatten(1), y[m], reduction="sum")
        if self.pattern == "a layer's output on picked rows squeezed":
            return F.mse_loss(self.fc(x[m])[:, :1].squeeze(-1), y[m].sum(-1))
        if self.pattern == "picked rows flattened together":
            return self.fc(x[m]).view(-1).sum()
        if self.pattern == "picked rows transposed":
            return x[m].T.sum(1)
        if self.pattern == "a parameter times a layer's output on picked rows":
            return (self.scale * self.fc(x[m])).sum(0)
        if self.pattern == "an RMSNorm written in Python on picked rows":
            r = self.fc(x[m])
            return (self.scale * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6))).pow(2).sum(0)
        if self.pattern == "picked rows plus a (1, C) parameter, then a loss":
            return F.mse_loss(self.fc(x[m]) + self.scale.view(1, 3), y[m])
        if self.pattern == "a parameter with a dimension of its own times picked rows":
            return (self.scale.view(3, 1) * self.fc(x[m]).unsqueeze(1)).sum(0)
        if self.pattern == "picked rows normalised and scattered back (higgs_audio_v2)":
            r = h[m]
            r = self.scale * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6))
            g = h.masked_scatter(m.unsqueeze(-1), r)
            g[~m] += self.norm(g[~m])
            return g
        if self.pattern == "picked rows scattered back in place":
            g = h.clone()
            g.masked_scatter_(m.unsqueeze(-1).expand_as(g), self.norm(g[m]))
            return g
        if self.pattern == "rows scattered back by another mask":
            return h.masked_scatter((m & (y[:, 1] > 0)).unsqueeze(-1), self.norm(h[m]))  # (fewer: each its first)
        if self.pattern == "a parameter, picked rows and a constant with rows of its own":
            return torch.addcmul(torch.ones(3, 3, dtype=x.dtype), self.scale, self.fc(x[m])).sum(0)
        if self.pattern == "a per-model value, picked rows and the batch size":
            r = self.fc(x[m])
            return torch.addcmul(r, self.scale, r, value=x.size(0)).sum(0)
        if self.pattern == "picked rows sliced by the batch size":
            return self.fc(x[m])[:, : x.size(0) - 3].sum(0)
        if self.pattern == "picked rows viewed by the batch size":
            return self.fc(x[m]).view(-1, x.size(0)).sum(0)
        if self.pattern == "a layer's output on picked rows over the batch size":
            return (self.fc(x[m]) * (x.size(0) - 1) / x.size(0)).sum(0)
        if self.pattern == "features of picked rows concatenated":
            return F.mse_loss(torch.cat([self.fc(x[m]), y[m]], -1), torch.cat((y[m], h[m].detach()), dim=1))
        if self.pattern == "picked rows stacked with a layer's output on them":
            r = self.fc(x[m])
            return torch.stack([r, self.norm(r)], 1).sum((0, 1))
        if self.pattern == "picked rows concatenated along the rows":
            r = self.fc(x[m])
            return torch.cat([r, r * 2]).sum(0)
        if self.pattern == "picked rows into batch norm":
            return self.bn(h[m]).mean(0)
        if self.pattern == "picked rows and every sample into a layer":
            return self.fc(x[m]).sum() + self.fc(x).sum()
        if self.pattern == "a layer's output on picked rows, mixed":
            return self.fc(x[m]).cumsum(0).mean()
        raise AssertionError(self.pattern)


PICKED = [
    "mean of picked rows",
    "cross entropy of picked rows, the mask computed twice",
    "mse of picked rows",
    "squared error of picked rows, summed per row, averaged",
    "log_softmax then nll of picked rows",
    "per-row losses summed over the count",
    "picked rows scaled in place",
    "a mask over two dimensions",
    "sum over picked rows / count",
    "picked rows written back, doubled",
    "rows of another tensor written by the same mask",
    "masked_select's elements, averaged",
    "masked_select's elements written back",
    "picked rows into a layer",
    "a loss of a layer's output on picked rows",
    "picked rows through two layers, summed",
    "a layer's output on picked rows written back",
    "a layer given picked rows and a shared value",
    "picked rows and every sample into a layer",
    "picked rows unsqueezed and squeezed into a layer",
    "a layer's output on picked rows, reshaped and transposed, in a loss",
    "a layer's output on picked rows squeezed",
    "a layer's output on picked rows permuted and flattened",
    "a parameter times a layer's output on picked rows",
    "an RMSNorm written in Python on picked rows",
    "picked rows plus a (1, C) parameter, then a loss",
    "a parameter with a dimension of its own times picked rows",
    "picked rows normalised and scattered back (higgs_audio_v2)",
    "a layer's output on picked rows over the batch size",
    "features of picked rows concatenated",
    "picked rows stacked with a layer's output on them",
    "a per-model value, picked rows and the batch size",
    "picked rows scattered back in place",
]
PICKED_REFUSED = {
    "picked rows written back reversed": r"output .*writing into part of the models' samples",
    "cumsum over picked rows": "output .*indexing by values computed from the models' samples",
    "a picked row overwritten": "output .*indexing by values computed from the models' samples",
    "softmax over the picked rows": "output .*indexing by values computed from the models' samples",
    "max over picked rows, with indices": r"output .*Tensor.max over rows picked from the models' samples by a mask",
    "picked rows into batch norm": r"'bn': its input holds rows picked .* BatchedBatchNorm1d in training",
    "a layer's output on picked rows, mixed": "output .*indexing by values computed from the models' samples",
    "picked rows flattened together": "output .*indexing by values computed from the models' samples",
    "rows scattered back by another mask": "output .*Tensor.masked_scatter",
    "picked rows concatenated along the rows": "output .*indexing by values computed from the models' samples",
    "a parameter, picked rows and a constant with rows of its own": "addcmul .*per-model value .*indexing by",
    "picked rows sliced by the batch size": r"Tensor.__getitem__ uses the number 12",
    "picked rows transposed": "output .*indexing by values computed from the models' samples",
}


def _picked_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(3, batch, 4, dtype=torch.float64), torch.randn(3, batch, 3, dtype=torch.float64)
    y[:, 0, 0] = 1.0  # every model picks a row or more
    return x, y


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("pattern", PICKED)
def test_reductions_and_losses_of_rows_picked_by_a_mask_are_each_models_own(pattern: str, batch: int) -> None:
    """``h[mask]`` keeps the folded batch's order, each model's rows one block of its own count: a reduction
    over those rows or a loss of them (operands picked by the same mask, or an equal one) is each model's own,
    through elementwise and row-by-row calls. Exact against the originals, gradients included."""
    models = [seeded(lambda: _Picked(pattern, 3), i) for i in range(3)]
    _matches_originals(stack(models), models, *_picked_inputs(batch), msg=pattern)


def test_picked_rows_viewed_by_a_batch_size_that_equals_their_width_are_refused() -> None:
    """``r.view(-1, B)`` of picked rows 3 wide, with ``M * B = 3``: the folded view keeps the rows as they are,
    where each original model (B = 1) makes one row of every element. A size read from the samples given to
    a reshape of picked rows ends what batchlayers follows of them (here the sum over them is refused)."""
    batched = stack([seeded(lambda: _Picked("picked rows viewed by the batch size", 3), i) for i in range(3)])
    with pytest.raises(ValueError, match="output .*indexing by values computed from the models' samples"):
        batched(*_picked_inputs(1))
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.parametrize("pattern", list(PICKED_REFUSED))
def test_rows_picked_by_a_mask_mixed_or_rewritten_are_refused(pattern: str) -> None:
    """Picked rows that a call mixes (along them), that are written into since, that leave as indices, or
    that reach a layer: refused, never split into blocks that no longer are each model's."""
    batched = stack([seeded(lambda: _Picked(pattern, 3), i) for i in range(3)])
    with pytest.raises(ValueError, match=PICKED_REFUSED[pattern]):
        batched(*_picked_inputs(5))
    assert torch.overrides._get_current_function_mode_stack() == []


class _Heads(nn.Module):
    """Layers given rows picked from the samples by a mask: an embedding of picked ids, a convolution and group
    norm of picked images, a fused Linear-ReLU-Linear run, a batch norm (its running statistics in eval mode)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.emb = nn.Embedding(10, 3, padding_idx=0)
        self.conv = nn.Conv2d(1, 2, 2, padding=1)
        self.gn = nn.GroupNorm(1, 2)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.bn = nn.BatchNorm1d(3)
        self.renormed = nn.Embedding(10, 3, max_norm=1.0)
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)
        self.bag = nn.EmbeddingBag(10, 3, mode="sum")

    def forward(self, x):
        m = x[:, 0] > 0
        if self.pattern == "embedding with max_norm of picked ids":
            return self.renormed((x.detach().abs() * 4).long().clamp(max=9)[m]).sum((0, 1))
        if self.pattern == "attention over picked rows":
            h = x[m].unsqueeze(1)
            return self.attn(h, h, h)[0].sum((0, 1))
        if self.pattern == "bags of picked ids":
            return self.bag((x.detach().abs() * 4).long().clamp(max=9)[m]).sum(0)
        if self.pattern == "embedding of picked ids":
            ids = (x.detach().abs() * 4).long().clamp(max=9)
            return (self.emb(ids[m]).sum(1) * x[m].sum(-1, keepdim=True)).sum(0)
        if self.pattern == "convolution and group norm of picked images":
            return self.gn(self.conv(x.view(-1, 1, 2, 2)[m])).sum((0, 2, 3))
        if self.pattern == "fused MLP on picked rows":
            return self.mlp(x[m]).sum(0)
        if self.pattern == "batch norm (eval) of picked rows":
            return self.bn(self.mlp(x[m])).pow(2).sum(0)
        raise AssertionError(self.pattern)


@pytest.mark.parametrize(
    ("pattern", "train"),
    [
        ("embedding of picked ids", True),
        ("embedding of picked ids", False),
        ("convolution and group norm of picked images", True),
        ("convolution and group norm of picked images", False),
        ("fused MLP on picked rows", True),
        ("fused MLP on picked rows", False),
        ("batch norm (eval) of picked rows", False),  # (in training: refused, above)
    ],
)
def test_layers_given_rows_picked_by_a_mask_compute_each_models_own(pattern: str, train: bool) -> None:
    """A batched layer given ``h[mask]`` gets each model's block of rows alone (padded to the widest model's
    count, zeros that change nothing): outputs, input gradients and parameter gradients equal the originals',
    each model picking its own number of rows (none, in one model)."""
    models = [seeded(lambda: _Heads(pattern), i).train(train) for i in range(3)]
    batched = stack(models).train(train)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    x[1, :, 0] = -1.0  # model 1 picks no row
    x[2, :, 0] = 1.0  # model 2 picks every row
    x.requires_grad_(True)
    out = batched(x)
    refs = [m(x[i]) for i, m in enumerate(models)]
    assert_close(out, torch.stack(refs))
    grad_out = torch.randn_like(out)
    (x_grad,) = torch.autograd.grad((out * grad_out).sum(), x, retain_graph=True)
    (ref_grad,) = torch.autograd.grad(sum((r * g).sum() for r, g in zip(refs, grad_out)), x, retain_graph=True)
    assert_close(x_grad, ref_grad)
    (out * grad_out).sum().backward()
    sum((r * g).sum() for r, g in zip(refs, grad_out)).backward()
    for key, p in batched.named_parameters():
        expected = [dict(m.named_parameters())[key].grad for m in models]
        assert (p.grad is None) == (expected[0] is None), key
        if p.grad is not None:
            assert_close(p.grad, torch.stack(expected), msg=key)
    for key, b in batched.named_buffers():
        assert_close(b, torch.stack([dict(m.named_buffers())[key] for m in models]), msg=key)


@pytest.mark.parametrize(
    ("pattern", "match"),
    [
        ("embedding with max_norm of picked ids", "'renormed': .* with max_norm renormalises every table row"),
        ("attention over picked rows", "multi_head_attention_forward .*indexing by values computed from the models"),
        ("bags of picked ids", "'bag': its input holds rows picked .* is not known to compute each row on its own"),
    ],
)
def test_layers_that_mix_or_pad_picked_rows_refuse_them(pattern: str, match: str) -> None:
    """A layer whose padded rows would change something (an embedding renormalising the rows it looks up), or
    that is not known to compute each row alone, refuses rows picked by a mask."""
    batched = stack([seeded(lambda: _Heads(pattern), i) for i in range(3)])
    with pytest.raises(ValueError, match=match):
        batched(torch.randn(3, 5, 4, dtype=torch.float64))
    assert torch.overrides._get_current_function_mode_stack() == []


# Steps of a random program over rows picked by a mask (see _PickedProgram): followed ones, and ones that mix
# the rows (which must be refused, never computed as if each model's).
_ROW_STEPS = {
    "layer": lambda s, h, m, r: s.inner(r),
    "layer norm": lambda s, h, m, r: s.norm(r),
    "gelu": lambda s, h, m, r: F.gelu(r),
    "per-model scale": lambda s, h, m, r: s.scale * r,
    "per-model (1, C) shift": lambda s, h, m, r: r + s.shift.view(1, -1),
    "unsqueeze, squeeze": lambda s, h, m, r: r.unsqueeze(1).squeeze(1),
    "view": lambda s, h, m, r: r.view(-1, 6),
    "permute, flatten": lambda s, h, m, r: r.unsqueeze(-1).permute(0, 2, 1).flatten(1),
    "softmax over features": lambda s, h, m, r: r.softmax(-1),
    "centred by the rows' mean": lambda s, h, m, r: r - r.mean(0, keepdim=True),
    "scattered back, picked again": lambda s, h, m, r: h.masked_scatter(m.unsqueeze(-1), r)[m],
    "written back, picked again": lambda s, h, m, r: _written_back(h, m, r)[m],
    "times its first feature": lambda s, h, m, r: r * r[:, :1],
    "cumsum over rows": lambda s, h, m, r: r.cumsum(0),
    "flipped rows": lambda s, h, m, r: r.flip(0),
    "transposed twice": lambda s, h, m, r: r.T.T,
    "shared rows added": lambda s, h, m, r: r + torch.ones(3, 6, dtype=r.dtype)[:1],
    "divided by the batch size": lambda s, h, m, r: r / h.size(0),
    "per-model scale over the batch size": lambda s, h, m, r: (s.scale / h.size(0)) * r,
    "reshaped by the batch size": lambda s, h, m, r: r.reshape(-1, h.size(0) * 0 + 6),
    "features joined and cut back": lambda s, h, m, r: torch.cat([r, r * 2], -1)[:, 3:9],
}
_ROW_ENDS = {
    "sum over rows": lambda s, m, r, x: r.sum(0),
    "squared error with picked targets": lambda s, m, r, x: F.mse_loss(r[:, :4], x[m], reduction="sum"),
    "cross entropy": lambda s, m, r, x: F.cross_entropy(r, (x[m][:, 1] > 0).long(), reduction="sum").unsqueeze(0),
    "scattered into the samples": lambda s, m, r, x: s.inner(x.new_zeros(x.shape[0], 6).masked_scatter(m[:, None], r)),
}


def _written_back(h: torch.Tensor, m: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    g = h.clone()
    g[m] = r
    return g


class _PickedProgram(nn.Module):
    """``h = fc(x)``, its rows picked by a mask, then steps from :data:`_ROW_STEPS` and an end."""

    def __init__(self, steps: list[str], end: str, threshold: float) -> None:
        super().__init__()
        self.fc, self.inner, self.norm = nn.Linear(4, 6), nn.Linear(6, 6), nn.LayerNorm(6)
        self.scale, self.shift = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))
        self.steps, self.end, self.threshold = steps, end, threshold

    def forward(self, x):
        h = self.fc(x)
        m = x[:, 0] > self.threshold
        r = h[m]
        for step in self.steps:
            r = _ROW_STEPS[step](self, h, m, r)
        return _ROW_ENDS[self.end](self, m, r, x)


def test_random_programs_over_picked_rows_are_exact_or_refused() -> None:
    """Random chains of steps over rows picked by a mask, each model picking its own number of rows (none in
    some; the ends sum, so that no model's empty mean is NaN): the stacked model equals the originals or
    refuses, never a silent wrong result; and the followed steps keep a third of the programs or more exact
    (35 of these 60; 1 before picked rows reached layers and per-model values)."""
    rng = random.Random(0)
    outcomes = []
    for _ in range(60):
        steps = rng.choices(list(_ROW_STEPS), k=rng.randint(1, 4))
        end, threshold = rng.choice(list(_ROW_ENDS)), rng.choice([-0.5, 0.0, 0.8])
        program = functools.partial(_PickedProgram, steps, end, threshold)
        outcomes.append(assert_exact_or_refused(program, 3, rows, batch=rng.choice([1, 4])))
    assert outcomes.count("exact") >= 20, outcomes


class _CTC(nn.Module):
    """A CTC loss in forward, targets concatenated by a mask (wav2vec2's) or padded per sample."""

    def __init__(self, reduction: str, padded: bool) -> None:
        super().__init__()
        self.fc, self.reduction, self.padded = nn.Linear(4, 5), reduction, padded

    def forward(self, x, labels):
        log_probs = self.fc(x).log_softmax(-1).transpose(0, 1)  # (T, B, C)
        input_lengths = torch.full((x.size(0),), x.size(1), dtype=torch.long)
        mask = labels >= 0
        targets = labels.clamp(min=1) if self.padded else labels.masked_select(mask)
        return F.ctc_loss(log_probs, targets, input_lengths, mask.sum(-1), reduction=self.reduction, zero_infinity=True)


@pytest.mark.parametrize("padded", [False, True], ids=["concatenated", "padded"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_loss_in_forward_is_each_models_own(reduction: str, padded: bool) -> None:
    """``F.ctc_loss`` of the folded batch, with each model's targets one block of the concatenated ones (or
    padded rows): each model's own loss ((M,), or (M, B) with 'none'), computed on its own samples."""
    models = [seeded(lambda: _CTC(reduction, padded), i) for i in range(3)]
    x = torch.randn(3, 4, 6, 4, dtype=torch.float64)
    labels = torch.randint(1, 5, (3, 4, 3))
    labels[0, 1, 1:] = -1  # each model its own number of targets
    labels[2, :, 2:] = -1
    _matches_originals(stack(models), models, x, labels, msg=reduction)


class _Escapes(_Pattern):
    """A value computed over every model's samples read into Python (a number, a bool, a list, an array) or
    handed to code batchlayers does not see: one value for all models, where each original reads its own."""

    def forward(self, x):
        h = self.fc(x)
        if self.pattern == "int of a sum of arange(B)":
            return h * int(torch.arange(x.size(0)).sum())
        if self.pattern == "item of arange(B)'s last":
            return h * torch.arange(x.size(0))[-1].item()
        if self.pattern == "if on a mean of arange(B)":
            return h * 2 if torch.arange(x.size(0), dtype=h.dtype).mean() > 0.7 else h
        if self.pattern == "tolist of arange(B)":
            return h * len(torch.arange(x.size(0)).tolist())
        if self.pattern == "count of a mask":
            return h / (h[h > 0].numel() + 1)
        if self.pattern == "nonzero rows":
            return h / ((h > 0).nonzero().shape[0] + 1)
        if self.pattern == "tolist":
            return h - torch.tensor(h.mean(1).tolist(), dtype=h.dtype).mean()
        if self.pattern == "numpy":
            return h - torch.from_numpy(h.detach().numpy().mean(0))
        if self.pattern == "in":
            return h * 2 if 0.5 in (x > 0).to(x.dtype) else h
        if self.pattern == "allclose":
            return h if torch.allclose(x, torch.zeros_like(x)) else h * 2
        if self.pattern == "equal":
            return h if torch.equal(x > 0, x > -1) else h * 2
        if self.pattern == "gradient hook":
            h.register_hook(lambda g: g / g.norm())
            return h
        raise AssertionError(self.pattern)


class _FoldedSizes(_Pattern):
    """The batch size read from the input used as a number: M * B in a batched forward."""

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        # different in every model (as after some training), so stored per model
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("count", torch.rand(()) + 1)
        self.register_buffer("seen", torch.rand(()))

    def forward(self, x):
        h = self.fc(x)
        if self.pattern == "running mean (RL observation normaliser)":
            batch_mean, batch_count = x.detach().mean(0), x.shape[0]
            total = self.count + batch_count
            self.mean += (batch_mean - self.mean) * batch_count / total
            self.count.copy_(total)
            return h - self.mean
        if self.pattern == "samples seen":
            self.seen.add_(x.size(0))
            return h * self.seen
        if self.pattern == "sum / batch size":
            return h / x.size(0)
        if self.pattern == "scaled by 1 / B":
            return h * (1 / x.size(0))
        if self.pattern == "divided by the square root of B":
            return h / x.shape[0] ** 0.5
        if self.pattern == "divided by half the batch":
            return h / (x.size(0) / 2)
        if self.pattern == "divided by len(x)":  # Python makes len() a plain int
            return h / len(x)
        if self.pattern == "divided by float(B)":
            return h / float(x.size(0))
        if self.pattern == "divided by math.sqrt(B)":
            return h / math.sqrt(x.shape[0])
        if self.pattern == "divided by B - 1 (unbiased)":
            return h / (x.size(0) - 1)
        if self.pattern == "scaled by B * 0.5":
            return h * (x.size(0) * 0.5)
        if self.pattern == "scaled by -B":
            return h * -x.shape[0]
        if self.pattern == "divided by int(B)":
            return h / int(x.size(0))
        if self.pattern == "divided by a tensor made from B":
            return h / torch.tensor(x.size(0))
        if self.pattern == "divided by a tensor filled with B":
            return h / torch.full((4,), x.size(0), dtype=h.dtype)
        if self.pattern == "times a constant tensor divided by B":
            return h * (torch.ones(4, dtype=h.dtype) / x.size(0))
        if self.pattern == "clamped at B - 1":
            return h.clamp(max=x.size(0) - 1)
        if self.pattern == "a branch on B - 1":
            return h * 2 if x.size(0) - 1 > 2 else h
        if self.pattern == "a feature dimension padded by B":
            return h + F.pad(h, (0, x.size(0)), value=1.0).sum(-1, keepdim=True)
        if self.pattern == "a feature dimension resampled to B":
            return h + F.interpolate(h.unsqueeze(1), size=x.size(0)).sum(-1)
        if self.pattern == "a literal that equals M * B":  # Swin v2: 16 * sigmoid(bias), here with M * B == 6
            B, C = x.shape
            return h.view(B, C) * (6 * torch.sigmoid(self.mean))
        raise AssertionError(self.pattern)


AS_A_VALUE = (
    r"uses the number -?[\d.]+, (read|computed) from the size of a tensor that holds the models' samples "
    r"\(M \* B = 3 \* 2"
)
# Python turns these into plain numbers that batchlayers cannot follow, so they are refused where read.
AS_A_PLAIN_NUMBER = (
    r"(len|float|int)\(\) of {} gives 6, {} \(M \* B = 3 \* 2( there)?\), as a plain.*own \(2\).*x\.size\(0\)"
)
A_SIZE = ("a size", "read from the size of a tensor that holds the models' samples")
FOLDED_SIZES = {
    "divided by len(x)": AS_A_PLAIN_NUMBER.format("a tensor that holds the models' samples", "every model's samples"),
    "divided by float(B)": AS_A_PLAIN_NUMBER.format(*A_SIZE),
    "divided by math.sqrt(B)": AS_A_PLAIN_NUMBER.format(*A_SIZE),
    "divided by int(B)": AS_A_PLAIN_NUMBER.format(*A_SIZE),
    "divided by a tensor made from B": AS_A_VALUE,
    "divided by a tensor filled with B": AS_A_VALUE,
    "a feature dimension padded by B": AS_A_VALUE,
    "a feature dimension resampled to B": AS_A_VALUE,
    "a branch on B - 1": r"compares 5, computed from the size .* with 2 \(>\): each original model compares its "
    r"own \(1\) and gets False",
}


# what Python computes from B stays marked (batchlayers._numbers), with each model's own value
AS_ELEMENTWISE_VALUES = [
    "running mean (RL observation normaliser)",
    "samples seen",
    "sum / batch size",
    "scaled by 1 / B",
    "divided by the square root of B",
    "divided by half the batch",
    "divided by B - 1 (unbiased)",
    "scaled by B * 0.5",
    "scaled by -B",
    "times a constant tensor divided by B",
    "clamped at B - 1",
]


@pytest.mark.parametrize("pattern", AS_ELEMENTWISE_VALUES)
def test_the_batch_size_as_an_elementwise_value_is_each_models_own(pattern: str) -> None:
    """``x.size(0)`` (and what Python computes from it) given to an elementwise op is each model's own B: every
    element is its original model's, with the samples, per-model buffers (an RL observation normaliser's
    running mean and count) or constants. Exact, buffers included, step after step with changing B."""
    models = [seeded(lambda: _FoldedSizes(pattern), i) for i in range(3)]
    stacked = stack(models)
    for step in range(3):
        x = torch.randn(3, 2 + step, 4, dtype=torch.float64)
        out = stacked(x)
        expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
        assert_close(out, expected, msg=f"{pattern}, step {step}")
        for key, value in stacked.named_buffers():
            assert_close(value, torch.stack([dict(m.named_buffers())[key] for m in models]), msg=key)


@pytest.mark.parametrize("pattern", list(FOLDED_SIZES))
def test_the_folded_batch_size_as_a_value_is_refused(pattern: str) -> None:
    """``x.size(0)`` is ``M * B`` in a batched forward: used as a number it would be M times each model's
    own; refused, naming it. Model by model it is each model's B: exact, buffers included."""
    models = [seeded(lambda: _FoldedSizes(pattern), i) for i in range(3)]
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    _refused(stack(models), x, FOLDED_SIZES[pattern], TypeError if "len(" in pattern else ValueError)
    stacked = stack(models, execution="model_by_model")
    for _ in range(2):
        out = stacked(x)
        expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
        assert_close(out, expected, msg=pattern)
    for key, value in stacked.named_buffers():
        assert_close(value, torch.stack([dict(m.named_buffers())[key] for m in models]), msg=key)


def test_len_of_a_dimension_that_merely_equals_the_folded_size_is_exact() -> None:
    """``len(h)`` of a time-major ``(T, B, C)`` tensor reads T, not the samples: exact, also where T equals
    M * B (6 = 3 * 2 here), the size a ``len()`` of the samples would be refused for."""

    class TimeMajor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):  # x: (B, T, 4)
            h = self.fc(x).transpose(0, 1)
            return (h / len(h)).transpose(0, 1)

    models = [seeded(TimeMajor, i) for i in range(3)]
    x = torch.randn(3, 2, 6, 4, dtype=torch.float64)
    assert_close(stack(models)(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="time-major len")


FROM_SIZE = r"reads into Python a tensor that \(shape .*\) was computed from a size read from the models' samples"
ESCAPES = {
    # values of tensors built from the read batch size alone: M * B's, where each original reads its own B's
    "int of a sum of arange(B)": r"Tensor.__int__ " + FROM_SIZE,
    "item of arange(B)'s last": r"Tensor.item " + FROM_SIZE,
    "if on a mean of arange(B)": r"Tensor.__bool__ " + FROM_SIZE,
    "tolist of arange(B)": r"Tensor.tolist " + FROM_SIZE,
    "count of a mask": r"Tensor.numel.*computed from the models' samples",
    "nonzero rows": r"Tensor.shape.*computed from the models' samples",
    "tolist": r"Tensor.tolist.*holds the models' samples",
    "numpy": r"Tensor.numpy.*holds the models' samples",
    "in": r"Tensor.__contains__.*holds the models' samples",
    "allclose": r"torch.allclose.*holds the models' samples",
    "equal": r"torch.equal.*holds the models' samples",
    "gradient hook": r"Tensor.register_hook.*holds the models' samples.*model_by_model",
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("pattern", list(ESCAPES))
def test_samples_read_into_python_are_refused(pattern: str, batch: int) -> None:
    """Python sees one folded batch: a number, bool, list or array made from it (or a gradient hook, which
    would see every model's gradient) is refused, never one value for every model. Model by model, each
    model reads its own: exact against the originals."""
    models = [seeded(lambda: _Escapes(pattern), i) for i in range(3)]
    x = torch.randn(3, batch, 4, dtype=torch.float64)
    _refused(stack(models), x, ESCAPES[pattern])
    _matches_originals(stack(models, execution="model_by_model"), models, x, msg=pattern)


class _ReadsASum(_Pattern):
    """A sum or count over the samples read into Python (a per-model value); ``read`` keeps what was read."""

    def forward(self, x):
        h = self.fc(x)
        if self.pattern == "item of a sum":
            self.read = int(h.sum(0).argmax().item())
            return h[:, : self.read + 1].sum(1, keepdim=True) * h
        if self.pattern == "if on a sum":
            self.read = bool(h.sum() > 0)
            return h * 2 if self.read else h
        if self.pattern == "int of a count":
            self.read = int((h > 0).sum())
            return h / (self.read + 1)
        if self.pattern == "float of a sum":
            self.read = float(h.detach().abs().sum())
            return h / (self.read + 1)
        raise AssertionError(self.pattern)


@pytest.mark.parametrize("models_differ", [False, True], ids=["same models", "different models"])
@pytest.mark.parametrize("pattern", ["item of a sum", "if on a sum", "int of a count", "float of a sum"])
def test_per_model_sums_read_into_python(pattern: str, models_differ: bool) -> None:
    """A sum over the samples is each model's own: read into Python, it is that number where every original
    model reads the same (exact, gradients included), and refused, naming the call, where they differ."""
    models = [seeded(lambda: _ReadsASum(pattern), i if models_differ else 0) for i in range(3)]
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    if not models_differ:
        x = x[:1].expand_as(x)
    stacked = stack(models)
    with torch.no_grad():
        reads = {(m(x[i]), m.read)[1] for i, m in enumerate(models)}
    if pattern == "float of a sum" and models_differ:
        assert len(reads) > 1  # (so the refusal below is tested)
    if len(reads) > 1:
        _refused(stacked, x, r"inside a stacked forward gives different results for different models")
    else:
        _matches_originals(stacked, models, x, msg=pattern)


def test_a_number_that_merely_equals_the_folded_size_is_exact() -> None:
    """Only sizes read from the samples are refused as values: a literal equal to M * B is a number."""
    models = [seeded(lambda: _FoldedSizes("a literal that equals M * B"), i) for i in range(3)]
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    compare = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(stack(models)(x), compare, msg="literal")


@pytest.mark.parametrize("pattern", [*ESCAPES, *FOLDED_SIZES])
def test_reading_into_python_is_exact_for_one_model(pattern: str) -> None:
    """With M=1 the folded batch is the one model's: whatever Python reads from it is its own."""
    factory = (lambda: _FoldedSizes(pattern)) if pattern in FOLDED_SIZES else (lambda: _Escapes(pattern))
    model = seeded(factory, 0).double()
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    assert_close(stack([seeded(factory, 0)])(x), model(x[0])[None], msg=pattern)


def test_per_model_values_read_into_python_stay_allowed() -> None:
    """A per-model value (a mean over the samples, each model's own) read into Python is allowed where every
    model reads the same (here: whether anything is NaN), as before; so is a count of a mask compared with
    the mask's size, which is each model's ``mask.all()`` (transformers' ``fast_all``)."""

    class NanGuard(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            if torch.isnan(h).any():
                raise FloatingPointError("nan")
            finite = torch.isfinite(h)
            if finite.sum() == finite.numel():  # transformers' fast_all(mask): mask.all()
                return h
            return h * 2

    models = [seeded(NanGuard, i) for i in range(2)]
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert_close(stack(models)(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))


class _Sizes(_Pattern):
    """Sizes read from the samples, computed with in Python, then used to shape a tensor or to decide."""

    def forward(self, x):  # x: (B, T, 4)
        h = self.fc(x)
        B, T, C = h.shape
        p = self.pattern
        # exact: sizes that count the samples, however they are computed
        if p == "B * T rows":
            return self.fc(h.reshape(B * T, C)).view(B, T, C)
        if p == "product of the leading sizes":
            return self.fc(h.reshape(math.prod(h.shape[:2]), -1)).view(h.shape)
        if p == "pairs of samples, B // 2":
            return h.view(B // 2, 2, T, C).flip(1).reshape(B, T, C)
        if p == "pairs of samples, -1":
            return h.view(-1, 2, T, C).flip(1).reshape(B, T, C)
        if p == "unflatten by B":
            return self.fc(h.flatten(0, 1)).unflatten(0, (B, T))
        if p == "sizes of another tensor of samples":
            return self.fc(h.reshape(x.size(0) * x.size(1), C)).view(x.shape[0], -1, C)
        if p == "a comparison every model answers alike":
            return h * 2 if B > 0 and B != x.size(1) * 100 else h
        # refused: a number used where each original model has its own
        if p == "halves of the batch, a literal 2":
            return h.view(2, -1).softmax(-1).view(B, T, C)
        if p == "a hard-coded batch size":
            return h.reshape(4, -1).softmax(-1).view(B, T, C)
        if p == "unflatten into halves, a literal 2":
            return h.flatten(0, 1).unflatten(0, (2, -1)).softmax(1).reshape(B, T, C)
        if p == "branch on the batch size":
            return h * 2 if B > 4 else h
        if p == "at most 4":
            return h * min(B, 4)
        if p == "a batch of one":
            return h.squeeze(0).unsqueeze(0) * 2 if B == 1 else h
        raise AssertionError(self.pattern)


SIZES_EXACT = [
    "B * T rows",
    "product of the leading sizes",
    "pairs of samples, B // 2",
    "pairs of samples, -1",
    "unflatten by B",
    "sizes of another tensor of samples",
    "a comparison every model answers alike",
]
# pattern: (batch, what the error names); M = 2 models
SIZES_REFUSED = {
    "halves of the batch, a literal 2": (
        4,
        r"Tensor.view with the shape \(2, -1\), whose size 2 .*not a size read from them",
    ),
    "a hard-coded batch size": (
        4,
        r"Tensor.reshape with the shape \(4, -1\), whose size 4 .*not a size read from them",
    ),
    "unflatten into halves, a literal 2": (4, r"Tensor.unflatten with the sizes \(2, -1\), whose size 2"),
    "branch on the batch size": (
        3,
        r"compares 6, read from the size .* \(M \* B = 2 \* 3\), with 4 \(>\): "
        r"each original model compares its own \(3\) and gets False",
    ),
    "at most 4": (3, r"compares 6, read from the size"),
    "a batch of one": (1, r"compares 2, read from the size .* with 1"),
}


@pytest.mark.parametrize("num_models", [2, 3])
@pytest.mark.parametrize("pattern", SIZES_EXACT)
def test_sizes_computed_from_the_samples_are_exact(pattern: str, num_models: int) -> None:
    """``B * T``, ``B // 2``, ``math.prod(x.shape[:2])`` count the samples as ``B`` does: reshapes by them
    and comparisons that every model answers alike are exact against the originals, gradients included."""
    models = [seeded(lambda: _Sizes(pattern), i) for i in range(num_models)]
    compare_training(stack(models), [seeded(lambda: _Sizes(pattern), i) for i in range(num_models)],
                     lambda lead: torch.randn(*lead, 3, 4, dtype=torch.float64), batch=4)  # fmt: skip


@pytest.mark.parametrize("pattern", list(SIZES_REFUSED))
def test_numbers_that_count_one_models_samples_are_refused(pattern: str) -> None:
    """A literal where the models' samples go in a reshape (``h.view(2, -1)`` to split each batch in halves:
    with M = 2 it would split the models instead), or a comparison of a read size whose answer differs from
    each original's (``if B > 4`` with M * B = 6, B = 3): refused, never one model's number read as all
    models'. Model by model each model reads its own: exact, and with one model nothing is refused."""
    batch, match = SIZES_REFUSED[pattern]
    models = [seeded(lambda: _Sizes(pattern), i) for i in range(2)]
    x = torch.randn(2, batch, 3, 4, dtype=torch.float64)
    _refused(stack(models), x, match)
    for stacked, used in ((stack(models, execution="model_by_model"), models), (stack(models[:1]), models[:1])):
        expected = torch.stack([m(x[i]) for i, m in enumerate(used)])
        assert_close(stacked(x[: len(used)]), expected, msg=pattern)


class _SecondBatchSized(_Pattern):
    """``B = x.size(0)`` as the size of a dimension that does not hold the samples: a ``(B, B)`` constant, a
    broadcast or repeat of the samples along a new dimension of size ``B``. Each original model's is ``B`` wide;
    in the folded forward it would be ``M * B`` wide."""

    def forward(self, x):  # x: (B, 4)
        h = self.fc(x)
        B, p, dt = x.size(0), self.pattern, h.dtype
        if p == "ones(B, B) summed along its second dimension":
            return torch.ones(B, B, dtype=dt).sum(1, keepdim=True) * h
        if p == "zeros(B, B) softmax along its second dimension":
            return torch.zeros(B, B, dtype=dt).softmax(1)[:, :1] * h
        if p == "the width of ones(B, B) as a number":
            return h * torch.ones(B, B).shape[1]
        if p == "new_ones(B, B) cumulative sum":
            return h.new_ones(B, B).cumsum(1)[:, -1:] * h
        if p == "ones(B, F, B) summed along its last dimension":
            return torch.ones(B, 4, B, dtype=dt).sum(-1) * h
        if p == "expand (1, B, F) to (B, B, F), summed":
            return h.unsqueeze(0).expand(B, -1, -1).sum(0)
        if p == "expand (B, F, 1) to (B, F, B), summed":
            return h.view(B, 4, 1).expand(-1, -1, B).sum(-1)
        if p == "expand (B, 1, F) to (B, B, F), summed":
            return h.unsqueeze(1).expand(-1, B, -1).sum(1)
        if p == "expand (B, F) to (B, B, F), summed":
            return h.expand(B, B, 4).sum(0)
        if p == "broadcast with a (B, B, 1) constant, summed":
            return (h[:, None] * torch.ones(B, B, 1, dtype=dt)).sum(1)
        if p == "zeros(B, F, B) plus the samples, summed":
            return (torch.zeros(B, 4, B, dtype=dt) + h[..., None]).sum(-1)
        if p == "repeat (B, 1, F) B times along a new dimension":
            return h.unsqueeze(1).repeat(1, B, 1).sum(1)
        if p == "repeat (1, B, F) B times":
            return h.unsqueeze(0).repeat(B, 1, 1).sum(0)
        if p == "scores over pairs plus zeros(B, B)":
            return (h @ h.t() + torch.zeros(B, B, dtype=dt)).sum(1, keepdim=True) * h
        if p == "scores over pairs masked by eye(B)":
            return (h @ h.t()).masked_fill(torch.eye(B, dtype=torch.bool), 0).sum(1, keepdim=True) * h
        if p == "features sliced by B":
            return h.repeat(1, 3)[:, :B].sum(1, keepdim=True) * h
        if p == "features narrowed by B":
            return h.repeat(1, 3).narrow(1, 0, B).sum(1, keepdim=True) * h
        if p == "features split by B":
            return torch.split(h.repeat(1, 3), B, dim=1)[0].sum(1, keepdim=True) * h
        if p == "features picked by arange(B) % F":
            return h[:, torch.arange(B) % 4]
        if p == "features selected by arange(B) % F":
            return h.index_select(1, torch.arange(B) % 4)
        if p == "arange(B) broadcast to (B, B)":
            return torch.arange(B).expand(B, -1).to(dt).sum(1, keepdim=True) * h
        if p == "arange(B) as a row, repeated B times":
            return torch.arange(B).unsqueeze(0).repeat(B, 1).to(dt).sum(1, keepdim=True) * h
        if p == "features repeated B times each":
            return h.repeat_interleave(B, dim=1).sum(1, keepdim=True) * h
        if p == "samples repeated B times each":
            return h.repeat_interleave(B, dim=0)[:B]
        if p == "windows of B features":
            return h.repeat(1, 3).unfold(1, B, 1).sum(-1).sum(1, keepdim=True) * h
        if p == "randint(1, 2, (B, B)) summed":
            return torch.randint(1, 2, (B, B)).to(dt).sum(1, keepdim=True) * h
        if p == "normal(0, 0, (B, B)) summed":
            return (torch.normal(0.0, 0.0, (B, B)) + 1).to(dt).sum(1, keepdim=True) * h
        if p == "linspace(0, 1, B) summed, as a factor":
            return h * torch.linspace(0, 1, B, dtype=dt).sum()
        if p == "the mean of arange(B) as a factor":
            return h * torch.arange(B, dtype=dt).mean()
        if p == "the number of elements of arange(B)":
            return h * torch.arange(B).numel()
        if p == "features written by a slice of B":
            g = h * 1
            g[:, :B] = 0
            return g
        if p == "features written at arange(B) % F":
            g = h * 1
            g[:, torch.arange(B) % 4] = 0
            return g
        if p == "new_zeros(F, B) plus the samples transposed":  # exact: the samples are where B was given
            return (h.new_zeros(4, B) + h.t()).t() * 2
        raise AssertionError(p)


_GIVEN_B = r"given the size \d+, read from the size of a tensor that holds the models' samples"
_SLICED_BY_B = r"of dimension 1, which does not hold the models' samples, by a size read from them"
_INDEX_AS_LONG = r"of dimension 1, which does not hold the models' samples, by an index of shape \(\d+,\), as long as"
_MOVED = r"a tensor of shape \(\d+,\), as long as the folded batch \(M \* B\) on dimension 0, broadcast or repeated"
_COUNTED_BY_B = r"by a size read from the models' samples \(M \* B, where each original model reads its own B\)"
_VALUES_FROM_B = r"values computed from a size read from the models' samples alone \(torch.arange\(B\)"
SECOND_BATCH_SIZED = {
    "ones(B, B) summed along its second dimension": _GIVEN_B,
    "zeros(B, B) softmax along its second dimension": _GIVEN_B,
    "the width of ones(B, B) as a number": _GIVEN_B,
    "new_ones(B, B) cumulative sum": _GIVEN_B,
    "ones(B, F, B) summed along its last dimension": _GIVEN_B,
    "expand (1, B, F) to (B, B, F), summed": _GIVEN_B,
    "expand (B, F, 1) to (B, F, B), summed": _GIVEN_B,
    "expand (B, 1, F) to (B, B, F), summed": _GIVEN_B,
    "expand (B, F) to (B, B, F), summed": _GIVEN_B,
    "broadcast with a (B, B, 1) constant, summed": _GIVEN_B,
    "zeros(B, F, B) plus the samples, summed": _GIVEN_B,
    "repeat (B, 1, F) B times along a new dimension": _GIVEN_B,
    "repeat (1, B, F) B times": _GIVEN_B,
    "scores over pairs plus zeros(B, B)": _GIVEN_B,
    "scores over pairs masked by eye(B)": _GIVEN_B,
    "features sliced by B": "Tensor.__getitem__ " + _SLICED_BY_B,
    "features narrowed by B": "Tensor.narrow " + _SLICED_BY_B,
    "features split by B": "torch.split " + _SLICED_BY_B,
    "features picked by arange(B) % F": "Tensor.__getitem__ " + _INDEX_AS_LONG,
    "features selected by arange(B) % F": "Tensor.index_select " + _INDEX_AS_LONG,
    "arange(B) broadcast to (B, B)": _MOVED,
    "features repeated B times each": "Tensor.repeat_interleave " + _COUNTED_BY_B,
    "samples repeated B times each": "Tensor.repeat_interleave " + _COUNTED_BY_B,
    "windows of B features": "Tensor.unfold " + _COUNTED_BY_B,
    "randint(1, 2, (B, B)) summed": _GIVEN_B,
    "normal(0, 0, (B, B)) summed": _GIVEN_B,
    "linspace(0, 1, B) summed, as a factor": _VALUES_FROM_B,
    "the mean of arange(B) as a factor": _VALUES_FROM_B,
    "features written by a slice of B": "Tensor.__setitem__ " + _SLICED_BY_B,
    "features written at arange(B) % F": "Tensor.__setitem__ " + _INDEX_AS_LONG,
    "arange(B) as a row, repeated B times": r"a tensor of shape \(1, \d+\), as long as the folded batch \(M \* B\) on "
    "dimension 1, broadcast or repeated",
}


@pytest.mark.parametrize("num_models,batch", [(2, 1), (2, 3), (3, 2)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(SECOND_BATCH_SIZED))
def test_the_batch_size_on_another_dimension_is_refused(pattern: str, num_models: int, batch: int) -> None:
    """A dimension sized by ``B`` that does not hold the samples would be ``M * B`` wide in the folded forward
    (a count or sum along it ``M`` times each original's, shapes that merely broadcast at ``B = 1``), and so
    would one sliced by ``B`` or indexed by ``torch.arange(B)``: refused, naming the call and the dimension,
    never a silent wrong result. Model by model: exact."""
    models = [seeded(lambda: _SecondBatchSized(pattern), i) for i in range(num_models)]
    x = torch.randn(num_models, batch, 4, dtype=torch.float64)
    _refused(stack(models), x, SECOND_BATCH_SIZED[pattern])
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(stack(models, execution="model_by_model")(x), expected, msg=pattern)


@pytest.mark.parametrize("num_models,batch", [(2, 1), (2, 2), (3, 2)], ids=lambda n: str(n))
@pytest.mark.parametrize(
    "pattern", ["new_zeros(F, B) plus the samples transposed", "the number of elements of arange(B)"]
)
def test_the_samples_are_where_the_batch_size_was_given(pattern: str, num_models: int, batch: int) -> None:
    """``h.new_zeros(F, B)``: the samples on the dimension given ``B``, also where ``F`` equals ``M * B`` (4 = 2 * 2),
    which a guess from the sizes would take for them; ``torch.arange(B).numel()``, a size read back, each model's
    own ``B`` as a factor: exact, gradients included."""
    compare_training(stack([seeded(lambda: _SecondBatchSized(pattern), i) for i in range(num_models)]),
                     [seeded(lambda: _SecondBatchSized(pattern), i) for i in range(num_models)],
                     lambda lead: torch.randn(*lead, 4, dtype=torch.float64), batch=batch)  # fmt: skip


def test_folded_sizes_copy_and_pickle_as_plain_ints() -> None:
    """A size kept past the call (``self.last = x.size(0)``) copies and pickles as the number it is."""
    size = FoldedSize(12, 2)  # M * B = 2 * 6
    for copied in (copy.deepcopy(size), pickle.loads(pickle.dumps(size))):
        assert type(copied) is int and copied == 12
    assert tuple(v.folded() for v in (size * 3, size // 2, size + size)) == (36, 6, 24)
    assert all(isinstance(v, FoldedSize) for v in (size * 3, 3 * size, size // 2, size + size))
    assert not any(isinstance(v, FoldedSize) for v in (size // 4, size + 1, size * size, size * True))
    for number in (size - 1, size * 0.5, -size, 1 / size):
        for copied in (copy.deepcopy(number), pickle.loads(pickle.dumps(number))):
            assert type(copied) in (int, float) and copied == number.folded()


def test_numbers_the_same_in_every_model_are_exact() -> None:
    """A number computed from read sizes that every original model computes alike (the elements per sample,
    ``x.numel() / x.size(0)``) is each model's own: used as a value it is allowed, and exact."""

    class PerSample(_Pattern):
        def forward(self, x):  # x: (B, T, 4)
            h = self.fc(x)
            return h / (x.numel() / x.size(0)) + torch.full((4,), x.size(1) * 1.0, dtype=h.dtype)

    models = [seeded(lambda: PerSample("elements per sample"), i) for i in range(3)]
    x = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    assert_close(stack(models)(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))


@pytest.mark.parametrize("pattern", ["T / (T - 1)", "B % 4"])
def test_numbers_that_merely_equal_the_folded_size_are_exact(pattern: str) -> None:
    """Sizes that coincide: a sequence length ``T`` equal to ``M * B`` (6 = 3 * 2) read from its own dimension
    is each model's ``T``, used as a value (``T / (T - 1)``): exact. ``B % 4`` is 2 both folded (6 % 4) and in
    each model (2 % 4): the same number in every model, exact, not refused."""

    class Scaled(_Pattern):
        def forward(self, x):  # x: (B, T, 4)
            h = self.fc(x)
            T = x.size(1)
            return h * (T / (T - 1)) if self.pattern.startswith("T") else h * (x.size(0) % 4)

    models = [seeded(lambda: Scaled(pattern), i) for i in range(3)]
    x = torch.randn(3, 2, 6, 4, dtype=torch.float64)
    assert_close(stack(models)(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=pattern)


# What Python computes from a size read from the samples, written as each original model would: computed on
# M * B = 12 (M = 2), the result carries both that value and the one each model computes from its own B = 6.
COMPUTED = {
    "B - 1": lambda b: b - 1,
    "1 - B": lambda b: 1 - b,
    "B + 1": lambda b: b + 1,
    "2 + B": lambda b: 2 + b,
    "-B": lambda b: -b,
    "B * 0.5": lambda b: b * 0.5,
    "B * B": lambda b: b * b,
    "B / 4": lambda b: b / 4,
    "3 / B": lambda b: 3 / b,
    "B ** 2": lambda b: b**2,
    "B ** -0.5": lambda b: b**-0.5,
    "2 ** B": lambda b: 2**b,
    "B % 5": lambda b: b % 5,
    "7 % B": lambda b: 7 % b,
    "B // 5": lambda b: b // 5,
    "30 // B": lambda b: 30 // b,
    "divmod(B, 5)": lambda b: divmod(b, 5)[1],
    "round(B / 5)": lambda b: round(b / 5),
    "round(B / 5, 1)": lambda b: round(b / 5, 1),
    "abs(1 - B)": lambda b: abs(1 - b),
    "math.floor(B / 5)": lambda b: math.floor(b / 5),
    "math.ceil(B / 5)": lambda b: math.ceil(b / 5),
    "math.trunc(-B / 5)": lambda b: math.trunc(-b / 5),
    "(B - 1) * 3 - B": lambda b: (b - 1) * 3 - b,
    "(B - 1) / 2": lambda b: (b - 1) / 2,
    "B << 1, B >> 1, B & 3, B | 1, B ^ 1": lambda b: (b << 1) + (b >> 1) + (b & 3) + (b | 1) + (b ^ 1),
    "sum([B, B - 1])": lambda b: sum([b, b - 1]),
    "max(B - 1, 2)": lambda b: max(b - 1, 2),
}


@pytest.mark.parametrize("expression", list(COMPUTED))
def test_numbers_computed_from_a_read_size_carry_each_models_value(expression: str) -> None:
    """Python's own arithmetic on the folded size (12) and on each model's (6) is the reference: the result
    holds both, so the tracker can tell a number that differs per model wherever it goes."""
    compute = COMPUTED[expression]
    out = compute(FoldedSize(12, 2))
    assert isinstance(out, (FoldedInt, FoldedValue)), type(out)
    assert type(out.folded()) is type(compute(12)) and out.folded() == compute(12)
    assert type(out.own) is type(compute(6)) and out.own == compute(6)


@pytest.mark.parametrize(
    ("how", "refused"),
    [("int", int), ("float", float), ("math.sqrt", math.sqrt), ("comparison", lambda n: n > 8)],
)
def test_numbers_that_differ_are_not_made_plain(how: str, refused) -> None:
    """``int()``, ``float()`` (``math.sqrt`` of an int calls it; of a float it reads the float itself) and a
    comparison whose answer differs from each model's would make a number that differs per model plain:
    refused. Where every model has the same value they are allowed and plain; so are all of them once the
    stacked call that read them has ended (kept in a cache, returned)."""
    call = open_call()  # (what a stacked call does when it begins)
    numbers = [FoldedSize(12, 2), FoldedSize(12, 2) - 1]
    numbers = numbers if how == "math.sqrt" else [*numbers, FoldedSize(12, 2) * 0.75]
    for number in numbers:
        with pytest.raises(ValueError, match="(plain Python number|compares)"):
            refused(number)
    same = FoldedSize(12, 2) / FoldedSize(6, 2)  # a ratio of two sizes: 2 in every model
    assert refused(same) == refused(2.0)
    close_call(call)
    for number in numbers:
        assert refused(number) == refused(number.folded())


class _LayoutAlias(nn.Module):
    """``reshape``/``flatten``/``contiguous`` of a convolution's output: a view in the original (torch.nn's
    layout), a copy in a stacked model that keeps it channels-last (and the reverse after a permute). A write
    in place afterwards reaches the other tensor in one and not in the other."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)
        self.pattern = pattern

    def forward(self, x):
        y = self.conv(x)
        if self.pattern.startswith("flatten"):
            z = y.flatten(1)
        elif self.pattern.startswith("contiguous"):
            z = y.contiguous().reshape(y.size(0), -1)
        else:  # "permute, reshape": a copy in the original
            z = y.permute(0, 2, 3, 1).reshape(y.size(0), -1)
        if self.pattern.endswith("then in place"):
            y.relu_()
        elif self.pattern.endswith("then nn.ReLU(inplace=True)"):  # (F.relu(y, inplace=True): the tracker sees F.relu)
            nn.ReLU(inplace=True)(y)
        return self.fc(z)


LAYOUT_ALIASES = ["flatten", "contiguous", "permute, reshape"]


@pytest.mark.parametrize("write", ["in place", "nn.ReLU(inplace=True)"])
@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
@pytest.mark.parametrize("pattern", LAYOUT_ALIASES)
def test_writes_after_a_reshape_whose_aliasing_differs_are_refused(
    pattern: str, execution: str, mode: type, write: str
) -> None:
    """Without a write the reshape is exact; a write in place to its source afterwards is refused, since it
    would reach the reshaped tensor in one of the two layouts only (a silent difference otherwise)."""
    x = torch.randn(2, 3, 3, 5, 5, dtype=torch.float64)
    models = [seeded(lambda: _LayoutAlias(pattern), i) for i in range(2)]
    with mode():
        out = stack(models, execution=execution)(x)
        assert_close(out, torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=pattern)
    written = [seeded(lambda: _LayoutAlias(f"{pattern}, then {write}"), i) for i in range(2)]
    with pytest.raises(RuntimeError, match=r"written in place after .*(copy|alias) in the stacked model"), mode():
        stack(written, execution=execution)(x)
    assert torch.overrides._get_current_function_mode_stack() == []


class _WritesAConvOutput(nn.Module):
    """In-place writes into a convolution's output, no reshape between: exact. Under inference mode the
    copy/alias check records storages by address; a freed copy's address given to the output must not count."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        h = self.conv(x)
        h[:, :2] = h[:, 2:]
        h.detach()[:, 3].zero_()
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("mode", GRAD_MODES[1:])  # (with gradients autograd refuses the write itself)
@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
def test_writes_into_a_conv_output_without_a_reshape_are_exact(execution: str, mode: type) -> None:
    x = torch.randn(2, 3, 3, 5, 5, dtype=torch.float64)
    models = [seeded(_WritesAConvOutput, i) for i in range(2)]
    with mode():
        out = stack(models, execution=execution)(x)
        assert_close(out, torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=execution)


class _VectorTimesBatch(nn.Module):
    """``w @ y`` with a ``(T,)`` weight vector and ``(B, T, C)`` samples: ``(B, C)``, the samples staying on
    the first dimension (``C == M * B`` and ``B == M`` make every other reading the same shape)."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, channels)
        self.head = nn.Linear(channels, out)

    def forward(self, x):
        y = self.fc(x)
        w = torch.linspace(0.5, 1.5, y.shape[1], dtype=y.dtype)
        return self.head(w @ y)


@pytest.mark.parametrize("num_models,batch", [(2, 2), (3, 3), (2, 5)])
def test_vector_times_samples_is_exact(num_models: int, batch: int) -> None:
    factory = lambda: _VectorTimesBatch(num_models * batch, num_models)  # noqa: E731
    models = [seeded(factory, i) for i in range(num_models)]
    x = torch.randn(num_models, batch, 3, num_models * batch, dtype=torch.float64)
    out = stack(models)(x)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(out, expected, msg="w @ y")


class _CountedAll(nn.Module):
    def __init__(self, against: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.against = against

    def forward(self, x):
        positive = x[..., 0] > 0
        size = positive.numel() if self.against is None else self.against
        return self.fc(x) * 2 if positive.sum() == size else self.fc(x)


def test_all_as_a_count_follows_each_model() -> None:
    """``mask.sum() == mask.numel()`` is each model's ``mask.all()``: exact where the models agree, refused
    where they would take different branches (not one answer for all)."""
    models = [seeded(_CountedAll, i) for i in range(3)]
    x = torch.rand(3, 2, 4, dtype=torch.float64)  # every first feature positive
    assert_close(stack(models)(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))
    x[1, 0, 0] = -1.0  # model 1 alone takes the other branch
    _refused(stack(models), x, r"Tensor.__bool__ .*gives different results for different models")
    # a literal that equals the folded mask's size (M * B = 6) is compared with each model's own count
    literal = [seeded(lambda: _CountedAll(against=6), i) for i in range(3)]
    x = torch.rand(3, 2, 4, dtype=torch.float64)
    assert_close(stack(literal)(x), torch.stack([m(x[i]) for i, m in enumerate(literal)]))


class BatchSized(nn.Module):
    """Tensors made from the batch size read out of the input (BERT's ``token_type_ids = zeros(B, T)``,
    padding by ``x.new_zeros``) and samples written in place."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.types = nn.Embedding(2, features)
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        B, T, C = x.shape
        token_types = torch.zeros(B, T, dtype=torch.long)
        h = self.fc(x) + self.types(token_types)
        h = torch.cat([h, x.new_zeros(B, 1, C)], dim=1)  # one padding position
        h[:, -1] = h[:, 0] * 2
        return h + torch.ones(B, T + 1, 1, dtype=x.dtype)


@pytest.mark.parametrize("seq", [5, 6], ids=["T != M*B", "T == M*B"])
def test_batch_sized_constants_and_writes_are_exact(seq: int) -> None:
    models = [seeded(BatchSized, i) for i in range(2)]
    compare_training(stack(models), [seeded(BatchSized, i) for i in range(2)], _sequences(seq), batch=3)


class _WithConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 3.0]))

    def forward(self, x):
        return self.fc(x), self.scale


def test_output_without_samples_is_the_same_for_every_model() -> None:
    models = [seeded(_WithConstant, i) for i in range(2)]
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out, scale = stack(models)(x)
    assert_close(out, torch.stack([m(xi)[0] for m, xi in zip(models, x)]), msg="output")
    assert_close(scale, torch.stack([m(xi)[1] for m, xi in zip(models, x)]), msg="constant output")
    assert scale.stride(0) == 0  # an expand, not M copies


INDICES = [
    (slice(None),), (slice(None), 0), (Ellipsis, 1), (None, slice(None)), (slice(None), torch.tensor([2, 0])),
    (slice(None), slice(None), [1, 1, 0]), (0,), (slice(1, None),), (torch.tensor([1, 0]),),
    (slice(None), 1, slice(None), torch.tensor([0, 1])), (torch.tensor(1), slice(None)),
    (slice(None), torch.tensor([[True, False, True, True, False]] * 3)), (Ellipsis, None, 0),
]  # fmt: skip


@pytest.mark.parametrize("d", range(4))
@pytest.mark.parametrize("index", INDICES, ids=range(len(INDICES)))
def test_index_rule_never_names_a_wrong_dimension(d: int, index: tuple) -> None:
    """``x[index]`` of a tensor whose dimension ``d`` (size 6) is model-major: the rule's answer, if not
    Lost, is the dimension of the result along which the values are still ``d``'s indices."""
    from batchlayers._provenance import Lost, _index_position

    shape = [3, 5, 4, 2]
    shape[d] = 6
    marker = torch.arange(6).reshape([6 if k == d else 1 for k in range(4)]).expand(shape)
    try:
        out = marker[index]
    except (IndexError, RuntimeError):
        return  # not a valid index for this shape
    where = _index_position(marker, index, d)
    if isinstance(where, Lost):
        return
    expected = torch.arange(6).reshape([6 if k == where else 1 for k in range(out.dim())]).expand(out.shape)
    assert torch.equal(out, expected), (index, d, where)


class _BatchSizedFromConstants(nn.Module):
    """Batch-sized tensors made from constants after reading B: expand, repeat, and a per-sample gather."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.pos = nn.Embedding(8, 4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # x: (B, T, 4)
        b, t, _ = x.shape
        positions = torch.arange(t)
        if self.how == "gather":  # (1, T): a sequence, unambiguous also when T == M*B
            positions = positions.unsqueeze(0)
        elif self.how == "expand":
            positions = positions.expand(b, -1)
        elif self.how == "repeat":
            positions = positions.unsqueeze(0).repeat(b, 1)
        h = self.fc(x) + self.pos(positions)
        if self.how == "gather":
            return h[torch.arange(b), x[..., 0].argmax(-1)]
        return h


@pytest.mark.parametrize("batch", [1, 2, 3], ids=["B == 1", "T != M*B", "T == M*B"])
@pytest.mark.parametrize("how", ["expand", "repeat", "gather"])
def test_batch_sized_from_constants_is_exact(how: str, batch: int) -> None:
    models = [seeded(lambda: _BatchSizedFromConstants(how), i) for i in range(2)]
    x = torch.randn(2, batch, 6, 4, dtype=torch.float64)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(stack(models)(x), expected, msg=how)


class _Checkpointed(nn.Module):
    """A segment of forward under torch.utils.checkpoint, recomputed in backward."""

    def __init__(self, segment: str, reentrant: bool) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.segment, self.reentrant = segment, reentrant

    def forward(self, x):
        segments = {
            "a batched layer": lambda t: torch.tanh(self.fc(t)),
            "a per-model parameter": lambda t: torch.tanh(t) * self.gamma,
            "a reduction over the samples": lambda t: torch.tanh(t - t.mean(0)),
            "elementwise only": lambda t: torch.tanh(t) * 2,
        }
        h = torch.utils.checkpoint.checkpoint(segments[self.segment], self.fc(x), use_reentrant=self.reentrant)
        return self.out(h + self.gamma)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("segment", ["a batched layer", "a per-model parameter", "a reduction over the samples"])
def test_checkpointed_segments_are_refused_in_forward(segment: str, reentrant: bool) -> None:
    """Recomputed in backward, outside the stacked call, such a segment would not be followed: refused before
    anything is computed wrongly, naming what runs inside."""
    batched = stack([_Checkpointed(segment, reentrant) for _ in range(2)])
    x = torch.randn(2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"runs inside torch.utils.checkpoint .*Turn activation checkpointing off"):
        batched(x)
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_elementwise_segment_is_exact(reentrant: bool) -> None:
    """Elementwise code on the samples computes the same values with or without the tracker: exact."""
    factory = lambda: _Checkpointed("elementwise only", reentrant)  # noqa: E731
    compare_training(
        stack([seeded(factory, i) for i in range(3)]),
        [seeded(factory, i) for i in range(3)],
        lambda lead: torch.randn(*lead, 4, dtype=torch.float64, requires_grad=True),
    )


class _MaskByIndex(nn.Module):
    """transformers' mask building: padding[arange(B)[:, None, None], kv[None, None, :]] broadcast with a
    causal (T, T) mask, then attention scores masked per sample."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.order = order

    def forward(self, x, padding):
        B, T, _ = x.shape
        rows = torch.arange(B) if self.order == "arange" else torch.arange(B).flip(0)
        keep = padding[rows[:, None, None], torch.arange(T)[None, None, :]]  # (B, 1, T)
        keep = keep & torch.ones(T, T, dtype=torch.bool).tril()  # (B, T, T)
        h = self.fc(x)
        scores = (h @ h.transpose(1, 2)).masked_fill(~keep, float("-inf"))
        return scores.softmax(-1) @ h


@pytest.mark.parametrize("seq", [5, 6], ids=["T != M*B", "T == M*B"])
def test_masks_built_by_indexing_with_arange_are_per_sample(seq: int) -> None:
    """Exact, also with T == M*B: the (T, T) causal mask is given T, a size read from another dimension than
    the samples', so it is not batch-sized however its size compares with theirs."""
    models = [seeded(lambda: _MaskByIndex("arange"), i) for i in range(2)]
    x = torch.randn(2, 3, seq, 4, dtype=torch.float64)
    padding = torch.rand(2, 3, seq) > 0.3
    padding[..., 0] = True
    out = stack(models)(x, padding)
    assert_close(out, torch.stack([m(x[i], padding[i]) for i, m in enumerate(models)]), msg="masked attention")
    shuffled = stack([_MaskByIndex("flipped"), _MaskByIndex("flipped")])
    with pytest.raises(ValueError, match=r"fc|output"):
        shuffled(x.float(), padding)


# (the std over a single sample is nan for the originals too: no B=1 case for it)
_COINCIDING = [(p, b) for p in REDUCES for b in (1, 2) if not (b == 1 and p == "standardised over the batch")]


@pytest.mark.parametrize(
    "pattern, batch", _COINCIDING, ids=[f"{p}-{'B=1' if b == 1 else 'M*B==C'}" for p, b in _COINCIDING]
)
def test_reductions_over_the_samples_when_sizes_coincide(pattern: str, batch: int) -> None:
    """Two models with 4 features: B=2 makes M*B equal the feature size, B=1 leaves one sample per model."""
    factory = lambda: _Reduces(pattern)  # noqa: E731
    compare_training(
        stack([seeded(factory, i) for i in range(2)]),
        [seeded(factory, i) for i in range(2)],
        lambda lead: torch.randn(*lead, 4, dtype=torch.float64),
        batch=batch,
    )


@pytest.mark.parametrize("batch", [1, 3], ids=["B=1", "M*B*T == tokens"])
def test_in_forward_token_loss_when_sizes_coincide(batch: int) -> None:
    """Tokens flattened to (M*B*T, C) with T == M*B (B=3) or B=1: each model's loss is its own."""
    factory = lambda: _InForwardLoss(_tokens_ce)  # noqa: E731
    batched, references = stack([seeded(factory, i) for i in range(2)]), [seeded(factory, i) for i in range(2)]
    x = torch.randn(2, batch, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (2, batch, 6))
    y[0, 0, :2] = -1
    out = batched(x, y)
    expected = torch.stack([r(x[i], y[i]) for i, r in enumerate(references)])
    assert_close(out, expected, msg="losses")
    out.sum().backward()
    expected.sum().backward()
    for key, p in batched.named_parameters():
        assert_close(p.grad, torch.stack([dict(r.named_parameters())[key].grad for r in references]), msg=key)


class _Einsum(nn.Module):
    """``torch.einsum`` as torchvision and timm write it (found by ``scripts/survey_real_models.py``)."""

    def __init__(self, form: str, seq: int = 6, features: int = 4) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(features, 3 * features)
        if form == "attention":
            self.bias = nn.Parameter(torch.randn(seq, seq))
        if form == "relative positions":
            self.rel = nn.Parameter(torch.randn(2 * seq - 1, features))
            index = torch.arange(seq)[:, None] - torch.arange(seq)[None, :] + seq - 1
            self.register_buffer("rel_index", index, persistent=False)
        if form == "ellipsis with a parameter":
            self.heads = nn.Parameter(torch.randn(2, 3, features))
        if form in ("list form, implicit output", "sublist form"):
            self.w = nn.Parameter(torch.randn(features, 5))

    def forward(self, x):  # x: (B, T, features)
        q, k, v = self.fc(x).chunk(3, -1)
        if self.form == "attention":  # MaxViT: spaces in the equation, a per-model bias on the scores
            scores = torch.einsum("b i d, b j d -> b i j", q, k) + self.bias
            return torch.einsum("bij,bjd->bid", scores.softmax(-1), v)
        if self.form == "relative positions":  # MViTv2, SAM: the queries against a looked-up per-model table
            return torch.einsum("btc,tkc->btk", q, self.rel[self.rel_index])
        if self.form == "ellipsis with a parameter":  # MultiQueryAttentionV2
            return torch.einsum("...d,hkd->...hk", q, self.heads).flatten(-2)
        if self.form == "list form, implicit output":  # convit: operands in a list; output 'dnt', samples second
            return torch.einsum("ntc,cd", [q, self.w]).permute(1, 2, 0)
        if self.form == "sublist form":
            return torch.einsum(q, [0, 1, 2], self.w, [2, 3], [0, 1, 3])
        if self.form == "samples only":  # no per-model operand: the rule alone
            return torch.einsum("bij->bji", torch.einsum("bid,bjd->bij", q, k))
        raise AssertionError(self.form)


EINSUM_FORMS = ["attention", "relative positions", "ellipsis with a parameter", "list form, implicit output",
                "sublist form", "samples only"]  # fmt: skip


@pytest.mark.parametrize("batch", [1, 2, 3], ids=["B=1", "T != M*B", "T == M*B"])
@pytest.mark.parametrize("form", EINSUM_FORMS)
def test_einsum_is_exact(form: str, batch: int) -> None:
    factory = lambda: _Einsum(form)  # noqa: E731
    references = [seeded(factory, i) for i in range(2)]
    compare_training(stack(references), [seeded(factory, i) for i in range(2)], _sequences(6), batch=batch)


@pytest.mark.parametrize(
    "equation, match",
    [
        ("btc,stc,c->bs", "torch.einsum combines the models' samples along two different dimensions"),
        ("bbc->bc", "torch.einsum takes a diagonal along the dimension that holds the models' samples"),
    ],
    ids=["samples on two dimensions", "diagonal"],
)
def test_einsum_mixing_the_models_is_refused(equation: str, match: str) -> None:
    class Mixes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x):  # (B, 3, 3): a diagonal over 'b' needs an (M * B, M * B, 3) operand, here by a
            # literal 6 == M * B (expanded by the read x.shape[0], the expand is refused first, as a second
            # dimension sized by the folded batch)
            operands = (x.unsqueeze(1).expand(-1, 6, -1, -1)[:, :, 0],) if equation == "bbc->bc" else (x, x)
            if equation.count(",") == 2:  # pairs of samples (each model's own with two operands) and a third
                operands += (torch.ones(3),)
            return self.fc(torch.einsum(equation, *operands))

    _refused(stack([Mixes(), Mixes()]), torch.randn(2, 3, 3, 3), f"fc.*{match}")


def test_einsum_rule_never_names_a_wrong_dimension() -> None:
    """Random equations (1-3 operands, ellipses, repeated and implicit subscripts) over operands that hold the
    samples of M models on a random dimension, or are shared: wherever the rule names an output dimension, its
    blocks are each model's own einsum; wherever two operands hold them on two subscripts and the einsum is
    computed per model instead (pairs of samples), so is the result; and wherever the equation sums over the
    samples and is computed as a per-model value, model i's entry is model i's own einsum."""
    from types import SimpleNamespace

    from batchlayers import _per_model
    from batchlayers._provenance import (
        Tracker,
        _einsum_over_samples,
        _einsum_pairs,
        _tagged,
        einsum_labels,
        einsum_tag,
        get_tag,
        set_tag,
    )

    rng = random.Random(0)
    named = paired = summed = 0
    for _ in range(3000):
        m, n = rng.choice([2, 3]), rng.choice([1, 2, 3])
        size = {c: rng.choice([1, 2, 3]) for c in "abcd"}
        terms = []
        for _ in range(rng.choice([1, 2, 2, 3])):
            term = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.25:
                cut = rng.randint(0, len(term))
                term = term[:cut] + "..." + term[cut:]
            terms.append(term)
        letters = sorted(set("".join(terms)) - {"."})
        equation = ",".join(terms)
        if rng.random() < 0.7:
            out = "".join(rng.sample(letters, rng.randint(0, len(letters))))
            equation += "->" + ("..." + out if "..." in equation else out)
        folded, per_model = [], []
        for term in terms:
            shape = [size[c] for c in term.replace("...", "")]
            if "..." in term:
                cut = term.index("...")
                shape[cut:cut] = [2]
            if rng.random() < 0.6:
                d = rng.randrange(len(shape))
                blocks = [torch.randn([n if k == d else s for k, s in enumerate(shape)], dtype=torch.float64)
                          for _ in range(m)]  # fmt: skip
                t = torch.cat(blocks, d)
                set_tag(t, d)
                folded.append(t)
                per_model.append(blocks)
            else:
                t = torch.randn(shape, dtype=torch.float64)
                folded.append(t)
                per_model.append([t] * m)
        if not any(isinstance(getattr(t, "_batchlayers_models", None), int) for t in folded):
            continue
        try:
            expected = [torch.einsum(equation, *[ops[i] for ops in per_model]) for i in range(m)]
        except RuntimeError:  # an equation torch refuses (shapes that do not broadcast, ...)
            continue
        arguments = (equation, *folded)
        if _einsum_over_samples("torch.einsum", arguments, {}, _tagged(arguments, {})):
            summed += 1
            result = _per_model.call(Tracker(m, [m * n]), torch.einsum, arguments, {})
            assert_close(result, torch.stack(expected), msg=f"{equation} summed per model")
        pairs = _einsum_pairs(SimpleNamespace(num_models=m), torch.einsum, arguments, {}, _tagged(arguments, {}))
        if pairs is not None:
            paired += 1
            assert_close(pairs, torch.cat(expected, get_tag(pairs)), msg=f"{equation} per model")
        try:
            out = torch.einsum(equation, *folded)
        except RuntimeError:
            continue
        labels = einsum_labels(equation, [t.dim() for t in folded])
        assert labels is not None and len(labels[1]) == out.dim(), equation
        d = einsum_tag("torch.einsum", folded, *labels)
        if isinstance(d, int):
            named += 1
            assert_close(out, torch.cat(expected, d), msg=f"{equation} {[tuple(t.shape) for t in folded]}")
    assert named > 300 and paired > 30 and summed > 100, (named, paired, summed)  # often enough to test something


class _RowLSTM(nn.Module):
    """timm's Sequencer: an LSTM over the rows of a feature map, every row of every sample one sequence, so
    the LSTM's own initial state is sized ``M * B * W``, not the folded batch ``M * B``."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 3, num_layers=layers, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        rows, _ = self.rnn(x.permute(0, 2, 1, 3).reshape(-1, h, c))
        return self.fc(rows.reshape(b, w, h, -1).permute(0, 2, 1, 3))


@pytest.mark.parametrize(
    "num_models, batch, layers", [(2, 3, 1), (2, 1, 1), (3, 2, 3)], ids=["M*B*W rows", "B=1", "2*layers == M*B"]
)
def test_recurrent_state_sized_from_more_than_the_samples_is_exact(num_models: int, batch: int, layers: int) -> None:
    factory = lambda: _RowLSTM(layers)  # noqa: E731
    make_input = lambda lead: torch.randn(*lead, 5, 2, 4, dtype=torch.float64)  # noqa: E731
    references = [seeded(factory, i) for i in range(num_models)]
    compare_training(stack([seeded(factory, i) for i in range(num_models)]), references, make_input, batch=batch)


class _PerModelFromBatchSize(nn.Module):
    """A per-model value brought to the folded batch size read from the input: XCiT's Fourier position encoding
    (a per-model convolution of constants, ``.repeat(B, 1, 1, 1)``), and its twins."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Conv2d(2, 4, 1)
        if how.endswith("summed"):
            self.w = nn.Parameter(torch.randn(1, 4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 4), T = 6 = 2 * 3 positions
        b = x.shape[0]
        grid = torch.linspace(0, 1, 12, dtype=x.dtype).view(1, 2, 2, 3)
        pos = self.proj(grid)  # (1, 4, 2, 3): per model, no samples
        if self.how == "repeat":
            pos = pos.repeat(b, 1, 1, 1)
        elif self.how == "tile":
            pos = pos.tile(b, 1, 1, 1)
        elif self.how == "expand":
            pos = pos.expand(b, -1, -1, -1)
        elif self.how == "repeat, summed":  # B * w per model; M * B * w if the repeat were not per model
            return self.fc(x + self.w.repeat(b, 1).sum(0))
        elif self.how == "new_ones, summed":
            return self.fc(x + self.w.new_ones(b, 4).sum(0))
        return self.fc(x + pos.reshape(b, 4, -1).transpose(1, 2))


@pytest.mark.parametrize("batch", [1, 2, 3], ids=["B == 1", "T != M*B", "T == M*B"])
@pytest.mark.parametrize("how", ["repeat", "tile", "expand"])
def test_per_model_value_repeated_to_the_batch_is_exact(how: str, batch: int) -> None:
    factory = lambda: _PerModelFromBatchSize(how)  # noqa: E731
    references = [seeded(factory, i) for i in range(2)]
    compare_training(stack(references), [seeded(factory, i) for i in range(2)], _sequences(6), batch=batch)


@pytest.mark.parametrize("how", ["repeat, summed", "new_ones, summed"])
def test_sums_of_batch_sized_per_model_values_are_each_models_own(how: str) -> None:
    """Summed over the batch, a per-model value repeated to the folded batch size gives each model its own B
    times the value, not M times that (these gave wrong numbers without an error before repeat and new_ones of
    per-model values had rules, and were refused while sums over the samples were)."""
    models = [seeded(lambda: _PerModelFromBatchSize(how), i) for i in range(2)]
    _matches_originals(stack(models), models, torch.randn(2, 3, 6, 4, dtype=torch.float64), msg=how)


def test_new_tensor_of_per_sample_values_is_refused() -> None:
    """``x.new_tensor(range(B))`` holds per-sample values of the folded batch, not one value for every sample
    (it was tagged as the samples, giving each model the positions of its block of the folded batch)."""

    class Positions(_Pattern):
        def forward(self, x):
            return self.fc(x + x.new_tensor([float(i) for i in range(x.shape[0])])[:, None])

    batched = stack([seeded(lambda: Positions(""), i) for i in range(2)])
    _refused(batched, torch.randn(2, 3, 4, dtype=torch.float64), r"fc.*differs along the models")


class _CachedInForward(nn.Module):
    """A cache that forward assigns to a registered buffer of a module with parameters of its own, so the
    stacked model stores the buffer per model: ConViT's ``rel_indices`` (constants), an ALiBi-style bias with
    as many heads as models (its leading dimension M), and a cache of the samples themselves (refused)."""

    def __init__(self, what: str, heads: int = 2) -> None:
        super().__init__()
        self.what = what
        self.heads = heads
        self.qk = nn.Linear(8, 8)
        if what == "relative indices":
            self.pos_proj = nn.Linear(3, heads)
        self.gate = nn.Parameter(torch.ones(heads, 1, 1))
        self.register_buffer("cache", torch.zeros(1, 1, 1, 3), persistent=False)

    def forward(self, x):  # (B, N, 8)
        b, n, _ = x.shape
        if self.what == "samples":
            self.cache = x.detach().clone()
            return self.qk(x)
        if self.what == "positions of the batch":
            self.cache = torch.arange(b, dtype=x.dtype)
            return self.qk(x)
        if self.cache.shape[1] != n:
            i = torch.arange(n, dtype=x.dtype)
            d = i[None, :] - i[:, None]
            if self.what == "relative indices":
                self.cache = torch.stack([d, i[:, None] + 0 * d, d**2], -1).unsqueeze(0)
            else:  # (heads, N, N) with heads == M
                self.cache = -torch.arange(1, self.heads + 1, dtype=x.dtype).view(-1, 1, 1) * d.abs()
        if self.what == "relative indices":
            scores = self.pos_proj(self.cache.expand(b, -1, -1, -1)).permute(0, 3, 1, 2)
        else:
            scores = self.cache.expand(b, -1, -1, -1)
        attention = (scores * self.gate).softmax(-1)
        return (attention @ self.qk(x).view(b, n, self.heads, -1).transpose(1, 2)).transpose(1, 2).reshape(b, n, -1)


@pytest.mark.parametrize("seq", [5, 6], ids=["N != M*B", "N == M*B"])
@pytest.mark.parametrize("what", ["relative indices", "ALiBi heads == M"])
def test_caches_that_forward_assigns_are_each_models_own(what: str, seq: int) -> None:
    """Exact on the call that fills the cache and on the calls that read it (they read it as one model's),
    also where the cache's length equals the folded batch: it was not made from the read batch size."""
    factory = lambda: _CachedInForward(what)  # noqa: E731
    references = [seeded(factory, i) for i in range(2)]
    make_input = lambda lead: torch.randn(*lead, seq, 8, dtype=torch.float64)  # noqa: E731
    compare_training(stack(references), [seeded(factory, i) for i in range(2)], make_input, batch=3, steps=3)


@pytest.mark.parametrize(
    "what, seq, match",
    [
        ("samples", 5, r"forward assigned a value computed from the models' samples .*'cache'"),
        ("positions of the batch", 5, r"the tensor forward assigned to 'cache' .* is ambiguous: it has shape \(6,\)"),
    ],
)
def test_a_cache_of_the_samples_is_refused_and_the_buffer_kept(what: str, seq: int, match: str) -> None:
    batched = stack([seeded(lambda: _CachedInForward(what), i) for i in range(2)])
    kept = batched.cache
    with pytest.raises(ValueError, match=match):
        batched(torch.randn(2, 3, seq, 8, dtype=torch.float64))
    assert batched.cache is kept


def test_a_per_model_buffer_that_forward_sets_to_none_stays_none() -> None:
    class UsedOnce(nn.Module):  # a one-shot offset, dropped after the first call
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("offset", torch.randn(4), persistent=False)

        def forward(self, x):
            if self.offset is None:
                return self.fc(x)
            out = self.fc(x) + self.offset
            self.offset = None
            return out

    models = [seeded(UsedOnce, i) for i in range(2)]
    batched = stack([seeded(UsedOnce, i) for i in range(2)])
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    for call in range(3):
        assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=f"call {call}")
    assert batched.offset is None


class _Windows(nn.Module):
    """Sliding windows as timm writes them: ``Tensor.unfold`` on the spatial dimensions (HaloNet),
    ``nn.Unfold`` into per-patch images (TNT), ``F.unfold`` then ``F.fold`` (VOLO's outlook attention)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv = nn.Conv2d(3, 3, 1)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):  # (B, 3, 8, 8)
        b, c, h, w = x.shape
        x = self.conv(x)
        if self.form == "Tensor.unfold":
            windows = F.pad(x, [1, 1, 1, 1]).unfold(2, 4, 2).unfold(3, 4, 2)  # (B, C, 4, 4, 4, 4)
            x = windows.reshape(b, c, -1, 16).mean(-1).reshape(b, c, h // 2, w // 2)
        elif self.form == "nn.Unfold":
            patches = nn.functional.unfold(x, kernel_size=4, stride=4)  # (B, C*16, L)
            x = patches.transpose(1, 2).reshape(b * 4, c, 4, 4)
        elif self.form == "unfold and fold":
            x = F.fold(F.unfold(x, kernel_size=3, padding=1), output_size=(h, w), kernel_size=3, padding=1)
        elif self.form == "Tensor.unfold over the batch":
            x = x.unfold(0, 2, 1).mean(-1)
        return self.fc(x.flatten(2).transpose(1, 2))


@pytest.mark.parametrize("batch", [1, 3, 4], ids=["B=1", "B=3", "H == M*B"])
@pytest.mark.parametrize("form", ["Tensor.unfold", "nn.Unfold", "unfold and fold"])
def test_sliding_windows_are_exact(form: str, batch: int) -> None:
    factory = lambda: _Windows(form)  # noqa: E731
    make_input = lambda lead: torch.randn(*lead, 3, 8, 8, dtype=torch.float64)  # noqa: E731
    compare_training(stack([seeded(factory, i) for i in range(2)]), [seeded(factory, i) for i in range(2)],
                     make_input, batch=batch)  # fmt: skip


def test_sliding_windows_over_the_batch_are_refused() -> None:
    batched = stack([seeded(lambda: _Windows("Tensor.unfold over the batch"), i) for i in range(2)])
    _refused(batched, torch.randn(2, 3, 3, 8, 8, dtype=torch.float64), r"fc.*Tensor.unfold along the dimension")


class _Ops(_Pattern):
    """Ops as transformers models write them (bloom, llama4, idefics3, fnet, ibert), on a tensor of samples."""

    def forward(self, x):  # x: (B, T, 4)
        h = self.fc(x)
        B, T, C = h.shape
        p = self.pattern
        if p == "baddbmm with keyword batches":  # bloom's alibi scores
            bias = h.sum(-1, keepdim=True).expand(B, T, T)
            scores = bias.baddbmm(batch1=h, batch2=h.transpose(1, 2), beta=1.0, alpha=0.5)
            return self.fc(scores.softmax(-1) @ h)
        if p == "bmm with a keyword operand":
            return self.fc(torch.bmm(h, mat2=h.transpose(1, 2)).softmax(-1) @ h)
        if p == "rotary embedding in complex numbers":  # llama4
            angles = torch.arange(T * C // 2, dtype=h.dtype).view(T, C // 2)
            rotation = torch.polar(torch.ones_like(angles), angles)
            rotated = torch.view_as_complex(h.reshape(B, T, C // 2, 2)) * rotation
            return self.fc(torch.view_as_real(rotated).flatten(2))
        if p == "bucketized positions":  # idefics3's patch positions
            boundaries = torch.tensor([-0.5, 0.0, 0.5], dtype=h.dtype)
            return self.fc(h + torch.bucketize(h.sum(-1, keepdim=True), boundaries).to(h.dtype))
        if p == "Fourier transform over tokens and features":  # fnet
            return self.fc(torch.fft.fftn(h, dim=(1, 2)).real)
        if p == "Fourier transform over the features":
            spectrum = torch.fft.rfft(h, dim=-1)
            return self.fc(torch.fft.irfft(spectrum * spectrum.imag, n=C, dim=-1))
        if p == "mean with numpy's axis":  # ibert's IntLayerNorm
            return self.fc(h - h.mean(axis=2, keepdim=True) + self.fc.weight.sum(axis=0))
        if p == "pad that leaves the samples alone":  # mobilebert's trigram input
            return self.fc(h + F.pad(h[:, 1:], [0, 0, 0, 1, 0, 0]) + F.pad(input=h[:, :-1], pad=(0, 0, 1, 0)))
        if p == "rows of a shared table selected by the samples":  # m2m_100's sinusoidal positions
            positions = torch.arange(T).expand(B, T) + (h[..., 0] > 0).long()
            table = torch.sin(torch.arange(5 * C, dtype=h.dtype)).view(5, C)
            return self.fc(h + table.index_select(0, positions.reshape(-1)).view(B, T, C))
        if p == "diff along the tokens, a column prepended":  # transformers' packed-sequence check
            return self.fc(torch.diff(h, prepend=h[:, :1] - 1, dim=1))
        if p == "triangular solve batched over the samples":  # qwen3_next's chunked gated delta rule
            system = torch.eye(T, dtype=h.dtype) + 0.1 * torch.tril(h @ h.transpose(1, 2), -1)
            return self.fc(torch.linalg.solve_triangular(system, h, upper=False, unitriangular=True))
        if p == "as_tensor of a tensor":  # tapas's positions
            return self.fc(torch.as_tensor(h, dtype=h.dtype) + torch.as_tensor(h, device=h.device))
        if p == "group mask scattered in place":  # deepseek_v3's grouped routing
            group_scores = h.sigmoid().view(B * T, 2, 2).amax(-1)
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_scores.topk(1, dim=-1)[1], 1)
            mask = group_mask.unsqueeze(-1).expand(-1, 2, 2).reshape(B, T, C)
            return self.fc(h.masked_fill(~mask.bool(), 0.0))
        if p == "counts added in place along the features":
            return self.fc(h + torch.zeros_like(h).scatter_add_(2, h.argmax(-1, keepdim=True), h[..., :1].exp()))
        if p == "mean over the samples with numpy's names":  # each model's own samples
            return self.fc(h - h.mean(axis=0, keepdims=True))
        raise AssertionError(self.pattern)


OPS = [
    "baddbmm with keyword batches",
    "bmm with a keyword operand",
    "rotary embedding in complex numbers",
    "bucketized positions",
    "Fourier transform over tokens and features",
    "Fourier transform over the features",
    "mean with numpy's axis",
    "mean over the samples with numpy's names",
    "pad that leaves the samples alone",
    "as_tensor of a tensor",
    "rows of a shared table selected by the samples",
    "diff along the tokens, a column prepended",
    "triangular solve batched over the samples",
    "group mask scattered in place",
    "counts added in place along the features",
]


@pytest.mark.parametrize("pattern", OPS)
def test_ops_as_transformers_writes_them_are_exact(pattern: str) -> None:
    """Matrix products with keyword operands, complex views, bucketize, FFTs over non-sample dimensions and
    numpy's ``axis=`` (each found refused in a transformers model): exact against the originals."""
    models = [seeded(lambda: _Ops(pattern), i) for i in range(2)]
    compare_training(stack(models), [seeded(lambda: _Ops(pattern), i) for i in range(2)],
                     lambda lead: torch.randn(*lead, 3, 4, dtype=torch.float64), batch=4)  # fmt: skip
