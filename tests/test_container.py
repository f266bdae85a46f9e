"""Folded: ordinary parameter-free modules on ``(M, B, *)`` tensors, against a loop over the models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from harness import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchlayers.container import Folded
from batchlayers.conv import BatchedConv2d
from batchlayers.linear import BatchedLinear

F64 = torch.float64


class _Lambda(nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> object:
        return self.fn(x)


class _CallLog(nn.Module):
    """Records the input shape of every call of the wrapped module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return self.module(x)


def _compare_with_loop(
    folded: nn.Module,
    per_model: Callable[[int], Callable[[torch.Tensor], torch.Tensor]],
    sample_shape: tuple[int, ...],
    *,
    num_models: int = 3,
    batch: int = 4,
    shared: bool,
) -> torch.Tensor:
    """``folded`` on an ``(M, B, *sample_shape)`` input against ``per_model(m)`` applied to each model's
    ``(B, *sample_shape)``: outputs and input gradients. Returns the batched output."""
    base = torch.randn(*(() if shared else (num_models,)), batch, *sample_shape, dtype=F64)
    xb = base.clone().requires_grad_()
    xr = base.clone().requires_grad_()
    y = folded(xb.expand(num_models, *xb.shape) if shared else xb)
    ys = torch.stack([per_model(m)(xr if shared else xr[m]) for m in range(num_models)])
    where = "shared" if shared else "per-model"
    assert_close(y, ys, msg=f"output ({where})")
    grad_out = torch.randn_like(ys)
    y.backward(grad_out)
    ys.backward(grad_out)
    assert_close(xb.grad, xr.grad, msg=f"input gradient ({where})")
    return y


MODULES = {
    "MaxPool2d": (lambda: nn.MaxPool2d(2), (3, 6, 6)),
    "MaxPool2d-stride-pad": (lambda: nn.MaxPool2d(3, stride=2, padding=1), (2, 7, 5)),
    "AvgPool2d": (lambda: nn.AvgPool2d(2, ceil_mode=True), (3, 5, 6)),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((2, 3)), (3, 5, 7)),
    "Flatten": (lambda: nn.Flatten(), (3, 2, 2)),
    "Flatten-end": (lambda: nn.Flatten(2), (3, 2, 2)),
    "Upsample-nearest": (lambda: nn.Upsample(scale_factor=2), (2, 3, 3)),
    "Upsample-bilinear": (lambda: nn.Upsample(size=(5, 4), mode="bilinear", align_corners=False), (2, 3, 3)),
    "ReLU": (lambda: nn.ReLU(), (5,)),
    "GELU-seq": (lambda: nn.GELU(approximate="tanh"), (3, 5)),
    "Dropout-eval": (lambda: nn.Dropout(0.5).eval(), (6,)),
    "Sequential": (lambda: nn.Sequential(nn.AvgPool2d(2), nn.Tanh(), nn.Flatten()), (2, 4, 4)),
}


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_matches_loop(name: str, shared: bool) -> None:
    torch.manual_seed(0)
    make, sample_shape = MODULES[name]
    module = make()
    _compare_with_loop(Folded(module), lambda m: module, sample_shape, shared=shared)


@pytest.mark.parametrize("name", list(MODULES))
def test_shared_batch_computed_once_and_returned_as_expand(name: str) -> None:
    make, sample_shape = MODULES[name]
    logged = _CallLog(make())
    batch = torch.randn(4, *sample_shape, dtype=F64)
    out = Folded(logged)(batch.expand(3, *batch.shape))
    assert logged.shapes == [tuple(batch.shape)], f"the shared batch was not computed once: {logged.shapes}"
    assert out.stride(0) == 0, "the shared output was copied for every model"
    assert out.untyped_storage().nbytes() <= out[0].numel() * out.element_size(), "more than one model's output"


def test_per_model_input_is_one_call_on_the_folded_batch() -> None:
    logged = _CallLog(nn.MaxPool2d(2))
    x = torch.randn(3, 4, 2, 6, 6)
    out = Folded(logged)(x)
    assert logged.shapes == [(12, 2, 6, 6)]
    assert out.shape == (3, 4, 2, 3, 3)


