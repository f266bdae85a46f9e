"""What is special to the batched convolutions: every strategy against the torch.nn loop, the shared-batch
path without M-fold copies, the packed output layout, strategy selection and argument checks."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from harness import assert_close, assert_uniform_init, compare_with_loop, unbatch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import CNN
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from batchlayers import _workspace, backends
from batchlayers.conv import (
    BatchedConv1d,
    BatchedConv2d,
    BatchedConv3d,
    BatchedConvTranspose1d,
    BatchedConvTranspose2d,
    BatchedConvTranspose3d,
)
from batchlayers.convert import stack
from batchlayers.functional import _conv as conv_impl
from batchlayers.functional._conv import conv

CLASSES = {1: BatchedConv1d, 2: BatchedConv2d, 3: BatchedConv3d}

# (dims, in, out, kernel, spatial, kwargs): the options where the strategies differ in what they do.
# fmt: off
CONFIGS = {
    "1d-same-even-reflect-groups": (1, 4, 6, 4, (9,), dict(padding="same", dilation=2, padding_mode="reflect",
                                                           groups=2)),
    "2d-plain": (2, 3, 4, 3, (6, 5), dict(padding=1)),
    "2d-stride-circular-nobias": (2, 2, 4, (3, 2), (7, 6), dict(stride=(2, 1), padding=(1, 2), padding_mode="circular",
                                                                bias=False)),
    "2d-depthwise-same-replicate": (2, 4, 8, 2, (5, 6), dict(padding="same", groups=4, padding_mode="replicate")),
    "3d-groups-dilation": (3, 4, 2, 2, (4, 5, 4), dict(dilation=(1, 2, 1), groups=2, padding=(1, 0, 1))),
    "3d-valid-replicate": (3, 2, 2, 2, (3, 4, 3), dict(padding="valid", padding_mode="replicate")),
    "3d-same-zeros-rect-dilated": (3, 2, 3, (1, 3, 5), (3, 5, 8), dict(padding="same", dilation=(1, 2, 1))),
}
# fmt: on


@pytest.fixture(autouse=True)
def _fresh_backend_settings():
    """Tests change the global settings; each one starts from the defaults and an empty cache."""
    saved = backends.conv.strategy, backends.conv.benchmark
    backends.conv.clear_cache()
    yield
    backends.conv.strategy, backends.conv.benchmark = saved
    backends.conv.clear_cache()


def _build(config, num_models, dtype=torch.float64, classes=CLASSES):
    """A batched (transposed) convolution of a ``CONFIGS`` entry, the torch.nn modules holding its slices,
    and an input maker."""
    dims, c_in, c_out, kernel, spatial, kwargs = config
    batched = classes[dims](num_models, c_in, c_out, kernel, **kwargs, dtype=dtype)
    modules = unbatch(batched, lambda: classes[dims].torch_module(c_in, c_out, kernel, **kwargs, dtype=dtype))
    return batched, modules, lambda lead: torch.randn(*lead, c_in, *spatial, dtype=dtype)


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_strategy_matches_loop(config, strategy: str, shared: bool, kept: bool) -> None:
    torch.manual_seed(0)
    batched, modules, make_input = _build(config, num_models=3)
    batched.strategy = strategy
    compare_with_loop(batched, modules, make_input, shared=shared)


@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
def test_float32_strategies_match_loop(strategy: str) -> None:
    torch.manual_seed(0)
    batched, modules, make_input = _build(CONFIGS["2d-plain"], num_models=4, dtype=torch.float32)
    batched.strategy = strategy
    compare_with_loop(batched, modules, make_input, shared=False, steps=1)


class _StorageSizes(TorchDispatchMode):
    """Records the storage size of every tensor an operator returns (views share their base's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
@pytest.mark.parametrize(
    "kwargs", [dict(padding=1), dict(padding=1, groups=2, padding_mode="reflect")], ids=["zeros", "groups-reflect"]
)
def test_shared_batch_is_never_copied_per_model(strategy: str, kwargs: dict) -> None:
    num_models = 6
    layer = BatchedConv2d(num_models, 8, 2, 3, **kwargs)  # few output channels: outputs are smaller than M inputs
    layer.strategy = strategy
    batch = torch.randn(4, 8, 6, 6)
    shared = batch.expand(num_models, *batch.shape)
    with _StorageSizes() as sizes:
        y = layer(shared)
        y.sum().backward()  # gradients of the weights only: the data needs none
    # An M-fold copy of the batch would need num_models * batch.nbytes; a padded or channels-last copy of the
    # one batch is allowed (at most (8/6)**2 = 1.8 times its size here).
    assert sizes.largest < num_models / 2 * batch.nbytes, f"a tensor of {sizes.largest} bytes was made"
    modules = unbatch(layer, lambda: nn.Conv2d(8, 2, 3, **kwargs))
    assert_close(y, torch.stack([m(batch) for m in modules]), msg="output")


@pytest.mark.parametrize("strategy", ["grouped", "grouped_channels_last"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_grouped_output_packs_back_as_a_view(strategy: str, shared: bool) -> None:
    """The next grouped layer (a convolution, BatchNorm) packs ``(M, B, C, H, W)`` into ``(B, M*C, H, W)``:
    for a grouped convolution's output that reshape is free."""
    layer = BatchedConv2d(3, 4, 5, 3)
    layer.strategy = strategy
    x = torch.randn(2, 4, 7, 7)
    y = layer(x.expand(3, *x.shape) if shared else x.expand(3, *x.shape).clone())
    packed = y.transpose(0, 1).reshape(2, 3 * 5, 5, 5)
    assert packed._is_view() and packed.data_ptr() == y.data_ptr(), "packing the output made a copy"
    assert_close(packed[:, 5:10], y[1], msg="model 1's channels in the packed layout")


class _Recorder:
    """Wraps every strategy to record which ones ran."""

    def __init__(self, monkeypatch) -> None:
        self.ran: list[str] = []
        for name, (fn, channels_last) in list(conv_impl._STRATEGIES.items()):
            monkeypatch.setitem(conv_impl._STRATEGIES, name, (self._wrap(name, fn), channels_last))

    def _wrap(self, name, fn):
        def run(*args):
            self.ran.append(name)
            return fn(*args)

        return run


def test_heuristic_without_benchmark(monkeypatch) -> None:
    recorder = _Recorder(monkeypatch)
    layer = BatchedConv2d(3, 2, 4, 3)
    x = torch.randn(3, 2, 2, 5, 5)
    shared = x[0].expand_as(x)
    layer(x)
    layer(shared)
    assert recorder.ran == [
        conv_impl.heuristic_strategy(x, layer.weight),
        conv_impl.heuristic_strategy(shared, layer.weight),
    ]
    assert backends.conv.cache == {}, "without benchmark nothing is measured or cached"


def test_override_precedence(monkeypatch) -> None:
    recorder = _Recorder(monkeypatch)
    layer = BatchedConv1d(3, 2, 4, 3)
    x = torch.randn(3, 2, 2, 6)
    with backends.conv.flags(strategy="loop_channels_last"):
        layer(x)  # the global setting
        layer.strategy = "grouped"
        layer(x)  # the layer's own setting wins
        assert backends.conv.strategy == "loop_channels_last"
    assert backends.conv.strategy == "auto", "flags() restores the previous setting"
    layer.strategy = "auto"
    backends.conv.cache.clear()
    assert recorder.ran == ["loop_channels_last", "grouped"]


def test_bad_strategy_names_raise() -> None:
    layer = BatchedConv2d(3, 2, 4, 3)
    with pytest.raises(ValueError, match=r"BatchedConv2d: strategy must be 'auto' or one of .*'loop'.*got 'fast'"):
        layer.strategy = "fast"
    with pytest.raises(ValueError, match=r"batchlayers.backends.conv: strategy must be"):
        backends.conv.strategy = "fast"
    with pytest.raises(ValueError, match=r"batchlayers.backends.conv: strategy must be"):
        with backends.conv.flags(strategy="fast"):
            pass
    assert backends.conv.strategy == "auto" and layer.strategy == "auto"
    with pytest.raises(ValueError, match=r"batchlayers.functional.conv: strategy must be"):
        conv(torch.randn(3, 2, 2, 5, 5), layer.weight, strategy="vmap")


def test_benchmark_measures_once_per_key_and_caches(monkeypatch) -> None:
    measured = []
    real_fastest = backends.fastest

    def counting_fastest(candidates, device, repeats=3):
        measured.append(sorted(candidates))
        return real_fastest(candidates, device, repeats=1)

    monkeypatch.setattr(backends, "fastest", counting_fastest)
    recorder = _Recorder(monkeypatch)
    layer = BatchedConv2d(3, 2, 4, 3)
    x = torch.randn(3, 2, 2, 5, 5)
    with backends.conv.flags(benchmark=True):
        layer(x).sum().backward()
        assert len(measured) == 1 and measured[0] == sorted(backends.CONV_STRATEGIES)
        ((key, winner),) = backends.conv.cache.items()
        assert winner in backends.CONV_STRATEGIES and recorder.ran[-1] == winner
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        layer(x).sum().backward()
        assert len(measured) == 1, "the second call with the same key measured again"
        assert recorder.ran[-1] == winner
        assert all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), grads)), "timing touched gradients"
        with torch.no_grad():
            layer(x)  # forward only: another key
        layer(x[0].expand_as(x))  # a shared batch: another key
        BatchedConv1d(3, 2, 4, 3)(torch.randn(3, 2, 2, 5))  # 1-D: no channels-last candidates
    assert len(measured) == 4 and len(backends.conv.cache) == 4
    assert measured[-1] == ["grouped", "loop"]
    # The cache is used even when benchmark is off again.
    layer(x)
    assert len(measured) == 4 and recorder.ran[-1] == winner


