"""BatchedEmbeddingBag and functional.embedding_bag against a loop of torch.nn.EmbeddingBag modules.

Every bag form (fixed-size 2-D bags, offsets, offsets with include_last_offset, empty bags), mode, padding,
per-sample weights and max_norm, per-model and shared inputs; then what is special: torch's CPU frequency
scaling, sparse gradients, one kernel call for all models, offsets that never mix models, bad inputs,
constructors and the converter.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from harness import LayerCase, RecordOps, assert_close, check_init_matches_torch, check_state_dict_layout, unbatch
from torch import nn

import batchlayers
from batchlayers.functional._embedding import _embedding_bag, embedding_bag
from batchlayers.sparse import BatchedEmbeddingBag

F64 = torch.float64
NUM, DIM = 6, 3
PAD = -2  # row 4: a negative padding_idx counts from the end, as in torch.nn

# Each model's own bags for N = 7 indices: empty bags in the middle and at the end, bags of 1 to 4 indices. The
# first two indices are padding (see _batch): bag 0 of the first pattern is padding only (zeros, as torch gives),
# the other patterns mix padding with indices (a mean counts only the indices).
N = 7
PATTERNS = [[0, 2, 2, 5], [0, 0, 4, 6], [0, 3, 7, 7]]
FORMS = ["2d", "offsets", "last_offset"]
MODES = ["sum", "sum_weights", "mean", "max"]  # sum_weights: mode 'sum' with per_sample_weights


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def _reference(layer: BatchedEmbeddingBag) -> list[nn.EmbeddingBag]:
    """One torch.nn.EmbeddingBag per model, holding that model's table, with the same options."""
    options = {
        "max_norm": layer.max_norm,
        "norm_type": layer.norm_type,
        "scale_grad_by_freq": layer.scale_grad_by_freq,
        "mode": layer.mode,
        "sparse": layer.sparse,
        "include_last_offset": layer.include_last_offset,
        "padding_idx": layer.padding_idx,
        "dtype": layer.weight.dtype,
    }
    return unbatch(layer, lambda: nn.EmbeddingBag(layer.num_embeddings, layer.embedding_dim, **options))


