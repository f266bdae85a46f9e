"""Patterns an adversarial hunt (1,100 code patterns against the default batched execution) found silently
wrong, each now exact against the original models or refused by batchlayers: code the tracker never sees
(TorchScript, ``torch.vmap``, ``as_subclass``), writes into per-model values (chained in-place ops, ``.data``
assignment), ``torch`` functions that pass ``out=None``, and numbers computed from the batch size returned by
forward. Model by model, every pattern is exact."""

from __future__ import annotations

import contextlib
import warnings

import einops
import pytest
import torch
import torch.nn.functional as F
from convert_harness import assert_exact_or_refused, rows, seeded
from harness import assert_close
from torch import nn
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

from batchlayers.convert import stack


def _swish(h: torch.Tensor) -> torch.Tensor:
    return h * torch.sigmoid(h)


def _mean(h: torch.Tensor) -> torch.Tensor:
    return h.mean(0)


def _centred(h: torch.Tensor) -> torch.Tensor:
    return h - h.mean(0)


with warnings.catch_warnings():  # (deprecated in torch 2.13, still in timm and transformers)
    warnings.simplefilter("ignore", DeprecationWarning)
    _scripted_swish, _scripted_mean = torch.jit.script(_swish), torch.jit.script(_mean)
    _scripted_centred = torch.jit.script(_centred)


class _Hunted(nn.Module):
    """``fc`` gives ``h`` (B, 6); ``w`` and ``b`` are per-model parameters, ``buf`` a per-model buffer."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 5)
        self.w = nn.Parameter(torch.randn(5, 6))
        self.b = nn.Parameter(torch.randn(5))
        self.register_buffer("buf", torch.rand(6) + 0.5)

    def forward(self, x):
        return PATTERNS[self.pattern](self, self.fc(x))


def _transformed(h, size):
    img = h[:, :4].reshape(-1, 1, 2, 2)
    grid = F.affine_grid(torch.tanh(h).reshape(-1, 2, 3), size(img), align_corners=False)
    return F.grid_sample(img, grid, align_corners=False).flatten(1)


def _chained(m, h):
    r = m.buf.exp_()
    r += 1
    return h * m.buf


def _clamp_data(m, h):
    m.w.data = m.w.data.clamp(-0.5, 0.5)
    return F.linear(h, m.w)


def _data_of_buffer(m, h):
    m.buf.data = h.mean(0)
    return h * m.buf


def _to_its_own_dtype(m, h):
    m.out = m.out.to(h.dtype)  # Switch Transformers' router casts its classifier so: torch sets each .data again
    return m.out(h)


def _new_tensor(h, data):
    with warnings.catch_warnings():  # (torch recommends clone() for a tensor)
        warnings.simplefilter("ignore", UserWarning)
        return h.new_tensor(data)


def _old_drop_path(m, h, keep=1.0):
    """timm's DropPath before ``bernoulli_`` (kept 1.0 here, so that it is deterministic)."""
    mask = keep + torch.rand((h.shape[0],) + (1,) * (h.ndim - 1), dtype=h.dtype)
    mask.floor_()
    return h.div(keep) * mask