def _layout(t: torch.Tensor) -> list[tuple[int, int]]:
    """``t``'s strides where they mean something: of the dimensions longer than 1."""
    return [(d, stride) for d, (size, stride) in enumerate(zip(t.shape, t.stride())) if size > 1]


# (models, batch, in, out, kernel, padding, spatial in of a convolution, of a transposed one): distinct sizes,
# and sizes that coincide (M = B = channels = kernel = the spatial side) with a 1x1 side on one end
LAYOUT_SIZES = {"distinct": (3, 5, 4, 6, 3, 1, (7, 6), (7, 6)), "coinciding": (4, 4, 4, 4, 4, 0, (4, 4), (1, 1))}


@pytest.mark.parametrize("sizes", LAYOUT_SIZES.values(), ids=LAYOUT_SIZES.keys())
@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
@pytest.mark.parametrize("chosen", backends.CONV_STRATEGIES)
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_benchmark_choice_keeps_the_heuristic_layout(monkeypatch, tmp_path, transposed, chosen, shared, sizes) -> None:
    """``benchmark = True`` times every strategy with its result copied into the heuristic's layout, and one
    chosen over the heuristic returns its result so: the layers after it run as without benchmarking (in the
    strategy's own layout they ran up to 1.3x slower). Results and gradients stay the torch.nn loop's; the
    layout is saved with the cache, and ``tune`` (which times inside the step) drops it."""
    num_models, batch, in_channels, out_channels, kernel, padding, conv_spatial, transposed_spatial = sizes
    timed: list[str] = []

    def choosing(candidates, device, repeats=3):
        for name, run in candidates.items():
            run()
            timed.append(name)
        return chosen

    monkeypatch.setattr(backends, "fastest", choosing)
    torch.manual_seed(0)
    batched, torch_class = (BatchedConvTranspose2d, nn.ConvTranspose2d) if transposed else (BatchedConv2d, nn.Conv2d)
    layer = batched(num_models, in_channels, out_channels, kernel, padding=padding, dtype=torch.float64)
    modules = unbatch(
        layer, lambda: torch_class(in_channels, out_channels, kernel, padding=padding, dtype=torch.float64)
    )
    spatial = transposed_spatial if transposed else conv_spatial
    x0 = torch.randn(1 if shared else num_models, batch, in_channels, *spatial, dtype=torch.float64, requires_grad=True)
    x = x0.expand(num_models, -1, -1, -1, -1)
    heuristic = (conv_impl.heuristic_transpose_strategy if transposed else conv_impl.heuristic_strategy)(
        x, layer.weight
    )
    with backends.conv.flags(strategy=heuristic):
        heuristic_result = layer(x)
    heuristic_layout = _layout(heuristic_result)
    copied_into: list = []
    real_in_layout = conv_impl._in_layout
    monkeypatch.setattr(
        conv_impl, "_in_layout", lambda t, layout: copied_into.append(layout) or real_in_layout(t, layout)
    )
    with backends.conv.flags(benchmark=True):
        y = layer(x)
    assert sorted(timed) == sorted(backends.CONV_STRATEGIES), "not every strategy was timed"
    assert copied_into[:4] == [conv_impl._dense_order(heuristic_result)] * 4, "timed in their own layouts"
    ((key, winner),) = backends.conv.cache.items()
    assert winner == chosen
    assert _layout(y) == heuristic_layout, f"{chosen} left its result in its own layout"
    assert (key in backends.conv.layouts) == (chosen != heuristic)

    grad = torch.randn_like(y)
    y.backward(grad)
    inputs = [x0[0 if shared else m].detach().clone().requires_grad_(True) for m in range(num_models)]
    for m, (module, xm) in enumerate(zip(modules, inputs)):
        assert_close(y[m], module(xm), msg=f"model {m}'s output")
        module(xm).backward(grad[m])
    expected_input_grad = torch.stack([xm.grad for xm in inputs])
    assert_close(x0.grad, expected_input_grad.sum(0, keepdim=True) if shared else expected_input_grad, msg="dx")
    for name, p in layer.named_parameters():
        assert_close(p.grad, torch.stack([dict(m.named_parameters())[name].grad for m in modules]), msg=name)

    layouts = dict(backends.conv.layouts)
    backends.conv.save_cache(tmp_path / "conv.json")
    backends.conv.clear_cache()
    assert backends.conv.layouts == {}
    assert backends.conv.load_cache(tmp_path / "conv.json") == 1
    assert backends.conv.layouts == layouts and backends.conv.cache == {key: chosen}
    assert _layout(layer(x)) == heuristic_layout, "the loaded choice lost its layout"
    backends.conv.tune(lambda: layer(x).sum().backward(), repeats=1)
    assert backends.conv.cache == {key: chosen} and backends.conv.layouts == {}, "tune kept a benchmark layout"


