"""Mixed precision. Every batched layer, and stacked models, under ``torch.autocast`` against the torch.nn modules
holding the same slices under the same autocast (CPU bfloat16: the machine's autocast); and
``batchlayers.amp.GradScaler`` against one ``torch.amp.GradScaler`` and one torch optimizer per model.

The output dtype must be torch's exactly; values are compared against the largest magnitude in the compared tensor
(a difference of two rounded values near zero is as large as the rounding of either). bfloat16 keeps 8
significant bits: its ulp is at most 2^-7 of the largest magnitude. Tolerances, in that unit:

- ``EXACT``: torch's own kernel on the same values (embeddings, PReLU, the normalizations of a bfloat16 input
  per model): equal.
- ``FLOAT32``: float32 all the way (the normalizations of a float32 input, on no CPU autocast list): the same
  sums in another order, a few float32 ulps.
- ``ONE_OP``: one bfloat16 rounding of float32 sums accumulated in another order or by another kernel (a bmm over
  all models against torch's addmm, a grouped or channels-last convolution against a dense one, whose bfloat16
  paths may round partial sums): two ulps, 2^-6 (torch.testing's bfloat16 default is 1.6e-2).
- ``CHAINED``: several bfloat16 roundings taken in different places (recurrences over time, attention, stacked
  networks, every gradient: each backward matmul rounds, a shared batch's gradient sums the models'): four ulps.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import pathlib
import pickle

import models
import pytest
import torch
from harness import LayerCase, unbatch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import batchlayers as bl
import batchlayers.functional._linear as linear_module
from batchlayers import amp
from batchlayers.optim import SGD, Adam

BF16 = torch.bfloat16
M = 3

EXACT = None
FLOAT32 = 2.0**-18
ONE_OP = 2.0**-6
CHAINED = 2.0**-5

# torch.nn's own modules warn under autocast: its LSTM with projections leaves oneDNN, its RMSNorm with a bfloat16
# input and float32 weight leaves the fused kernel.
_ONEDNN_PROJ_WARNING = "ignore:LSTM with projections is not supported with oneDNN:UserWarning"
_RMS_NORM_WARNING = "ignore:Mismatch dtype between input and weight:UserWarning"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: on a shared machine a second intra-op thread costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def assert_matches(actual: Tensor, expected: Tensor, tol: float | None, what: str) -> None:
    """Same dtype and shape; values within ``tol`` times the largest magnitude of ``expected`` (``None``: equal)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, torch gives {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if tol is None:
        assert torch.equal(actual, expected), f"{what}: not equal, max diff {(actual - expected).abs().max()}"
        return
    scale = expected.detach().double().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        rtol=0,
        atol=tol * max(scale, 1e-6),
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def leaf(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(t.is_floating_point())


def _lstm_as_autocast_asks(self: nn.LSTM, input: Tensor, hx: tuple[Tensor, Tensor] | None = None):
    """``nn.LSTM.forward`` under CPU autocast where this CPU's oneDNN has no bfloat16 LSTM (AVX2 only: the AMD EPYC
    development VM). torch sends a float32 input to oneDNN's ``mkldnn_rnn_layer``, which autocast casts to
    bfloat16 and oneDNN then cannot run ("could not create a primitive descriptor"): torch's own call fails. This
    runs what autocast asks for, every operand cast to bfloat16, on torch's native LSTM kernel instead."""
    bf16, batched = torch.bfloat16, input.dim() == 3
    if not batched:
        input = input.unsqueeze(1)
        hx = None if hx is None else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
    if hx is None:
        zeros = input.new_zeros(
            self.num_layers * (2 if self.bidirectional else 1),
            input.size(0 if self.batch_first else 1),
            self.hidden_size,
        )
        hx = (zeros, zeros)
    with torch.autocast("cpu", enabled=False):
        out, h, c = torch._VF.lstm(input.to(bf16), [t.to(bf16) for t in hx], [w.to(bf16) for w in self._flat_weights],
                                   self.bias, self.num_layers, float(self.dropout), self.training,
                                   self.bidirectional, self.batch_first)  # fmt: skip
    return (out, (h, c)) if batched else (out.squeeze(1), (h.squeeze(1), c.squeeze(1)))


@contextlib.contextmanager
def torch_lstm_where_onednn_lacks_bfloat16():
    """Around the reference calls: torch's LSTM as autocast asks for it (:func:`_lstm_as_autocast_asks`), where this
    CPU's oneDNN cannot run it in bfloat16; torch's own call everywhere else (an Intel CPU with AVX-512)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported() or not torch.backends.mkldnn.is_available():
        yield
        return
    forward = nn.LSTM.forward

    def patched(self, input, hx=None):
        if self.proj_size == 0 and input.dtype == torch.float32 and torch.backends.mkldnn.enabled:
            return _lstm_as_autocast_asks(self, input, hx)
        return forward(self, input, hx)

    nn.LSTM.forward = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.LSTM.forward = forward  # type: ignore[method-assign]


def run_and_compare(
    batched: nn.Module,
    modules: list[nn.Module],
    inputs: tuple,
    *,
    shared: bool,
    tol: float | None,
    grad_tol: float | None,
    call=lambda module, *args: module(*args),
) -> None:
    """Forward under autocast through ``batched`` and through ``modules`` one by one (``inputs`` are model 0's
    ``(B, *)`` batch if ``shared``, else ``(M, B, *)``); compare every output, then backward with the same
    output gradients and compare the floating inputs' and the parameters' gradients and the buffers."""
    xb = [leaf(t) for t in inputs]
    xr = [leaf(t) for t in inputs]
    with autocast():
        y = call(batched, *[t.expand(M, *t.shape) if shared else t for t in xb])
        with torch_lstm_where_onednn_lacks_bfloat16():
            ys = [call(m, *[t if shared else t[i] for t in xr]) for i, m in enumerate(modules)]
    outs, _ = tree_flatten(y)
    refs = list(zip(*[tree_flatten(yi)[0] for yi in ys]))
    assert len(outs) == len(refs)
    grads = []
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert_matches(out, torch.stack(ref), tol, f"output {k}")
        if out.requires_grad:
            grads.append(torch.randn(out.shape).to(out.dtype))
    if not grads:
        return
    differentiable = [o for o in outs if o.requires_grad]
    torch.autograd.backward(differentiable, grads)
    for i in range(M):
        refs_i = [r[i] for o, r in zip(outs, refs) if o.requires_grad]
        torch.autograd.backward(refs_i, [g[i] for g in grads])
    for k, (tb, tr) in enumerate(zip(xb, xr)):
        if tb.grad is not None:
            assert_matches(tb.grad, tr.grad, grad_tol, f"gradient of input {k}")
    for name, p in batched.named_parameters():
        ref = [dict(m.named_parameters())[name].grad for m in modules]
        if p.grad is None:
            assert all(r is None for r in ref), f"{name}: no gradient, torch has one"
            continue
        assert_matches(p.grad, torch.stack([torch.zeros_like(p[0]) if r is None else r for r in ref]), grad_tol,
                       f"gradient of {name}")  # fmt: skip
    for name, b in batched.named_buffers():
        refs = [dict(m.named_buffers())[name] for m in modules]
        if b.shape == refs[0].shape:  # a stacked model keeps a buffer equal in every model once (a causal mask)
            assert all(torch.equal(b, r) for r in refs), f"shared buffer {name} differs"
            continue
        assert_matches(b, torch.stack(refs), FLOAT32 if b.is_floating_point() else EXACT, f"buffer {name}")


# -- every LayerCase ------------------------------------------------------------------------------------------

_HERE = pathlib.Path(__file__).parent
CASES: list[LayerCase] = [
    case for path in sorted(_HERE.glob("cases_*.py")) for case in importlib.import_module(path.stem).CASES
]


def _output_tolerance(case: LayerCase, input_dtype: torch.dtype, shared: bool) -> float | None:
    if case.id.startswith(("Embedding", "PReLU")):
        return EXACT
    if "Norm" in case.id:
        if input_dtype == torch.float32:
            return FLOAT32
        # A shared batch's running statistics are blended once for all models, in another order: the eval
        # output's float32 value can differ in its last bits, and so round the other way.
        return ONE_OP if shared else EXACT
    return ONE_OP


@pytest.mark.filterwarnings(_RMS_NORM_WARNING)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("input_dtype", [torch.float32, BF16], ids=["f32_in", "bf16_in"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_layer_under_autocast(case: LayerCase, input_dtype: torch.dtype, shared: bool) -> None:
    """float32 layers under autocast, fed float32 (a network's input) or bfloat16 (the output of an autocast
    Linear or convolution before them), in training mode (running statistics updated) and in eval mode."""
    check_layer_under_autocast(case, input_dtype, shared)


@pytest.mark.parametrize("case", [c for c in CASES if c.id.startswith("Linear")], ids=lambda c: c.id)
@pytest.mark.parametrize("input_dtype", [torch.float32, BF16], ids=["f32_in", "bf16_in"])
def test_linear_with_its_own_weight_gradient_under_autocast(case, input_dtype, monkeypatch) -> None:
    """A linear layer with fewer outputs than inputs computes its weight gradient itself where large enough
    (here at every size); under autocast it leaves that to autograd, which makes autocast's casts (its
    backward raised "expected scalar type Float but found BFloat16" before)."""
    monkeypatch.setattr(linear_module, "OUT_MAJOR_MIN_MACS", 0)
    check_layer_under_autocast(case, input_dtype, shared=False)


def check_layer_under_autocast(case: LayerCase, input_dtype: torch.dtype, shared: bool) -> None:
    torch.manual_seed(0)
    batched = case.build(M, torch.float32)
    modules = unbatch(batched, lambda: case.torch(torch.float32))
    tol = _output_tolerance(case, input_dtype, shared)
    for training in (True, False):
        batched.train(training)
        for m in modules:
            m.train(training)
        x = case.input((5,) if shared else (M, 5), input_dtype)
        run_and_compare(batched, modules, (x,), shared=shared, tol=tol, grad_tol=CHAINED)


# -- the layers with their own tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_bilinear(shared: bool) -> None:
    """torch's bilinear is on no CPU autocast list but its _trilinear runs bmm, which autocasts: float32 out, the
    products in bfloat16. BatchedBilinear turns autocast off and computes in float32: within bfloat16 of torch."""
    torch.manual_seed(0)
    batched = bl.BatchedBilinear(M, 4, 5, 6)
    lead = (5,) if shared else (M, 5)
    x1, x2 = torch.randn(*lead, 4), torch.randn(*lead, 5)
    run_and_compare(batched, unbatch(batched, lambda: nn.Bilinear(4, 5, 6)), (x1, x2), shared=shared, tol=CHAINED,
                    grad_tol=CHAINED)  # fmt: skip


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mode: str) -> None:
    """embedding_bag is on no autocast list: float32 in float32 out, the same values."""
    torch.manual_seed(0)
    batched = bl.BatchedEmbeddingBag(M, 10, 6, mode=mode)
    modules = unbatch(batched, lambda: nn.EmbeddingBag(10, 6, mode=mode))
    indices = torch.randint(10, (M, 4, 3))
    if mode == "sum":
        weights = torch.rand(M, 4, 3)
        run_and_compare(batched, modules, (indices, weights), shared=False, tol=None, grad_tol=CHAINED,
                        call=lambda m, i, w: m(i, per_sample_weights=w))  # fmt: skip
    else:
        run_and_compare(batched, modules, (indices,), shared=False, tol=None, grad_tol=CHAINED)


def _attention_masks(kind: str, dtype: torch.dtype) -> tuple[dict, list[dict]]:
    from test_attention import _masks

    return _masks(kind, dtype)


@pytest.mark.parametrize("config", ["default", "bias_kv + zero_attn", "kdim/vdim"])
@pytest.mark.parametrize("mask", ["none", "padding bool", "attn per model", "causal"])
@pytest.mark.parametrize("input_dtype", [torch.float32, BF16], ids=["f32_in", "bf16_in"])
def test_multihead_attention(config: str, mask: str, input_dtype: torch.dtype) -> None:
    from test_attention import CONFIGS, HEADS, B, E, L, S

    torch.manual_seed(0)
    kwargs = {**CONFIGS[config], "batch_first": True}
    batched = bl.BatchedMultiheadAttention(M, E, HEADS, **kwargs)
    modules = unbatch(batched, lambda: nn.MultiheadAttention(E, HEADS, **kwargs))
    source = L if mask == "causal" else S
    q = torch.randn(M, B, L, E, dtype=input_dtype)
    k = torch.randn(M, B, source, kwargs.get("kdim", E), dtype=input_dtype)
    v = torch.randn(M, B, source, kwargs.get("vdim", E), dtype=input_dtype)
    batched_masks, own_masks = _attention_masks(mask, input_dtype)

    def call(module, q, k, v):
        masks = batched_masks if module is batched else own_masks[modules.index(module)]
        return module(q, k, v, **masks)

    run_and_compare(batched, modules, (q, k, v), shared=False, tol=CHAINED, grad_tol=CHAINED, call=call)


RNN_CONFIGS = {
    "RNN": (bl.BatchedRNN, nn.RNN, {}),
    "RNN_2layers": (bl.BatchedRNN, nn.RNN, {"num_layers": 2}),
    "LSTM": (bl.BatchedLSTM, nn.LSTM, {}),
    "LSTM_bidirectional_batch_first": (bl.BatchedLSTM, nn.LSTM, {"bidirectional": True, "batch_first": True}),
    "LSTM_proj_2layers": (bl.BatchedLSTM, nn.LSTM, {"proj_size": 3, "num_layers": 2}),
    "GRU": (bl.BatchedGRU, nn.GRU, {}),
    "GRU_bidirectional_nobias": (bl.BatchedGRU, nn.GRU, {"bidirectional": True, "bias": False}),
}


@pytest.mark.filterwarnings(_ONEDNN_PROJ_WARNING)
@pytest.mark.parametrize("name", list(RNN_CONFIGS))
@pytest.mark.parametrize("input_dtype", [torch.float32, BF16], ids=["f32_in", "bf16_in"])
@pytest.mark.parametrize("initial_state", [False, True], ids=["zeros", "hx"])
def test_recurrent(name: str, input_dtype: torch.dtype, initial_state: bool) -> None:
    """torch's dtypes are its kernels': a CPU LSTM goes through oneDNN's mkldnn_rnn_layer, on autocast's list
    (all bfloat16); RNN, GRU and an LSTM with projections are composites whose states promote (a GRU fed float32
    returns float32, the projected LSTM's c stays float32). States given in float32 stay as torch keeps them."""
    batched_cls, torch_cls, kwargs = RNN_CONFIGS[name]
    torch.manual_seed(0)
    batched = batched_cls(M, 5, 6, **kwargs)
    modules = unbatch(batched, lambda: torch_cls(5, 6, **kwargs))
    layers_dirs = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    out_size = kwargs.get("proj_size") or 6
    x = torch.randn(M, 2, 4, 5) if kwargs.get("batch_first") else torch.randn(M, 4, 2, 5)
    inputs = (x.to(input_dtype),)
    if initial_state:
        h0 = torch.randn(M, layers_dirs, 2, out_size)  # float32 states, as a first step's zeros would be
        inputs += (h0, torch.randn(M, layers_dirs, 2, 6)) if torch_cls is nn.LSTM else (h0,)

    def call(module, x, *state):
        return module(x, (tuple(state) if len(state) == 2 else state[0]) if state else None)

    run_and_compare(batched, modules, inputs, shared=False, tol=CHAINED, grad_tol=CHAINED, call=call)


CELLS = {
    "RNNCell": (bl.BatchedRNNCell, nn.RNNCell),
    "LSTMCell": (bl.BatchedLSTMCell, nn.LSTMCell),
    "GRUCell": (bl.BatchedGRUCell, nn.GRUCell),
}


@pytest.mark.parametrize("name", list(CELLS))
@pytest.mark.parametrize("input_dtype", [torch.float32, BF16], ids=["f32_in", "bf16_in"])
def test_cell_loop(name: str, input_dtype: torch.dtype) -> None:
    """Three steps of a cell, each step's states fed back: under autocast their dtypes change from step to step
    as torch's do (LSTMCell's h in bfloat16 next to a float32 c; a GRUCell's h in the first state's dtype)."""
    batched_cls, torch_cls = CELLS[name]
    torch.manual_seed(0)
    batched = batched_cls(M, 5, 6)
    modules = unbatch(batched, lambda: torch_cls(5, 6))
    xs = torch.randn(M, 3, 2, 5, dtype=input_dtype)  # (M, steps, B, input_size)

    def call(module, xs):
        state = None
        outputs = []
        for t in range(xs.shape[-3]):
            state = module(xs.select(-3, t), state)
            outputs.append(state)
        return outputs

    run_and_compare(batched, modules, (xs,), shared=False, tol=CHAINED, grad_tol=CHAINED, call=call)


# -- stacked models -----------------------------------------------------------------------------------------------


def _transformer_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)


def _tokens(lead: tuple, vocab: int = 11, length: int = 6) -> Tensor:
    return torch.randint(vocab, (*lead, length))


def _logits_and_loss(out):
    return (out.logits, out.loss) if hasattr(out, "logits") else out


# name -> (model constructor, (leading shape) -> inputs)
STACKED = {
    "MLP": (lambda: models.MLP(), lambda lead: (torch.randn(*lead, 6),)),
    "CNN": (lambda: models.CNN(), lambda lead: (torch.randn(*lead, 3, 8, 8),)),
    "TransformerEncoderLayer": (_transformer_layer, lambda lead: (torch.randn(*lead, 5, 8),)),
    "GPT": (lambda: models.GPT(), lambda lead: (_tokens(lead), _tokens(lead))),
    "LSTMLanguageModel": (lambda: models.LSTMLanguageModel(), lambda lead: (_tokens(lead), _tokens(lead))),
    "Seq2SeqGRU": (lambda: models.Seq2SeqGRU(), lambda lead: (_tokens(lead, 12, 5), _tokens(lead, 12, 3))),
}


@pytest.mark.parametrize("name", list(STACKED))
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_stacked_model(name: str, shared: bool) -> None:
    """A stacked model under autocast against the original models under autocast, in training mode (BatchNorm's
    batch statistics); losses computed inside forward (cross_entropy: float32 under autocast) come back per model.
    The LSTM runs through batchlayers.functional.rnn, the GRUCell decoder stepped in Python per model."""
    make_model, make_inputs = STACKED[name]
    torch.manual_seed(0)
    originals = [make_model() for _ in range(M)]
    stacked = bl.stack(originals)
    inputs = make_inputs((5,) if shared else (M, 5))
    run_and_compare(stacked, originals, inputs, shared=shared, tol=CHAINED, grad_tol=CHAINED,
                    call=lambda model, *args: _logits_and_loss(model(*args)))  # fmt: skip


# -- GradScaler ---------------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(bl.BatchedLinear(M, 6, 8), nn.ReLU(), bl.BatchedLinear(M, 8, 3))


def _torch_mlps(batched: nn.Module) -> list[nn.Module]:
    state = batched.state_dict()
    models = [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(M)]
    for m, model in enumerate(models):
        model.load_state_dict({k: v[m].clone() for k, v in state.items()})
    return models


class ScalerPair:
    """A batched model, optimizer and GradScaler, and per model a torch.nn model, torch optimizer and
    torch.amp.GradScaler. Each step the gradients come from the batched model (scaled by the batched scaler,
    whose scale is checked to be the torch scaler's) and are copied into the torch models, so that everything
    after ``backward`` (unscaling, finding the overflows, skipping, the optimizer, the scale updates) is
    compared bit for bit; the autocast forward and backward themselves are compared above, within bfloat16."""

    def __init__(self, optimizer: str, **scaler_kwargs) -> None:
        torch.manual_seed(0)
        self.model = _mlp()
        self.refs = _torch_mlps(self.model)
        batched_cls, torch_cls, kwargs = {
            "SGD": (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
            "Adam": (Adam, torch.optim.Adam, {"lr": 1e-2}),
        }[optimizer]
        self.opt = batched_cls(self.model.parameters(), **kwargs)
        self.ref_opts = [torch_cls(r.parameters(), **kwargs) for r in self.refs]
        self.scaler = amp.GradScaler("cpu", **scaler_kwargs)
        self.ref_scalers = [torch.amp.GradScaler("cpu", **scaler_kwargs) for _ in range(M)]
        self.skipped: list[list[bool]] = []

    def backward(self, x: Tensor, y: Tensor, dtype: torch.dtype) -> None:
        with torch.autocast("cpu", dtype=dtype):
            losses = bl.losses.cross_entropy(self.model(x), y)
        scaled = self.scaler.scale(losses)
        for m, ref in enumerate(self.ref_scalers):
            assert torch.equal(scaled[m], ref.scale(losses[m].detach())), f"model {m}: scaled loss differs"
        self.opt.zero_grad()
        scaled.sum().backward()

    def copy_grads(self) -> None:
        for m, ref in enumerate(self.refs):
            for p, q in zip(self.model.parameters(), ref.parameters()):
                q.grad = p.grad[m].clone()

    def step(self, unscale_first: bool) -> None:
        self.copy_grads()
        before = [p.detach().clone() for p in self.model.parameters()]
        if unscale_first:
            self.scaler.unscale_(self.opt)
            for ref, ref_opt in zip(self.ref_scalers, self.ref_opts):
                ref.unscale_(ref_opt)
            self.check_grads()
        self.scaler.step(self.opt)
        for ref, ref_opt in zip(self.ref_scalers, self.ref_opts):
            ref.step(ref_opt)
        self.scaler.update()
        for ref in self.ref_scalers:
            ref.update()
        self.skipped.append([all(torch.equal(b[m], p[m]) for b, p in zip(before, self.model.parameters()))
                             for m in range(len(self.refs))])  # fmt: skip
        self.check()

    def check_grads(self) -> None:
        for m, ref in enumerate(self.refs):
            for (name, p), q in zip(self.model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad[m], q.grad, rtol=0, atol=0, equal_nan=True,
                                           msg=f"model {m}: unscaled gradient of {name}")  # fmt: skip

    def check(self) -> None:
        scale, tracker = self.scaler.get_scale(), self.scaler.state_dict()["_growth_tracker"]
        num_models = len(self.refs)
        assert scale.shape == (num_models,) and scale.dtype == torch.float32 and tracker.dtype == torch.int32
        for m, (ref_model, ref_scaler, ref_opt) in enumerate(zip(self.refs, self.ref_scalers, self.ref_opts)):
            assert scale[m].item() == ref_scaler.get_scale(), f"model {m}: scale"
            assert tracker[m].item() == ref_scaler._get_growth_tracker(), f"model {m}: growth tracker"
            for (name, p), q in zip(self.model.named_parameters(), ref_model.parameters()):
                assert torch.equal(p[m], q), f"model {m}: {name}"
                for key, expected in ref_opt.state[q].items():  # empty while model m has not stepped yet
                    value = self.opt.state[p][key][m]
                    assert torch.equal(value, expected.to(value.dtype)), f"model {m}: optimizer state {key}"


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_scaler_float16_overflow_matches_torch(optimizer: str, unscale_first: bool) -> None:
    """float16 autocast from a scale too large for every model: each model's float16 gradients overflow until its
    own scale is small enough, model 1 (inputs 50x larger) longest; scales grow back every 2 finite steps and
    overflow again, so the models skip different steps and end with different scales."""
    pair = ScalerPair(optimizer, init_scale=2.0**20, growth_interval=2, growth_factor=1.7, backoff_factor=0.3)
    torch.manual_seed(1)
    for _ in range(10):
        x, y = torch.randn(M, 5, 6), torch.randint(3, (M, 5))
        x[1] *= 50
        pair.backward(x, y, torch.float16)
        pair.step(unscale_first)
    skipped = torch.tensor(pair.skipped)
    assert skipped.any(1).sum() >= 2 and not skipped.all(1).all(), "the run never skipped only some models"
    assert len(set(pair.scaler.get_scale().tolist())) > 1, "the models should end with different scales"


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_scaler_injected_overflow_matches_torch(optimizer: str, bad: float) -> None:
    """bfloat16 autocast; a non-finite gradient put into given models at given steps (step 3: every model)."""
    pattern = {1: [1], 3: [0, 1, 2], 4: [2], 5: [2]}
    pair = ScalerPair(optimizer, init_scale=2.0**8, growth_interval=2)
    torch.manual_seed(1)
    for step in range(7):
        x, y = torch.randn(M, 5, 6), torch.randint(3, (M, 5))
        pair.backward(x, y, BF16)
        for m in pattern.get(step, []):
            next(pair.model.parameters()).grad[m, 0, 0] = bad
        pair.step(unscale_first=step % 2 == 0)
    assert pair.skipped == [[step in pattern and m in pattern[step] for m in range(M)] for step in range(7)]


def _follow_selection(pair: ScalerPair, order: list[int]) -> None:
    """The torch runs in the models' new order: position ``k`` continues run ``order[k]`` (a copy of the whole run,
    model, optimizer and scaler, so that a model kept twice continues as two independent runs)."""
    runs = [copy.deepcopy((pair.refs[i], pair.ref_opts[i], pair.ref_scalers[i])) for i in order]
    pair.refs, pair.ref_opts, pair.ref_scalers = ([run[j] for run in runs] for j in range(3))


SELECTIONS = [
    ("keep", [2, 0, 1]),  # a reordering: M unchanged
    ("keep", [2, 0]),
    ("keep", [1]),
    ("keep", [1, 1, 0, 2]),  # a duplicate: M grows
    ("keep", torch.tensor([True, False, True])),
    ("copy", ([0], [2])),
    ("copy", ([1, 1], [0, 2])),
    ("copy", ([2, 0], [0, 2])),  # a swap: every read happens before the writes
]


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: f"{s[0]}-{s[1]}".replace(" ", ""))
def test_scaler_follows_keep_and_copy_models(optimizer: str, selection: tuple) -> None:
    """keep_models_ / copy_model_ with scalers=[scaler]: each model's scale and growth tracker move with it, so
    training goes on bit for bit as each model's own torch run (torch.amp.GradScaler and optimizer) would. Overflows
    put into given models first make every model's scale and tracker differ, then continue after the selection."""
    pair = ScalerPair(optimizer, init_scale=2.0**8, growth_interval=3)
    before, after = {1: [0], 3: [2], 4: [0]}, {0: [0], 3: [-1], 4: [0, -1]}

    def run(steps: range, pattern: dict[int, list[int]]) -> None:
        for step in steps:
            num_models = len(pair.refs)
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(num_models, 5, 6, generator=g), torch.randint(3, (num_models, 5), generator=g)
            pair.backward(x, y, BF16)
            for m in pattern.get(step, []):
                next(pair.model.parameters()).grad[m, 0, 0] = float("inf")
            pair.step(unscale_first=step % 2 == 0)

    run(range(5), before)
    assert pair.scaler.get_scale().unique().numel() == M and pair.scaler._get_growth_tracker().unique().numel() == M
    kind, arg = selection
    if kind == "keep":
        bl.keep_models_(pair.model, pair.opt, arg, scalers=[pair.scaler])
        order = arg.nonzero().flatten().tolist() if isinstance(arg, Tensor) else arg
    else:
        src, dst = arg
        bl.copy_model_(pair.model, pair.opt, src, dst, scalers=[pair.scaler])
        order = [src[dst.index(m)] if m in dst else m for m in range(M)]
    _follow_selection(pair, order)
    pair.check()
    assert pair.scaler.num_models == len(order)
    run(range(5, 10), {step + 5: [m % len(order) for m in ms] for step, ms in after.items()})


def test_scaler_selection_before_the_first_scale_and_disabled() -> None:
    """A scaler that has not scaled anything yet keeps its per-model initial scales in the models' new order; a
    disabled scaler only counts the models."""
    model = _mlp()
    optimizer = SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=torch.tensor([1.0, 2.0, 4.0]))
    off = amp.GradScaler("cpu", enabled=False, num_models=M)
    bl.keep_models_(model, optimizer, [2, 2, 0, 1], scalers=[scaler, off])
    assert scaler.get_scale().tolist() == [4.0, 4.0, 1.0, 2.0] and scaler.num_models == 4
    assert off.num_models == 4 and off.get_scale().tolist() == [1.0] * 4
    bl.copy_model_(model, optimizer, 3, 0, scalers=[scaler])
    assert scaler.get_scale().tolist() == [2.0, 4.0, 1.0, 2.0]
    assert scaler.scale(torch.ones(4)).tolist() == [2.0, 4.0, 1.0, 2.0]


