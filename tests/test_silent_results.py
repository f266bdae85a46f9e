"""Results that could go silently wrong, each against torch's own behaviour (a loop over torch.nn modules):
an input on another device than the layer, empty batches, mixed dtypes and autocast, seeds torch's generator
cannot tell apart. Every comparison asks for the same kind of exception as torch, or the same output (dtype
and values), gradients and buffers."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
from harness import LayerCase, unbatch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from batchlayers import backends
from batchlayers.data import ModelBatchSampler, ModelTensorLoader, model_data_loader
from batchlayers.linear import BatchedBilinear
from batchlayers.recurrent import BatchedGRUCell, BatchedLSTM, BatchedRNN

_HERE = pathlib.Path(__file__).parent
CASES: list[LayerCase] = [
    case for path in sorted(_HERE.glob("cases_*.py")) for case in importlib.import_module(path.stem).CASES
]
NORM_CASES = [case for case in CASES if "Norm" in case.id]
CONV_CASES = [case for case in CASES if case.id.startswith("Conv")]
NUM_MODELS = 3

REDUCED = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Per result dtype: float64 and float32 as the rest of the suite. float16 and bfloat16 results differ from
# torch's by a few roundings, more than one where the two sides round intermediate values differently (a
# pure-float16 LayerNorm here rounds the normalised value before the affine; the loop accumulates a shared
# input's gradient model by model in float16): a few units of the dtype's epsilon, relative to the tensor's
# largest value. A wrong statistic or a model mix-up is far above that.
TOLERANCES = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
}
REDUCED_ROUNDINGS = 4


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ids(cases: Sequence[LayerCase]) -> list[str]:
    return [case.id for case in cases]


def _outcome(fn: Callable[..., object], *args: object) -> tuple[object, Exception | None]:
    try:
        return fn(*args), None
    except Exception as error:  # the comparison is about which exception, if any
        return None, error


def _loop(modules: Sequence[nn.Module], x: Tensor, shared: bool) -> list[Tensor]:
    """The torch.nn modules one by one, on the shared batch or on each model's own (torch's performance
    warnings, e.g. layer_norm's about a slower kernel for mixed dtypes, are not part of the result)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return [m(x if shared else x[i]) for i, m in enumerate(modules)]