@pytest.mark.parametrize("chosen", ["grouped", "loop"])
def test_benchmark_choice_in_1d_keeps_the_heuristic_layout(monkeypatch, chosen) -> None:
    """In 1-D the channels-last strategies are the plain ones: the heuristic's ``loop_channels_last`` is the
    candidate ``loop``, so that choice keeps its own layout (no entry in ``layouts``), and ``grouped`` returns
    its result in the loop's layout."""
    monkeypatch.setattr(backends, "fastest", lambda candidates, device, repeats=3: chosen)
    torch.manual_seed(0)
    layer = BatchedConv1d(3, 4, 6, 3, padding=1, dtype=torch.float64)
    x = torch.randn(3, 5, 4, 9, dtype=torch.float64)
    assert conv_impl.heuristic_strategy(x, layer.weight) == "loop_channels_last"
    with backends.conv.flags(strategy="loop"):
        expected = layer(x)
    with backends.conv.flags(benchmark=True):
        y = layer(x)
    assert backends.conv.cache and set(backends.conv.cache.values()) == {chosen}
    assert (backends.conv.layouts != {}) == (chosen == "grouped")
    assert y.stride() == expected.stride()
    assert_close(y, expected, msg=f"{chosen} against the loop")


@pytest.mark.parametrize("chosen", backends.CONV_STRATEGIES)
def test_benchmark_choices_in_a_stacked_resnet_match_the_models(monkeypatch, chosen) -> None:
    """A stacked CIFAR-style ResNet (batch norm, in-place residual adds) with every convolution's benchmark
    choice forced to one strategy, its result copied into the heuristic's layout: outputs, gradients and
    running statistics are the original models' own."""
    monkeypatch.setattr(backends, "fastest", lambda candidates, device, repeats=3: chosen)
    torch.manual_seed(0)
    models = [CNN().double() for _ in range(3)]
    stacked = stack(models)
    x = torch.randn(3, 4, 3, 8, 8, dtype=torch.float64)
    with backends.conv.flags(benchmark=True):
        out = stacked(x)
    out.square().sum().backward()
    assert set(backends.conv.cache.values()) == {chosen}
    expected = torch.stack([model(x[m]) for m, model in enumerate(models)])
    expected.square().sum().backward()
    assert_close(out, expected, msg="outputs")
    for name, tensor in [*stacked.named_parameters(), *stacked.named_buffers()]:
        per_model = [dict([*m.named_parameters(), *m.named_buffers()])[name] for m in models]
        if isinstance(tensor, nn.Parameter):
            assert_close(tensor.grad, torch.stack([p.grad for p in per_model]), msg=f"{name}.grad")
        else:
            assert_close(tensor.to(per_model[0].dtype), torch.stack(per_model), msg=name)