def _batch(form: str, lead: tuple[int, ...], padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indices (and offsets) for ``lead = (M,)`` (per model) or ``()`` (one model's, to be shared)."""
    if form == "2d":
        idx = torch.randint(0, NUM, (*lead, 4, 3))
        if padding_idx is not None:
            idx[..., 0, :] = padding_idx  # a bag of padding only
            idx[..., 1, 1] = padding_idx
        return idx, None
    idx = torch.randint(0, NUM, (*lead, N))
    if padding_idx is not None:
        idx[..., :2] = padding_idx
    patterns = [PATTERNS[m % len(PATTERNS)] for m in range(lead[0])] if lead else PATTERNS[0]
    offsets = torch.tensor(patterns)
    if form == "last_offset":
        offsets = torch.cat([offsets, torch.full((*lead, 1), N)], dim=-1)
    return idx, offsets


def _compare_step(
    layer: BatchedEmbeddingBag,
    modules: list[nn.EmbeddingBag],
    idx: torch.Tensor,
    offsets: torch.Tensor | None,
    weights: torch.Tensor | None,
    shared: bool,
    where: str,
) -> None:
    """One forward/backward through both: outputs, weight gradients, per-sample-weight gradients, and the
    weights after the call (max_norm renormalises them in place) must agree model by model."""
    num_models = layer.num_models
    layer.zero_grad()
    for m in modules:
        m.zero_grad()
    w_batched = None if weights is None else weights.detach().clone().requires_grad_()
    w_ref = None if weights is None else weights.detach().clone().requires_grad_()

    def expand(t):  # a shared batch is one batch, viewed M times (stride 0), never copied
        return t.expand(num_models, *t.shape) if shared and t is not None else t

    def own(t, i):
        return t if shared or t is None else t[i]

    y = layer(expand(idx), expand(offsets), expand(w_batched))
    if shared and num_models > 1:
        assert expand(idx).stride(0) == 0
    ys = [m(own(idx, i), own(offsets, i), own(w_ref, i)) for i, m in enumerate(modules)]
    assert_close(y, torch.stack(ys), msg=f"output ({where})")
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    for i, yi in enumerate(ys):
        yi.backward(grad_out[i])
    assert layer.weight.grad.is_sparse == layer.sparse, f"gradient layout {layer.weight.grad.layout} ({where})"
    ref_grad = torch.stack([_dense(m.weight.grad) for m in modules])
    assert_close(_dense(layer.weight.grad), ref_grad, msg=f"weight gradient ({where})")
    if weights is not None:
        assert_close(w_batched.grad, w_ref.grad, msg=f"per_sample_weights gradient ({where})")
    assert_close(layer.weight.detach(), torch.stack([m.weight.detach() for m in modules]), msg=f"weights ({where})")


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("max_norm", [None, 1.1], ids=["", "max_norm"])
@pytest.mark.parametrize("padding_idx", [None, PAD], ids=["", "pad"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_loop(mode, form, padding_idx, max_norm, num_models, dtype) -> None:
    """Per-model bags, then one batch shared by every model (a stride-0 expand), through the same layer (with
    max_norm, the second step sees weights the first renormalised)."""
    torch.manual_seed(0)
    layer = BatchedEmbeddingBag(
        num_models,
        NUM,
        DIM,
        max_norm=max_norm,
        mode=mode.removesuffix("_weights"),
        include_last_offset=form == "last_offset",
        padding_idx=padding_idx,
        dtype=dtype,
    )
    with torch.no_grad():  # a non-zero padding row too: it must still be left out of the bags
        layer.weight.add_(torch.randn_like(layer.weight))
    modules = _reference(layer)
    for shared in (False, True):
        idx, offsets = _batch(form, () if shared else (num_models,), layer.padding_idx)
        weights = torch.randn(idx.shape, dtype=dtype) if mode == "sum_weights" else None
        _compare_step(layer, modules, idx, offsets, weights, shared, "shared" if shared else "per-model")


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("padding_idx", [None, 1], ids=["", "pad"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_scale_grad_by_freq_matches_torch_cpu_per_model(mode, form, padding_idx, shared) -> None:
    """torch's CPU kernel scales the gradient of its i-th distinct index by the count of its i-th sorted index,
    not always its own: with model 0 = [5, 3, 3] the gradient of row 5 is halved. Each model must get exactly
    that, computed from its own indices only (the kernel run over all models at once would mix their counts)."""
    torch.manual_seed(0)
    layer = BatchedEmbeddingBag(3, NUM, DIM, scale_grad_by_freq=True, mode=mode, padding_idx=padding_idx, dtype=F64)
    layer.include_last_offset = form == "last_offset"
    modules = _reference(layer)
    idx, offsets = _batch(form, () if shared else (3,), padding_idx)
    idx.view(-1)[:3] = torch.tensor([5, 3, 3])
    _compare_step(layer, modules, idx, offsets, None, shared, "scale_grad_by_freq")
    flat = torch.randint(0, NUM, (3, 1500))  # beyond 1000 indices torch's kernel runs in parallel
    bags = torch.tensor([0, 10, 10, 700]).expand(3, 4)
    if layer.include_last_offset:
        bags = torch.cat([bags, torch.full((3, 1), 1500)], dim=1)
    _compare_step(layer, modules, flat, bags, None, False, "scale_grad_by_freq, 1500 indices")


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sparse_gradient_trains_like_the_loop(mode: str) -> None:
    torch.manual_seed(0)
    layer = BatchedEmbeddingBag(3, NUM, DIM, mode=mode, sparse=True, padding_idx=0, dtype=F64)
    modules = _reference(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in modules]
    for step, form in enumerate(FORMS):
        layer.include_last_offset = form == "last_offset"
        for m in modules:
            m.include_last_offset = layer.include_last_offset
        idx, offsets = _batch(form, (3,), 0)
        _compare_step(layer, modules, idx, offsets, None, False, f"{form}")
        assert layer.weight.grad.shape == layer.weight.shape and layer.weight.grad.sparse_dim() == 2
        opt.step()
        for o in ref_opts:
            o.step()
        assert_close(layer.weight.detach(), torch.stack([m.weight.detach() for m in modules]), msg=f"step {step}")


def test_include_last_offset_ends_the_last_bag_at_the_end_like_torch() -> None:
    """torch's kernels end the last bag at the end of the indices whatever the last offset (at most N): the
    indices after it are in the last bag."""
    torch.manual_seed(0)
    layer = BatchedEmbeddingBag(2, NUM, DIM, mode="mean", include_last_offset=True, dtype=F64)
    modules = _reference(layer)
    idx = torch.randint(0, NUM, (2, N))
    offsets = torch.tensor([[0, 2, 4], [0, 5, 5]])
    _compare_step(layer, modules, idx, offsets, None, False, "last offset before the end")
    assert_close(layer(idx, offsets)[0, 1], layer.weight[0, idx[0, 2:]].mean(0), msg="last bag")


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_no_bags_gives_an_empty_output(include_last_offset: bool) -> None:
    """(torch.nn.EmbeddingBag crashes on empty offsets; the batched layer returns (M, 0, dim).)"""
    layer = BatchedEmbeddingBag(3, NUM, DIM, mode="sum", include_last_offset=include_last_offset)
    y = layer(torch.randint(0, NUM, (3, 4)), torch.zeros(3, int(include_last_offset), dtype=torch.int64))
    assert y.shape == (3, 0, DIM)
    y.sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
    assert layer(torch.zeros(3, 0, 2, dtype=torch.int64)).shape == (3, 0, DIM)
    with pytest.raises(ValueError, match="bags of size 0"):  # torch.nn.EmbeddingBag fails there too
        layer(torch.zeros(3, 0, 0, dtype=torch.int64))


@pytest.mark.parametrize("form", FORMS)
def test_one_kernel_call_for_all_models(form: str) -> None:
    layer = BatchedEmbeddingBag(3, NUM, DIM, mode="mean", padding_idx=1, include_last_offset=form == "last_offset")
    idx, offsets = _batch(form, (3,), 1)
    with RecordOps() as record:
        layer(idx, offsets).sum().backward()
    calls = [op for op, _, _ in record.ops if "embedding_bag" in op and "backward" not in op]
    assert len(calls) == 1, calls


def test_functional_offsets_never_mix_models() -> None:
    """Where offsets are not checked (off CPU, compiled), bad ones are clamped into the model's own indices:
    with model m's rows all equal to m, every bag of model m is m (or 0 when empty)."""
    weight = torch.arange(3, dtype=F64).view(3, 1, 1).expand(3, NUM, DIM).contiguous()
    idx = torch.randint(0, NUM, (3, 5))
    for offsets in ([[0, 9, 2], [4, -3, 1], [7, 0, 5]], [[-1, 1, 9], [9, 9, 9], [0, 2, 6]]):
        for last in (False, True):
            args = (None, 2.0, False, "max", False, None, last, None)
            out = _embedding_bag(idx, weight, torch.tensor(offsets), *args)
            for m in range(3):
                assert bool(((out[m] == m) | (out[m] == 0)).all()), f"model {m} read another model's rows: {out[m]}"


def test_functional_matches_layer_and_refuses_bad_indices() -> None:
    torch.manual_seed(0)
    layer = BatchedEmbeddingBag(3, NUM, DIM, mode="max", padding_idx=2, dtype=F64)
    idx, offsets = _batch("offsets", (3,), 2)
    expected = layer(idx, offsets)
    assert_close(embedding_bag(idx, layer.weight, offsets, mode="max", padding_idx=-4), expected, msg="functional")
    idx[1, 3] = -1  # in a flat table: the last row of model 0
    with pytest.raises(RuntimeError, match="idx >= 0 && idx < num_embeddings"):
        embedding_bag(idx, layer.weight, offsets)
    with pytest.raises(ValueError, match=r"embedding_bag: offsets\[0, 0\] is 1"):
        embedding_bag(idx.clamp(0), layer.weight, offsets + 1)
    with pytest.raises(ValueError, match="max_norm.*contiguous"):
        embedding_bag(idx.clamp(0), layer.weight.detach().transpose(1, 2).contiguous().transpose(1, 2), offsets, 1.0)


def test_compiled_matches_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {"mode": "mean", "padding_idx": 1, "max_norm": 1.0, "scale_grad_by_freq": True}
    eager = BatchedEmbeddingBag(3, NUM, DIM, **options, dtype=F64)
    compiled_copy = BatchedEmbeddingBag(3, NUM, DIM, **options, _weight=eager.weight.detach().clone())
    compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
    idx, offsets = _batch("offsets", (3,), 1)
    y_eager, y_compiled = eager(idx, offsets), compiled(idx, offsets)
    assert_close(y_compiled, y_eager, msg="compiled output")
    y_eager.sum().backward()
    y_compiled.sum().backward()
    assert_close(compiled_copy.weight.grad, eager.weight.grad, msg="compiled gradient")
    assert_close(compiled_copy.weight.detach(), eager.weight.detach(), msg="renormalised weights")


CASE = LayerCase(
    id="EmbeddingBag",
    batched=lambda m, dt: BatchedEmbeddingBag(m, 11, 4, padding_idx=3, dtype=dt),
    torch=lambda dt: nn.EmbeddingBag(11, 4, padding_idx=3, dtype=dt),
    input=lambda lead, dt: torch.randint(0, 11, (*lead, 3)),
)


def test_init_matches_torch_per_model() -> None:
    check_init_matches_torch(CASE)
    layer = BatchedEmbeddingBag(4, 6, 3, padding_idx=-1)
    assert layer.padding_idx == 5 and torch.equal(layer.weight[:, 5], torch.zeros(4, 3))


def test_state_dict_layout() -> None:
    check_state_dict_layout(CASE)


def test_signature_mirrors_torch() -> None:
    ours = list(inspect.signature(BatchedEmbeddingBag.__init__).parameters.values())
    theirs = list(inspect.signature(nn.EmbeddingBag.__init__).parameters.values())
    assert [p.name for p in ours[:2]] == ["self", "num_models"]
    assert [(p.name, p.default) for p in ours[2:]] == [(p.name, p.default) for p in theirs[1:]]
    forward = list(inspect.signature(BatchedEmbeddingBag.forward).parameters.values())
    assert [(p.name, p.default) for p in forward] == [
        (p.name, p.default) for p in inspect.signature(nn.EmbeddingBag.forward).parameters.values()
    ]
    assert BatchedEmbeddingBag.torch_module is nn.EmbeddingBag


def _indices_with(model: int, value: int) -> torch.Tensor:
    idx = torch.randint(0, NUM, (3, 2, 3))
    idx[model, 1, 2] = value
    return idx


def _flat() -> torch.Tensor:
    return torch.randint(0, NUM, (3, 5))


def _bags(*rows) -> torch.Tensor:
    return torch.tensor(rows)


# id: (layer options, call arguments, exception, message)
BAD_INPUTS = {
    "models": ({}, lambda: (torch.randint(0, NUM, (4, 2, 3)),), ValueError, r"dimension 0 \(models\) is 4, not 3"),
    "models_offsets": ({}, lambda: (_flat(), _bags([0, 1], [0, 2])), ValueError, r"offsets \(M, B\) with M=3.*\(2, 2\)"),  # noqa: E501
    "negative": ({}, lambda: (_indices_with(1, -1),), IndexError, r"BatchedEmbeddingBag: index -1 .*\(model 1\)"),
    "too_large": ({}, lambda: (_indices_with(0, NUM),), IndexError, rf"index {NUM} .*\(model 0\).*num_embeddings={NUM}"),  # noqa: E501
    "offsets_with_2d": ({}, lambda: (_indices_with(0, 0), _bags(*[[0, 1]] * 3)), ValueError, r"offsets must be None"),
    "flat_without_offsets": ({}, lambda: (_flat(),), ValueError, r"\(M, N\) indices .*need offsets"),
    "weights_with_mean": (
        {},
        lambda: (_indices_with(0, 0), None, torch.ones(3, 2, 3)),
        NotImplementedError,
        r"per_sample_weights is only supported for mode='sum' \(got mode='mean'\)",
    ),
    "not_a_tensor": ({}, lambda: ([[0, 1]] * 3,), TypeError, r"BatchedEmbeddingBag: expected the indices to be a Tensor"),  # noqa: E501
    "offsets_not_a_tensor": ({}, lambda: (_flat(), [[0]] * 3), TypeError, r"offsets to be a Tensor, got list"),
    "float_indices": ({}, lambda: (torch.zeros(3, 2, 3),), TypeError, r"integer indices.*float32"),
    "one_dimension": ({}, lambda: (torch.zeros(3, dtype=torch.int64),), ValueError, r"got 1-D shape \(3\)"),
    "empty_fixed_bags": ({}, lambda: (torch.zeros(3, 2, 0, dtype=torch.int64),), ValueError, r"bags of size 0"),
    "offsets_start": ({}, lambda: (_flat(), _bags([0, 1], [1, 2], [0, 0])), ValueError, r"offsets\[1, 0\] is 1"),
    "offsets_decrease": ({}, lambda: (_flat(), _bags([0, 1, 1], [0, 3, 2], [0, 0, 0])), ValueError, r"offsets of model 1 decrease at position 2: 3 then 2"),  # noqa: E501
    "offsets_beyond": ({}, lambda: (_flat(), _bags([0, 1], [0, 6], [0, 5])), ValueError, r"offsets\[1, -1\] is 6, more than .*N=5"),  # noqa: E501
    "last_offset_missing": ({"include_last_offset": True}, lambda: (_flat(), torch.zeros(3, 0, dtype=torch.int64)), ValueError, r"\(M, B \+ 1\)"),  # noqa: E501
    "stacked_offsets": ({}, lambda: (_flat(), torch.zeros(3, 5, 2, dtype=torch.int64)), ValueError, r"cannot be split among the models"),  # noqa: E501
    "weights_shape": ({"mode": "sum"}, lambda: (_flat(), _bags(*[[0, 2]] * 3), torch.ones(3, 4)), ValueError, r"per_sample_weights must have the indices' shape \(3, 5\), got \(3, 4\)"),  # noqa: E501
    "weights_dtype": ({"mode": "sum"}, lambda: (_flat(), _bags(*[[0, 2]] * 3), torch.ones(3, 5, dtype=F64)), TypeError, r"weight's dtype torch.float32"),  # noqa: E501
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises(name: str) -> None:
    options, make_args, exc, pattern = BAD_INPUTS[name]
    layer = BatchedEmbeddingBag(3, NUM, DIM, **options)
    before = layer.weight.detach().clone()
    with pytest.raises(exc, match=pattern):
        layer(*make_args())
    assert torch.equal(layer.weight, before)


def test_constructor_validation_and_pretrained_weights() -> None:
    with pytest.raises(ValueError, match=r"BatchedEmbeddingBag: mode must be 'sum', 'mean' or 'max', got 'min'"):
        BatchedEmbeddingBag(2, 5, 3, mode="min")
    with pytest.raises(ValueError, match=r"padding_idx must be within num_embeddings=5.*got -6"):
        BatchedEmbeddingBag(2, 5, 3, padding_idx=-6)
    with pytest.raises(ValueError, match=r"_weight of shape .*\(2, 5, 3\), got \(5, 3\)"):
        BatchedEmbeddingBag(2, 5, 3, _weight=torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"from_pretrained: expected embeddings .*got shape \(5, 3\)"):
        BatchedEmbeddingBag.from_pretrained(torch.randn(5, 3))
    tables = torch.randn(2, 5, 3)
    layer = BatchedEmbeddingBag(2, 5, 3, padding_idx=0, _weight=tables)
    assert layer.weight.data_ptr() == tables.data_ptr() and layer.weight.requires_grad
    assert torch.equal(layer.weight[:, 0], tables[:, 0]), "a given _weight is not re-initialised, as in torch.nn"
    pretrained = BatchedEmbeddingBag.from_pretrained(tables, mode="sum", padding_idx=1, max_norm=2.0)
    assert not pretrained.weight.requires_grad and pretrained.mode == "sum" and pretrained.padding_idx == 1
    assert BatchedEmbeddingBag.from_pretrained(tables, freeze=False).weight.requires_grad
    torch_repr = nn.EmbeddingBag.from_pretrained(tables[0], mode="sum", padding_idx=1, max_norm=2.0).extra_repr()
    assert pretrained.extra_repr() == "num_models=2, num_embeddings=5, embedding_dim=3, " + torch_repr[6:]


class _Bags(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(NUM, 4, **options, dtype=F64)
        self.head = nn.Linear(4, 2, dtype=F64)

    def forward(self, x, weights=None):
        return self.head(self.bag(x, per_sample_weights=weights))


class _Offsets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(NUM, 4, dtype=F64)
        self.register_buffer("offsets", torch.tensor([0, 2, 2]))

    def forward(self, x):  # x: (N,) indices of three bags
        return self.bag(x, self.offsets)


@pytest.mark.parametrize("options", [{"mode": "mean", "padding_idx": 0}, {"mode": "max"}, {"mode": "sum"}], ids=str)
def test_stacked_models_swap_in_the_batched_layer(options) -> None:
    torch.manual_seed(0)
    models = [_Bags(**options) for _ in range(3)]
    stacked = batchlayers.stack(models)
    assert isinstance(stacked.bag, BatchedEmbeddingBag)
    idx = torch.randint(0, NUM, (3, 5, 4))
    weights = torch.randn(3, 5, 4, dtype=F64) if options["mode"] == "sum" else None
    result = batchlayers.verify(models, stacked, idx, weights)
    assert result.passed.all(), result
    shared = batchlayers.verify(models, stacked, torch.randint(0, NUM, (5, 4)).expand(3, 5, 4))
    assert shared.passed.all(), shared
    for model, back in zip(models, batchlayers.unstack(stacked)):
        assert type(back.bag) is nn.EmbeddingBag and torch.equal(back.bag.weight, model.bag.weight)


def test_stacked_offsets_are_refused() -> None:
    stacked = batchlayers.stack([_Offsets() for _ in range(3)])
    with pytest.raises(ValueError, match=r"BatchedEmbeddingBag at 'bag'.*cannot be split among the models"):
        stacked(torch.randint(0, NUM, (3, 8)))