def test_scaler_state_dict_resume_and_pickle() -> None:
    """A run saved after update() and loaded into fresh objects continues bit for bit; pickling keeps the state;
    a torch.amp.GradScaler's state dict gives every model its scale."""

    def run(pair: ScalerPair, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(M, 5, 6, generator=g), torch.randint(3, (M, 5), generator=g)
            pair.backward(x, y, BF16)
            if step == 1:
                next(pair.model.parameters()).grad[2, 0, 0] = float("inf")
            pair.step(unscale_first=False)

    kwargs = {"init_scale": 2.0**8, "growth_interval": 2}
    full = ScalerPair("Adam", **kwargs)
    run(full, range(6))
    first = ScalerPair("Adam", **kwargs)
    run(first, range(3))
    saved = copy.deepcopy({"model": first.model.state_dict(), "opt": first.opt.state_dict(),
                           "scaler": first.scaler.state_dict()})  # fmt: skip
    assert saved["scaler"]["scale"].shape == (M,) and saved["scaler"]["_growth_tracker"].shape == (M,)
    second = ScalerPair("Adam", **kwargs)
    second.model.load_state_dict(saved["model"])
    second.opt.load_state_dict(saved["opt"])
    second.scaler = pickle.loads(pickle.dumps(amp.GradScaler("cpu", **kwargs)))
    second.scaler.load_state_dict(saved["scaler"])
    second.refs, second.ref_opts, second.ref_scalers = first.refs, first.ref_opts, first.ref_scalers
    run(second, range(3, 6))
    for p, q in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q), "the resumed run differs from the uninterrupted one"
    assert torch.equal(full.scaler.get_scale(), second.scaler.get_scale())
    restored = pickle.loads(pickle.dumps(second.scaler))
    assert torch.equal(restored.get_scale(), second.scaler.get_scale())
    assert torch.equal(restored.state_dict()["_growth_tracker"], second.scaler.state_dict()["_growth_tracker"])

    single = torch.amp.GradScaler("cpu", init_scale=2.0**5)
    single.scale(torch.ones(()))
    scaler = amp.GradScaler("cpu", num_models=M)
    scaler.load_state_dict(single.state_dict())
    assert torch.equal(scaler.get_scale(), torch.full((M,), 2.0**5))