def test_benchmark_never_times_while_compiling(monkeypatch) -> None:
    monkeypatch.setattr(backends, "fastest", lambda *a, **k: pytest.fail("timed while compiling"))
    torch._dynamo.reset()
    layer = BatchedConv2d(3, 2, 4, 3, dtype=torch.float64)
    x = torch.randn(3, 2, 2, 5, 5, dtype=torch.float64)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with backends.conv.flags(benchmark=True):
        y = compiled(x)
    assert backends.conv.cache == {}
    modules = unbatch(layer, lambda: nn.Conv2d(2, 4, 3, dtype=torch.float64))
    assert_close(y, torch.stack([m(xm) for m, xm in zip(modules, x)]), msg="compiled output")


@st.composite
def _conv_configs(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding_kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    stride = 1 if padding_kind == "same" else tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding = {
        "int": draw(st.integers(0, 2)),
        "tuple": tuple(draw(st.integers(0, 2)) for _ in range(dims)),
        "same": "same",
        "valid": "valid",
    }[padding_kind]
    # Large enough for the kernel, and for reflect padding (padding < size).
    spatial = tuple(d * (k - 1) + 3 + draw(st.integers(0, 2)) for k, d in zip(kernel, dilation))
    kwargs = dict(
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
    )
    return (dims, c_in, c_out, kernel, spatial, kwargs)


# torch.nn.Conv*d (the reference) warns that an even kernel with padding='same' copies the input; the
# batched layer makes that copy itself and does not warn (test_same_padding_even_kernel_does_not_warn).
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@settings(max_examples=25, deadline=None)
@given(
    config=_conv_configs(),
    num_models=st.integers(1, 3),
    strategy=st.sampled_from(backends.CONV_STRATEGIES),
    shared=st.booleans(),
)
def test_property_random_configs_match_loop(config, num_models: int, strategy: str, shared: bool) -> None:
    torch.manual_seed(0)
    batched, modules, make_input = _build(config, num_models)
    batched.strategy = strategy
    compare_with_loop(batched, modules, make_input, shared=shared, steps=1, batch=2, check_eval=False)


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        ((4, 6, 3), dict(groups=0), r"groups must be a positive integer, got 0"),
        ((3, 6, 3), dict(groups=2), r"in_channels \(3\) must be divisible by groups \(2\)"),
        ((4, 5, 3), dict(groups=2), r"out_channels \(5\) must be divisible by groups \(2\)"),
        ((4, 6, 3), dict(padding="full"), r"invalid padding string 'full'"),
        ((4, 6, 3), dict(padding="same", stride=2), r"padding='same' is not supported for strided convolutions"),
        ((4, 6, 3), dict(padding_mode="mirror"), r"padding_mode must be one of .*'mirror'"),
    ],
)
def test_bad_arguments_raise_like_torch(args, kwargs, pattern: str) -> None:
    with pytest.raises(ValueError):
        nn.Conv2d(*args, **kwargs)
    with pytest.raises(ValueError, match=rf"^BatchedConv2d: {pattern}"):
        BatchedConv2d(3, *args, **kwargs)