# torch.func transforms entered in forward over the samples or a per-model value (refused without gradients too)
TRANSFORMS = {
    "torch.vmap over the features (centred over the batch), then a layer": lambda m, h: m.out(
        torch.vmap(lambda column: column - column.mean())(h.t()).t()
    ),
    "torch.vmap(torch.func.jacrev(torch.tanh)) per sample, summed": lambda m, h: m.out(
        torch.vmap(torch.func.jacrev(torch.tanh))(h).sum(-1)
    ),
    "torch.func.grad of an energy coupling the samples": lambda m, h: m.out(
        torch.func.grad(lambda z: z.sum(0).pow(2).sum())(h)
    ),
    "torch.vmap(layer) over the samples": lambda m, h: torch.vmap(m.out)(h),
    "torch.vmap over a per-model weight's rows": lambda m, h: h[:, :5] * torch.vmap(torch.sum)(m.w),
    # a transformed function reading the samples from outside: model 0's first sample for every model
    "torch.vmap(lambda k: h[0, k]) over the features": lambda m, h: (
        h * torch.vmap(lambda k: h[0, k])(torch.arange(h.shape[1]))
    ),
    # ... and transformers' mask read, mask[b] over b = torch.arange(B), each sample's own row, then summed
    "torch.vmap(lambda b: column[b]) over the samples, summed": lambda m, h: (
        h * _mask_read_by_rows(h, h[:, 0], by_mod_index=False).sum()
    ),
    "torch.vmap(lambda b: column[b]) as ModIndex over the samples, summed": lambda m, h: (
        h * _mask_read_by_rows(h, h[:, 0], by_mod_index=True).sum()
    ),
    # transformers' mask functions, each mapped index picking its own sample's row: refused, with or without
    # padding (the mask the same for every sample, or not)
    **{
        f"h * torch.vmap(lambda b: mask[b]) over the samples{how}, {which}": (
            lambda m, h, mod_index=mod_index, same=same: (
                h * _mask_read_by_rows(h, h[:, 0] > (-1e9 if same else 0), mod_index).unsqueeze(1)
            )
        )
        for how, mod_index in [("", False), (" as ModIndex", True)]
        for which, same in [("the same mask", True), ("a mask per sample", False)]
    },
}


def _mask_read_by_rows(h: torch.Tensor, mask: torch.Tensor, by_mod_index: bool) -> torch.Tensor:
    """transformers' mask functions: ``mask[b]`` under ``torch.vmap`` over ``b = torch.arange(B)``, through
    ``TransformGetItemToIndex`` (as transformers calls it) or as a plain index."""
    rows = torch.arange(h.shape[0])
    with TransformGetItemToIndex() if by_mod_index else contextlib.nullcontext():
        return torch.vmap(lambda b: mask[b])(rows).to(h.dtype)


