"""Per-model clipping and non-finite detection against torch.nn.utils run on each model alone."""

from __future__ import annotations

import math

import pytest
import torch
from harness import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from batchlayers.clip_grad import clip_grad_norm_, clip_grad_value_, get_total_norm, nonfinite_models
from batchlayers.linear import BatchedLinear

M = 3
SHAPES = [(4, 3), (3,), ()]


def make_params(num_models=M, dtype=torch.float64, shapes=SHAPES, scale=None):
    params = [torch.nn.Parameter(torch.randn(num_models, *s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
        if scale is not None:
            p.grad *= scale.to(dtype).view(-1, *([1] * (p.dim() - 1)))
    return params


def per_model_copies(params):
    """One list of torch parameters per model, holding that model's slices and gradient slices."""
    copies = []
    for m in range(params[0].shape[0]):
        ps = [torch.nn.Parameter(p[m].detach().clone()) for p in params]
        for q, p in zip(ps, params):
            q.grad = p.grad[m].clone()
        copies.append(ps)
    return copies


def assert_grads_match(params, copies, msg=""):
    for i, p in enumerate(params):
        assert_close(p.grad, torch.stack([c[i].grad for c in copies]), msg=f"{msg} gradient {i}")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, "inf"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("per_model_max", [False, True], ids=["float_max", "tensor_max"])
def test_clip_grad_norm_matches_torch_per_model(norm_type, dtype, per_model_max) -> None:
    torch.manual_seed(0)
    # Models with small, medium and huge gradients: some get clipped, some do not.
    params = make_params(dtype=dtype, scale=torch.tensor([0.01, 1.0, 100.0]))
    copies = per_model_copies(params)
    max_norm = torch.tensor([0.5, 2.0, 3.0], dtype=dtype) if per_model_max else 1.5
    norms = clip_grad_norm_(params, max_norm, norm_type)
    expected = [
        torch.nn.utils.clip_grad_norm_(c, max_norm[m].item() if per_model_max else max_norm, norm_type)
        for m, c in enumerate(copies)
    ]
    assert norms.shape == (M,)
    assert_close(norms, torch.stack(expected), msg="norms")
    assert_grads_match(params, copies)


def test_clip_grad_norm_on_a_model_and_without_grads() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(BatchedLinear(M, 4, 5), torch.nn.Tanh(), BatchedLinear(M, 5, 2, bias=False))
    model(torch.randn(M, 6, 4)).pow(2).sum().backward()
    params = list(model.parameters())
    copies = per_model_copies(params)
    norms = clip_grad_norm_(model.parameters(), 0.1)
    assert_close(norms, torch.stack([torch.nn.utils.clip_grad_norm_(c, 0.1) for c in copies]), msg="norms")
    assert_grads_match(params, copies)
    model.zero_grad()
    assert torch.equal(clip_grad_norm_(model.parameters(), 1.0), torch.zeros(M))


def test_nonfinite_norm_stays_in_its_model() -> None:
    torch.manual_seed(0)
    params = make_params()
    params[0].grad[1, 0, 0] = float("nan")
    params[1].grad[2, 0] = float("inf")
    copies = per_model_copies(params)
    norms = clip_grad_norm_(params, 1.0)
    assert norms[0].isfinite() and norms[1].isnan() and norms[2].isinf()
    expected = torch.nn.utils.clip_grad_norm_(copies[0], 1.0)
    assert_close(norms[0], expected, msg="healthy model's norm")
    for i, p in enumerate(params):
        assert_close(p.grad[0], copies[0][i].grad, msg=f"healthy model's gradient {i}")
    with pytest.raises(RuntimeError, match=r"models \[1, 2\] is non-finite"):
        get_total_norm([p.grad for p in params], error_if_nonfinite=True)


def test_error_if_nonfinite_leaves_gradients_alone() -> None:
    params = make_params()
    params[0].grad[2] = float("inf")
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match=r"models \[2\]"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


@pytest.mark.parametrize("per_model", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_value_matches_torch_per_model(per_model, foreach) -> None:
    torch.manual_seed(0)
    params = make_params()
    copies = per_model_copies(params)
    clip = torch.tensor([0.1, 0.5, 2.0], dtype=torch.float64) if per_model else 0.3
    clip_grad_value_(params, clip, foreach=foreach)
    for m, c in enumerate(copies):
        torch.nn.utils.clip_grad_value_(c, clip[m].item() if per_model else clip)
    assert_grads_match(params, copies)


def test_bad_arguments_raise() -> None:
    params = make_params()
    with pytest.raises(ValueError, match=r"max_norm must be a float or a tensor of shape \(M,\) = \(3,\), got shape"):
        clip_grad_norm_(params, torch.ones(2))
    with pytest.raises(ValueError, match=r"clip_value must be .* \(M,\) = \(3,\)"):
        clip_grad_value_(params, torch.ones(3, 1))
    with pytest.raises(ValueError, match="model dimension first, the same size M"):
        clip_grad_norm_([*params, torch.nn.Parameter(torch.randn(4, 2))], 1.0)
    with pytest.raises(ValueError, match="got no parameters"):
        clip_grad_norm_([], 1.0)


def test_nonfinite_models_reports_losses_params_grads_and_buffers() -> None:
    model = torch.nn.Sequential(BatchedLinear(4, 3, 2), BatchedLinear(4, 2, 1))
    model.register_buffer("stats", torch.zeros(4, 2))
    losses = torch.tensor([0.1, float("nan"), 0.3, 0.4])
    assert nonfinite_models(losses).tolist() == [False, True, False, False]
    assert nonfinite_models(parameters=model).tolist() == [False] * 4
    with torch.no_grad():
        model[1].weight[2, 0, 0] = float("inf")
    model.stats[3, 1] = float("nan")
    assert nonfinite_models(losses, model).tolist() == [False, True, True, True]
    model[0].bias.grad = torch.zeros(4, 2)
    model[0].bias.grad[0, 1] = float("-inf")
    assert nonfinite_models(losses, model).tolist() == [True, True, True, True]
    assert nonfinite_models(losses, model, grads=False).tolist() == [False, True, True, True]
    assert nonfinite_models(parameters=[model[0].bias]).tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="same size M"):
        nonfinite_models(torch.zeros(3), model)


def test_nonfinite_models_on_a_stacked_gpt_skips_its_shared_mask() -> None:
    """A converted model keeps its causal mask as one buffer for all models (no model dimension): it is not a
    model's number, and must not make the check fail. Each model is judged as its original alone."""
    import models as zoo

    from batchlayers.convert import shared_buffers, stack

    torch.manual_seed(0)
    originals = [zoo.GPT().double() for _ in range(3)]
    with torch.no_grad():
        originals[1].lm_head.weight[0, 0] = float("nan")
    stacked = stack(originals)
    assert shared_buffers(stacked), "the GPT's causal mask should be kept as one shared buffer"
    expected = [any(not bool(t.isfinite().all()) for t in m.state_dict().values()) for m in originals]
    assert nonfinite_models(parameters=stacked).tolist() == expected == [False, True, False]


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(1, 4),
    norm_type=st.sampled_from([1.0, 2.0, 0.5, math.inf]),
    max_norm=st.floats(0.01, 10.0),
    scales=st.lists(st.floats(1e-3, 1e3), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_random_clipping_matches_torch(num_models, norm_type, max_norm, scales, seed) -> None:
    torch.manual_seed(seed)
    params = make_params(num_models, shapes=[(2, 3), (1,)], scale=torch.tensor(scales[:num_models]))
    copies = per_model_copies(params)
    norms = clip_grad_norm_(params, max_norm, norm_type)
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(c, max_norm, norm_type) for c in copies])
    assert_close(norms, expected, msg="norms")
    assert_grads_match(params, copies)