@pytest.mark.parametrize("num_models", [0, 2.0, True])
def test_bad_num_models_raise(num_models) -> None:
    with pytest.raises((ValueError, TypeError), match="BatchedConv1d: num_models"):
        BatchedConv1d(num_models, 2, 2, 3)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_extra_repr_is_torchs_after_num_models(config) -> None:
    dims, c_in, c_out, kernel, _, kwargs = config
    batched = CLASSES[dims](3, c_in, c_out, kernel, **kwargs)
    reference = CLASSES[dims].torch_module(c_in, c_out, kernel, **kwargs)
    assert batched.extra_repr() == f"num_models=3, {reference.extra_repr()}"
    assert batched._reversed_padding_repeated_twice == list(reference._reversed_padding_repeated_twice)


def test_functional_accepts_ints_and_lists() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 3, 4, 6, 6), torch.randn(2, 6, 2, 3, 3), torch.randn(2, 6)
    with backends.conv.flags(benchmark=True):
        y = conv(x, weight, bias, stride=[2, 1], padding=1, dilation=[1, 2], groups=2)
    expected = [nn.functional.conv2d(x[m], weight[m], bias[m], (2, 1), 1, (1, 2), 2) for m in range(2)]
    assert_close(y, torch.stack(expected), msg="output")


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_same_padding_even_kernel_does_not_warn(strategy: str, shared: bool, monkeypatch) -> None:
    """torch warns (once per process, so a warning filter cannot see it reliably) when F.conv*d gets
    padding='same' with an even kernel; the batched layer pads explicitly instead, and matches torch."""
    torch.manual_seed(0)
    layer = BatchedConv2d(3, 2, 3, (2, 3), padding="same", dilation=(1, 2), dtype=torch.float64)
    layer.strategy = strategy
    modules = unbatch(layer, lambda: nn.Conv2d(2, 3, (2, 3), padding="same", dilation=(1, 2), dtype=torch.float64))
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    expected = torch.stack([m(x) for m in modules])
    paddings = []

    def recording_conv2d(*args):
        paddings.append(args[4])
        return nn.functional.conv2d(*args)

    monkeypatch.setitem(conv_impl._DENSE_CONV, 2, recording_conv2d)
    y = layer(x.expand(3, *x.shape) if shared else x.expand(3, *x.shape).clone())
    assert_close(y, expected, msg="output")
    assert paddings and all(p == 0 for p in paddings), f"F.conv2d got padding {paddings}"