def test_scaler_sparse_gradients() -> None:
    """A sparse (M, rows, dim) gradient: each value row is unscaled by its own model's scale and flags only it."""
    torch.manual_seed(0)
    embedding = bl.BatchedEmbedding(M, 7, 4, sparse=True)
    scaler = amp.GradScaler("cpu", init_scale=torch.tensor([2.0, 4.0, 8.0]))
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    out = embedding(torch.randint(7, (M, 2, 3)))
    scaler.scale(out).sum().backward()
    grad = embedding.weight.grad
    grad._values()[grad._indices()[0] == 1] = float("inf")
    dense = grad.to_dense()
    scaler.unscale_(optimizer)
    expected = dense * torch.tensor([0.5, 0.25, 0.125]).view(M, 1, 1)
    assert torch.equal(embedding.weight.grad.to_dense(), expected)
    assert scaler._per_optimizer_states[id(optimizer)]["found_inf"].tolist() == [0.0, 1.0, 0.0]


def test_scaler_errors_and_disabled() -> None:
    model = _mlp()
    scaler = amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"0-d tensor.*\(M,\) per-model losses"):
        scaler.scale(torch.ones(()))
    losses = scaler.scale(torch.ones(M, requires_grad=True) * model[0].weight.sum((1, 2)))
    with pytest.raises(ValueError, match=r"M = 3 models.*shape \(4,\)"):
        scaler.scale(torch.ones(4))
    losses.sum().backward()
    with pytest.raises(TypeError, match=r"SGD\.step\(\) takes no active= mask.*batchlayers\.optim"):
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(ValueError, match="growth_factor"):
        amp.GradScaler("cpu", growth_factor=1.0)

    off = amp.GradScaler("cpu", enabled=False)
    x = torch.ones(M)
    assert off.scale(x) is x and off.state_dict() == {} and torch.equal(off.get_scale(), torch.ones(()))
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert not amp.GradScaler().is_enabled()
