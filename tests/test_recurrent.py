"""The batched recurrent layers against a loop over torch.nn.RNN / LSTM / GRU (and their cells) holding the same
slices: outputs, returned states, input, state and parameter gradients, over every option; then init,
state_dict, copies, dtype, torch.compile, dropout and bad inputs."""

from __future__ import annotations

import copy
import math
import pickle
import weakref

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from harness import LayerCase, RecordOps, assert_close, check_init_matches_torch, check_state_dict_layout, unbatch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import batchlayers as bl
from batchlayers import _workspace
from batchlayers.functional import _recurrent
from batchlayers.functional._recurrent import rnn
from batchlayers.recurrent import (
    BatchedGRU,
    BatchedGRUCell,
    BatchedLSTM,
    BatchedLSTMCell,
    BatchedRNN,
    BatchedRNNCell,
)
from batchlayers.registry import constructor_kwargs

F64, F32 = torch.float64, torch.float32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: on a busy machine, waking a second intra-op thread for each of them costs far
    more than the work (20x slower measured on 2 shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


T, B, I, H = 4, 3, 5, 6  # noqa: E741  (time steps, batch, input and hidden size of most tests)

# id -> (batched class, torch.nn class, extra constructor arguments)
NETWORKS = {
    "RNN_TANH": (BatchedRNN, nn.RNN, {}),
    "RNN_RELU": (BatchedRNN, nn.RNN, {"nonlinearity": "relu"}),
    "LSTM": (BatchedLSTM, nn.LSTM, {}),
    "LSTM_PROJ": (BatchedLSTM, nn.LSTM, {"proj_size": 4}),
    "GRU": (BatchedGRU, nn.GRU, {}),
}
CELLS = {
    "RNNCell_TANH": (BatchedRNNCell, nn.RNNCell, {}),
    "RNNCell_RELU": (BatchedRNNCell, nn.RNNCell, {"nonlinearity": "relu"}),
    "LSTMCell": (BatchedLSTMCell, nn.LSTMCell, {}),
    "GRUCell": (BatchedGRUCell, nn.GRUCell, {}),
}


def build(kind: str, num_models: int, dtype=F64, input_size=I, hidden_size=H, **options):
    """The batched layer and a ``dtype -> torch.nn module`` factory with the same arguments."""
    batched_cls, torch_cls, extra = {**NETWORKS, **CELLS}[kind]
    kwargs = {**extra, **options}
    batched = batched_cls(num_models, input_size, hidden_size, **kwargs, dtype=dtype)
    return batched, lambda dt=dtype: torch_cls(input_size, hidden_size, **kwargs, dtype=dt)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _flatten_state(state) -> list[torch.Tensor]:
    return list(state) if isinstance(state, tuple) else [state]


def compare(
    batched: nn.Module, modules: list[nn.Module], x: torch.Tensor, hx, *, shared: bool, where: str = ""
) -> None:
    """Forward and backward through ``batched`` and through ``modules`` one by one; compare the output, the
    returned states and the gradients of the input, the initial states and every parameter.

    ``x`` is one model's input when ``shared`` (the batched layer gets its stride-0 expand), else ``(M, ...)``;
    ``hx`` is ``None``, a tensor or a tuple of ``(M, ...)`` tensors.
    """
    num_models = batched.num_models
    xb, xr = _leaf(x), _leaf(x)
    hb = None if hx is None else tuple(_leaf(h) for h in _flatten_state(hx))
    hr = None if hx is None else tuple(_leaf(h) for h in _flatten_state(hx))
    is_tuple = isinstance(hx, tuple) or isinstance(batched, (BatchedLSTM, BatchedLSTMCell))
    arg = None if hb is None else (hb if is_tuple else hb[0])
    result = batched(xb.expand(num_models, *xb.shape) if shared else xb, arg)

    ref_results = []
    for i, m in enumerate(modules):
        state_i = None if hr is None else tuple(h[i] for h in hr)
        ref_results.append(
            m(xr if shared else xr[i], None if state_i is None else (state_i if is_tuple else state_i[0]))
        )

    cell = isinstance(batched, (BatchedRNNCell, BatchedLSTMCell, BatchedGRUCell))
    if cell:  # a cell returns its new state: h, or (h, c)
        outs = _flatten_state(result)
        refs = [torch.stack([_flatten_state(r)[k] for r in ref_results]) for k in range(len(outs))]
        names = ["h'", "c'"]
    else:  # (output, h_n) or (output, (h_n, c_n))
        outs = [result[0], *_flatten_state(result[1])]
        refs = [torch.stack([r[0] for r in ref_results])]
        refs += [torch.stack([_flatten_state(r[1])[k] for r in ref_results]) for k in range(len(outs) - 1)]
        names = ["output", "h_n", "c_n"]
    for name, out, ref in zip(names, outs, refs):
        assert_close(out, ref, msg=f"{name} {where}")

    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    ref_outs = [o for r in ref_results for o in (_flatten_state(r) if cell else [r[0], *_flatten_state(r[1])])]
    ref_grads = [g[i] for i in range(num_models) for g in grads]
    torch.autograd.backward(ref_outs, ref_grads)
    assert_close(xb.grad, xr.grad, msg=f"input gradient {where}")
    if hb is not None:
        for k, (a, b) in enumerate(zip(hb, hr)):
            assert_close(a.grad, b.grad, msg=f"gradient of initial state {k} {where}")
    for name, p in batched.named_parameters():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        assert_close(p.grad, ref, msg=f"gradient of {name} {where}")


def initial_state(kind: str, num_models: int, lead: tuple[int, ...], dtype=F64):
    """Random ``(M, *lead, H_out)`` initial states (a tuple with ``c`` for LSTMs)."""
    out_size = NETWORKS.get(kind, (None, None, {}))[2].get("proj_size", H)
    h = torch.randn(num_models, *lead, out_size, dtype=dtype)
    return (h, torch.randn(num_models, *lead, H, dtype=dtype)) if "LSTM" in kind else h


def network_input(num_models: int | None, batch_first: bool, dtype=F64) -> torch.Tensor:
    lead = () if num_models is None else (num_models,)
    return torch.randn(*lead, *((B, T) if batch_first else (T, B)), I, dtype=dtype)


@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("kind", NETWORKS)
def test_network_matches_loop(kind, num_layers, bidirectional, batch_first, bias, with_h0, shared, num_models):
    torch.manual_seed(0)
    options = dict(num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
    batched, make_torch = build(kind, num_models, **options)
    modules = unbatch(batched, make_torch)
    x = network_input(None if shared else num_models, batch_first)
    hx = initial_state(kind, num_models, (num_layers * (2 if bidirectional else 1), B)) if with_h0 else None
    compare(batched, modules, x, hx, shared=shared)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", NETWORKS)
def test_plain_recurrence_matches_loop(monkeypatch, kind, bidirectional):
    """The differentiable recurrence that torch.compile traces, run eagerly; it supports double backward."""
    monkeypatch.setattr(_recurrent, "_fused_steps", lambda x: False)
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3, num_layers=2, bidirectional=bidirectional)
    modules = unbatch(batched, make_torch)
    compare(
        batched, modules, network_input(3, False), initial_state(kind, 3, (2 * (1 + bidirectional), B)), shared=False
    )
    x = network_input(3, False).requires_grad_(True)
    (grad,) = torch.autograd.grad(batched(x)[0].pow(2).sum(), x, create_graph=True)
    grad.sum().backward()


@pytest.mark.parametrize("input_size", [I, 13], ids=["narrow_input", "wide_input"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("kind", NETWORKS)
def test_step_layouts_match_loop(kind, batch_first, input_size):
    """Every layout of the input projection gives the loop's numbers, two layers deep: batch-first rows as they
    are, or copied into time-major ones (an input narrower than the gates, in training), and the time-major
    output passed between layers."""
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3, input_size=input_size, num_layers=2, batch_first=batch_first)
    modules = unbatch(batched, make_torch)
    x = torch.randn(3, *((B, T) if batch_first else (T, B)), input_size, dtype=F64)
    compare(batched, modules, x, initial_state(kind, 3, (2, B)), shared=False)
    with torch.no_grad():  # nothing recorded: the batch-first rows as they are
        assert_close(batched(x)[0], torch.stack([m(x[i])[0] for i, m in enumerate(modules)]), msg="no_grad output")


def _count_native_steps(monkeypatch) -> list[str]:
    """Count the LSTM and GRU backward's calls of batchlayers' C kernels (one per time step and layer)."""
    calls: list[str] = []
    kernel_of = _recurrent._backward_kernel

    def counted(mode, like):
        kernel = kernel_of(mode, like)
        return None if kernel is None else (lambda *args: calls.append(mode) or kernel(*args))

    monkeypatch.setattr(_recurrent, "_backward_kernel", counted)
    return calls


LOSSES = {
    # each gives the backward other gradient layouts: contiguous random ones (w: fixed random tensors), stride-0
    # ones (a sum), a transposed output's, and the last step's alone (zeros elsewhere, none for the states)
    "random": lambda out, states, w: (out * w[0]).sum() + sum((s * w[k + 1]).sum() for k, s in enumerate(states)),
    "sums": lambda out, states, w: out.sum() + sum(s.sum() for s in states),
    "transposed": lambda out, states, w: out.transpose(1, 2).contiguous().transpose(1, 2).sin().sum(),
    "last_step": lambda out, states, w: (out[:, :, -1] if out.shape[2] == T else out[:, -1]).pow(2).sum(),
}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", ["LSTM", "LSTM_PROJ", "GRU"])
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_backward_native_kernel_matches_loop_and_torch_ops(monkeypatch, kind, bidirectional, batch_first, dtype, loss):
    """The LSTM and GRU backward's time steps in batchlayers' C kernels, two layers deep, against the torch.nn
    loop (the contract) and against the same backward with torch's ops (the same arithmetic: equal up to how the
    CPU rounds ``1 - t * t``), for gradients of every layout the loss gives the steps."""
    calls = _count_native_steps(monkeypatch)
    torch.manual_seed(0)
    batched, make_torch = build(
        kind, 3, num_layers=2, bidirectional=bidirectional, batch_first=batch_first, dtype=dtype
    )
    modules = unbatch(batched, make_torch)
    x = network_input(3, batch_first, dtype)
    hx = _flatten_state(initial_state(kind, 3, (2 * (1 + bidirectional), B), dtype))
    with torch.no_grad():
        out, states = batched(x, tuple(hx) if len(hx) == 2 else hx[0])
    weights = (torch.randn_like(out), *(torch.randn_like(s) for s in _flatten_state(states)))

    def gradients(run) -> list[torch.Tensor]:
        xs, hs = _leaf(x), [_leaf(t) for t in hx]
        out, states = run(xs, hs)
        LOSSES[loss](out, states, weights).backward()
        return [xs.grad, *(t.grad for t in hs)]

    def run_loop(xs, hs):
        results = [m(xs[i], tuple(h[i] for h in hs) if len(hs) == 2 else hs[0][i]) for i, m in enumerate(modules)]
        states = [_flatten_state(r[1]) for r in results]
        return torch.stack([r[0] for r in results]), [torch.stack([s[k] for s in states]) for k in range(len(hs))]

    def run_batched(xs, hs):
        out, states = batched(xs, tuple(hs) if len(hs) == 2 else hs[0])
        return out, _flatten_state(states)

    expected = gradients(run_loop)
    expected += [torch.stack([m.get_parameter(name).grad for m in modules]) for name, _ in batched.named_parameters()]
    found = {}
    for native in (True, False):
        monkeypatch.setattr(_recurrent, "native_kernel", native)
        batched.zero_grad()
        found[native] = gradients(run_batched) + [p.grad for p in batched.parameters()]
        assert len(calls) == 2 * T, f"{len(calls)} calls of the kernel, expected one per step and layer"
    tolerance = {"rtol": 1e-13, "atol": 1e-13} if dtype == F64 else {"rtol": 1e-5, "atol": 1e-6}
    for k, (a, b, ref) in enumerate(zip(found[True], found[False], expected, strict=True)):
        assert_close(a, ref, msg=f"gradient {k}, kernel against the loop")
        torch.testing.assert_close(a, b, **tolerance, msg=f"gradient {k}, kernel against torch's ops")


@pytest.mark.parametrize("sizes", [(3, 3, 3, 3), (3, 1, 3, 1), (1, 3, 1, 3)], ids=["M=B=T=H", "B=1,H=1", "M=1,T=1"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("kind", ["LSTM", "LSTM_PROJ", "GRU"])
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_backward_native_kernel_with_sizes_that_coincide(monkeypatch, kind, batch_first, sizes):
    """The kernels take every size from the saved gates and every stride from the tensors: models, samples,
    steps and hidden units all equal, or ones among them, still give the loop's numbers, with the kernel run."""
    calls = _count_native_steps(monkeypatch)
    num_models, batch, steps, hidden = sizes
    torch.manual_seed(0)
    options = {"proj_size": 1} if kind == "LSTM_PROJ" else {}
    batched_cls, torch_cls, _ = NETWORKS[kind]
    batched = batched_cls(
        num_models, I, hidden + 1 if options else hidden, batch_first=batch_first, **options, dtype=F64
    )
    modules = unbatch(batched, lambda: torch_cls(I, batched.hidden_size, batch_first=batch_first, **options, dtype=F64))
    x = torch.randn(num_models, *((batch, steps) if batch_first else (steps, batch)), I, dtype=F64)
    out_size = 1 if options else hidden
    h0 = torch.randn(num_models, 1, batch, out_size, dtype=F64)
    hx = (h0, torch.randn(num_models, 1, batch, batched.hidden_size, dtype=F64)) if "LSTM" in kind else h0
    compare(batched, modules, x, hx, shared=False)
    assert len(calls) == steps


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_backward_native_kernel_matches_loop_over_options(monkeypatch, kind):
    """With the kernels, the whole comparison with the torch.nn loop (outputs, states, every gradient) over
    shared and per-model inputs, with and without initial states and biases."""
    calls = _count_native_steps(monkeypatch)
    for shared, with_h0, bias in [(False, True, True), (True, False, True), (False, False, False)]:
        torch.manual_seed(0)
        batched, make_torch = build(kind, 3, bias=bias)
        modules = unbatch(batched, make_torch)
        hx = initial_state(kind, 3, (1, B)) if with_h0 else None
        compare(batched, modules, network_input(None if shared else 3, False), hx, shared=shared)
    assert len(calls) == 3 * T


@pytest.mark.parametrize(
    "case", ["setting off", "no library", "above the units limit", "bfloat16"], ids=lambda c: c.replace(" ", "_")
)
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_backward_without_the_native_kernel(monkeypatch, kind, case):
    """Where the kernels do not serve (turned off, not built, a step too large, another dtype), the backward
    takes torch's ops and still matches the loop."""
    calls = _count_native_steps(monkeypatch)
    dtype = torch.bfloat16 if case == "bfloat16" else F64
    if case == "setting off":
        monkeypatch.setattr(_recurrent, "native_kernel", _recurrent.native_kernel)  # (restored afterwards)
        bl.backends.cpu.native_recurrent = False
        assert bl.backends.cpu.native_recurrent is False
    elif case == "no library":
        monkeypatch.setattr(_recurrent._native, "library", lambda: None)
    elif case == "above the units limit":
        monkeypatch.setattr(_recurrent, "NATIVE_MAX_UNITS", 3 * B * H - 1)
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3, dtype=dtype)
    modules = unbatch(batched, make_torch)
    x = network_input(3, False, dtype)
    if dtype == F64:
        compare(batched, modules, x, initial_state(kind, 3, (1, B)), shared=False)
    else:
        batched(x)[0].float().sum().backward()  # (the loop's bfloat16 kernels round otherwise: only that it runs)
        assert all(p.grad is not None and p.grad.isfinite().all() for p in batched.parameters())
    assert not calls
    if case == "setting off":
        bl.backends.cpu.native_recurrent = True
        batched(x)[0].sum().backward()
        assert len(calls) == T
        with pytest.raises(TypeError, match="native_recurrent must be True or False"):
            bl.backends.cpu.native_recurrent = 1


def test_a_missing_kernel_source_leaves_the_kernels_out(monkeypatch, tmp_path):
    """An install that lacks one of the C sources (or the header) has no kernels, with the reason kept, instead
    of raising from every optimizer step and LSTM backward; the backward then takes torch's ops."""
    monkeypatch.setenv("BATCHLAYERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_recurrent._native, "HEADER", tmp_path / "missing.h")
    _recurrent._native._load.cache_clear()
    try:
        assert _recurrent._native.library() is None
        assert "missing.h" in _recurrent._native.unavailable_reason()
        calls = _count_native_steps(monkeypatch)
        torch.manual_seed(0)
        batched, make_torch = build("LSTM", 3)
        compare(batched, unbatch(batched, make_torch), network_input(3, False), None, shared=False)
        assert not calls
    finally:
        _recurrent._native._load.cache_clear()  # (the next use loads the real library again)


def _force_per_model_kernels(monkeypatch) -> list[int]:
    """Make every LSTM take the per-model kernel path; returns a list that grows by one per call of it."""
    calls: list[int] = []
    run = _recurrent._per_model_lstm
    monkeypatch.setattr(_recurrent, "_per_model_kernels", lambda *args: True)
    monkeypatch.setattr(_recurrent, "_per_model_lstm", lambda *args: calls.append(1) or run(*args))
    return calls


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("kind", ["LSTM", "LSTM_PROJ"])
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_lstm_per_model_kernels_match_loop(
    monkeypatch, kind, num_layers, bidirectional, batch_first, with_h0, shared, dtype, kept
):
    """The per-model path (torch's own LSTM kernel once per model, chosen for few models with large matrix
    multiplies), forced at these small sizes: outputs, states and every gradient equal the loop's."""
    calls = _force_per_model_kernels(monkeypatch)
    torch.manual_seed(0)
    options = dict(num_layers=num_layers, batch_first=batch_first, bidirectional=bidirectional)
    batched, make_torch = build(kind, 3, dtype, **options)
    modules = unbatch(batched, make_torch)
    x = network_input(None if shared else 3, batch_first, dtype)
    hx = initial_state(kind, 3, (num_layers * (2 if bidirectional else 1), B), dtype) if with_h0 else None
    compare(batched, modules, x, hx, shared=shared)
    assert calls == [1]


def test_lstm_per_model_kernels_never_write_held_results(monkeypatch, kept_workspace):
    """The per-model path's stacked output, input gradient and weight gradients in kept memory (every size
    here): held across later steps they are never written, the later steps still equal the loop, and once
    dropped their memory is used again instead of new."""
    _force_per_model_kernels(monkeypatch)
    torch.manual_seed(0)
    batched, make_torch = build("LSTM", 3, num_layers=2)
    modules = unbatch(batched, make_torch)
    x = network_input(3, False).requires_grad_()
    out = batched(x)[0]
    out.square().sum().backward()
    held = [out, x.grad, *(p.grad for p in batched.parameters())]
    copies = [t.clone() for t in held]
    for step in range(2):
        batched.zero_grad()
        for m in modules:
            m.zero_grad()
        compare(batched, modules, network_input(3, False), None, shared=False, where=f"(step {step})")
    assert all(torch.equal(t, c) for t, c in zip(held, copies)), "a held result was written"
    pointers = {t.data_ptr() for t in held}
    del out, held, copies
    x.grad = None
    for m in (batched, *modules):
        m.zero_grad()
    compare(batched, modules, network_input(3, False), None, shared=False, where="(after dropping)")
    again = {p.grad.data_ptr() for p in batched.parameters()}
    assert again & pointers, "the dropped gradients' memory was not reused"
    assert again <= {b.data_ptr() for b in kept_workspace}, "weight gradients not in kept memory"


@pytest.mark.parametrize("per_model", [False, True], ids=["batched", "per_model_kernels"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
def test_lstm_with_models_batch_and_steps_all_equal(monkeypatch, batch_first, per_model):
    """M == B == T: nothing may be told apart by size; both paths follow batch_first, against the loop."""
    calls = _force_per_model_kernels(monkeypatch) if per_model else []
    if not per_model:
        monkeypatch.setattr(_recurrent, "_per_model_kernels", lambda *args: False)
    torch.manual_seed(0)
    batched, make_torch = build("LSTM", 3, num_layers=2, batch_first=batch_first)
    modules = unbatch(batched, make_torch)
    x = torch.randn(3, 3, 3, I, dtype=F64)
    compare(batched, modules, x, initial_state("LSTM", 3, (2, 3)), shared=False)
    assert calls == ([1] if per_model else [])


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_lstm_per_model_kernels_with_dropout(monkeypatch, training):
    """Dropout in eval mode does nothing, so the per-model path serves it; in training every model draws its
    own masks in the batched recurrence (its random stream), so that path is kept."""
    calls = _force_per_model_kernels(monkeypatch)
    torch.manual_seed(0)
    batched, make_torch = build("LSTM", 3, num_layers=2, dropout=0.5)
    modules = unbatch(batched, make_torch)
    batched.train(training)
    for m in modules:
        m.train(training)
    if training:
        batched(network_input(3, False))
    else:
        compare(batched, modules, network_input(3, False), None, shared=False)
    assert calls == ([] if training else [1])


@pytest.mark.parametrize(
    "num_models, batch, hidden_size, dtype, proj_size, expected",
    [
        (8, 64, 256, F32, 0, True),  # the benchmark's 2x256 LSTM
        (4, 16, 256, F32, 0, True),
        (8, 128, 64, F32, 0, True),
        (8, 32, 128, F32, 0, True),
        (16, 64, 128, F32, 0, False),  # more models: the batched recurrence
        (32, 8, 64, F32, 0, False),  # the RL policy
        (8, 16, 64, F32, 0, False),  # small matrix multiplies
        (8, 64, 256, F64, 0, False),  # not oneDNN's kernel
        (8, 64, 256, F32, 32, False),  # projections leave oneDNN
    ],
)
def test_per_model_kernels_rule(num_models, batch, hidden_size, dtype, proj_size, expected):
    """The measured rule of the docstring: at most 8 models, B * H >= 4096, float32 through oneDNN."""
    x = torch.zeros(num_models, 2, batch, 3, dtype=dtype)
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    assert _recurrent._per_model_kernels(x, batch, hidden_size, proj_size) is (expected and onednn)


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", NETWORKS)
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_network_float32(kind, bidirectional, shared):
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3, F32, num_layers=2, bidirectional=bidirectional)
    modules = unbatch(batched, make_torch)
    hx = initial_state(kind, 3, (2 * (1 + bidirectional), B), F32)
    compare(batched, modules, network_input(None if shared else 3, False, F32), hx, shared=shared)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", CELLS)
def test_cell_matches_loop(kind, bias, with_h0, shared, num_models, dtype):
    torch.manual_seed(0)
    batched, make_torch = build(kind, num_models, dtype, bias=bias)
    modules = unbatch(batched, make_torch)
    x = torch.randn(*(() if shared else (num_models,)), B, I, dtype=dtype)
    hx = initial_state(kind, num_models, (B,), dtype) if with_h0 else None
    compare(batched, modules, x, hx, shared=shared)


def test_cell_steps_match_torch_over_a_sequence():
    """A cell driven step by step carries its state like torch's (the state gradient flows through time)."""
    torch.manual_seed(0)
    batched, make_torch = build("LSTMCell", 3)
    modules = unbatch(batched, make_torch)

    class Unrolled(nn.Module):
        def __init__(self, cell):
            super().__init__()
            self.cell = cell
            self.num_models = getattr(cell, "num_models", None)

        def forward(self, xs, state=None):
            hs = []
            for x_t in xs.unbind(-3):
                state = self.cell(x_t, state)
                hs.append(state[0])
            return torch.stack(hs, -3), state

    unrolled = Unrolled(batched)
    for name, p in batched.named_parameters():  # the reference reads gradients under the cell's own names
        unrolled.register_parameter(name, p)
    refs = [Unrolled(m) for m in modules]
    for r, m in zip(refs, modules):
        for name, p in m.named_parameters():
            r.register_parameter(name, p)
    x = torch.randn(3, T, B, I, dtype=F64)
    xb, xr = _leaf(x), _leaf(x)
    yb, (hb, cb) = unrolled(xb)
    outs = [unrolled_ref(xr[i]) for i, unrolled_ref in enumerate(refs)]
    assert_close(yb, torch.stack([o[0] for o in outs]), msg="outputs")
    assert_close(cb, torch.stack([o[1][1] for o in outs]), msg="c")
    g = torch.randn_like(yb)
    yb.backward(g)
    for i, o in enumerate(outs):
        o[0].backward(g[i])
    assert_close(xb.grad, xr.grad, msg="input gradient")
    for name, p in batched.named_parameters():
        assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in modules]), msg=name)


# ----------------------------------------------------------------------------------------------------------
# Init, state_dict, copies, dtype, constructor arguments.

LAYOUT_CASES = [
    LayerCase(id=f"{kind}-{tag}", batched=lambda m, dt, k=kind, o=o: build(k, m, dt, **o)[0],
              torch=lambda dt, k=kind, o=o: build(k, 1, dt, **o)[1](dt), input=None)
    for kind in NETWORKS
    for tag, o in [("plain", {}), ("deep-bi-nobias", dict(num_layers=2, bidirectional=True, bias=False))]
] + [
    LayerCase(id=kind, batched=lambda m, dt, k=kind: build(k, m, dt)[0],
              torch=lambda dt, k=kind: build(k, 1, dt)[1](dt), input=None)
    for kind in CELLS
]  # fmt: skip


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.id)
def test_init_like_torch_per_model(case):
    check_init_matches_torch(case, num_models=4, torch_samples=8)
    torch.manual_seed(0)
    batched = case.batched(5, F64)
    bound = 1 / math.sqrt(batched.hidden_size)
    for name, p in batched.named_parameters():
        for i in range(5):
            assert p[i].abs().max() <= bound, f"{name}[{i}] exceeds the bound {bound}"
        assert p.abs().max() > 0.8 * bound, f"{name} does not span the bound {bound}"


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.id)
def test_state_dict_layout(case):
    check_state_dict_layout(case)
    batched, ref = case.batched(3, F64), case.torch(F64)
    if hasattr(ref, "_flat_weights_names"):
        assert batched._flat_weights_names == ref._flat_weights_names
        assert [[p.shape[1:] for p in ps] for ps in batched.all_weights] == [
            [p.shape for p in ps] for ps in ref.all_weights
        ]