# (class, in, out, kernel, kwargs): grouped and depthwise layers, whose fan-in is (in / groups) * prod(kernel).
# fmt: off
GROUPED = {
    "1d-groups": (BatchedConv1d, 4, 6, 3, dict(groups=2)),
    "2d-depthwise": (BatchedConv2d, 4, 8, 3, dict(groups=4)),
    "2d-groups-rect": (BatchedConv2d, 6, 9, (2, 3), dict(groups=3)),
    "3d-depthwise": (BatchedConv3d, 3, 3, (1, 2, 3), dict(groups=3)),
    "transpose2d-groups": (BatchedConvTranspose2d, 4, 6, 3, dict(groups=2)),
    "transpose1d-depthwise": (BatchedConvTranspose1d, 4, 4, 3, dict(groups=4)),
    "transpose3d-groups": (BatchedConvTranspose3d, 4, 2, (1, 2, 2), dict(groups=2)),
}
# fmt: on


@pytest.mark.parametrize("config", GROUPED.values(), ids=GROUPED.keys())
def test_grouped_init_bounds_are_torchs(config) -> None:
    """Weight and bias are uniform on [-bound, bound] with torch's bound, computed from the torch.nn module's
    own fan-in: with 64 models the largest |value| comes close to the bound (a halved or doubled bound is
    seen), no model's slice goes past it, and each model gets values of its own."""
    cls, c_in, c_out, kernel, kwargs = config
    num_models = 64
    torch.manual_seed(0)
    batched = cls(num_models, c_in, c_out, kernel, **kwargs, dtype=torch.float64)
    reference = cls.torch_module(c_in, c_out, kernel, **kwargs, dtype=torch.float64)
    fan_in, _ = nn.init._calculate_fan_in_and_fan_out(reference.weight)
    # torch: kaiming_uniform_(a=sqrt(5)) for the weight, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the bias.
    weight_bound = nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(3 / fan_in)
    bias_bound = 1 / math.sqrt(fan_in)
    for name, bound in [("weight", weight_bound), ("bias", bias_bound)]:
        p = getattr(batched, name).detach()
        ref = getattr(reference, name).detach()
        assert p.shape == (num_models, *ref.shape), f"{name}: {tuple(p.shape)}"
        assert ref.abs().max() <= bound, f"torch's own {name} exceeds the bound: the reference is wrong"
        assert_uniform_init(p, bound, name)
        batched.reset_parameters()
        assert_uniform_init(getattr(batched, name).detach(), bound, f"{name} after reset_parameters()")