@pytest.mark.parametrize(
    "make", [lambda: nn.Dropout(0.5), lambda: nn.Dropout2d(0.5), lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.5))]
)
def test_dropout_on_shared_batch_gives_each_model_its_own_mask(make) -> None:
    torch.manual_seed(0)
    folded = Folded(make())
    batch = torch.rand(4, 3, 5, 5) + 0.5  # positive: ReLU keeps it, dropout zeros are only dropout's
    out = folded(batch.expand(3, *batch.shape))
    masks = out != 0
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), "models share a mask"
    assert_close(out[masks], (batch.expand_as(out) * 2)[masks], msg="kept values scaled by 1/(1-p)")
    assert 0.2 < masks.double().mean().item() < 0.8

    folded.eval()  # no randomness in eval: computed once, the identity
    out = folded(batch.expand(3, *batch.shape))
    assert out.stride(0) == 0 and torch.equal(out[2], batch)


def test_rrelu_on_shared_batch_draws_slopes_per_model() -> None:
    torch.manual_seed(0)
    folded = Folded(nn.RReLU())
    batch = -torch.rand(4, 50) - 0.1
    out = folded(batch.expand(3, *batch.shape))
    assert out.stride(0) != 0 and not torch.equal(out[0], out[1])
    folded.eval()
    _compare_with_loop(folded, lambda m: folded.module, (6,), shared=True)


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize(
    "fn",
    [lambda x: x.sum(0), lambda x: x[:1], lambda x: x.reshape(-1), lambda x: x.sum()],
    ids=["sum_batch", "first_sample", "flatten_all", "scalar"],
)
def test_module_that_changes_the_batch_size_raises(shared: bool, fn) -> None:
    folded = Folded(_Lambda(fn))
    x = torch.randn(4, 3) if shared else torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"Folded\(_Lambda\): the wrapped module must keep the batch dimension"):
        folded(x.expand(2, *x.shape) if shared else x)


@pytest.mark.parametrize(
    "bad, exc, pattern",
    [
        ([[1.0, 2.0]], TypeError, r"Folded\(ReLU\): expected a Tensor, got list"),
        (torch.randn(5), ValueError, r"Folded\(ReLU\): expected input \(M, B, \*\), got shape \(5,\)"),
        (torch.tensor(1.0), ValueError, r"Folded\(ReLU\).*shape \(\)"),
    ],
    ids=["list", "1d", "0d"],
)
def test_bad_input_raises(bad, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        Folded(nn.ReLU())(bad)


def test_module_returning_a_tuple_raises() -> None:
    with pytest.raises(TypeError, match=r"Folded\(MaxPool2d\): the wrapped module must return one Tensor, got tuple"):
        Folded(nn.MaxPool2d(2, return_indices=True))(torch.randn(2, 3, 1, 4, 4))


@pytest.mark.parametrize(
    "module, pattern",
    [
        (nn.Linear(3, 2), r"Folded\(Linear\).*parameter 'weight'"),
        (nn.Sequential(nn.ReLU(), nn.LayerNorm(3)), r"Folded\(Sequential\).*parameter '1.weight'"),
        (nn.BatchNorm1d(3, affine=False), r"Folded\(BatchNorm1d\).*buffer 'running_mean'"),
        (nn.BatchNorm2d(3, affine=False, track_running_stats=False), r"Folded\(BatchNorm2d\).*batch norm mixes"),
        (
            nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3, affine=False, track_running_stats=False)),
            r"batch norm \('1'\) mixes the samples of all models",
        ),
    ],
    ids=["linear", "nested_parameter", "buffer", "batch_stats", "nested_batch_stats"],
)
def test_modules_with_per_model_state_are_refused(module: nn.Module, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Folded(module)


def test_non_module_is_refused() -> None:
    with pytest.raises(TypeError, match="Folded: expected an nn.Module to wrap, got builtin_function_or_method"):
        Folded(torch.relu)


def _mlp(num_models: int) -> tuple[nn.Module, Callable[[], nn.Module]]:
    batched = nn.Sequential(
        Folded(nn.Flatten()),
        BatchedLinear(num_models, 12, 8, dtype=F64),
        Folded(nn.ReLU()),
        BatchedLinear(num_models, 8, 3, dtype=F64),
    )
    return batched, lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


def _cnn_like(num_models: int) -> tuple[nn.Module, Callable[[], nn.Module]]:
    batched = nn.Sequential(
        Folded(nn.Upsample(scale_factor=2)),
        Folded(nn.MaxPool2d(3, stride=2, padding=1)),
        Folded(nn.AdaptiveAvgPool2d(2)),
        Folded(nn.Flatten()),
        BatchedLinear(num_models, 12, 8, dtype=F64),
        Folded(nn.GELU()),
        Folded(nn.Dropout(0.2).eval()),
        BatchedLinear(num_models, 8, 3, dtype=F64),
    )

    def make_torch() -> nn.Module:
        return nn.Sequential(
            nn.Upsample(scale_factor=2),
            nn.MaxPool2d(3, stride=2, padding=1),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(12, 8),
            nn.GELU(),
            nn.Dropout(0.2).eval(),
            nn.Linear(8, 3),
        ).to(F64)

    return batched, make_torch


def _cnn(num_models: int) -> tuple[nn.Module, Callable[[], nn.Module]]:
    batched = nn.Sequential(
        BatchedConv2d(num_models, 2, 4, 3, padding=1, dtype=F64),
        Folded(nn.ReLU()),
        Folded(nn.MaxPool2d(2)),
        BatchedConv2d(num_models, 4, 5, 3, dtype=F64),
        Folded(nn.AdaptiveAvgPool2d(1)),
        Folded(nn.Flatten()),
        BatchedLinear(num_models, 5, 3, dtype=F64),
    )

    def make_torch() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 5, 3),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(5, 3),
        ).to(F64)

    return batched, make_torch


