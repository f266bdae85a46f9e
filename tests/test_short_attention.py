"""Scaled dot-product attention over short sequences, computed explicitly on the CPU
(``batchlayers/functional/_short_attention.py``), against torch's own ``F.scaled_dot_product_attention``, in
stacked models against the original models, and in ``BatchedMultiheadAttention`` against ``nn.MultiheadAttention``."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from convert_harness import compare_gradient_penalty, compare_training, seeded
from harness import assert_close
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import batchlayers as bl
from batchlayers.convert import stack
from batchlayers.functional import _short_attention
from batchlayers.functional._short_attention import MAX_LENGTH, attention

F64 = torch.float64


def _split_heads(n: int, heads: int, length: int, dim: int, dtype: torch.dtype) -> Tensor:
    """A query laid out as user code makes it: one third of a packed projection, viewed into heads and
    transposed (``(n, heads, length, dim)``, not contiguous, with gaps)."""
    packed = torch.randn(n, length, 3 * heads * dim, dtype=dtype)
    return packed[..., : heads * dim].view(n, length, heads, dim).transpose(1, 2)


LAYOUTS = {
    "contiguous": lambda shape, dtype: torch.randn(*shape, dtype=dtype),
    "transposed": lambda shape, dtype: torch.randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype).transpose(1, 2),
    "split-heads": lambda shape, dtype: _split_heads(shape[0], shape[1], shape[2], shape[3], dtype),
    "expanded": lambda shape, dtype: torch.randn(1, *shape[1:], dtype=dtype).expand(shape),
}
# (N, heads, L, d) of the query; keys and values (N, heads, S, d) and (N, heads, S, d_v)
SHAPES = {
    "square": ((3, 2, 5, 4), 5, 4),
    "more-keys": ((3, 2, 4, 4), 7, 3),
    "more-queries": ((2, 3, 6, 4), 3, 4),
    "one-query": ((2, 2, 1, 8), 6, 8),
    "longest": ((2, 1, MAX_LENGTH, 4), MAX_LENGTH, 4),
}


def _inputs(shape, source, value_dim, layout, dtype):
    n, heads, length, dim = shape
    q = LAYOUTS[layout]((n, heads, length, dim), dtype)
    k = torch.randn(n, heads, source, dim, dtype=dtype)
    v = torch.randn(n, heads, source, value_dim, dtype=dtype)
    return [t.detach().requires_grad_() for t in (q, k, v)]


@pytest.fixture
def calls(monkeypatch):
    """How many attention calls took the explicit path."""
    counted = []
    original = _short_attention._attend

    def counting(*args, **kwargs):
        counted.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_short_attention, "_attend", counting)
    return counted


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default-scale", "scale"])
def test_matches_torch_forward_and_backward(dtype, layout, shape, scale, calls) -> None:
    torch.manual_seed(0)
    q_shape, source, value_dim = SHAPES[shape]
    q, k, v = _inputs(q_shape, source, value_dim, layout, dtype)
    expected = F.scaled_dot_product_attention(q, k, v, scale=scale)
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    out = attention(q, k, v, scale=scale)
    assert out is not None and calls == [1]
    assert_close(out, expected, msg="output")
    assert out.stride() == expected.stride(), "laid out as torch's result"
    for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), grad), expected_grads):
        assert_close(got, want, msg=f"gradient by {name}")
    with torch.no_grad():  # (measured no faster without gradients: torch's call)
        assert attention(q, k, v, scale=scale) is None
    assert attention(*(t.detach() for t in (q, k, v)), scale=scale) is None


def test_second_derivatives_match_torch() -> None:
    """create_graph=True (a gradient penalty), against torch's math backend (its CPU flash kernel has no second
    derivative)."""
    torch.manual_seed(2)
    q, k, v = _inputs((2, 2, 5, 4), 6, 3, "split-heads", F64)
    weights = torch.randn(2, 2, 5, 3, dtype=F64)

    def penalty(fn):
        out = fn(q, k, v)
        grads = torch.autograd.grad((out * weights).tanh().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))

    with sdpa_kernel(SDPBackend.MATH):
        expected = penalty(F.scaled_dot_product_attention)
    for name, got, want in zip("qkv", penalty(attention), expected):
        assert_close(got, want, msg=f"penalty gradient by {name}")


def _refused_inputs():
    def qkv(length=5, source=5, dtype=F64, **kw):
        return [torch.randn(2, 2, n, 4, dtype=dtype, **kw) for n in (length, source, source)]

    return {
        "mask": (qkv(), {"attn_mask": torch.ones(5, 5, dtype=torch.bool)}),
        "causal": (qkv(), {"is_causal": True}),
        "dropout": (qkv(), {"dropout_p": 0.1}),
        "gqa": (qkv(), {"enable_gqa": True}),
        "long-queries": (qkv(length=MAX_LENGTH + 1), {}),
        "long-keys": (qkv(source=MAX_LENGTH + 1), {}),
        "bfloat16": (qkv(dtype=torch.bfloat16), {}),
        "mixed-dtypes": ([*qkv()[:2], torch.randn(2, 2, 5, 4)], {}),
        "2-d": ([torch.randn(5, 4, dtype=F64) for _ in range(3)], {}),
        "broadcast-batch": ([torch.randn(2, 2, 5, 4, dtype=F64), *(torch.randn(1, 2, 5, 4, dtype=F64),) * 2], {}),
        "empty": (qkv(length=0), {}),
        "meta": (qkv(device="meta"), {}),
    }


@pytest.mark.parametrize("case", list(_refused_inputs()))
def test_other_calls_are_left_to_torch(case) -> None:
    """Each case alone keeps a call that records gradients (else explicit) on torch's path."""
    (q, k, v), kwargs = _refused_inputs()[case]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert attention(q, k, v, **kwargs) is None