PATTERNS = {
    # code the tracker never sees (while gradients are recorded)
    "a TorchScript activation, then a layer": lambda m, h: (
        m.out(_scripted_swish(h)).mean(0, keepdim=True) + 0 * h[:, :5]
    ),
    "h - a TorchScript mean": lambda m, h: h - _scripted_mean(h),
    "torch.vmap(torch.tanh), then a layer": lambda m, h: m.out(torch.vmap(torch.tanh)(h)),
    "h.as_subclass(Tensor), then a layer": lambda m, h: m.out(h.as_subclass(torch.Tensor)),
    "h.as_subclass(Tensor) as the output": lambda m, h: h.as_subclass(torch.Tensor),
    # ... then through ops the tracker does see, on nothing else: still not a value every model shares
    "a TorchScript centring, then .t().t() and a layer": lambda m, h: m.out(_scripted_centred(h).t().t()),
    "(h.as_subclass(Tensor) * 1).clone() as the output": lambda m, h: (h.as_subclass(torch.Tensor) * 1).clone(),
    # torch.func transforms entered in forward
    **TRANSFORMS,
    # a tensor that shares the samples' storage, made from the storage alone
    "torch.empty(0).set_(h's untyped storage)": lambda m, h: m.out(
        torch.empty(0, dtype=h.dtype).set_(h.detach().untyped_storage(), 0, h.shape, h.stride()) * 1
    ),
    # a copy by new_tensor (torch warns to use clone) keeps the samples
    "h.new_tensor(h.detach()), then a layer": lambda m, h: m.out(_new_tensor(h, h.detach()) * 1),
    "h * h.new_tensor([row[0] for row in h])": lambda m, h: h * _new_tensor(h, [r[0] for r in h.detach()])[:, None],
    # writes into per-model values
    "buf.mul_(2).sqrt_().add_(1)": lambda m, h: h * m.buf.mul_(2).sqrt_().add_(1),
    "buf.sqrt_().mul_(3)": lambda m, h: h + m.buf.sqrt_().mul_(3),
    "buf.abs_().neg_() then read": lambda m, h: h * m.buf.abs_().neg_().reciprocal_(),
    "r = buf.exp_(); r += 1": _chained,
    "w.data = w.data.clamp(...)": _clamp_data,
    "buf.data = h.mean(0)": _data_of_buffer,
    "self.out = self.out.to(h.dtype)": _to_its_own_dtype,
    "buf.unsqueeze_(0)": lambda m, h: h * m.buf.unsqueeze_(0),
    # in-place math on a batch-sized tensor (refused before: no rule for floor_)
    "timm's old DropPath: (keep + rand(B, 1)).floor_()": _old_drop_path,
    # a contrastive loss with the targets copied first (the copy lost what made them each model's own)
    "cross_entropy(h @ h.T, arange(B).clone())": lambda m, h: F.cross_entropy(
        h @ h.T, torch.arange(h.shape[0]).clone()
    ),
    # a per-model mask selecting each model's own number of features
    "h[:, w.sum(0) > 0]": lambda m, h: h[:, m.w.sum(0) > 0].sum(-1, keepdim=True) * h,
    # per-model values through dunders that are not in-place (they look like __iadd__)
    "~(w > 0), and rows of w iterated": lambda m, h: h[:, :5] * (~(m.w > 0)).sum(1) + sum(r.sum() for r in m.w),
    # torch functions that pass out=None
    "F.linear(h, w, F.normalize(b, dim=0))": lambda m, h: F.linear(h, m.w, F.normalize(m.b, dim=0)),
    "cosine head F.linear(F.normalize(h), F.normalize(w))": lambda m, h: F.linear(F.normalize(h), F.normalize(m.w)),
    "h * torch.norm(w)": lambda m, h: h * torch.norm(m.w),
    "torch.tensordot(h, w, dims=([1], [1]))": lambda m, h: torch.tensordot(h, m.w, dims=([1], [1])),
    # similarities and distances of rows (siamese and cosine heads); over the samples they must be refused
    "F.cosine_similarity(h, h.flip(-1))": lambda m, h: F.cosine_similarity(h, h.flip(-1))[:, None] * h,
    "F.cosine_similarity(h[:, None], w, dim=-1)": lambda m, h: F.cosine_similarity(h[:, None], m.w, dim=-1),
    "F.cosine_similarity(h, buf, dim=1)": lambda m, h: F.cosine_similarity(h, m.buf, dim=1)[:, None] * h,
    "F.cosine_similarity(h, h.flip(-1), dim=0)": lambda m, h: F.cosine_similarity(h, h.flip(-1), dim=0) * h,
    "F.pairwise_distance(h, h.roll(1, -1), keepdim=True)": lambda m, h: (
        F.pairwise_distance(h, h.roll(1, -1), keepdim=True) * h
    ),
    "torch.pairwise_distance(h[:, 0], h[:, 1]) (1-D: over the samples)": lambda m, h: (
        h * torch.pairwise_distance(h[:, 0], h[:, 1])
    ),
    # a spatial transformer: the grid's size is the image's, batch included; a read B anywhere else is refused
    "F.affine_grid(theta, img.size()), grid_sample": lambda m, h: _transformed(h, lambda img: img.size()),
    "F.affine_grid(theta, (B, 1, 2, B)) (B as a width)": lambda m, h: _transformed(
        h, lambda img: (img.shape[0], 1, 2, img.shape[0])
    ),
    "nn.CosineSimilarity()(h, h.flip(-1)), nn.PairwiseDistance()(h, 2 * h)": lambda m, h: (
        h * (nn.CosineSimilarity()(h, h.flip(-1)) + nn.PairwiseDistance()(h, 2 * h))[:, None]
    ),
}


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_hunted_pattern_is_exact_or_refused(pattern: str, num_models: int, batch: int) -> None:
    assert_exact_or_refused(lambda: _Hunted(pattern), num_models, rows, batch)