def _unbatch_chain(batched: nn.Sequential, make_torch: Callable[[], nn.Module], num_models: int) -> list[nn.Module]:
    """The loop reference for a Sequential of batched layers and Folded modules, index for index."""
    modules = [make_torch() for _ in range(num_models)]
    for index, layer in enumerate(batched):
        if isinstance(layer, Folded):
            continue
        state = layer.state_dict()
        for i, m in enumerate(modules):
            m[index].load_state_dict({k: v[i] for k, v in state.items()})
    return modules


@pytest.mark.parametrize(
    "build, sample_shape",
    [(_mlp, (3, 2, 2)), (_cnn_like, (3, 5, 5)), (_cnn, (2, 8, 8))],
    ids=["mlp", "pool_upsample_mlp", "cnn"],
)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_chain_of_batched_and_folded_layers_matches_loop(build, sample_shape, shared: bool) -> None:
    torch.manual_seed(0)
    batched, make_torch = build(3)
    loop = _unbatch_chain(batched, make_torch, 3)
    _compare_with_loop(batched, lambda m: loop[m], sample_shape, shared=shared)
    for name, p in batched.named_parameters():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        assert_close(p.grad, ref, msg=f"gradient of {name}")


def test_chain_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    batched, _ = _cnn_like(3)
    compiled = torch.compile(batched, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 4, 3, 5, 5, dtype=F64)
    assert_close(compiled(x), batched(x), msg="compiled per-model output")
    shared = torch.randn(4, 3, 5, 5, dtype=F64).expand(3, 4, 3, 5, 5)
    assert_close(compiled(shared), batched(shared), msg="compiled shared output")


def test_docstring_examples() -> None:
    net = nn.Sequential(
        Folded(nn.Flatten()),
        BatchedLinear(4, 28 * 28, 64),
        Folded(nn.ReLU()),
        Folded(nn.Dropout(0.1)),
        BatchedLinear(4, 64, 10),
    )
    assert net(torch.randn(4, 16, 1, 28, 28)).shape == (4, 16, 10)
    pool = Folded(nn.MaxPool2d(2))
    image = torch.randn(16, 3, 32, 32)
    pooled = pool(image.expand(4, *image.shape))
    assert (pooled.shape, pooled.stride(0)) == (torch.Size([4, 16, 3, 16, 16]), 0)


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(1, 4),
    batch=st.integers(1, 3),
    channels=st.integers(1, 3),
    height=st.integers(2, 7),
    width=st.integers(2, 7),
    kind=st.sampled_from(["max", "avg", "adaptive", "upsample", "flatten"]),
    kernel=st.integers(1, 2),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_loop(num_models, batch, channels, height, width, kind, kernel, shared, seed) -> None:
    torch.manual_seed(seed)
    module = {
        "max": lambda: nn.MaxPool2d(kernel, ceil_mode=True),
        "avg": lambda: nn.AvgPool2d(kernel, padding=kernel // 2),
        "adaptive": lambda: nn.AdaptiveAvgPool2d((kernel, kernel + 1)),
        "upsample": lambda: nn.Upsample(scale_factor=kernel + 1, mode="nearest"),
        "flatten": lambda: nn.Flatten(kernel),
    }[kind]()
    _compare_with_loop(
        Folded(module),
        lambda m: module,
        (channels, height, width),
        num_models=num_models,
        batch=batch,
        shared=shared,
    )
