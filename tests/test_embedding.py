"""What is special to BatchedEmbedding: per-model options, index safety, sparse gradients, constructors.

The common checks (loop equality for plain, padding, int32 and frequency-scaled lookups, init, state dict,
compile, bad inputs) run from tests/cases_embedding.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from harness import assert_close, unbatch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchlayers.functional._embedding import embedding
from batchlayers.sparse import BatchedEmbedding

F64 = torch.float64


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def _reference(layer: BatchedEmbedding) -> list[nn.Embedding]:
    """One torch.nn.Embedding per model, holding that model's table, with the same options."""
    options = {
        "padding_idx": layer.padding_idx,
        "max_norm": layer.max_norm,
        "norm_type": layer.norm_type,
        "scale_grad_by_freq": layer.scale_grad_by_freq,
        "sparse": layer.sparse,
    }
    dtype = layer.weight.dtype
    return unbatch(layer, lambda: nn.Embedding(layer.num_embeddings, layer.embedding_dim, **options, dtype=dtype))


def _step_and_compare(layer: BatchedEmbedding, modules: list[nn.Embedding], idx: torch.Tensor, where: str) -> None:
    """One forward/backward through both; outputs, weight gradients and the weights after the call (max_norm
    renormalises them in place) must agree model by model."""
    layer.zero_grad()
    for m in modules:
        m.zero_grad()
    y = layer(idx)
    ys = [m(idx[i]) for i, m in enumerate(modules)]
    assert_close(y, torch.stack(ys), msg=f"output ({where})")
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    for i, yi in enumerate(ys):
        yi.backward(grad_out[i])
    assert layer.weight.grad.is_sparse == layer.sparse, f"gradient layout {layer.weight.grad.layout} ({where})"
    ref_grad = torch.stack([_dense(m.weight.grad) for m in modules])
    assert_close(_dense(layer.weight.grad), ref_grad, msg=f"weight gradient ({where})")
    ref_weight = torch.stack([m.weight.detach() for m in modules])
    assert_close(layer.weight.detach(), ref_weight, msg=f"weights after the call ({where})")


def _indices(num_models: int, num: int, shape: tuple[int, ...], shared: bool, dtype=torch.int64) -> torch.Tensor:
    if shared:
        return torch.randint(0, num, shape, dtype=dtype).expand(num_models, *shape)
    return torch.randint(0, num, (num_models, *shape), dtype=dtype)


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5])
def test_max_norm_renormalises_weights_like_the_loop(shared: bool, norm_type: float) -> None:
    torch.manual_seed(0)
    layer = BatchedEmbedding(3, 6, 4, max_norm=1.2, norm_type=norm_type, dtype=F64)
    modules = _reference(layer)
    before = layer.weight.detach().clone()
    for step in range(3):
        _step_and_compare(layer, modules, _indices(3, 6, (2, 3), shared), f"step {step}")
    assert not torch.equal(before, layer.weight), "max_norm=1.2 on N(0, 1) rows should have renormalised some"
    norms = layer.weight.detach().norm(p=norm_type, dim=-1)
    assert bool((norms <= 1.2 + 1e-6).any()), "no row renormalised"


def test_padding_row_gets_no_gradient_in_any_model() -> None:
    torch.manual_seed(0)
    layer = BatchedEmbedding(3, 5, 2, padding_idx=-2, dtype=F64)
    assert layer.padding_idx == 3
    assert torch.equal(layer.weight[:, 3], torch.zeros(3, 2, dtype=F64)), "padding row not zeroed in every model"
    with torch.no_grad():
        layer.weight[:, 3] = torch.arange(6, dtype=F64).view(3, 2)  # a non-zero pad is still looked up
    idx = torch.full((3, 4), 3)
    idx[:, 0] = torch.tensor([0, 1, 2])
    y = layer(idx)
    assert torch.equal(y[:, 1], layer.weight[:, 3].detach())
    y.sum().backward()
    assert torch.equal(layer.weight.grad[:, 3], torch.zeros(3, 2, dtype=F64))
    for m in range(3):
        assert torch.equal(layer.weight.grad[m, m], torch.ones(2, dtype=F64)), f"model {m}'s row {m}"