@pytest.mark.parametrize(
    "pattern",
    ["F.linear(h, w, F.normalize(b, dim=0))", "cosine head F.linear(F.normalize(h), F.normalize(w))",
     "h * torch.norm(w)", "buf.mul_(2).sqrt_().add_(1)", "timm's old DropPath: (keep + rand(B, 1)).floor_()",
     "cross_entropy(h @ h.T, arange(B).clone())", "~(w > 0), and rows of w iterated",
     "self.out = self.out.to(h.dtype)", "h.new_tensor(h.detach()), then a layer",
     "F.cosine_similarity(h, h.flip(-1))", "F.cosine_similarity(h, buf, dim=1)",
     "F.cosine_similarity(h[:, None], w, dim=-1)",
     "F.affine_grid(theta, img.size()), grid_sample",
     "F.pairwise_distance(h, h.roll(1, -1), keepdim=True)",
     "nn.CosineSimilarity()(h, h.flip(-1)), nn.PairwiseDistance()(h, 2 * h)"],
)  # fmt: skip
def test_per_model_functions_and_in_place_chains_are_exact(pattern: str) -> None:
    """Not only not silent: these compute each model's own."""
    assert assert_exact_or_refused(lambda: _Hunted(pattern), 2, rows, 3) == "exact"


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_hunted_pattern_is_exact_model_by_model(pattern: str) -> None:
    models = [seeded(lambda: _Hunted(pattern), i) for i in range(2)]
    stacked = stack([seeded(lambda: _Hunted(pattern), i) for i in range(2)], execution="model_by_model")
    x = rows((2, 3))
    with warnings.catch_warnings():
        # Module.to reads each parameter's .grad, and a model-by-model pass's parameters are views of the
        # stacked ones: torch warns that a non-leaf's .grad is read (it is not used)
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        assert_close(stacked(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=pattern)


@pytest.mark.parametrize("pattern", list(TRANSFORMS))
def test_transforms_in_forward_without_gradients_are_refused(pattern: str) -> None:
    """Without gradients the transforms' results have no autograd history to show the tracker missed them:
    refused all the same, naming the transform's op, where a plain stacked call would be silently wrong."""
    models = [seeded(lambda: _Hunted(pattern), i) for i in range(2)]
    stacked = stack([seeded(lambda: _Hunted(pattern), i) for i in range(2)])
    x = rows((2, 3))
    with torch.no_grad():
        with pytest.raises(ValueError, match="inside a torch.func transform"):
            stacked(x)
        assert torch.overrides._get_current_function_mode_stack() == []
        expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
        assert_close(stack(models, execution="model_by_model")(x), expected, msg=pattern)


class _CentresHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 5)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return self.out(h - h.mean(0))


def test_the_stacked_model_runs_under_torch_func_transforms() -> None:
    """Transforms entered outside the stacked model are not refused: torch.func.grad through
    functional_call gives each model's gradients, and torch.vmap over the samples runs each one as a
    batch of its own (one sample a model)."""
    models = [seeded(_CentresHidden, i) for i in range(2)]
    stacked = stack([seeded(_CentresHidden, i) for i in range(2)])
    x = rows((2, 3))
    params = {k: v.detach() for k, v in stacked.named_parameters()}
    grads = torch.func.grad(lambda p: torch.func.functional_call(stacked, p, (x,)).pow(2).sum())(params)
    for m, model in enumerate(models):
        model(x[m]).pow(2).sum().backward()
        for k, p in model.named_parameters():
            assert_close(grads[k][m], p.grad, msg=f"model {m}'s {k}")
    per_sample = torch.vmap(lambda xj: stacked(xj.unsqueeze(1)).squeeze(1), in_dims=1, out_dims=1)(x)
    expected = [torch.cat([m(x[i, j : j + 1]) for j in range(3)]) for i, m in enumerate(models)]
    assert_close(per_sample, torch.stack(expected), msg="one sample a model")


