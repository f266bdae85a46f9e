"""Every computation path of ``batchlayers.functional.linear`` against a loop of ``torch.nn.functional.linear``:
the shared-batch paths (one GEMM, ``baddbmm`` on the stride-0 expand) and the per-model path, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from harness import RecordOps, assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import batchlayers.functional._linear as linear_module
from batchlayers.functional._linear import SHARED_PATHS, linear


def _loop(x_per_model, weight, bias):
    return torch.stack(
        [F.linear(x_per_model[m], weight[m], None if bias is None else bias[m]) for m in range(weight.shape[0])]
    )


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(2, 5),
    extra=st.lists(st.integers(1, 20), min_size=1, max_size=2),
    in_features=st.integers(1, 20),
    out_features=st.integers(1, 6),
    bias=st.booleans(),
    path=st.sampled_from(SHARED_PATHS),
    input_grad=st.booleans(),
    custom=st.booleans(),
)
def test_shared_paths_match_loop(num_models, extra, in_features, out_features, bias, path, input_grad, custom):
    with pytest.MonkeyPatch.context() as patch:
        # The custom weight-gradient orientation runs only above a work size; force it or its absence.
        patch.setattr(linear_module, "OUT_MAJOR_MIN_MACS", 0 if custom else 1 << 62)
        _check_shared(num_models, extra, in_features, out_features, bias, path, input_grad)


def _check_shared(num_models, extra, in_features, out_features, bias, path, input_grad):
    torch.manual_seed(0)
    batch = torch.randn(*extra, in_features, dtype=torch.float64)
    weight = torch.randn(num_models, out_features, in_features, dtype=torch.float64)
    b = torch.randn(num_models, out_features, dtype=torch.float64) if bias else None
    xs, ws, bs = _leaves(batch, weight, b)
    xr, wr, br = _leaves(batch, weight, b)
    xs.requires_grad_(input_grad)
    xr.requires_grad_(input_grad)

    y = linear(xs.expand(num_models, *xs.shape), ws, bs, shared=path)
    expected = _loop([xr] * num_models, wr, br)
    assert_close(y, expected, msg=f"output ({path})")
    grad = torch.randn_like(expected)
    y.backward(grad)
    expected.backward(grad)
    assert_close(ws.grad, wr.grad, msg=f"weight gradient ({path})")
    if bias:
        assert_close(bs.grad, br.grad, msg=f"bias gradient ({path})")
    if input_grad:
        assert_close(xs.grad, xr.grad, msg=f"input gradient ({path})")


@pytest.mark.parametrize("extra", [(5,), (2, 9)])
@pytest.mark.parametrize("in_features, out_features", [(4, 2), (2, 4), (20, 2)], ids=["out<in", "out>in", "out<<in"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("custom", [True, False], ids=["custom-grad", "autograd"])
def test_per_model_path_matches_loop(extra, in_features, out_features, bias, custom, monkeypatch):
    # The custom orientation is only used above a work size; force it (or its absence) on tiny tensors.
    monkeypatch.setattr(linear_module, "OUT_MAJOR_MIN_MACS", 0 if custom else 1 << 62)
    # out < in may take the custom weight-gradient orientation, out >= in always plain autograd: all against
    # the loop.
    torch.manual_seed(0)
    x = torch.randn(3, *extra, in_features, dtype=torch.float64)
    weight = torch.randn(3, out_features, in_features, dtype=torch.float64)
    b = torch.randn(3, out_features, dtype=torch.float64) if bias else None
    xs, ws, bs = _leaves(x, weight, b)
    xr, wr, br = _leaves(x, weight, b)
    y = linear(xs, ws, bs)
    expected = _loop(xr, wr, br)
    assert_close(y, expected, msg="per-model output")
    grad = torch.randn_like(expected)
    y.backward(grad)
    expected.backward(grad)
    for name, got, want in [("input", xs, xr), ("weight", ws, wr), ("bias", bs, br)]:
        if got is not None:
            assert_close(got.grad, want.grad, msg=f"{name} gradient")
    assert ws.grad.is_contiguous()


@pytest.mark.parametrize("rows, in_features, out_features", [(3, 4, 2), (17, 16, 2)])
def test_custom_weight_gradient_twice_differentiable(rows, in_features, out_features, monkeypatch):
    monkeypatch.setattr(linear_module, "OUT_MAJOR_MIN_MACS", 0)
    torch.manual_seed(0)
    x, weight, bias = _leaves(
        torch.randn(2, rows, in_features, dtype=torch.float64),
        torch.randn(2, out_features, in_features, dtype=torch.float64),
        torch.randn(2, out_features, dtype=torch.float64),
    )
    assert torch.autograd.gradgradcheck(linear, (x, weight, bias))


def test_shared_gemm_reads_the_batch_once():
    # The shared batch is never copied M times: one GEMM against the stacked weights, output a view.
    batch = torch.randn(5, 4)
    weight = torch.randn(1000, 3, 4)
    y = linear(batch.expand(1000, 5, 4), weight, shared="gemm")
    assert y.shape == (1000, 5, 3) and y.untyped_storage().nbytes() == 1000 * 5 * 3 * 4


def test_unknown_shared_path_raises():
    with pytest.raises(ValueError, match="shared must be"):
        linear(torch.randn(3, 4).expand(2, 3, 4), torch.randn(2, 5, 4), shared="loop")


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compiling"])
def test_bias_is_added_apart_only_under_compile(compiling, monkeypatch):
    """Eager: one ``baddbmm``. While torch.compile traces (CPU): ``bmm`` and an add, which inductor fuses into
    the next elementwise kernel instead of its library ``baddbmm``. The same numbers either way."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 2, 4, dtype=torch.float64)
    bias = torch.randn(3, 2, dtype=torch.float64)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    with RecordOps() as ops:
        y = linear_module._affine(x, weight, bias)
    names = [name for name, is_view, _ in ops.ops if not is_view]
    assert names == (["aten.bmm.default", "aten.add.Tensor"] if compiling else ["aten.baddbmm.default"]), names
    assert_close(y, _loop(x, weight, bias), msg="output")