def test_scale_grad_by_freq_counts_per_model() -> None:
    # Model 0 looks up row 1 four times, model 1 once: scaled gradients 4 * (1/4) = 1 and 1 * 1 = 1. Counted
    # over all models together, model 1 would get 1/5.
    layer = BatchedEmbedding(2, 3, 2, scale_grad_by_freq=True, dtype=F64)
    idx = torch.tensor([[1, 1, 1, 1], [1, 0, 2, 2]])
    layer(idx).sum().backward()
    assert torch.equal(layer.weight.grad[:, 1], torch.ones(2, 2, dtype=F64))
    modules = _reference(layer)
    _step_and_compare(layer, modules, idx, "scale_grad_by_freq")


def test_sparse_with_scale_grad_by_freq_fails_at_backward_like_torch() -> None:
    layer = BatchedEmbedding(2, 4, 3, scale_grad_by_freq=True, sparse=True)
    reference = nn.Embedding(4, 3, scale_grad_by_freq=True, sparse=True)
    idx = torch.tensor([[1, 1], [2, 3]])
    for module, x in ((layer, idx), (reference, idx[0])):
        y = module(x)  # the forward works (e.g. for evaluation), as in torch.nn
        with pytest.raises(RuntimeError, match="scale_grad_by_freq not supported with sparse gradients"):
            y.sum().backward()


@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam", "Adagrad"])
def test_sparse_gradient_trains_like_the_loop(optimizer: str) -> None:
    torch.manual_seed(0)
    layer = BatchedEmbedding(3, 7, 4, padding_idx=0, sparse=True, dtype=F64)
    modules = _reference(layer)
    make = getattr(torch.optim, optimizer)
    opt = make(layer.parameters(), lr=0.1)
    ref_opts = [make(m.parameters(), lr=0.1) for m in modules]
    for step in range(3):
        _step_and_compare(layer, modules, _indices(3, 7, (5, 2), shared=step == 1), f"{optimizer} step {step}")
        assert layer.weight.grad.shape == layer.weight.shape
        assert layer.weight.grad.sparse_dim() == 2 and layer.weight.grad.dense_dim() == 1
        # Checking invariants is opting in explicitly (Adagrad's own sparse tensors warn otherwise), and it
        # validates the sparse gradient the layer produced.
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            opt.step()
            for o in ref_opts:
                o.step()
        assert_close(layer.weight.detach(), torch.stack([m.weight.detach() for m in modules]), msg=f"after step {step}")


def test_compiled_sparse_and_max_norm_match_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    idx = torch.randint(0, 6, (3, 4, 2))
    idx[:, 0, 0] = 5  # padding row looked up in every model
    for options in ({"sparse": True, "padding_idx": 5, "max_norm": 1.0}, {"max_norm": 1.0, "scale_grad_by_freq": True}):
        eager = BatchedEmbedding(3, 6, 4, **options, dtype=F64)
        compiled_copy = BatchedEmbedding(3, 6, 4, **options, _weight=eager.weight.detach().clone())
        compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
        y_eager, y_compiled = eager(idx), compiled(idx)
        assert_close(y_compiled, y_eager, msg=f"compiled output {options}")
        y_eager.sum().backward()
        y_compiled.sum().backward()
        assert compiled_copy.weight.grad.layout == eager.weight.grad.layout
        assert_close(_dense(compiled_copy.weight.grad), _dense(eager.weight.grad), msg=f"compiled gradient {options}")
        assert_close(compiled_copy.weight.detach(), eager.weight.detach(), msg=f"renormalised weights {options}")


BAD_INDICES = [-1, 6, 13, -7]  # with flat offsets (M=3, num=6), in model 1 these are rows of models 0, 2, 3, 0
PATHS = {"plain": {}, "max_norm": {"max_norm": 0.5}, "sparse": {"sparse": True}}


def _with_bad_index(bad_index: int) -> torch.Tensor:
    idx = torch.randint(0, 6, (3, 2, 2))
    idx[1, 1, 0] = bad_index
    return idx


def _assert_only_own_rows_changed(weight: torch.Tensor, before: torch.Tensor, idx: torch.Tensor) -> None:
    """A failed lookup may have renormalised rows it was asked for (torch.nn.Embedding does too, before its
    bounds check fires), never any other row."""
    for m in range(weight.shape[0]):
        asked = {int(i) for i in idx[m].flatten() if 0 <= i < weight.shape[1]}
        changed = {r for r in range(weight.shape[1]) if not torch.equal(weight[m, r], before[m, r])}
        assert changed <= asked, f"model {m}: rows {sorted(changed - asked)} changed by a failed lookup"