@pytest.mark.parametrize("kind", [*NETWORKS, *CELLS])
def test_constructor_arguments_read_back_like_torch(kind):
    options = {} if kind in CELLS else dict(num_layers=2, batch_first=True, bidirectional=True, bias=False)
    if kind in NETWORKS and kind != "LSTM_PROJ":
        options["dropout"] = 0.25
    batched, make_torch = build(kind, 3, **options)
    ref = make_torch()
    names = ["input_size", "hidden_size", "bias", "num_layers", "batch_first", "dropout", "bidirectional"]
    for name in [*names, "proj_size", "nonlinearity", "mode"]:
        if hasattr(ref, name):
            assert getattr(batched, name) == getattr(ref, name), name
    assert batched.torch_module is type(ref)
    assert batched.extra_repr().startswith("num_models=3")
    # nn.RNN/LSTM/GRU.__init__ take (*args, **kwargs): their arguments are RNNBase's (plus nonlinearity)
    signature_of = nn.RNNBase if kind in NETWORKS else type(ref)
    assert constructor_kwargs(batched, signature_of) == constructor_kwargs(ref, signature_of)


@pytest.mark.parametrize("kind", NETWORKS)
def test_no_grad_and_inference_mode_give_the_same_output(kind):
    torch.manual_seed(0)
    batched, _ = build(kind, 3, num_layers=2, bidirectional=True)
    x, hx = network_input(3, True), initial_state(kind, 3, (4, B))
    batched.batch_first = True
    expected = batched(x, hx)[0]
    with torch.no_grad():
        assert_close(batched(x, hx)[0], expected, msg="no_grad")
    with torch.inference_mode():
        assert_close(batched(x, hx)[0], expected.detach(), msg="inference_mode")