class _Counts(nn.Module):
    """Returns numbers computed from the batch size beside the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        B = x.shape[0]
        return self.fc(x), {"n": B, "shape": x.shape, "half": B // 2, "scaled": B * 1.5, "pair": (B - 1, -B)}


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2)], ids=lambda n: str(n))
def test_numbers_returned_by_forward_are_each_models_own(num_models: int, batch: int) -> None:
    """Each original model returns its own B (and what it computes from it); the stacked model returns that
    number, as a plain one, never the folded M * B."""
    models = [seeded(_Counts, i) for i in range(num_models)]
    x = rows((num_models, batch))
    out, numbers = stack(models)(x)
    own = models[0](x[0])[1]
    assert numbers == own and all(type(numbers[k]) is type(own[k]) for k in own), (numbers, own)
    assert type(numbers["shape"]) is torch.Size and all(type(n) is int for n in numbers["shape"])
    assert_close(out, torch.stack([m(x[i])[0] for i, m in enumerate(models)]), msg="output")


class _Recipes(nn.Module):
    """einops with the batch size read in forward, which einops keeps in its recipe cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):  # (B, T, 4)
        B = x.shape[0]
        h = self.fc(x).reshape(-1, 6)  # (B * T, 6)
        return einops.rearrange(h, "(b t) c -> b t c", b=B)


def test_sizes_kept_past_the_call_are_plain_numbers() -> None:
    """A size read in one stacked call and kept (einops' recipe cache, ``self.last = B``) is a plain number
    once the call has ended: code outside any stacked model that meets it (einops with ``b=6``) runs, and a
    later call with other numbers of models and samples is exact, not refused with the old call's sizes."""
    for num_models, batch in [(2, 3), (3, 2), (2, 3)]:
        models = [seeded(_Recipes, i) for i in range(num_models)]
        x = torch.randn(num_models, batch, 5, 4, dtype=torch.float64)
        expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
        assert_close(stack(models)(x), expected, msg=f"M={num_models}, B={batch}")
        plain = torch.randn(6, 5)
        assert torch.equal(einops.rearrange(plain, "(b t) c -> b t c", b=6), plain.view(6, 1, 5))


_SHARED_SCALE = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))  # trained, and shared by every model


class _Closure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        return self.fc(x) * _SHARED_SCALE.exp() + torch.tanh(_SHARED_SCALE)


def test_a_trainable_tensor_shared_through_a_closure_is_not_untracked_code() -> None:
    """A tensor computed in forward from a trainable tensor outside the models (a closure's) has an autograd
    history and no tag, as untracked code's results have, but the tracker saw it made: exact, not refused."""
    assert assert_exact_or_refused(_Closure, 3, rows, 2) == "exact"


class _CachesInASharedBuffer(nn.Module):
    """A buffer equal in every model (stored once by stack) that forward assigns anew."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.fc = nn.Linear(4, 6)
        self.register_buffer("cache", torch.zeros(1, 6))

    def forward(self, x):
        h = self.fc(x)
        if self.what == "the samples":
            self.cache = h.detach()
        elif self.what == "a per-model value":
            self.cache = self.fc.bias[None].detach() * 2
        elif self.what == "a per-model value of another shape":
            self.cache = self.fc.bias[None, None].detach() * 2
        else:  # a constant, the same for every model
            self.cache = torch.full((1, 6), 0.5, dtype=h.dtype)
        return h + self.cache


@pytest.mark.parametrize(
    "what", ["the samples", "a per-model value", "a per-model value of another shape", "a constant"]
)
def test_a_shared_buffer_that_forward_replaces(what: str) -> None:
    """Holding the samples it would hold the folded batch, and a per-model value of another shape is not the
    buffer's value per model: refused, the buffer put back; a constant is each model's own, and a per-model
    value of the buffer's shape is stored per model from then on: exact."""
    factory = lambda: _CachesInASharedBuffer(what)  # noqa: E731
    outcome = assert_exact_or_refused(factory, 2, rows, 3)
    assert outcome == ("exact" if what in ("a constant", "a per-model value") else "refused")
    if outcome == "refused":
        stacked = stack([seeded(factory, i) for i in range(2)])
        kept = stacked.cache
        with pytest.raises(ValueError, match="stores once because it was equal in every model"):
            stacked(rows((2, 3)))
        assert stacked.cache is kept


