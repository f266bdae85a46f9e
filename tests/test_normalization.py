"""What is special to the batched norms: running statistics per model, layouts that must not be copied."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from cases_norm import perturbed
from harness import RecordOps, assert_close, compare_with_loop, unbatch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchlayers.batchnorm import BatchedBatchNorm1d, BatchedBatchNorm2d, BatchedBatchNorm3d
from batchlayers.functional._batchnorm import PER_MODEL_MIN_NUMEL
from batchlayers.normalization import BatchedGroupNorm, BatchedLayerNorm, BatchedRMSNorm

F64 = torch.float64
COPY_OPS = {"aten.clone.default", "aten.copy_.default", "aten._to_copy.default"}


def copies_of_at_least(ops: RecordOps, numel: int) -> list[str]:
    return [name for name, _, n in ops.ops if name in COPY_OPS and n >= numel]


def packed_view(batch: int, num_models: int, channels: int, *spatial: int) -> torch.Tensor:
    """``(M, B, C, *)`` as the transposed view of a contiguous ``(B, M*C, *)`` tensor, as a batched conv returns."""
    packed = torch.randn(batch, num_models * channels, *spatial, dtype=F64)
    return packed.view(batch, num_models, channels, *spatial).transpose(0, 1)


def run_modes(batched: nn.Module, modules: list[nn.Module], modes: str, make_input, forward=None) -> None:
    """Forward passes in the given sequence of modes ("t" train, "e" eval); outputs and buffers must match.
    ``forward`` runs the batched layer (default: the layer itself; e.g. a compiled wrapper of it)."""
    forward = batched if forward is None else forward
    for step, mode in enumerate(modes):
        batched.train(mode == "t")
        for m in modules:
            m.train(mode == "t")
        x = make_input()
        y = forward(x)
        assert_close(y, torch.stack([m(x[i]) for i, m in enumerate(modules)]), msg=f"output, step {step} ({mode})")
        for name, buf in batched.named_buffers():
            ref = torch.stack([dict(m.named_buffers())[name] for m in modules])
            assert_close(buf, ref, msg=f"buffer {name}, step {step} ({mode})")


# --- init and construction -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: BatchedLayerNorm(3, (2, 4)),
        lambda: BatchedRMSNorm(3, 4),
        lambda: BatchedGroupNorm(3, 2, 4),
        lambda: BatchedBatchNorm1d(3, 4),
        lambda: BatchedBatchNorm3d(3, 4, bias=False),
    ],
)
def test_init_and_reset_like_torch(make) -> None:
    layer = make()
    fresh = {k: v.clone() for k, v in layer.state_dict().items()}
    for name, value in fresh.items():
        ref = layer.torch_module.__name__
        if name == "weight" or name == "running_var":
            assert torch.equal(value, torch.ones_like(value)), f"{ref}: {name} must start at 1"
        else:
            assert torch.equal(value, torch.zeros_like(value)), f"{ref}: {name} must start at 0"
    perturbed(layer)
    if "num_batches_tracked" in fresh:
        layer.num_batches_tracked.fill_(7)
    pointers = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    layer.reset_parameters()
    for name, value in layer.state_dict().items():
        assert torch.equal(value, fresh[name]), f"reset_parameters did not restore {name}"
        assert value.data_ptr() == pointers[name], f"reset_parameters replaced {name} instead of filling it"


def test_reset_running_stats_keeps_parameters() -> None:
    layer = perturbed(BatchedBatchNorm2d(2, 3))
    weight = layer.weight.detach().clone()
    layer(torch.randn(2, 4, 3, 2, 2))
    layer.reset_running_stats()
    assert torch.equal(layer.weight, weight)
    assert torch.equal(layer.running_mean, torch.zeros(2, 3)) and torch.equal(layer.running_var, torch.ones(2, 3))
    assert torch.equal(layer.num_batches_tracked, torch.zeros(2, dtype=torch.long))


def test_group_norm_rejects_indivisible_channels() -> None:
    with pytest.raises(ValueError, match=r"BatchedGroupNorm: num_channels \(6\) must be divisible by num_groups \(4\)"):
        BatchedGroupNorm(3, 4, 6)


def test_untracked_batch_norm_has_no_buffers() -> None:
    layer = BatchedBatchNorm2d(3, 4, track_running_stats=False)
    assert layer.running_mean is None and layer.running_var is None and layer.num_batches_tracked is None
    assert list(layer.state_dict()) == list(nn.BatchNorm2d(4, track_running_stats=False).state_dict())


# --- running statistics -------------------------------------------------------------------------------


def _models_with_different_histories(num_batches: list[int]) -> list[nn.BatchNorm2d]:
    """torch.nn BatchNorms with momentum=None that have seen different numbers of batches, as after loading
    checkpoints from different points of training."""
    torch.manual_seed(0)
    models = []
    for count in num_batches:
        model = perturbed(nn.BatchNorm2d(3, momentum=None, dtype=F64))
        model.num_batches_tracked.zero_()
        for _ in range(count):
            model(torch.randn(4, 3, 2, 2, dtype=F64) * 2 + 1)
        models.append(model)
    return models


def _batched_from(models: list[nn.Module], batched: nn.Module) -> nn.Module:
    states = [m.state_dict() for m in models]
    batched.load_state_dict({k: torch.stack([s[k] for s in states]) for k in states[0]})
    return batched


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_cumulative_average_follows_each_models_own_count(shared: bool) -> None:
    models = _models_with_different_histories([0, 2, 5])
    batched = _batched_from(models, BatchedBatchNorm2d(3, 3, momentum=None, dtype=F64))
    assert batched.num_batches_tracked.tolist() == [0, 2, 5]
    compare_with_loop(
        batched,
        [copy.deepcopy(m) for m in models],
        lambda lead: torch.randn(*lead, 3, 2, 2, dtype=F64) * 2 + 1,
        shared=shared,
        steps=3,
    )
    assert batched.num_batches_tracked.tolist() == [3, 5, 8]


def test_cumulative_average_compiles_without_graph_breaks() -> None:
    models = _models_with_different_histories([1, 4])
    batched = _batched_from(models, BatchedBatchNorm2d(2, 3, momentum=None, dtype=F64))
    torch._dynamo.reset()
    compiled = torch.compile(batched, fullgraph=True, backend="aot_eager")
    references = [copy.deepcopy(m) for m in models]
    run_modes(batched, references, "tte", lambda: torch.randn(2, 4, 3, 2, 2, dtype=F64), compiled)
    assert batched.num_batches_tracked.tolist() == [3, 6]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("track", [True, False], ids=["tracked", "untracked"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_switching_between_train_and_eval(momentum, track: bool, shared: bool) -> None:
    torch.manual_seed(0)
    batched = perturbed(BatchedBatchNorm1d(3, 4, momentum=momentum, track_running_stats=track, dtype=F64))
    modules = unbatch(batched, lambda: nn.BatchNorm1d(4, momentum=momentum, track_running_stats=track, dtype=F64))

    def make_input():
        x = torch.randn(5, 4, 3, dtype=F64) * 3 - 1
        return x.expand(3, *x.shape) if shared else torch.randn(3, 5, 4, 3, dtype=F64) * 3 - 1

    run_modes(batched, modules, "tetteet", make_input)


def test_eval_accepts_a_single_sample_when_running_stats_are_tracked() -> None:
    batched = perturbed(BatchedBatchNorm1d(3, 4, dtype=F64)).eval()
    modules = unbatch(batched, lambda: nn.BatchNorm1d(4, dtype=F64))
    run_modes(batched, modules, "e", lambda: torch.randn(3, 1, 4, dtype=F64))
    untracked = BatchedBatchNorm1d(3, 4, track_running_stats=False).eval()
    with pytest.raises(ValueError, match="BatchedBatchNorm1d.*more than 1 value per channel"):
        untracked(torch.randn(3, 1, 4))


# --- layouts: packed views and shared batches are not copied --------------------------------------------

PACKED_LAYERS = [
    pytest.param(lambda: BatchedBatchNorm2d(3, 4, dtype=F64), lambda: nn.BatchNorm2d(4, dtype=F64), id="BatchNorm2d"),
    pytest.param(
        lambda: BatchedBatchNorm2d(3, 4, momentum=None, dtype=F64),
        lambda: nn.BatchNorm2d(4, momentum=None, dtype=F64),
        id="BatchNorm2d-cumulative",
    ),
    pytest.param(lambda: BatchedGroupNorm(3, 2, 4, dtype=F64), lambda: nn.GroupNorm(2, 4, dtype=F64), id="GroupNorm"),
]


@pytest.mark.parametrize("make_batched,make_torch", PACKED_LAYERS)
def test_packed_view_input_is_not_copied(make_batched, make_torch) -> None:
    torch.manual_seed(0)
    x = packed_view(4, 3, 4, 3, 3)
    with RecordOps() as ops:
        y = perturbed(make_batched())(x)
    assert copies_of_at_least(ops, x[0].numel()) == [], "the packed view was copied"
    assert y.transpose(0, 1).is_contiguous(), "the output should be the transposed view of the packed result"
    # The same numbers as the loop, gradients and running statistics included, in train and eval mode.
    batched = perturbed(make_batched())
    modules = unbatch(batched, make_torch)
    compare_with_loop(batched, modules, lambda lead: packed_view(lead[1], lead[0], 4, 3, 3), shared=False, steps=2)


@pytest.mark.parametrize(
    "make_batched,expected_copies",
    [
        (lambda: BatchedGroupNorm(3, 2, 4), 0),  # model-major fold (M*B, C, *) is a view
        (lambda: BatchedBatchNorm2d(3, 4), 1),  # channel packing needs one transpose copy
        (lambda: BatchedLayerNorm(3, (4, 3, 3)), 0),
    ],
)
def test_contiguous_input_copies_at_most_once(make_batched, expected_copies: int) -> None:
    x = torch.randn(3, 4, 4, 3, 3)
    with RecordOps() as ops:
        make_batched()(x)
    assert len(copies_of_at_least(ops, x[0].numel())) == expected_copies


SHARED_LAYERS = [
    lambda: BatchedLayerNorm(3, (3, 3)),
    lambda: BatchedLayerNorm(3, 3, bias=False),
    lambda: BatchedRMSNorm(3, 3),
    lambda: BatchedGroupNorm(3, 2, 4),
    lambda: BatchedBatchNorm2d(3, 4),
    lambda: BatchedBatchNorm2d(3, 4, momentum=None),
    lambda: BatchedBatchNorm2d(3, 4, track_running_stats=False),
    lambda: BatchedBatchNorm2d(3, 4).eval(),
]


@pytest.mark.parametrize("make_batched", SHARED_LAYERS)
def test_shared_batch_is_normalised_once(make_batched) -> None:
    """Only the per-model affine makes M-fold data; nothing copies the input or normalises it M times."""
    batched = perturbed(make_batched())
    sample = torch.randn(5, 4, 3, 3)
    x = sample.expand(3, *sample.shape)
    with RecordOps() as ops:
        y = batched(x)
    m_fold = [name for name, is_view, n in ops.ops if not is_view and n >= x.numel()]
    assert m_fold in (["aten.addcmul.default"], ["aten.mul.Tensor"]), f"M-fold computations: {m_fold}"
    assert y.shape == x.shape


@pytest.mark.parametrize(
    "make_batched",
    [
        lambda: BatchedLayerNorm(3, 3, elementwise_affine=False),
        lambda: BatchedRMSNorm(3, 3, elementwise_affine=False),
        lambda: BatchedGroupNorm(3, 2, 4, affine=False),
        lambda: BatchedBatchNorm2d(3, 4, affine=False),
    ],
)
def test_shared_batch_without_affine_stays_shared(make_batched) -> None:
    sample = torch.randn(5, 4, 3, 3)
    y = make_batched()(sample.expand(3, *sample.shape))
    assert y.stride(0) == 0 and y.shape == (3, *sample.shape)


# --- property test over random shapes and options ---------------------------------------------------------


@st.composite
def norm_configs(draw):
    kind = draw(st.sampled_from(["layer", "rms", "group", "batch1d", "batch2d"]))
    num_models = draw(st.integers(1, 3))
    channels = draw(st.integers(1, 4))
    if kind in ("layer", "rms"):
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
        extra = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
        affine = draw(st.booleans())
        if kind == "layer":
            bias = draw(st.booleans())
            args = (
                (lambda m: BatchedLayerNorm(m, shape, 1e-4, affine, bias, dtype=F64)),
                (lambda: nn.LayerNorm(shape, 1e-4, affine, bias, dtype=F64)),
            )
        else:
            args = (
                (lambda m: BatchedRMSNorm(m, shape, None, affine, dtype=F64)),
                (lambda: nn.RMSNorm(shape, None, affine, dtype=F64)),
            )
        return (*args, num_models, (*extra, *shape), "per-sample")
    if kind == "batch2d":
        spatial = tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=2)))
    else:
        spatial = tuple(draw(st.lists(st.integers(2, 3), max_size=1)))
    affine = draw(st.booleans())
    if kind == "group":
        groups = draw(st.sampled_from([g for g in range(1, channels + 1) if channels % g == 0]))
        args = (
            (lambda m: BatchedGroupNorm(m, groups, channels, 1e-4, affine, dtype=F64)),
            (lambda: nn.GroupNorm(groups, channels, 1e-4, affine, dtype=F64)),
        )
        if channels == groups and not spatial:
            spatial = (2,)  # a group of one value normalises to 0 with a noisy gradient
        return (*args, num_models, (channels, *spatial), "channels")
    momentum = draw(st.sampled_from([0.1, 0.5, None]))
    track = draw(st.booleans())
    cls, torch_cls = (BatchedBatchNorm1d, nn.BatchNorm1d) if kind == "batch1d" else (BatchedBatchNorm2d, nn.BatchNorm2d)
    args = (
        (lambda m: cls(m, channels, 1e-4, momentum, affine, track, dtype=F64)),
        (lambda: torch_cls(channels, 1e-4, momentum, affine, track, dtype=F64)),
    )
    return (*args, num_models, (channels, *spatial), "channels")


@settings(max_examples=25, deadline=None)
@given(config=norm_configs(), layout=st.sampled_from(["per_model", "shared", "packed"]), batch=st.integers(2, 4))
def test_property_matches_loop(config, layout: str, batch: int) -> None:
    make_batched, make_torch, num_models, sample_shape, kind = config
    torch.manual_seed(0)
    batched = perturbed(make_batched(num_models))
    modules = unbatch(batched, make_torch)  # they load the perturbed layer's state

    def make_input(lead):
        if layout == "packed" and kind == "channels" and len(lead) == 2:
            channels, *spatial = sample_shape
            return packed_view(lead[1], lead[0], channels, *spatial) * 2 + 1
        return torch.randn(*lead, *sample_shape, dtype=F64) * 2 + 1

    compare_with_loop(batched, modules, make_input, shared=layout == "shared", steps=2, batch=batch)


def per_model_channels_last(num_models: int, batch: int, channels: int, *spatial: int) -> torch.Tensor:
    """``(M, B, C, *)`` stored as ``(M, B, *, C)``: each model's ``(B, C, *)`` channels-last, as the loop
    convolution strategies return."""
    stored = torch.randn(num_models, batch, *spatial, channels, dtype=F64)
    return stored.movedim(-1, 2)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_keeps_a_per_model_channels_last_layout(training: bool) -> None:
    """Packing copies such an input; the output comes back in its layout, not torch's default (or, in eval mode,
    is computed in it), so the activation and convolution after it see one layout. Same numbers as the loop."""
    torch.manual_seed(0)
    x = per_model_channels_last(3, 4, 4, 3, 3)
    batched = perturbed(BatchedBatchNorm2d(3, 4, dtype=F64)).train(training)
    y = batched(x)
    assert y.stride() == x.stride(), f"output strides {y.stride()}, input strides {x.stride()}"
    batched = perturbed(BatchedBatchNorm2d(3, 4, dtype=F64))
    modules = unbatch(batched, lambda: nn.BatchNorm2d(4, dtype=F64))
    compare_with_loop(batched, modules, lambda lead: per_model_channels_last(lead[0], lead[1], 4, 3, 3), shared=False)


# From PER_MODEL_MIN_NUMEL elements a model on, a per-model channels-last 2-D/3-D input runs torch's kernel on
# each model's slice; the sample shapes sit at the threshold (65536 elements with a batch of 4) and just below it,
# and 1-D (no channels-last format in torch) stays packed.
PER_MODEL_LAYERS = [
    pytest.param(
        lambda: BatchedBatchNorm1d(3, 16, dtype=F64), lambda: nn.BatchNorm1d(16, dtype=F64), (16, 1024), id="1d"
    ),
    pytest.param(
        lambda: BatchedBatchNorm2d(3, 16, dtype=F64), lambda: nn.BatchNorm2d(16, dtype=F64), (16, 32, 32), id="2d"
    ),
    pytest.param(
        lambda: BatchedBatchNorm3d(3, 16, momentum=0.3, dtype=F64),
        lambda: nn.BatchNorm3d(16, momentum=0.3, dtype=F64),
        (16, 16, 8, 8),
        id="3d",
    ),
    pytest.param(
        lambda: BatchedBatchNorm2d(3, 16, affine=False, track_running_stats=False, dtype=F64),
        lambda: nn.BatchNorm2d(16, affine=False, track_running_stats=False, dtype=F64),
        (16, 32, 32),
        id="2d-untracked-noaffine",
    ),
    pytest.param(
        lambda: BatchedBatchNorm2d(3, 16, dtype=F64), lambda: nn.BatchNorm2d(16, dtype=F64), (16, 31, 33), id="2d-below"
    ),
]


@pytest.mark.parametrize("make_batched,make_torch,sample", PER_MODEL_LAYERS)
def test_large_per_model_channels_last_input_is_normalised_model_by_model(make_batched, make_torch, sample) -> None:
    batch = 4
    by_model = len(sample) > 2 and batch * math.prod(sample) >= PER_MODEL_MIN_NUMEL
    torch.manual_seed(0)
    x = per_model_channels_last(3, batch, *sample).requires_grad_()
    with RecordOps() as ops:
        y = perturbed(make_batched())(x)
        y.backward(torch.randn_like(y))
    kernels = [name for name, _, _ in ops.ops if name.startswith("aten.native_batch_norm")]
    layout_copies = copies_of_at_least(ops, x[0].numel())
    if by_model:
        assert kernels == ["aten.native_batch_norm.default"] * 3 + ["aten.native_batch_norm_backward.default"] * 3
        assert layout_copies == [], "a per-model channels-last input was copied into another layout"
        assert y.stride() == x.stride() and x.grad.stride() == x.stride()
    else:
        assert len(kernels) == 2, f"below the threshold one packed kernel each way, got {kernels}"
    batched = perturbed(make_batched())
    modules = unbatch(batched, make_torch)
    compare_with_loop(batched, modules, lambda lead: per_model_channels_last(*lead, *sample), shared=False, batch=batch)


def test_per_model_batch_norm_second_derivatives_match_the_loop() -> None:
    """A gradient penalty through the per-model path (create_graph=True) gives the loop's parameter gradients."""
    torch.manual_seed(0)
    batched = perturbed(BatchedBatchNorm2d(3, 16, dtype=F64))
    modules = unbatch(batched, lambda: nn.BatchNorm2d(16, dtype=F64))
    x = per_model_channels_last(3, 4, 16, 32, 32)
    weights = torch.randn_like(x)

    def penalty(layer, xs, w):
        xs = xs.detach().requires_grad_()
        (grad,) = torch.autograd.grad((layer(xs).tanh() * w).sum(), xs, create_graph=True)
        grad.square().sum().backward()

    penalty(batched, x, weights)
    for i, m in enumerate(modules):
        penalty(m, x[i], weights[i])
    for name, p in batched.named_parameters():
        assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in modules]), msg=name)


def test_per_model_batch_norm_of_bfloat16_input_with_float32_statistics() -> None:
    """Mixed precision on the per-model path: a bfloat16 input, float32 parameters and statistics, as torch's
    kernel takes them; the same kernel per model, so the loop's numbers exactly."""
    torch.manual_seed(0)
    batched = perturbed(BatchedBatchNorm2d(3, 16))
    modules = unbatch(batched, lambda: nn.BatchNorm2d(16))
    x = per_model_channels_last(3, 4, 16, 32, 32).to(torch.bfloat16).requires_grad_()
    y = batched(x)
    y.backward(torch.ones_like(y))
    for i, m in enumerate(modules):
        xi = x[i].detach().requires_grad_()
        yi = m(xi)
        yi.backward(torch.ones_like(yi))
        assert torch.equal(y[i], yi) and torch.equal(x.grad[i], xi.grad), f"model {i}"
        assert torch.equal(batched.running_var[i], m.running_var) and torch.equal(batched.weight.grad[i], m.weight.grad)