def test_copies_and_dtype():
    torch.manual_seed(0)
    batched, make_torch = build("LSTM_PROJ", 3, F32, num_layers=2, bidirectional=True)
    x = network_input(3, False, F32)
    for clone in (copy.deepcopy(batched), pickle.loads(pickle.dumps(batched))):
        for (name, p), q in zip(batched.named_parameters(), clone.parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), f"{name} not copied"
        assert torch.equal(clone(x)[0], batched(x)[0])
    batched = batched.to(F64)
    assert all(p.dtype == F64 for p in batched.parameters())
    modules = unbatch(batched, lambda: make_torch(F64))
    compare(batched, modules, x.double(), initial_state("LSTM_PROJ", 3, (4, B)), shared=False)


@pytest.mark.parametrize("kind", ["LSTM_PROJ", "GRU", "RNN_RELU", "GRUCell"])
def test_compile_fullgraph(kind):
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {} if kind in CELLS else dict(num_layers=2, bidirectional=True, batch_first=True)
    eager, _ = build(kind, 3, **options)
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, B, I, dtype=F64) if kind in CELLS else network_input(3, True)
    outs_eager = _flatten_state(eager(x)) if kind in CELLS else [eager(x)[0]]
    outs_compiled = _flatten_state(compiled(x)) if kind in CELLS else [compiled(x)[0]]
    for a, b in zip(outs_compiled, outs_eager):
        assert_close(a, b, msg="compiled output")
    grads = [torch.randn_like(o) for o in outs_eager]
    torch.autograd.backward(outs_eager, grads)
    torch.autograd.backward(outs_compiled, grads)
    for (name, p), q in zip(eager.named_parameters(), compiled_copy.parameters()):
        assert_close(q.grad, p.grad, msg=f"compiled gradient of {name}")