@pytest.mark.parametrize("bad_index", BAD_INDICES)
@pytest.mark.parametrize("path", list(PATHS))
def test_functional_out_of_range_raises_and_touches_no_other_row(bad_index: int, path: str) -> None:
    """The functional has no friendly message; the lookup itself must still refuse the index."""
    weight = torch.randn(3, 6, 2, dtype=F64, requires_grad=True)
    before = weight.detach().clone()
    idx = _with_bad_index(bad_index)
    with pytest.raises(IndexError, match="out of range"):
        embedding(idx, weight, **PATHS[path])
    _assert_only_own_rows_changed(weight.detach(), before, idx)


@pytest.mark.parametrize("path", list(PATHS))
def test_out_of_range_raises_compiled_and_eager(path: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = BatchedEmbedding(3, 6, 2, **PATHS[path], dtype=F64)
    eager_before = eager.weight.detach().clone()
    compiled_copy = BatchedEmbedding(3, 6, 2, **PATHS[path], _weight=eager_before.clone())
    compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
    compiled(torch.zeros(3, 2, 2, dtype=torch.int64))  # compile once, then only bad inputs of the same shape
    for bad_index in BAD_INDICES:
        idx = _with_bad_index(bad_index)
        with pytest.raises(IndexError, match=rf"BatchedEmbedding: index {bad_index} at position \(1, 1, 0\)"):
            eager(idx)
        before = compiled_copy.weight.detach().clone()
        with pytest.raises(Exception, match="out of range|out of bounds"):
            compiled(idx)
        _assert_only_own_rows_changed(compiled_copy.weight.detach(), before, idx)
    assert torch.equal(eager.weight, eager_before), "the eager check must fire before max_norm touches any row"


def test_functional_handles_negative_padding_idx_and_rejects_max_norm_on_non_contiguous_weight() -> None:
    weight = torch.randn(2, 4, 3, dtype=F64, requires_grad=True)
    idx = torch.tensor([[3, 1], [3, 2]])
    embedding(idx, weight, padding_idx=-1).sum().backward()
    assert torch.equal(weight.grad[:, 3], torch.zeros(2, 3, dtype=F64))
    transposed = torch.randn(3, 4, 2, dtype=F64).transpose(0, 2)  # (2, 4, 3), not contiguous
    assert_close(embedding(idx, transposed), torch.stack([transposed[m][idx[m]] for m in range(2)]), msg="lookup")
    with pytest.raises(ValueError, match="max_norm.*contiguous"):
        embedding(idx, transposed, max_norm=1.0)


def test_constructor_validation_and_pretrained_weights() -> None:
    with pytest.raises(ValueError, match=r"BatchedEmbedding: padding_idx must be within num_embeddings=5.*got 5"):
        BatchedEmbedding(2, 5, 3, padding_idx=5)
    with pytest.raises(ValueError, match=r"padding_idx.*got -6"):
        BatchedEmbedding(2, 5, 3, padding_idx=-6)
    with pytest.raises(ValueError, match=r"_weight of shape .*\(2, 5, 3\), got \(5, 3\)"):
        BatchedEmbedding(2, 5, 3, _weight=torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"from_pretrained: expected embeddings .*got shape \(5, 3\)"):
        BatchedEmbedding.from_pretrained(torch.randn(5, 3))

    tables = torch.randn(2, 5, 3)
    layer = BatchedEmbedding(2, 5, 3, padding_idx=0, _weight=tables, _freeze=True)
    assert layer.weight.data_ptr() == tables.data_ptr() and not layer.weight.requires_grad
    assert torch.equal(layer.weight[:, 0], tables[:, 0]), "a given _weight is not re-initialised, as in torch.nn"

    pretrained = BatchedEmbedding.from_pretrained(tables, padding_idx=1, max_norm=2.0)
    torch_pretrained = nn.Embedding.from_pretrained(tables[1], padding_idx=1, max_norm=2.0)
    assert (pretrained.num_models, pretrained.num_embeddings, pretrained.embedding_dim) == (2, 5, 3)
    assert not pretrained.weight.requires_grad and pretrained.padding_idx == 1 and pretrained.max_norm == 2.0
    assert BatchedEmbedding.from_pretrained(tables, freeze=False).weight.requires_grad
    assert pretrained.extra_repr() == "num_models=2, " + ", ".join(
        f"{k}={v}" for k, v in [("num_embeddings", 5), ("embedding_dim", 3), ("padding_idx", 1), ("max_norm", 2.0)]
    )
    assert torch_pretrained.extra_repr() == "5, 3, padding_idx=1, max_norm=2.0"
    full = BatchedEmbedding(2, 5, 3, norm_type=1.0, scale_grad_by_freq=True, sparse=True)
    assert full.extra_repr().endswith("norm_type=1.0, scale_grad_by_freq=True, sparse=True")


def test_reset_parameters_zeroes_padding_per_model_in_place() -> None:
    layer = BatchedEmbedding(4, 6, 3, padding_idx=2)
    with torch.no_grad():
        layer.weight.fill_(7.0)
    ptr = layer.weight.data_ptr()
    layer.reset_parameters()
    assert layer.weight.data_ptr() == ptr
    assert torch.equal(layer.weight[:, 2], torch.zeros(4, 3))
    assert not bool((layer.weight == 7.0).any())


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(1, 4),
    num=st.integers(1, 7),
    dim=st.integers(1, 4),
    sample_shape=st.lists(st.integers(0, 3), min_size=1, max_size=3).map(tuple),
    padding=st.one_of(st.none(), st.integers(-7, 6)),
    max_norm=st.one_of(st.none(), st.floats(0.3, 3.0)),
    scale_grad_by_freq=st.booleans(),
    sparse=st.booleans(),
    shared=st.booleans(),
    int32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_loop(
    num_models, num, dim, sample_shape, padding, max_norm, scale_grad_by_freq, sparse, shared, int32, seed
) -> None:
    torch.manual_seed(seed)
    scale_grad_by_freq = scale_grad_by_freq and not sparse  # torch has no such gradient either (tested below)
    padding_idx = padding if padding is not None and -num <= padding < num else None
    layer = BatchedEmbedding(num_models, num, dim, padding_idx, max_norm, 2.0, scale_grad_by_freq, sparse, dtype=F64)
    modules = _reference(layer)
    idx = _indices(num_models, num, sample_shape, shared, torch.int32 if int32 else torch.int64)
    _step_and_compare(layer, modules, idx, "property")


# (forward-mode AD's first use in a process registers torch's jit decompositions, which warn)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["vmap-grad", "forward-ad"])
@pytest.mark.parametrize("padding_idx", [None, 0], ids=["no-padding", "padding"])
def test_torch_func_transforms(padding_idx, transform) -> None:
    """Under a torch.func transform or forward-mode AD the lookup neither reads index values (vmap cannot) nor
    runs its own autograd Function (no vmap or jvp rule): per-sample gradients and a forward-mode derivative
    equal each model's ``nn.Embedding``'s, the padding row's gradient cut as there (both raised before)."""
    torch.manual_seed(0)
    batched = BatchedEmbedding(3, 6, 4, padding_idx=padding_idx, dtype=torch.float64)
    modules = unbatch(batched, lambda: nn.Embedding(6, 4, padding_idx=padding_idx, dtype=torch.float64))
    index = torch.randint(0, 6, (3, 2, 5))
    index[:, :, 0] = 0  # (the padding row, where there is one)
    weight = batched.weight.detach()
    if transform == "vmap-grad":

        def loss(w, sample):  # (M, 5): one sample per model
            return torch.func.functional_call(batched, {"weight": w}, (sample.unsqueeze(1),)).square().sum()

        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 1))(weight, index)
        for m, module in enumerate(modules):
            expected = [torch.autograd.grad(module(index[m, i]).square().sum(), module.weight)[0] for i in range(2)]
            assert_close(got[:, m], torch.stack(expected), msg=f"per-sample gradients of model {m}")
    else:
        tangent = torch.randn_like(weight)
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(weight.clone().requires_grad_(), tangent)  # (recorded for backward too)
            got = forward_ad.unpack_dual(torch.func.functional_call(batched, {"weight": dual}, (index,))).tangent
            for m, module in enumerate(modules):
                own = torch.func.functional_call(
                    module, {"weight": forward_ad.make_dual(weight[m], tangent[m])}, (index[m],)
                )
                assert_close(got[m], forward_ad.unpack_dual(own).tangent, msg=f"tangent of model {m}")