# (forward-mode AD's first use in a process registers torch's jit decompositions, which warn)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["vmap-grad", "forward-ad"])
def test_torch_func_transforms_take_autograds_weight_gradient(transform, monkeypatch):
    """Under a torch.func transform the layer leaves its weight gradient to autograd (its own Function has no
    vmap or jvp rule and raised there): per-sample gradients (``vmap(grad(...))``) and a forward-mode
    derivative of the batched layer equal those of each model's ``F.linear``."""
    monkeypatch.setattr(linear_module, "OUT_MAJOR_MIN_MACS", 0)  # (the layer's own path at every size)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, dtype=torch.float64)  # (models, samples, features)
    weight, bias = torch.randn(3, 2, 7, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    tangent = torch.randn_like(weight)
    if transform == "vmap-grad":

        def loss(w, b, sample):  # one sample per model: (M, 1, in)
            return linear(sample.unsqueeze(1), w, b).square().sum()

        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, None, 1))(weight, bias, x)
        for m in range(3):
            expected = torch.func.vmap(
                torch.func.grad(lambda w, sample, m=m: F.linear(sample, w, bias[m]).square().sum()), in_dims=(None, 0)
            )(weight[m], x[m])
            assert_close(got[:, m], expected, msg=f"per-sample weight gradients of model {m}")
    else:
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(weight.requires_grad_(), tangent)  # (recorded for backward too)
            got = forward_ad.unpack_dual(linear(x, dual, bias)).tangent
            expected = torch.stack(
                [forward_ad.unpack_dual(F.linear(x[m], forward_ad.make_dual(weight[m], tangent[m]), bias[m])).tangent
                 for m in range(3)]
            )  # fmt: skip
        assert_close(got, expected, msg="forward-mode derivative")