# ----------------------------------------------------------------------------------------------------------
# Dropout.


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN_TANH"])
def test_dropout_masks_are_independent_per_model(kind):
    torch.manual_seed(0)
    batched, _ = build(kind, 3, num_layers=2, dropout=0.5)
    with torch.no_grad():  # every model gets model 0's weights
        for p in batched.parameters():
            p.copy_(p[:1].expand_as(p))
    x = network_input(None, False)
    shared = x.expand(3, *x.shape)
    batched.eval()
    y_eval = batched(shared)[0]
    for i in range(1, 3):  # equal up to rounding: the batched GEMM may round each model's slice differently
        assert_close(y_eval[i], y_eval[0], msg="identical models differ in eval mode")
    batched.dropout = 0.0
    batched.train()
    assert_close(batched(shared)[0], y_eval, msg="eval with dropout vs train without")
    batched.dropout = 0.5
    y_train = batched(shared)[0]
    assert not torch.allclose(y_train, y_eval), "dropout changed nothing in train mode"
    for i in range(1, 3):
        assert not torch.allclose(y_train[i], y_train[0]), f"models 0 and {i} drew the same dropout mask"
    y_train.sum().backward()
    assert all(p.grad is not None for p in batched.parameters())


def test_dropout_generator_is_reproducible():
    torch.manual_seed(0)
    batched, _ = build("LSTM", 3, num_layers=3)
    x = network_input(3, False)
    options = dict(num_layers=3, bias=True, batch_first=False, dropout=0.3, training=True, bidirectional=False)
    a = rnn("LSTM", x, None, batched._flat_weights, **options, generator=torch.Generator().manual_seed(5))[0]
    b = rnn("LSTM", x, None, batched._flat_weights, **options, generator=torch.Generator().manual_seed(5))[0]
    c = rnn("LSTM", x, None, batched._flat_weights, **options, generator=torch.Generator().manual_seed(6))[0]
    d = rnn("LSTM", x, None, batched._flat_weights, **{**options, "training": False})[0]
    assert torch.equal(a, b) and not torch.allclose(a, c) and not torch.allclose(a, d)