# (make_dual's first call in a process imports torch code that calls the deprecated torch.jit.script)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("context", ["autocast", "vmap", "forward-ad"])
def test_left_to_torch_under_autocast_and_transforms(context) -> None:
    q, k, v = (torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
    assert attention(q, k, v) is not None  # (explicit outside the context)
    if context == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert attention(q, k, v) is None
    elif context == "vmap":
        seen = []
        torch.func.vmap(lambda a: seen.append(attention(a, k[0], v[0])) or a)(q)
        assert seen == [None]
    else:
        with forward_ad.dual_level():
            assert attention(forward_ad.make_dual(q, torch.randn_like(q)), k, v) is None


class SdpaNet(nn.Module):
    """An embedding, one attention block as user code writes it with ``F.scaled_dot_product_attention``
    (heads by ``view``/``transpose`` of a packed projection, ``.transpose(1, 2).contiguous().view``), a mean
    and a head."""

    def __init__(self, is_causal: bool, scale: float | None) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.is_causal, self.scale = is_causal, scale

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, scale=self.scale)
        y = self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return self.head((x + y).mean(1))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [None, 0.5], ids=["default-scale", "scale"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
def test_stacked_model_matches_the_originals(is_causal, scale, shared, calls) -> None:
    models = [seeded(lambda: SdpaNet(is_causal, scale), i) for i in range(3)]
    stacked = stack(models)
    compare_training(stacked, models, lambda lead: torch.randn(*lead, 6, 8, dtype=F64), shared=shared)
    # two training steps and an evaluation: explicit where nothing is masked, torch's call where causal
    assert len(calls) == (0 if is_causal else 3)


@pytest.mark.parametrize(
    "num_models,batch,length",
    [(2, 2, 4), (4, 1, 4), (2, 4, 8), (1, 4, 4), (3, 1, 1)],
    ids=["MB=T=d", "B=1,M=T=d", "MB=T=C", "M=1,B=T=d", "B=T=1"],
)
def test_stacked_model_matches_the_originals_where_sizes_coincide(num_models, batch, length, calls) -> None:
    """Sizes that coincide (models x samples equal to the sequence length, the head size or the width; one
    sample, one position): the explicit attention of the folded samples is each model's own."""
    models = [seeded(lambda: SdpaNet(False, None), i) for i in range(num_models)]
    stacked = stack(models)
    compare_training(stacked, models, lambda lead: torch.randn(*lead, length, 8, dtype=F64), batch=batch)
    assert len(calls) == 3


def test_stacked_model_second_derivatives_match_the_originals(calls) -> None:
    models = [seeded(lambda: SdpaNet(False, None), i) for i in range(3)]
    stacked = stack(models)
    with sdpa_kernel(SDPBackend.MATH):  # (the originals: torch's CPU flash kernel has no second derivative)
        compare_gradient_penalty(stacked, models, torch.randn(3, 4, 6, 8, dtype=F64))
    assert calls, "the stacked model's attention took the explicit path"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_stacked_attention_over_the_samples_is_still_refused(is_causal) -> None:
    """Attention whose sequence dimension holds the samples mixes every model's samples: refused as before."""

    class OverSamples(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.lin(x).unsqueeze(0)  # (1, B, 4): the samples as the sequence
            return F.scaled_dot_product_attention(h, h, h, is_causal=is_causal)[0]

    stacked = stack([seeded(OverSamples, i) for i in range(2)])
    with pytest.raises((ValueError, RuntimeError), match="samples"):
        stacked(torch.randn(2, 5, 4, dtype=F64))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_batched_multihead_attention_matches_torch(is_causal, calls) -> None:
    """``nn.TransformerEncoderLayer`` (its ``nn.MultiheadAttention``, need_weights=False) stacked, against the
    originals."""
    torch.manual_seed(3)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype) if is_causal else None
            return self.head(self.layer(x, src_mask=mask, is_causal=is_causal).mean(1))

    models = [seeded(Encoder, i) for i in range(3)]
    compare_training(stack(models), models, lambda lead: torch.randn(*lead, 5, 8, dtype=F64))
    assert len(calls) == (0 if is_causal else 3), "explicit where nothing is masked, torch's call where causal"


@pytest.mark.parametrize("limit", [0, 4, 5], ids=["off", "below", "at"])
def test_the_length_limit_is_a_setting(limit, calls) -> None:
    """``bl.backends.cpu.explicit_attention_max_length``: sequences up to it are explicit, longer ones (and all
    with 0) torch's; the results are torch's either way."""
    before = bl.backends.cpu.explicit_attention_max_length
    q, k, v = _inputs((2, 2, 5, 4), 5, 4, "split-heads", F64)
    try:
        bl.backends.cpu.explicit_attention_max_length = limit
        out = attention(q, k, v)
    finally:
        bl.backends.cpu.explicit_attention_max_length = before
    assert (out is not None) == (limit >= 5) and len(calls) == (limit >= 5)
    if out is not None:
        assert_close(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("bad,error", [(-1, ValueError), (True, TypeError), (64.0, TypeError), ("64", TypeError)])
def test_the_length_limit_refuses_what_is_not_a_length(bad, error) -> None:
    before = bl.backends.cpu.explicit_attention_max_length
    with pytest.raises(error, match="explicit_attention_max_length"):
        bl.backends.cpu.explicit_attention_max_length = bad
    assert bl.backends.cpu.explicit_attention_max_length == before