class _TorchRejects(nn.Module):
    """Code that each original model runs, where torch itself rejects what the batched forward gives it: a
    per-model value (stored ``(M, *)``) where it takes one number, or an index made for one model's ``B``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 4)
        self.fill = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        h = self.fc(x)
        lengths = (h > 0).sum(-1)
        if self.pattern == "torch.arange(lengths.max())":
            return h * torch.arange(lengths.max() + 1, dtype=h.dtype).sum()
        if self.pattern == "torch.full(shape, a 0-d parameter)":
            return h + torch.full((4,), self.fill.detach())
        if self.pattern == "h[:, :lengths.max()]":
            return h * h[:, : lengths.max() + 1].sum()
        if self.pattern == "scores[arange(B), arange(B)]":  # the diagonal of (B, B) pair scores
            scores, positions = h @ h.T, torch.arange(h.shape[0])
            return h * scores[positions, positions][:, None]
        raise AssertionError(self.pattern)


TORCH_REJECTS = {
    "torch.arange(lengths.max())": TypeError,
    "torch.full(shape, a 0-d parameter)": TypeError,
    "h[:, :lengths.max()]": TypeError,
    "scores[arange(B), arange(B)]": IndexError,
}


@pytest.mark.parametrize("pattern", list(TORCH_REJECTS))
def test_torch_errors_in_the_batched_forward_say_what_differs(pattern: str) -> None:
    """torch's own error keeps its type and message and says why the batched forward differs from the
    original's there, and what runs it: model by model, each is exact."""
    models = [seeded(lambda: _TorchRejects(pattern), i) for i in range(2)]
    x = rows((2, 3))
    with pytest.raises(TORCH_REJECTS[pattern], match=r"(?s)batchlayers: raised in a stacked model's batched forward"):
        stack(models)(x)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(stack(models, execution="model_by_model")(x), expected, msg=pattern)


def test_numpy_of_a_per_model_value_is_refused() -> None:
    """``.numpy()`` gives each model's array; they differ, so the batched forward refuses (it raised numpy's
    'truth value of an array is ambiguous' comparing them)."""

    class _Numpy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * float(self.fc.weight.detach().numpy().sum())

    models = [seeded(_Numpy, i) for i in range(2)]
    with pytest.raises(ValueError, match=r"Tensor.numpy inside a stacked forward gives different results"):
        stack(models)(rows((2, 3)))