def test_dropout_on_one_layer_warns_like_torch():
    with pytest.warns(UserWarning, match="num_layers greater than 1"):
        BatchedGRU(2, I, H, dropout=0.5)


# ----------------------------------------------------------------------------------------------------------
# The functional form and the shared batch.


@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
def test_shared_input_is_not_copied(batch_first):
    # I = 13 so that no intermediate of the layer has the size of M copies of the batch.
    batched, _ = build("LSTM", 3, input_size=13, hidden_size=4, batch_first=batch_first, bidirectional=True)
    x = torch.randn(*((B, T) if batch_first else (T, B)), 13, dtype=F64)
    with RecordOps() as ops:
        batched(x.expand(3, *x.shape))
    copies = [name for name, is_view, n in ops.ops if not is_view and n == 3 * x.numel()]
    assert copies == [], "the shared batch was copied M times"


def test_functional_takes_torch_flat_weights_order():
    torch.manual_seed(0)
    ref = nn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=3, dtype=F64)
    weights = [getattr(ref, name).detach().unsqueeze(0) for name in ref._flat_weights_names]
    x = torch.randn(1, T, B, I, dtype=F64)
    out, (h, c) = rnn(
        "LSTM", x, None, weights, num_layers=2, bias=True, batch_first=False, dropout=0.0, training=False,
        bidirectional=True, proj_size=3,
    )  # fmt: skip
    ref_out, (ref_h, ref_c) = ref(x[0])
    assert_close(out[0], ref_out, msg="output")
    assert_close(h[0], ref_h, msg="h_n")
    assert_close(c[0], ref_c, msg="c_n")
    with pytest.raises(ValueError, match="expected 20 weights"):
        rnn("LSTM", x, None, weights[:-1], num_layers=2, bias=True, batch_first=False, dropout=0.0,
            training=False, bidirectional=True, proj_size=3)  # fmt: skip
    with pytest.raises(ValueError, match="mode must be one of"):
        rnn("LSTMX", x, None, weights, num_layers=2, bias=True, batch_first=False, dropout=0.0,
            training=False, bidirectional=True, proj_size=3)  # fmt: skip