def _coarsest(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _assert_same(actual: Tensor, expected: Tensor, what: str, precision: torch.dtype = torch.float64) -> None:
    """Same dtype and shape, values within a few roundings of the coarser of the tensor's dtype and the
    ``precision`` it was computed in (a float32 weight gradient of a bfloat16 input is bfloat16-accurate);
    NaN where torch has NaN."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, torch gives {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, torch gives {tuple(expected.shape)}"
    dtype = _coarsest(expected.dtype, precision) if expected.is_floating_point() else expected.dtype
    if dtype in REDUCED:
        eps = REDUCED_ROUNDINGS * torch.finfo(dtype).eps
        scale = expected.detach().double().nan_to_num().abs().max().item() if expected.numel() else 0.0
        tol = {"rtol": eps, "atol": eps * scale}
    else:
        tol = TOLERANCES.get(dtype, {"rtol": 0, "atol": 0})
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}\n{m}", **tol)


def compare_outcomes(
    batched: nn.Module,
    modules: Sequence[nn.Module],
    make_input: Callable[[Sequence[int]], Tensor],
    *,
    shared: bool,
    batches: Sequence[int],
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    input_requires_grad: bool = True,
    precision: torch.dtype = torch.float64,
) -> None:
    """One train-mode step per entry of ``batches`` (its batch size), then one eval step with the last one,
    through ``batched`` and through ``modules`` one by one, forward under ``context``. A step where torch raises
    must raise the same kind of exception (and ends the comparison); otherwise output, input and parameter
    gradients and buffers must be torch's, to the ``precision`` the step computes in (see ``_assert_same``)."""
    num_models = batched.num_models
    steps = [(b, False) for b in batches] + [(batches[-1], True)]
    for step, (batch, evaluating) in enumerate(steps):
        if evaluating:
            batched.eval()
            for m in modules:
                m.eval()
        where = f"{'eval' if evaluating else 'train'} step {step} (B={batch}, {'shared' if shared else 'per-model'})"
        x = make_input((batch,) if shared else (num_models, batch))
        grad = input_requires_grad and x.is_floating_point()
        xb, xr = (x.detach().clone().requires_grad_(grad) for _ in range(2))
        batched.zero_grad()
        for m in modules:
            m.zero_grad()
        with context():
            ys, torch_error = _outcome(_loop, modules, xr, shared)
            y, error = _outcome(batched, xb.expand(num_models, *xb.shape) if shared else xb)
        if torch_error is not None:
            assert error is not None, f"{where}: torch raises {torch_error!r}, we returned a result"
            assert isinstance(error, type(torch_error)), f"{where}: we raise {error!r}, torch {torch_error!r}"
            return
        assert error is None, f"{where}: we raise {error!r}, torch returns a result"
        _assert_same(y, torch.stack(ys), f"output ({where})", precision)
        if not evaluating and y.requires_grad:
            grad_out = torch.randn_like(y)
            y.backward(grad_out)
            for i, yi in enumerate(ys):
                yi.backward(grad_out[i])
            if grad:
                _assert_same(xb.grad, xr.grad, f"input gradient ({where})", precision)
            for name, p in batched.named_parameters():
                refs = [dict(m.named_parameters())[name].grad for m in modules]
                if p.grad is None:
                    assert all(r is None for r in refs), f"{name}: no gradient, torch has one ({where})"
                    continue
                ref = torch.stack([torch.zeros_like(p[0]) if r is None else r for r in refs])
                _assert_same(p.grad, ref, f"gradient of {name} ({where})", precision)
        for name, buf in batched.named_buffers():
            _assert_same(
                buf, torch.stack([dict(m.named_buffers())[name] for m in modules]), f"{name} ({where})", precision
            )


def _loop_for(case: LayerCase, param_dtype: torch.dtype) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    batched = case.build(NUM_MODELS, param_dtype)
    return batched, unbatch(batched, lambda: case.torch(param_dtype))


# 1. Devices: an input on another device than the layer's parameters. torch raises for most mixes, and some of
# its kernels return uninitialised memory for the others (F.conv*d with meta weights, F.embedding with meta
# indices); every batched layer raises.


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
@pytest.mark.parametrize("where", ["input_on_meta", "layer_on_meta"])
def test_device_mismatch_raises(case: LayerCase, where: str) -> None:
    input_device, layer_device = ("meta", "cpu") if where == "input_on_meta" else ("cpu", "meta")
    with torch.device(layer_device):
        batched, reference = case.build(NUM_MODELS, torch.float32), case.torch(torch.float32)
    x = case.input((NUM_MODELS, 4), torch.float32).to(input_device)
    expected, torch_error = _outcome(lambda: reference(x[0]))
    if next(iter([*batched.parameters(), *batched.buffers()]), None) is None:
        # Nothing the input could mismatch (InstanceNorm without affine or statistics): torch's result.
        assert torch_error is None and batched(x).device == expected.device
        return
    with pytest.raises(RuntimeError, match=rf"{type(batched).__name__}: expected the \w+ on {layer_device}"):
        batched(x)
    assert torch_error is None or isinstance(torch_error, RuntimeError), f"torch raises {torch_error!r}"


def _rnn_state(where: str):
    layer = BatchedRNN(NUM_MODELS, 4, 3)
    return layer, lambda: layer(torch.randn(NUM_MODELS, 5, 2, 4), torch.randn(NUM_MODELS, 1, 2, 3, device=where))


def _lstm_state(where: str):
    layer = BatchedLSTM(NUM_MODELS, 4, 3)
    h0 = torch.randn(NUM_MODELS, 1, 2, 3)
    return layer, lambda: layer(torch.randn(NUM_MODELS, 5, 2, 4), (h0, h0.to(where)))


def _gru_cell_state(where: str):
    layer = BatchedGRUCell(NUM_MODELS, 4, 3)
    return layer, lambda: layer(torch.randn(NUM_MODELS, 2, 4), torch.randn(NUM_MODELS, 2, 3, device=where))


def _attention_mask(kind: str):
    def make(where: str):
        from batchlayers.attention import BatchedMultiheadAttention

        layer = BatchedMultiheadAttention(NUM_MODELS, 4, 2, batch_first=True)
        q = torch.randn(NUM_MODELS, 2, 5, 4)
        masks = {
            "attn_mask": torch.zeros(5, 5, device=where),
            "key_padding_mask": torch.zeros(NUM_MODELS, 2, 5, dtype=torch.bool, device=where),
        }
        return layer, lambda: layer(q, q, q, **{kind: masks[kind]})

    return make


SECOND_TENSORS = {
    "RNN-h_0": _rnn_state,
    "LSTM-c_0": _lstm_state,
    "GRUCell-hx": _gru_cell_state,
    "MultiheadAttention-attn_mask": _attention_mask("attn_mask"),
    "MultiheadAttention-key_padding_mask": _attention_mask("key_padding_mask"),
}


@pytest.mark.parametrize("make", SECOND_TENSORS.values(), ids=SECOND_TENSORS.keys())
def test_device_mismatch_of_other_tensors_raises(make) -> None:
    """States and masks on the meta device: torch's RNNs raise, its attention returns uninitialised memory."""
    layer, call = make("meta")
    with pytest.raises(RuntimeError, match=rf"{type(layer).__name__}: expected the .* on cpu"):
        call()
    _, call = make("cpu")
    call()  # the same call with every tensor on the layer's device runs


# 2. Empty batches (B = 0, or an empty spatial size): torch's batch norm leaves the running statistics as they
# are (and still counts the batch); every layer must return torch's empty result, or raise as torch does.


def _emptied(case: LayerCase, empty: str) -> Callable[[Sequence[int]], Tensor]:
    """The case's float64 input; a batch size of 0 asks for an empty one: no samples, or (``empty="spatial"``)
    two samples with an empty last spatial dimension."""

    def make(lead: Sequence[int]) -> Tensor:
        if lead[-1] == 0 and empty == "spatial":
            return case.input((*lead[:-1], 2), torch.float64)[..., :0]
        return case.input(lead, torch.float64)

    return make


# An empty spatial size for the channel norms with spatial dimensions (for LayerNorm and RMSNorm it would be a
# wrong normalized shape); not for GroupNorm, whose weight gradient torch makes NaN there (0 here).
EMPTY_NORM_PARAMS = [
    pytest.param(case, empty, id=f"{case.id}-{empty}")
    for case in NORM_CASES
    for empty in ("batch", "spatial")
    if empty == "batch"
    or (case.id.startswith(("BatchNorm", "InstanceNorm")) and case.input((1,), torch.float64).dim() > 2)
]


@pytest.mark.parametrize("case,empty", EMPTY_NORM_PARAMS)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_empty_batch_norm_matches_torch(case: LayerCase, empty: str, shared: bool) -> None:
    # Statistics learned from a batch, then an empty one, a normal one, and an empty one in eval mode
    # (momentum=None averages over the batches counted).
    batched, modules = _loop_for(case, torch.float64)
    compare_outcomes(batched, modules, _emptied(case, empty), shared=shared, batches=[4, 0, 4, 0])


@pytest.mark.parametrize("case", CONV_CASES, ids=_ids(CONV_CASES))
@pytest.mark.parametrize("strategy", ["auto", *backends.CONV_STRATEGIES])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_empty_batch_conv_matches_torch(case: LayerCase, strategy: str, shared: bool) -> None:
    batched, modules = _loop_for(case, torch.float64)
    batched.strategy = strategy
    compare_outcomes(batched, modules, lambda lead: case.input(lead, torch.float64), shared=shared, batches=[0, 2, 0])


# 3. Dtypes: parameters and input of different dtypes, with and without CPU autocast. torch's norms take a
# float16/bfloat16 input with float32 parameters (and return the input's dtype) and raise for other mixes;
# its Linear and Conv raise for any mix; under autocast some ops run in bfloat16, norms do not.

DTYPE_PARAMS = [
    pytest.param(p, x, autocast, id=f"{'autocast-' if autocast else ''}params_{_short(p)}-input_{_short(x)}")
    for autocast in (False, True)
    for p in DTYPES
    for x in DTYPES
    # same dtypes without autocast are test_layers' business, except the reduced ones (computed in float32)
    if autocast or p != x or p in REDUCED
]


def _autocast_context(autocast: bool) -> Callable[[], contextlib.AbstractContextManager]:
    if autocast:
        return lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


# An index input (Embedding) has no floating dtype to mix: only its parameters' dtypes and autocast vary.
CASE_DTYPE_PARAMS = [
    pytest.param(case, *param.values, id=f"{param.id}-{case.id}")
    for param in DTYPE_PARAMS
    for case in CASES
    if case.input_requires_grad or param.values[0] == param.values[1]
]


@pytest.mark.parametrize("case,param_dtype,input_dtype,autocast", CASE_DTYPE_PARAMS)
def test_dtypes_match_torch(case: LayerCase, param_dtype, input_dtype, autocast: bool) -> None:
    precision = _coarsest(param_dtype, input_dtype, *([torch.bfloat16] if autocast else []))
    for shared in (False, True):
        batched, modules = _loop_for(case, param_dtype)
        compare_outcomes(
            batched,
            modules,
            lambda lead: case.input(lead, input_dtype),
            shared=shared,
            batches=[5] * case.steps,
            context=_autocast_context(autocast),
            input_requires_grad=case.input_requires_grad,
            precision=precision,
        )


@pytest.mark.parametrize("param_dtype,input_dtype,autocast", DTYPE_PARAMS)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_bilinear_dtypes_match_torch(param_dtype, input_dtype, autocast: bool, shared: bool) -> None:
    """BatchedBilinear, two inputs (not a LayerCase). F.bilinear raises for any mix of dtypes and is on no
    autocast list: under autocast it returns its inputs' dtype, though its inner products run in bfloat16 (so
    values compare at bfloat16 precision), and for some shapes torch fails inside autocast with float16 inputs
    ("Unexpected floating ScalarType in at::autocast::prioritize"): there the reference is F.bilinear without
    autocast, the result autocast means to leave alone."""
    torch.manual_seed(0)
    layer = BatchedBilinear(NUM_MODELS, 5, 3, 4, dtype=param_dtype)
    modules = unbatch(layer, lambda: nn.Bilinear(5, 3, 4, dtype=param_dtype))
    x1, x2 = torch.randn(2, 5, dtype=input_dtype), torch.randn(NUM_MODELS, 2, 3, dtype=input_dtype)
    first = x1.expand(NUM_MODELS, *x1.shape) if shared else x1.repeat(NUM_MODELS, 1, 1)

    def loop() -> Tensor:
        return torch.stack([m(x1, x2[i]) for i, m in enumerate(modules)])

    with _autocast_context(autocast)():
        expected, torch_error = _outcome(loop)
        actual, error = _outcome(layer, first, x2)
    if autocast and torch_error is not None and "autocast::prioritize" in str(torch_error):
        expected, torch_error = _outcome(loop)
    if torch_error is not None:
        assert isinstance(error, type(torch_error)), f"we give {error!r}, torch raises {torch_error!r}"
        return
    assert error is None, f"we raise {error!r}, torch returns a result"
    _assert_same(
        actual, expected, "output", _coarsest(param_dtype, input_dtype, *([torch.bfloat16] if autocast else []))
    )


# 4. Seeds: torch.Generator.manual_seed keeps 64 bits (a negative seed is its two's complement), so any seed
# outside [0, 2**64 - 1] would give the stream of another seed.

ENTRY_POINTS = {
    "ModelBatchSampler": lambda seed: ModelBatchSampler(2, 10, 4, mode="bootstrap", seed=seed),
    "ModelTensorLoader": lambda seed: ModelTensorLoader(torch.arange(10), num_models=2, batch_size=4, seed=seed),
    "model_data_loader": lambda seed: model_data_loader(TensorDataset(torch.arange(10)), 2, 4, seed=seed),
}
_MASK64 = (1 << 64) - 1


@pytest.mark.parametrize("make", ENTRY_POINTS.values(), ids=ENTRY_POINTS.keys())
@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, 2**100 + 7, -1, -5, -(2**63)])
def test_seed_torch_cannot_tell_apart_is_refused(make, seed: int) -> None:
    """``seed`` has the low 64 bits of an accepted seed: refused with a ValueError naming the argument, never
    silently the other seed's stream."""
    make(seed & _MASK64)  # the seed with the same 64 bits is fine
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64 - 1\]"):
        make(seed)