def test_tune_times_strategies_inside_the_whole_step(monkeypatch, tmp_path) -> None:
    """tune() picks, per convolution, the strategy whose whole step is fastest: made deterministic by a clock
    that only advances (by 1 s a call) when a layer runs any strategy but the one chosen for it here (the
    layers told apart by output channels)."""
    fast = {4: "grouped", 6: "loop_channels_last"}
    clock = [0.0]
    monkeypatch.setattr(backends, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def slowed(name, fn):
        def run(x, weight, bias, opts):
            if fast[weight.shape[1]] != name:
                clock[0] += 1.0
            return fn(x, weight, bias, opts)

        return run

    for name, (fn, channels_last) in list(conv_impl._STRATEGIES.items()):
        monkeypatch.setitem(conv_impl._STRATEGIES, name, (slowed(name, fn), channels_last))
    torch.manual_seed(0)
    model = nn.Sequential(BatchedConv2d(2, 3, 4, 3), nn.ReLU(), BatchedConv2d(2, 4, 6, 3))
    x = torch.randn(2, 3, 3, 7, 7)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()

    before = [p.detach().clone() for p in model.parameters()]
    chosen = backends.conv.tune(step, repeats=1)
    assert sorted(chosen.values()) == ["grouped", "loop_channels_last"]
    assert {key[3][1]: strategy for key, strategy in chosen.items()} == fast  # key[3]: the weight's shape
    assert backends.conv.cache == chosen and backends.conv.recording is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "tuning changed the weights"

    recorder = _Recorder(monkeypatch)
    backends.conv.save_cache(tmp_path / "conv.json")
    backends.conv.clear_cache()
    assert backends.conv.load_cache(tmp_path / "conv.json") == 2
    assert backends.conv.cache == chosen
    model(x)
    assert recorder.ran == ["grouped", "loop_channels_last"], "the loaded choices are used"


def test_a_failed_save_cache_keeps_the_old_file_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    """``save_cache`` writes as checkpoints are written: where the write fails (here the final rename), the
    file saved before is whole and no temporary file is left beside it."""
    path = tmp_path / "conv.json"
    backends.conv.save_cache(path)
    saved = path.read_bytes()
    backends.conv.cache[("cpu", "float32", "x", "y")] = "grouped"  # (changed, so a new write would differ)

    def failing_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        backends.conv.save_cache(path)
    assert path.read_bytes() == saved
    assert [p.name for p in tmp_path.iterdir()] == ["conv.json"]


@pytest.mark.parametrize(
    "content, pattern",
    [
        ("not json", "is not JSON"),
        ('{"a": 1}', "is not a saved convolution cache"),
        ("[1, 2]", "is not a saved"),
        (
            '{"format": "batchlayers.backends.conv cache", "version": 1, "entries": [[["cpu"], "loop", [0, 0]]]}',
            "gives 'loop' the layout",
        ),
        ('{"format": "batchlayers.backends.conv cache", "version": 1, "entries": [["loop"]]}', "has entries that"),
        ('{"format": "batchlayers.backends.conv cache", "version": 1}', "has entries that"),
    ],
)
def test_load_cache_refuses_other_files(tmp_path, content: str, pattern: str) -> None:
    path = tmp_path / "conv.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"load_cache: '{path}' {pattern}"):
        backends.conv.load_cache(path)
    assert backends.conv.cache == {}


def test_loop_channels_last_gives_a_contiguous_input_a_contiguous_gradient() -> None:
    """The channels-last convolution returns its input gradient channels-last; a contiguous input gets it back
    contiguous, so the elementwise backward before it (a ReLU's) does not mix layouts. Same numbers as the loop.
    (The input is not a leaf: a leaf's accumulated .grad takes the leaf's layout whatever autograd passes.)"""
    torch.manual_seed(0)
    layer = BatchedConv2d(3, 4, 5, 3, padding=1, dtype=torch.float64)
    layer.strategy = "loop_channels_last"
    x = torch.randn(3, 2, 4, 6, 6, dtype=torch.float64, requires_grad=True) * 1
    y = layer(x)
    grad_y = torch.randn_like(y)
    (grad_x,) = torch.autograd.grad(y, x, grad_y)
    assert grad_x.is_contiguous(), f"input gradient strides {grad_x.stride()}"
    modules = unbatch(layer, lambda: nn.Conv2d(4, 5, 3, padding=1, dtype=torch.float64))
    for i, module in enumerate(modules):
        xi = x[i].detach().requires_grad_()
        module(xi).backward(grad_y[i])
        assert_close(grad_x[i], xi.grad, msg=f"model {i}'s input gradient")


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "conv_transpose"])
def test_per_sample_gradients_under_vmap(transposed) -> None:
    """Under a torch.func transform the layers run without channels-last copies (vmap makes none but the
    contiguous layout, and raised): per-sample weight gradients (``vmap(grad(...))``) equal those of each
    model's torch.nn layer, sample by sample."""
    torch.manual_seed(0)
    batched_cls, torch_cls = (BatchedConvTranspose2d, nn.ConvTranspose2d) if transposed else (BatchedConv2d, nn.Conv2d)
    batched = batched_cls(3, 3, 4, 3, dtype=torch.float64)  # (3 models)
    modules = unbatch(batched, lambda: torch_cls(3, 4, 3, dtype=torch.float64))
    x = torch.randn(3, 2, 3, 6, 6, dtype=torch.float64)
    params = {k: v.detach() for k, v in batched.named_parameters()}

    def loss(p, sample):  # (M, 3, 6, 6): one sample per model
        return torch.func.functional_call(batched, p, (sample.unsqueeze(1),)).square().sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 1))(params, x)["weight"]
    for m, module in enumerate(modules):
        expected = [torch.autograd.grad(module(x[m, i : i + 1]).square().sum(), module.weight)[0] for i in range(2)]
        assert_close(got[:, m], torch.stack(expected), msg=f"per-sample weight gradients of model {m}")