def test_fused_recurrence_refuses_double_backward():
    batched, _ = build("GRU", 2)
    x = network_input(2, False).requires_grad_(True)
    (grad,) = torch.autograd.grad(batched(x)[0].pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        grad.sum().backward()


# ----------------------------------------------------------------------------------------------------------
# Bad input.

_M = 3
BAD_INPUTS = [
    # (id, layer kind, input maker, hx maker, exception, message regex)
    ("models", "LSTM", lambda: torch.randn(_M + 1, T, B, I), None, ValueError,
     r"BatchedLSTM.*\(M, T, B, input_size\) with M=3.*dimension 0 \(models\) is 4, not 3"),
    ("features", "GRU", lambda: torch.randn(_M, T, B, I + 1), None, ValueError,
     rf"BatchedGRU.*input_size={I}.*dimension 3 \(input_size\) is {I + 1}"),
    ("unbatched", "RNN_TANH", lambda: torch.randn(_M, T, I), None, ValueError,
     r"BatchedRNN: expected a 4-D input \(M, T, B, input_size\).*got 3-D shape \(3, 4, 5\); unbatched inputs "
     r"are not supported, pass a batch of one \(input.unsqueeze\(2\)\)"),
    ("unbatched_batch_first", "LSTM_BF", lambda: torch.randn(_M, T, I), None, ValueError,
     r"BatchedLSTM.*4-D input \(M, B, T, input_size\).*input.unsqueeze\(1\)"),
    ("ndim", "GRU", lambda: torch.randn(_M, T, B, 1, I), None, ValueError,
     r"BatchedGRU: expected a 4-D input \(M, T, B, input_size\).*got 5-D shape"),
    ("packed", "LSTM", lambda: pack_padded_sequence(torch.randn(T, B, I), [T] * B), None, TypeError,
     r"BatchedLSTM: PackedSequence input is not supported; pad the sequences"),
    ("not_a_tensor", "GRU", lambda: [[0.0] * I] * T, None, TypeError, r"BatchedGRU.*Tensor, got list"),
    ("dtype", "GRU", lambda: torch.randn(_M, T, B, I, dtype=F32), None, ValueError,
     r"BatchedGRU: input dtype torch.float32 does not match the weights' torch.float64"),
    ("h0_shape", "GRU", lambda: torch.randn(_M, T, B, I), lambda: torch.randn(_M, 2, B, H), ValueError,
     r"BatchedGRU: expected h_0 \(M, L\*D, B, H\) of shape \(3, 1, 3, 6\), got \(3, 2, 3, 6\)"),
    ("lstm_hx_not_tuple", "LSTM", lambda: torch.randn(_M, T, B, I), lambda: torch.randn(_M, 1, B, H), TypeError,
     r"BatchedLSTM: expected hx to be a tuple \(h_0, c_0\)"),
    ("c0_shape", "LSTM_PROJ", lambda: torch.randn(_M, T, B, I),
     lambda: (torch.randn(_M, 1, B, 4), torch.randn(_M, 1, B, 4)), ValueError,
     r"BatchedLSTM: expected c_0 \(M, L\*D, B, H\) of shape \(3, 1, 3, 6\), got \(3, 1, 3, 4\)"),
    ("cell_models", "LSTMCell", lambda: torch.randn(_M + 1, B, I), None, ValueError,
     r"BatchedLSTMCell.*\(M, B, input_size\) with M=3.*dimension 0 \(models\) is 4"),
    ("cell_unbatched", "GRUCell", lambda: torch.randn(_M, I), None, ValueError,
     r"BatchedGRUCell: expected a 3-D input \(M, B, input_size\).*input.unsqueeze\(1\)"),
    ("cell_hx", "RNNCell_TANH", lambda: torch.randn(_M, B, I), lambda: torch.randn(_M, B + 1, H), ValueError,
     r"BatchedRNNCell: expected h \(M, B, H\) of shape \(3, 3, 6\), got \(3, 4, 6\)"),
    ("cell_packed", "GRUCell", lambda: pack_padded_sequence(torch.randn(T, B, I), [T] * B), None, TypeError,
     r"BatchedGRUCell: PackedSequence"),
]  # fmt: skip


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[r[0] for r in BAD_INPUTS])
def test_bad_input_raises(row):
    _, kind, make_input, make_hx, exc, pattern = row
    options = {}
    if kind == "LSTM_BF":
        kind, options = "LSTM", {"batch_first": True}
    batched, _ = build(kind, _M, **options)
    x = make_input()
    if isinstance(x, torch.Tensor) and x.dtype == F32 and "dtype" not in row[0]:
        x = x.double()
    hx = None if make_hx is None else make_hx()
    hx = None if hx is None else (tuple(h.double() for h in hx) if isinstance(hx, tuple) else hx.double())
    with pytest.raises(exc, match=pattern):
        batched(x, hx)


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda: BatchedLSTM(2, 4, 4, proj_size=4), r"BatchedLSTM: proj_size has to be smaller than hidden_size"),
        (lambda: BatchedRNN(2, 4, 4, nonlinearity="gelu"), r"BatchedRNN: unknown nonlinearity 'gelu'"),
        (lambda: BatchedGRU(2, 4, 4, num_layers=2, dropout=1.5), r"BatchedGRU: dropout should be a number in \[0, 1\]"),
        (lambda: BatchedGRU(2, 0, 4), r"BatchedGRU: input_size must be greater than zero"),
        (lambda: BatchedLSTM(0, 4, 4), r"BatchedLSTM: num_models must be at least 1"),
        (lambda: BatchedRNNCell(2, 4, 4, nonlinearity="gelu"), r"BatchedRNNCell: unknown nonlinearity"),
    ],
)
def test_bad_arguments_raise(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@pytest.fixture
def kept_workspace(monkeypatch):
    """The recurrent kernels' buffers and input projections kept between calls whatever their size (see
    batchlayers._workspace), an empty pool before and after."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    monkeypatch.setattr(_workspace, "MMAP_BYTES", 0)
    _workspace.release()
    yield _workspace._pool()
    _workspace.release()


# (unidirectional with M = T: the step-major forward buffers and the model-major gradients have one shape)
@pytest.mark.parametrize("num_models,bidirectional", [(3, True), (T, False)], ids=["bi", "M=T"])
@pytest.mark.parametrize("kind", NETWORKS)
def test_kept_buffers_are_reused_and_written_whole(kept_workspace, kind, num_models, bidirectional):
    """A second training step takes the first one's kept buffers, poisoned with NaN in between: every element
    they hold is written before it is read, so the step is exact against torch.nn."""
    torch.manual_seed(0)
    batched, make_torch = build(kind, num_models, num_layers=2, bidirectional=bidirectional)
    modules = unbatch(batched, make_torch)
    compare(batched, modules, network_input(num_models, False), None, shared=False, where="first step")
    kept = [weakref.ref(t) for t in kept_workspace]  # (a weak reference does not hold a buffer)
    assert kept
    for buffer in kept_workspace:
        buffer.fill_(math.nan)
    del buffer  # (a name holding a buffer keeps it from being reused)
    batched.zero_grad()
    for m in modules:
        m.zero_grad()
    compare(batched, modules, network_input(num_models, False), None, shared=False, where="second step")
    assert sorted(id(t) for t in kept_workspace) == sorted(id(r()) for r in kept)  # the same buffers: nothing new


@pytest.mark.parametrize("kind", ["LSTM_PROJ", "GRU", "RNN_TANH"])
def test_a_buffer_held_by_a_pending_backward_is_not_reused(kept_workspace, kind):
    """Two calls of one layer before one backward (the second call's buffers must be new ones), then a call
    without gradients while the first backward's buffers are free again."""
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3)
    modules = unbatch(batched, make_torch)
    x1, x2 = network_input(3, False), network_input(3, False)
    out = batched(x1)[0] * batched(x2)[0]
    ref = torch.stack([m(x1[i])[0] * m(x2[i])[0] for i, m in enumerate(modules)])
    assert_close(out, ref, msg="output")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for name, p in batched.named_parameters():
        assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in modules]), msg=name)
    with torch.no_grad():
        assert_close(batched(x2)[0], torch.stack([m(x2[i])[0] for i, m in enumerate(modules)]), msg="no grad")