class _Views(nn.Module):
    """Two views of a batch encoded together and split back, classifier-free guidance's doubled batch: each
    original joins and splits its own samples."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.enc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        B = x.shape[0]
        if self.pattern == "two views: cat, chunk(2)":
            z1, z2 = self.enc(torch.cat([x, x.flip(-1) * 0.5])).chunk(2)
            return self.head(z1) * self.head(z2)
        if self.pattern == "guidance: cat([x, x]), chunk(2, dim=0)":
            uncond, cond = self.head(self.enc(torch.cat([x, x]))).chunk(2, dim=0)
            return uncond + 3.0 * (cond - uncond)
        if self.pattern == "split(B)":
            a, b = self.enc(torch.concat([x, x * 2])).split(B)
            return self.head(a - b)
        if self.pattern == "torch.split by sizes, tensor_split":
            z = self.enc(torch.cat((x, x * 2, x * 3)))
            a, b, c = z.tensor_split(3)
            d, e = torch.split(z, [B, 2 * B])
            return self.head(a + b * c) + self.head(d) * self.head(e.chunk(2)[1])
        if self.pattern == "torch.cat(axis=1) of features":  # (numpy's keyword: along the features, not the samples)
            return self.head(torch.cat([self.enc(x)[:, :3], self.enc(x * 2)[:, 3:]], axis=1))
        if self.pattern == "a chunk written in place":  # a copy here, a view in the original: refused
            a, b = self.enc(torch.cat([x, x])).detach().chunk(2)
            with torch.no_grad():
                a.mul_(2)
            return self.head(b)
        if self.pattern == "the doubled batch viewed (2, B, C)":  # (M * 2B) rows viewed (2, -1): mixes models
            return self.head(self.enc(torch.cat([x, x * 2])).view(2, B, 6).sum(0))
        if self.pattern == "guidance by slices: z[:B], z[B:]":
            z = self.head(self.enc(torch.cat([x, x * 0.5])))
            cond, uncond = z[:B], z[B:]
            return uncond + 3.0 * (cond - uncond)
        if self.pattern == "rows of each batch: h[:2], h[-1:], h[::2], h[1:B]":
            h = self.enc(x)
            return torch.cat([self.head(h[:2]), self.head(h[-1:]), h[::2, :3], h[1:B][..., 3:] * 2, h[..., :3]])
        if self.pattern == "positions computed from B: z[:B - 1], z.split([B - 1, B + 1])":
            z = self.enc(torch.cat([x, x * 0.5]))
            head, rest = z.split([B - 1, B + 1])
            return self.head(torch.cat([z[: B - 1] * head, rest[1:]]))
        if self.pattern == "numpy's names and keyword forms: vsplit, vstack, hstack, tensor_split(sections=)":
            z = torch.vstack([self.enc(x), self.enc(x * 2)])
            a, b = torch.vsplit(z, 2)
            c, d = z.tensor_split(sections=2)
            e, f = z.split_with_sizes([B, B])
            return self.head(
                torch.hstack([(a - d)[:, :2], (b * c)[:, :2], (e + f)[:, 4:]]).index_fill(1, torch.tensor([0]), 0.5)
            )
        if self.pattern == "torch.vstack of 1-D tensors (reshaped first: the samples move)":
            return self.head(self.enc(x)) * torch.vstack([x[:, 0], x[:, 1]]).sum(0, keepdim=True).T
        if self.pattern == "a slice written in place":  # a copy here, a view in the original: refused
            h = self.enc(x).detach()
            first = h[:1]
            with torch.no_grad():
                first.mul_(2)
            return self.head(h)
        raise AssertionError(self.pattern)


VIEWS = {
    "two views: cat, chunk(2)": "exact",
    "guidance: cat([x, x]), chunk(2, dim=0)": "exact",
    "split(B)": "exact",
    "torch.split by sizes, tensor_split": "exact",
    "torch.cat(axis=1) of features": "exact",
    "a chunk written in place": RuntimeError,
    "the doubled batch viewed (2, B, C)": "refused",
    "guidance by slices: z[:B], z[B:]": "exact",
    "rows of each batch: h[:2], h[-1:], h[::2], h[1:B]": "exact",
    "positions computed from B: z[:B - 1], z.split([B - 1, B + 1])": "exact",
    "numpy's names and keyword forms: vsplit, vstack, hstack, tensor_split(sections=)": "exact",
    "torch.vstack of 1-D tensors (reshaped first: the samples move)": "refused",
    "a slice written in place": RuntimeError,
}


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2), (2, 1)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(VIEWS))
def test_cat_and_split_along_the_samples_are_each_models(pattern: str, num_models: int, batch: int) -> None:
    expected = VIEWS[pattern]
    if isinstance(expected, str):
        assert assert_exact_or_refused(lambda: _Views(pattern), num_models, rows, batch) == expected
    else:
        with pytest.raises(expected, match="written in place after a (split|slice) along the samples' dimension"):
            stack([seeded(lambda: _Views(pattern), i) for i in range(num_models)])(rows((num_models, batch)))


class _MasksRows(nn.Module):
    """Writes into the rows that a mask computed from each sample's own values picks."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 3)
        self.token = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.fc(x)
        mask = h[:, 0] > 0
        if self.pattern == "h[mask] = 0":
            h[mask] = 0
        elif self.pattern == "h[mask] = a tensor shared by the models":
            h[mask] = torch.tensor([1.0, -2.0, 3.0], dtype=h.dtype)
        elif self.pattern == "h[mask, 1:] = -1":
            h[mask, 1:] = -1.0
        elif self.pattern == "h[mask] = self.token (per model)":
            h[mask] = self.token
        elif self.pattern == "h[mask] = h[mask] * 2 (its own rows, written back)":
            h[mask] = h[mask] * 2
        elif self.pattern == "h[arange(B) % 2 == 0] = 0 (the folded arange's parity)":
            h[torch.arange(x.shape[0]) % 2 == 0] = 0
        return h * 2


