"""BatchedMultiheadAttention against a loop over torch.nn.MultiheadAttention modules holding the same slices,
and the converter's per-model path for MultiheadAttention inside stacked models."""

from __future__ import annotations

import itertools

import pytest
import torch
from harness import RecordOps, assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchlayers.attention import BatchedMultiheadAttention
from batchlayers.functional._short_attention import MAX_LENGTH

M, B, L, S, E, HEADS = 3, 2, 4, 5, 8, 2


def _loop(batched: BatchedMultiheadAttention, **kwargs) -> list[nn.MultiheadAttention]:
    modules = []
    for i in range(batched.num_models):
        module = nn.MultiheadAttention(E, HEADS, **kwargs, dtype=torch.float64)
        module.load_state_dict({k: v[i] for k, v in batched.state_dict().items()})
        modules.append(module.train(batched.training))
    return modules


CONFIGS = {
    "default": {},
    "no bias": {"bias": False},
    "bias_kv + zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
    "kdim/vdim": {"kdim": 6, "vdim": 3},
}
MASKS = ["none", "padding bool", "padding float", "attn 2-D bool", "attn 2-D float", "attn per model", "attn 4-D",
         "causal", "padding + attn"]  # fmt: skip


def _masks(kind: str, dtype: torch.dtype) -> tuple[dict, list[dict]]:
    """Masks for the batched layer and, per model, for torch's."""
    padding = torch.rand(M, B, S) < 0.3
    padding[..., 0] = False  # every query attends to something
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    if kind == "none":
        return {}, [{}] * M
    if kind.startswith("padding"):
        kpm = padding if "bool" in kind or kind == "padding + attn" else padding.to(dtype) * -1e4
        batched = {"key_padding_mask": kpm}
        if kind == "padding + attn":
            batched["attn_mask"] = causal
        return batched, [{k: (v[i] if v.dim() == 3 else v) for k, v in batched.items()} for i in range(M)]
    if kind.startswith("attn 2-D"):
        mask = causal if "bool" in kind else torch.randn(L, S, dtype=dtype)
        return {"attn_mask": mask}, [{"attn_mask": mask}] * M
    if kind == "attn per model":
        mask = torch.randn(M, L, S, dtype=dtype)
        return {"attn_mask": mask}, [{"attn_mask": mask[i]} for i in range(M)]
    if kind == "attn 4-D":
        mask = torch.rand(M, B * HEADS, L, S) < 0.2
        mask[..., 0] = False
        return {"attn_mask": mask}, [{"attn_mask": mask[i]} for i in range(M)]
    if kind == "causal":
        mask = torch.ones(L, L, dtype=torch.bool).triu(1)
        return {"attn_mask": mask, "is_causal": True}, [{"attn_mask": mask, "is_causal": True}] * M
    raise AssertionError(kind)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("weights", ["need_weights", "average=False", "no weights"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_matches_loop(config: str, mask: str, weights: str, batch_first: bool) -> None:
    kwargs = {**CONFIGS[config], "batch_first": batch_first}
    torch.manual_seed(0)
    batched = BatchedMultiheadAttention(M, E, HEADS, **kwargs, dtype=torch.float64)
    modules = _loop(batched, **kwargs)
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    target = L if mask != "causal" else L
    source = S if mask != "causal" else L
    q = torch.randn(M, B, target, E, dtype=torch.float64, requires_grad=True)
    self_attention = mask == "causal" and config != "kdim/vdim"
    k = q if self_attention else torch.randn(M, B, source, kdim, dtype=torch.float64, requires_grad=True)
    v = q if self_attention else torch.randn(M, B, source, vdim, dtype=torch.float64, requires_grad=True)
    layout = (lambda t: t) if batch_first else (lambda t: t.transpose(-3, -2))
    batched_masks, own_masks = _masks(mask, torch.float64)
    call = {"need_weights": weights != "no weights", "average_attn_weights": weights != "average=False"}
    out, w = batched(layout(q), layout(k), layout(v), **batched_masks, **call)
    refs = [m(layout(q[i]), layout(k[i]), layout(v[i]), **own_masks[i], **call) for i, m in enumerate(modules)]
    assert_close(out, torch.stack([r[0] for r in refs]), msg="output")
    if weights == "no weights":
        assert w is None
    else:
        assert_close(w, torch.stack([r[1] for r in refs]), msg="weights")
    grad = torch.randn_like(out)
    inputs = [t for t in dict.fromkeys((q, k, v))]
    got = torch.autograd.grad((out * grad).sum(), [*inputs, *batched.parameters()])
    ref_total = sum((r[0] * grad[i]).sum() for i, r in enumerate(refs))
    expected = torch.autograd.grad(ref_total, [*inputs, *itertools.chain(*(m.parameters() for m in modules))])
    for g, e, name in zip(got, expected, ["q", "k", "v"][: len(inputs)]):
        assert_close(g, e, msg=f"gradient of {name}")
    params = len(list(batched.parameters()))
    per_module = [expected[len(inputs) + j * params : len(inputs) + (j + 1) * params] for j in range(M)]
    for j, (name, _) in enumerate(batched.named_parameters()):
        assert_close(got[len(inputs) + j], torch.stack([p[j] for p in per_module]), msg=f"gradient of {name}")


def test_shared_query_is_not_copied() -> None:
    batched = BatchedMultiheadAttention(M, E, HEADS, batch_first=True, dtype=torch.float64)
    x = torch.randn(B, L, E, dtype=torch.float64)
    shared = x.expand(M, *x.shape)
    out, _ = batched(shared, shared, shared)
    modules = _loop(batched, batch_first=True)
    assert_close(out, torch.stack([m(x, x, x)[0] for m in modules]), msg="shared batch")


def test_heads_reach_scaled_dot_product_attention_without_copies() -> None:
    """Self-attention without weights: the heads are views of the packed projection, as torch's own attention
    passes them, in forward and backward; no copy the size of q, k, v or the attention's output is made. (A
    sequence longer than ``_short_attention.MAX_LENGTH``: shorter ones are computed explicitly, whose batched
    products copy the heads, see tests/test_short_attention.py.)"""
    batched = BatchedMultiheadAttention(M, E, HEADS, batch_first=True, dtype=torch.float64)
    # no weight or weight gradient has the size of q, k or v
    x = torch.randn(M, B, MAX_LENGTH + 1, E, dtype=torch.float64, requires_grad=True)
    with RecordOps() as ops:
        out, _ = batched(x, x, x, need_weights=False)
        out.backward(torch.randn_like(out))
    copies = [
        name for name, is_view, n in ops.ops if not is_view and n == x.numel() and ("copy" in name or "clone" in name)
    ]
    assert copies == [], f"the heads were copied: {copies}"
    modules = _loop(batched, batch_first=True)
    assert_close(out, torch.stack([m(x[i], x[i], x[i], need_weights=False)[0] for i, m in enumerate(modules)]))


def test_init_state_dict_and_dropout() -> None:
    torch.manual_seed(0)
    batched = BatchedMultiheadAttention(M, E, HEADS, add_bias_kv=True, dtype=torch.float64)
    reference = nn.MultiheadAttention(E, HEADS, add_bias_kv=True, dtype=torch.float64)
    assert {k: tuple(v.shape) for k, v in batched.state_dict().items()} == {
        k: (M, *v.shape) for k, v in reference.state_dict().items()
    }
    bound = (6 / (4 * E)) ** 0.5  # xavier_uniform on (3E, E)
    w = batched.in_proj_weight
    assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound
    assert not torch.allclose(w[0], w[1]), "models initialised alike"
    assert torch.equal(batched.in_proj_bias, torch.zeros_like(batched.in_proj_bias))
    dropping = BatchedMultiheadAttention(M, E, HEADS, dropout=0.5, batch_first=True, dtype=torch.float64)
    x = torch.randn(M, B, L, E, dtype=torch.float64)
    assert not torch.allclose(dropping(x, x, x)[0], dropping.eval()(x, x, x)[0])


BAD = {
    "models": (lambda: (torch.randn(M + 1, B, L, E),) * 3, {}, r"query .*dimension 0 \(models\) is 4, not 3"),
    "embed": (lambda: (torch.randn(M, B, L, E + 1),) * 3, {}, r"query .*embed_dim=8.*is 9"),
    "ndim": (lambda: (torch.randn(M, L, E),) * 3, {}, r"expected a 4-D query"),
    "batch": (lambda: (torch.randn(M, B, L, E), torch.randn(M, B + 1, S, E), torch.randn(M, B + 1, S, E)), {},
              r"share the batch size"),
    "padding mask": (lambda: (torch.randn(M, B, L, E),) * 3, {"key_padding_mask": torch.zeros(B, L, dtype=torch.bool)},
                     r"key_padding_mask \(M, B, S\) = \(3, 2, 4\), got \(2, 4\)"),
    "attn mask": (lambda: (torch.randn(M, B, L, E),) * 3, {"attn_mask": torch.zeros(L + 1, L)},
                  r"attn_mask \(L, S\) = \(4, 4\) \(shared\).*got \(5, 4\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises(case: str) -> None:
    make, kwargs, pattern = BAD[case]
    with pytest.raises(ValueError, match=pattern):
        BatchedMultiheadAttention(M, E, HEADS, batch_first=True)(*make(), **kwargs)


def _pair(batch_first: bool = True) -> tuple[BatchedMultiheadAttention, list[nn.MultiheadAttention]]:
    torch.manual_seed(0)
    batched = BatchedMultiheadAttention(M, E, HEADS, batch_first=batch_first, dtype=torch.float64)
    return batched, _loop(batched, batch_first=batch_first)


@pytest.mark.parametrize(
    "how", ["deepcopy", "pickle", "to float32", "compile fullgraph"], ids=lambda h: h.replace(" ", "-")
)
def test_copies_conversions_and_compile(how: str) -> None:
    import copy
    import pickle

    batched, _ = _pair()
    x = torch.randn(M, B, L, E, dtype=torch.float64)
    expected, weights = batched(x, x, x)
    if how == "deepcopy":
        other = copy.deepcopy(batched)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(batched))
    elif how == "to float32":
        other = copy.deepcopy(batched).float()
        assert all(p.dtype == torch.float32 for p in other.parameters())
        out, _ = other(x.float(), x.float(), x.float())
        torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-5)
        return
    else:
        torch._dynamo.reset()
        other = torch.compile(copy.deepcopy(batched), fullgraph=True, backend="aot_eager")
    out, w = other(x, x, x)
    assert_close(out, expected, msg=how)
    assert_close(w, weights, msg=f"{how} weights")


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 3),
    target=st.integers(1, 5),
    source=st.integers(1, 5),
    num_models=st.integers(1, 3),
    need_weights=st.booleans(),
    padding=st.booleans(),
)
def test_property_any_shape_matches_loop(heads, batch, target, source, num_models, need_weights, padding) -> None:
    torch.manual_seed(0)
    batched = BatchedMultiheadAttention(num_models, 8, heads, batch_first=True, dtype=torch.float64)
    modules = []
    for i in range(num_models):
        module = nn.MultiheadAttention(8, heads, batch_first=True, dtype=torch.float64)
        module.load_state_dict({k: v[i] for k, v in batched.state_dict().items()})
        modules.append(module)
    q = torch.randn(num_models, batch, target, 8, dtype=torch.float64)
    kv = torch.randn(num_models, batch, source, 8, dtype=torch.float64)
    mask = None
    if padding:
        mask = torch.rand(num_models, batch, source) < 0.3
        mask[..., 0] = False
    out, w = batched(q, kv, kv, key_padding_mask=mask, need_weights=need_weights)
    refs = [
        m(q[i], kv[i], kv[i], key_padding_mask=None if mask is None else mask[i], need_weights=need_weights)
        for i, m in enumerate(modules)
    ]
    assert_close(out, torch.stack([r[0] for r in refs]), msg="output")
    if need_weights:
        assert_close(w, torch.stack([r[1] for r in refs]), msg="weights")