def test_reuse_workspace_can_be_turned_off(kept_workspace, monkeypatch):
    monkeypatch.setattr(_workspace, "enabled", True)  # (restored after the test)
    batched, _ = build("LSTM", 2)
    batched(network_input(2, False))
    assert kept_workspace
    bl.backends.cpu.reuse_workspace = False
    assert not kept_workspace and not bl.backends.cpu.reuse_workspace  # turning it off frees the buffers
    batched(network_input(2, False))
    assert not kept_workspace
    with pytest.raises(TypeError, match="reuse_workspace must be True or False"):
        bl.backends.cpu.reuse_workspace = 1


def test_threads_keep_buffers_of_their_own(kept_workspace):
    """Two threads training at once each take buffers from their own pool: exact in both."""
    import threading

    torch.manual_seed(0)
    work = []
    for _ in range(2):
        batched, make_torch = build("LSTM", 3)
        work.append((batched, unbatch(batched, make_torch), [network_input(3, False) for _ in range(20)]))
    errors: list[BaseException] = []

    def train(batched, modules, inputs) -> None:
        try:
            for x in inputs:
                compare(batched, modules, x, None, shared=False)
        except BaseException as error:  # (reported by the main thread)
            errors.append(error)

    threads = [threading.Thread(target=train, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("holder", ["a backward's saved tensor", "a view", "another tensor on its storage", "a name"])
def test_a_kept_buffer_is_handed_out_only_when_nothing_holds_it(kept_workspace, holder):
    like = torch.empty(0, dtype=F64)
    buffer = _workspace.empty(like, 4, 5)
    if holder == "a backward's saved tensor":
        held = torch.ones(4, 5, dtype=F64, requires_grad=True) * buffer  # (autograd saves it in C++, no name)
    elif holder == "a view":
        held = buffer[1:]
    elif holder == "another tensor on its storage":
        held = torch.empty(0, dtype=F64).set_(buffer.untyped_storage(), 0, (20,), (1,))
    else:
        held = buffer
    first = id(buffer)
    del buffer
    assert id(_workspace.empty(like, 4, 5)) != first  # held: a new buffer
    del held
    assert id(_workspace.empty(like, 4, 5)) == first  # free again: handed out


def test_changing_sequence_lengths_keep_about_one_steps_buffers(kept_workspace):
    """Each length needs buffers of its own: the free ones of earlier lengths are dropped, so the pool holds no
    more than about one step's buffers beyond those in use (the most ever in use at once)."""
    batched, _ = build("LSTM", 3)
    for steps in range(2, 14):
        x = torch.randn(steps, 3, B, I, dtype=F64).transpose(0, 1)  # (M, T, B, I) time-major per model
        batched(x.contiguous())[0].sum().backward()
    held = sum(t.nbytes for t in kept_workspace)
    assert 0 < held <= 2 * _workspace._local.peak, (held, _workspace._local.peak)
    assert len(kept_workspace) < 12 * 5  # (five buffers a length: most lengths' are gone)


def test_buffers_kept_under_inference_mode_are_not_written_outside_it(kept_workspace):
    """An evaluation under torch.inference_mode() keeps inference tensors, which torch lets no one write outside
    it: the training step after it takes buffers of its own, and is exact."""
    torch.manual_seed(0)
    batched, make_torch = build("LSTM", 3)
    modules = unbatch(batched, make_torch)
    with torch.inference_mode():
        batched(network_input(3, False))
    assert kept_workspace and all(t.is_inference() for t in kept_workspace)
    compare(batched, modules, network_input(3, False), None, shared=False)


# (forward-mode AD's first use in a process registers torch's jit decompositions, which warn)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["vmap-grad", "forward-ad"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN_TANH"])
def test_torch_func_transforms_run_the_plain_recurrence(kind, transform):
    """Under a torch.func transform or forward-mode AD the layers run the plain recurrence (the fused steps'
    Functions have no vmap or jvp rule, and raised there): per-sample gradients (``vmap(grad(...))``, time
    major inputs, one sample per model) and a forward-mode derivative equal those of each model's torch.nn
    layer."""
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3)
    modules = unbatch(batched, make_torch)
    x = network_input(3, False)  # (M, T, B, I)
    params = {k: v.detach() for k, v in batched.named_parameters()}
    name = "weight_hh_l0"
    if transform == "vmap-grad":

        def loss(p, sample):  # (M, T, I): one sample per model
            return torch.func.functional_call(batched, p, (sample.unsqueeze(2),))[0].square().sum()

        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 2))(params, x)[name]
        for m, module in enumerate(modules):  # (torch.nn's own layers do not run under vmap: sample by sample)
            weight = dict(module.named_parameters())[name]
            expected = torch.stack(
                [torch.autograd.grad(module(x[m][:, i : i + 1])[0].square().sum(), weight)[0] for i in range(B)]
            )
            assert_close(got[:, m], expected, msg=f"per-sample {name} gradients of model {m}")
    else:
        tangent = torch.randn_like(params[name])
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(params[name].clone().requires_grad_(), tangent)  # (recorded too)
            out = torch.func.functional_call(batched, {**params, name: dual}, (x,))[0]
            got = forward_ad.unpack_dual(out).tangent
            for m, module in enumerate(modules):
                own = {k: v.detach() for k, v in module.named_parameters()}
                own_dual = forward_ad.make_dual(own[name].clone(), tangent[m])
                own_out = torch.func.functional_call(module, {**own, name: own_dual}, (x[m],))[0]
                assert_close(got[m], forward_ad.unpack_dual(own_out).tangent, msg=f"tangent of model {m}")


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_backward_native_kernel_reads_negative_views_by_value(monkeypatch, kind):
    """Initial states and the gradients by the output and the last states given as negative views (their memory
    holds the values' negatives): the backward's kernel gets their values, as the loop's torch ops do."""
    calls = _count_native_steps(monkeypatch)
    torch.manual_seed(0)
    batched, make_torch = build(kind, 3)
    modules = unbatch(batched, make_torch)
    x = network_input(3, False)
    states = [_leaf(h) for h in _flatten_state(initial_state(kind, 3, (1, B)))]
    negative = [torch._neg_view(-h) for h in states]  # (the same values)
    out, last = batched(x, tuple(negative) if kind == "LSTM" else negative[0])
    results = [out, *_flatten_state(last)]
    grads = [torch.randn_like(r) for r in results]
    torch.autograd.backward(results, [torch._neg_view(-g) for g in grads])
    assert len(calls) == T
    for m, module in enumerate(modules):
        own = [_leaf(h[m]) for h in states]
        out_m, last_m = module(x[m], tuple(own) if kind == "LSTM" else own[0])
        results_m = [out_m, *_flatten_state(last_m)]
        torch.autograd.backward(results_m, [g[m] for g in grads])
        assert_close(out[m], out_m, msg=f"output of model {m}")
        for k, (h, h_m) in enumerate(zip(states, own)):
            assert_close(h.grad[m], h_m.grad, msg=f"initial state {k} gradient of model {m}")
        for name, p in module.named_parameters():
            assert_close(batched.get_parameter(name).grad[m], p.grad, msg=f"{name} gradient of model {m}")