MASKED_ROWS = {
    "h[mask] = 0": "exact",
    "h[mask] = a tensor shared by the models": "exact",
    "h[mask, 1:] = -1": "exact",
    "h[mask] = self.token (per model)": "exact",
    "h[mask] = h[mask] * 2 (its own rows, written back)": "exact",
    "h[arange(B) % 2 == 0] = 0 (the folded arange's parity)": "refused",
}


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2), (2, 1)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(MASKED_ROWS))
def test_writes_into_rows_picked_by_a_mask(pattern: str, num_models: int, batch: int) -> None:
    """``h[row_mask] = v``: each sample's own rows get a value that is the same for every row, or the rows the
    mask picked, written back (both were refused); a mask made from the folded batch's size stays refused."""
    assert assert_exact_or_refused(lambda: _MasksRows(pattern), num_models, rows, batch) == MASKED_ROWS[pattern]


ROW_WRITES = {
    "y[0].zero_()": lambda y: y[0].zero_(),
    "y[:1].zero_()": lambda y: y[:1].zero_(),
    "y.narrow(0, 0, 1).zero_()": lambda y: y.narrow(0, 0, 1).zero_(),
    "y.select(0, 0).fill_(1)": lambda y: y.select(0, 0).fill_(1.0),
    "y[-1].add_(1)": lambda y: y[-1].add_(1.0),
    "y.T[:, 0].zero_()": lambda y: y.T[:, 0].zero_(),
    "y[:, :4].diagonal().zero_()": lambda y: y[:, :4].diagonal().zero_(),
    "y[:2][0].sigmoid_()": lambda y: y[:2][0].sigmoid_(),
    "F.relu(y[0], inplace=True)": lambda y: F.relu(y[0], inplace=True),
}


class _WritesRows(nn.Module):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        y = self.fc(x)
        ROW_WRITES[self.pattern](y.detach())  # (a view of y: no autograd check of the in-place write)
        return y


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("pattern", list(ROW_WRITES))
def test_a_write_into_some_of_the_samples_rows_is_refused(pattern: str, mode: type) -> None:
    """Each original writes into its own first (last, diagonal) rows; the folded write reaches some models'
    rows only (it changed model 0's alone)."""
    # (a slice along the samples is each model's own, a copy: the write is refused as a write into that copy)
    refused = r"writes into part of a tensor that holds the models' samples|written in place after a slice along"
    with mode(), pytest.raises((ValueError, RuntimeError), match=refused):
        stack([seeded(lambda: _WritesRows(pattern), i) for i in range(3)])(rows((3, 2)))


class _WritesEachSamplesRow(nn.Module):
    """Writes at ``[torch.arange(B), labels]``: sample i's own row i, as the read ``x[arange(B), idx]``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        B, labels = x.shape[0], h.argmax(-1)
        if self.pattern == "a one-hot: onehot[arange(B), labels] = 1":
            onehot = torch.zeros(B, 3, dtype=h.dtype)
            onehot[torch.arange(B), labels] = 1
            return h * onehot
        g = h.clone()
        if self.pattern == "g[arange(B), labels] = 0":
            g[torch.arange(B), labels] = 0
        elif self.pattern == "each sample's own values":
            g[torch.arange(B), labels] = h[:, 0] * 2
        elif self.pattern == "rows shifted by one (another sample's)":
            g[torch.arange(B).roll(1), labels] = 0
        return g


EACH_SAMPLES_ROW = {
    "a one-hot: onehot[arange(B), labels] = 1": "exact",
    "g[arange(B), labels] = 0": "exact",
    "each sample's own values": "exact",
    "rows shifted by one (another sample's)": "refused",
}


@pytest.mark.parametrize("num_models,batch", [(2, 3), (3, 2), (2, 1)], ids=lambda n: str(n))
@pytest.mark.parametrize("pattern", list(EACH_SAMPLES_ROW))
def test_writes_at_each_samples_own_row(pattern: str, num_models: int, batch: int) -> None:
    factory = lambda: _WritesEachSamplesRow(pattern)  # noqa: E731
    assert assert_exact_or_refused(factory, num_models, rows, batch) == EACH_SAMPLES_ROW[pattern]