@pytest.mark.parametrize("strategy", ["loop", "loop_channels_last"])
def test_kept_loop_results_are_never_written_while_held(strategy: str, monkeypatch) -> None:
    """The loops' stacked outputs and input gradients in kept memory (every size here): a result or gradient
    the caller still holds is never written by a later call, each equals the torch.nn loop (after an in-place
    op on the output, with only some models' outputs used, differentiated twice), the layout is torch.stack's,
    and once dropped the next call writes into kept memory instead of new."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    torch.manual_seed(0)
    batched, modules, make_input = _build(CONFIGS["2d-plain"], num_models=3)
    batched.strategy = strategy

    def step(loss_of, create_graph=False):
        """The batched and the loop's output and input gradient of ``loss_of(output)``, compared."""
        x = make_input((3, 5))
        xb, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = batched(xb)
        ys = torch.stack([m(xr[i]) for i, m in enumerate(modules)])
        assert_close(y, ys, msg="output")
        (gb,) = torch.autograd.grad(loss_of(y), xb, create_graph=create_graph)
        (gr,) = torch.autograd.grad(loss_of(ys), xr, create_graph=create_graph)
        assert_close(gb, gr, msg="input gradient")
        if create_graph:
            wb = torch.autograd.grad(gb.square().sum(), batched.weight)[0]
            wr = torch.stack(torch.autograd.grad(gr.square().sum(), [m.weight for m in modules]))
            assert_close(wb, wr, msg="second-order weight gradient")
        return y, gb

    monkeypatch.setattr(_workspace, "MIN_BYTES", 1 << 62)
    allocated_layout = step(lambda y: y.sum())[0].stride()
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    held = step(lambda y: y.square().sum())
    assert held[0].stride() == allocated_layout
    copies = [t.clone() for t in held]
    for loss_of in (lambda y: y.square().sum(), lambda y: y.relu_().sum(), lambda y: y[1].sum()):
        step(loss_of)
    step(lambda y: y.square().sum(), create_graph=True)
    assert all(torch.equal(t, c) for t, c in zip(held, copies)), "a held result was written"
    pointers = {t.data_ptr() for t in held}
    del held, copies
    pool = len(_workspace._pool())
    again = step(lambda y: y.square().sum())
    assert {t.data_ptr() for t in again} <= {b.data_ptr() for b in _workspace._pool()}, "not in kept memory"
    assert len(_workspace._pool()) == pool, "new buffers where dropped ones were free"
    assert pointers & {t.data_ptr() for t in again}, "the dropped results' memory was not reused"
    _workspace.release()


def test_kept_loop_results_of_different_sizes_share_a_buffer(monkeypatch) -> None:
    """A stacked output that dies within the step (its ReLU's output is what backward keeps) leaves its kept
    buffer to the next layer's smaller output: one buffer for both, not one kept per size; the results still
    equal the torch.nn loop."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    torch.manual_seed(0)
    first, first_loop, make_input = _build((2, 3, 4, 3, (6, 6), dict(padding=1)), num_models=3)
    second, second_loop, _ = _build((2, 4, 2, 3, (6, 6), dict(padding=1)), num_models=3)
    for layer in (first, second):
        layer.strategy = "loop_channels_last"
    x = make_input((3, 5))
    out = first(x)
    address = out.data_ptr()
    hidden = out.relu()
    del out
    result = second(hidden)
    assert result.data_ptr() == address, "the smaller output took a buffer of its own"
    expected = torch.stack([s(f(x[i]).relu()) for i, (f, s) in enumerate(zip(first_loop, second_loop))])
    assert_close(result, expected, msg="output")
    _workspace.release()


@pytest.mark.parametrize("spatial", [(3, 3), (5, 5)], ids=["1x1-output", "3x3-output"])
@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
def test_models_batch_channels_and_sizes_coincide(strategy: str, spatial, kept: bool) -> None:
    """M == B == channels == output side (and a 1x1 output, whose size-1 dimensions have free strides): nothing
    may be told apart by size, kept stacks included; against the loop."""
    torch.manual_seed(0)
    batched, modules, make_input = _build((2, 3, 3, 3, spatial, {}), num_models=3)
    batched.strategy = strategy
    compare_with_loop(batched, modules, make_input, shared=False, batch=3)
