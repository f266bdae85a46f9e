"""What is special to the batched transposed convolutions: ``output_size`` in ``forward``, every strategy
against the torch.nn loop (channels-last inputs too), the shared batch without M-fold copies, per-model init
with torch's transposed fan-in, strategy selection and argument checks."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close, compare_with_loop, unbatch
from test_conv import _build as conv_build
from test_conv import (
    _fresh_backend_settings,  # noqa: F401 (autouse: each test starts from the defaults)
    _StorageSizes,
)
from torch import nn

from batchlayers import backends
from batchlayers.conv import BatchedConv2d, BatchedConvTranspose1d, BatchedConvTranspose2d, BatchedConvTranspose3d
from batchlayers.functional import _conv as conv_impl
from batchlayers.functional._conv import conv_transpose
from batchlayers.registry import constructor_kwargs

CLASSES = {1: BatchedConvTranspose1d, 2: BatchedConvTranspose2d, 3: BatchedConvTranspose3d}

# (dims, in, out, kernel, spatial, kwargs): the options where the strategies differ in what they do.
# fmt: off
CONFIGS = {
    "1d-stride-outpad-groups": (1, 4, 6, 3, (6,), dict(stride=2, padding=1, output_padding=1, groups=2)),
    "2d-decoder": (2, 3, 4, 4, (5, 6), dict(stride=2, padding=1)),
    "2d-tuples-groups-outpad-nobias": (2, 4, 6, (2, 3), (4, 5), dict(stride=(2, 3), padding=(0, 1),
                                                                    output_padding=(1, 2), groups=2, bias=False)),
    "2d-depthwise-dilation": (2, 4, 8, 3, (5, 5), dict(padding=2, groups=4, dilation=2)),
    "3d-groups-outpad-dilation": (3, 4, 2, (1, 2, 3), (3, 4, 3), dict(stride=(1, 2, 2), padding=(0, 1, 1),
                                                                       output_padding=(0, 1, 1), groups=2,
                                                                       dilation=(1, 1, 2))),
}
# fmt: on


def _build(config, num_models, dtype=torch.float64):
    return conv_build(config, num_models, dtype, classes=CLASSES)


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
    batched, modules, make_input = _build(CONFIGS["2d-decoder"], num_models=4, dtype=torch.float32)
    batched.strategy = strategy
    compare_with_loop(batched, modules, make_input, shared=False, steps=1)


class _CalledWith(nn.Module):
    """Calls its layer with fixed keyword arguments; wraps the batched layer and each torch.nn module alike, so
    that parameter names match."""

    def __init__(self, layer: nn.Module, **kwargs) -> None:
        super().__init__()
        self.layer = layer
        self.kwargs = kwargs

    @property
    def num_models(self) -> int:
        return self.layer.num_models

    def forward(self, x):
        return self.layer(x, **self.kwargs)


# (config, output_size for torch's (B, C, *) call, what the batched layer gets with M=3, B=5)
OUTPUT_SIZES = {
    "spatial": ("2d-decoder", [11, 12], [11, 12]),
    "spatial-max": ("2d-tuples-groups-outpad-nobias", [9, 15], [9, 15]),
    "spatial-min": ("2d-tuples-groups-outpad-nobias", [8, 13], [8, 13]),
    "with-B-C": ("2d-decoder", [5, 4, 11, 13], [5 * 3, 4, 11, 13]),  # a stacked model's skip.shape: (M*B, C, *)
    "with-M-B-C": ("2d-decoder", [10, 12], torch.Size([3, 5, 4, 10, 12])),
    "1d-tuple": ("1d-stride-outpad-groups", (12,), (12,)),
    "3d": ("3d-groups-outpad-dilation", [3, 6, 7], [3, 6, 7]),
}


@pytest.mark.parametrize("strategy", ["auto", *backends.CONV_STRATEGIES])
@pytest.mark.parametrize("name", list(OUTPUT_SIZES))
def test_output_size_matches_loop(name: str, strategy: str) -> None:
    config_name, torch_size, batched_size = OUTPUT_SIZES[name]
    torch.manual_seed(0)
    batched, modules, make_input = _build(CONFIGS[config_name], num_models=3)
    batched.strategy = strategy
    wrapped = _CalledWith(batched, output_size=batched_size)
    references = [_CalledWith(m, output_size=torch_size) for m in modules]
    for shared in (False, True):
        compare_with_loop(wrapped, references, make_input, shared=shared, steps=1)
    y = wrapped(make_input((3, 5)))
    assert list(y.shape[3:]) == list(batched_size)[-len(y.shape[3:]) :]


def test_output_size_under_compile() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = BatchedConvTranspose2d(3, 4, 2, 3, stride=2, padding=1, dtype=torch.float64)
    compiled = torch.compile(_CalledWith(layer, output_size=[10, 9]), fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 2, 4, 5, 5, dtype=torch.float64)
    modules = unbatch(layer, lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, dtype=torch.float64))
    expected = torch.stack([m(xm, output_size=[10, 9]) for m, xm in zip(modules, x)])
    assert_close(compiled(x), expected, msg="compiled output")


@pytest.mark.parametrize(
    "output_size, pattern",
    [
        ([14, 11], r"requested an output size of \[14, 11\], but valid sizes range from \[9, 9\] to \[10, 10\] "
                   r"\(for an input of \(5, 5\), shape \(3, 2, 4, 5, 5\)\)"),
        ([8, 10], r"requested an output size of \[8, 10\], but valid sizes range from \[9, 9\] to \[10, 10\]"),
        ([10], r"output_size must have 2 elements \(H, W\), 4 \(B, C_out, ...\) or 5 \(M, B, C_out, ...\), got 1"),
        ([2, 3, 2, 10, 10], None),  # (M, B, C_out, H, W) with any leading values, as torch ignores them
        ([1, 1, 1, 2, 10, 10], r"output_size must have .* got 6"),
    ],
)  # fmt: skip
def test_bad_output_size_raises(output_size, pattern) -> None:
    layer = BatchedConvTranspose2d(3, 4, 2, 3, stride=2, padding=1)
    x = torch.randn(3, 2, 4, 5, 5)
    if pattern is None:
        assert layer(x, output_size=output_size).shape == (3, 2, 2, 10, 10)
        return
    with pytest.raises(ValueError, match=rf"^BatchedConvTranspose2d: {pattern}"):
        layer(x, output_size=output_size)


def test_bad_output_padding_raises_at_call() -> None:
    """torch accepts any output_padding in the constructor and raises a RuntimeError at the call (unless an
    output_size replaces it); the batched layer raises a ValueError there, and accepts an output_size."""
    layer = BatchedConvTranspose2d(3, 2, 2, 3, stride=(2, 1), output_padding=(1, 1))
    reference = nn.ConvTranspose2d(2, 2, 3, stride=(2, 1), output_padding=(1, 1))
    x = torch.randn(3, 1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="output padding must be smaller than either stride or dilation"):
        reference(x[0])
    with pytest.raises(
        ValueError,
        match=r"^BatchedConvTranspose2d: output_padding must be smaller than either "
        r"stride or dilation, but got output_padding=\(1, 1\), stride=\(2, 1\)",
    ):
        layer(x)
    assert layer(x, output_size=[10, 6]).shape == (3, *reference(x[0], output_size=[10, 6]).shape)


@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
@pytest.mark.parametrize("dims", [2, 3])
def test_channels_last_inputs_match_loop(dims: int, strategy: str) -> None:
    """Inputs whose per-model (and shared) slices are channels-last, as a channels-last network makes them."""
    torch.manual_seed(0)
    config = CONFIGS["2d-tuples-groups-outpad-nobias" if dims == 2 else "3d-groups-outpad-dilation"]
    batched, modules, make_input = _build(config, num_models=3)
    batched.strategy = strategy
    memory_format = torch.channels_last if dims == 2 else torch.channels_last_3d

    def channels_last_input(lead):
        x = make_input(lead)
        if len(lead) == 1:  # one shared (B, C, *) batch
            return x.contiguous(memory_format=memory_format)
        per_model = x.movedim(2, -1).contiguous().movedim(-1, 2)  # (M, B, *, C) in memory
        assert per_model[0].is_contiguous(memory_format=memory_format)
        return per_model

    for shared in (False, True):
        compare_with_loop(batched, modules, channels_last_input, shared=shared, steps=1)


@pytest.mark.parametrize("strategy", backends.CONV_STRATEGIES)
@pytest.mark.parametrize("groups", [1, 2])
def test_shared_batch_is_never_copied_per_model(strategy: str, groups: int) -> None:
    num_models = 6
    layer = BatchedConvTranspose2d(num_models, 8, 2, 3, padding=1, groups=groups)  # outputs smaller than M inputs
    layer.strategy = strategy
    batch = torch.randn(4, 8, 6, 6)
    shared = batch.expand(num_models, *batch.shape)
    with _StorageSizes() as sizes:
        y = layer(shared)
        y.sum().backward()  # gradients of the weights only: the data needs none
    # An M-fold copy of the batch would need num_models * batch.nbytes; a channels-last copy of the one batch
    # is allowed.
    assert sizes.largest < num_models / 2 * batch.nbytes, f"a tensor of {sizes.largest} bytes was made"
    modules = unbatch(layer, lambda: nn.ConvTranspose2d(8, 2, 3, padding=1, groups=groups))
    assert_close(y, torch.stack([m(batch) for m in modules]), msg="output")


@pytest.mark.parametrize("strategy", ["grouped", "grouped_channels_last"])
def test_grouped_output_packs_back_as_a_view(strategy: str) -> None:
    """As for BatchedConv2d: the next grouped layer packs ``(M, B, C, H, W)`` into ``(B, M*C, H, W)`` for free."""
    layer = BatchedConvTranspose2d(3, 4, 5, 3, stride=2)
    layer.strategy = strategy
    y = layer(torch.randn(3, 2, 4, 4, 4))
    packed = y.transpose(0, 1).reshape(2, 3 * 5, 9, 9)
    assert packed._is_view() and packed.data_ptr() == y.data_ptr(), "packing the output made a copy"
    assert_close(packed[:, 5:10], y[1], msg="model 1's channels in the packed layout")


@pytest.mark.parametrize("dims, in_channels, out_channels, groups", [(1, 16, 2, 1), (2, 2, 24, 1), (3, 8, 4, 4)])
def test_init_per_model_uses_torchs_transposed_fan_in(dims, in_channels, out_channels, groups) -> None:
    """torch's fan-in of a transposed weight (in, out // groups, *k) is (out // groups) * prod(k), not
    in // groups: each model's slice spans [-1/sqrt(fan_in), 1/sqrt(fan_in)], like a fresh torch module's, and
    the models differ."""
    torch.manual_seed(0)
    kernel = (3,) * dims
    num_models = 4
    layer = CLASSES[dims](num_models, in_channels, out_channels, kernel, groups=groups)
    reference = CLASSES[dims].torch_module(in_channels, out_channels, kernel, groups=groups)
    bound = 1 / ((out_channels // groups) * 3**dims) ** 0.5
    for name in ("weight", "bias"):
        p, ref = getattr(layer, name).detach(), getattr(reference, name).detach()
        assert p.shape == (num_models, *ref.shape)
        assert ref.abs().max() <= bound  # the bound is torch's
        for i in range(num_models):
            assert p[i].abs().max() <= bound, f"{name}[{i}] exceeds torch's bound {bound}"
            # Dense enough that a bound half as large as torch's (or a wrong fan) would show.
            assert p[i].abs().max() > bound / 2 or p[i].numel() < 8, f"{name}[{i}] is narrower than torch's"
            if i:
                assert not torch.equal(p[0], p[i]), f"{name}: models 0 and {i} got the same initial values"


def test_constructor_kwargs_read_back_torchs_arguments() -> None:
    layer = BatchedConvTranspose2d(3, 4, 6, (2, 3), (2, 1), (1, 0), (1, 0), 2, False, (1, 2))
    kwargs = constructor_kwargs(layer, nn.ConvTranspose2d)
    reference = nn.ConvTranspose2d(4, 6, (2, 3), (2, 1), (1, 0), (1, 0), 2, False, (1, 2))
    assert kwargs == constructor_kwargs(reference, nn.ConvTranspose2d)
    assert nn.ConvTranspose2d(**kwargs).extra_repr() == reference.extra_repr()
    assert BatchedConvTranspose2d(3, **kwargs).extra_repr() == layer.extra_repr()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_extra_repr_is_torchs_after_num_models(config) -> None:
    dims, c_in, c_out, kernel, _, kwargs = config
    batched = CLASSES[dims](3, c_in, c_out, kernel, **kwargs)
    reference = CLASSES[dims].torch_module(c_in, c_out, kernel, **kwargs)
    assert batched.extra_repr() == f"num_models=3, {reference.extra_repr()}"
    assert batched.output_padding == reference.output_padding and batched.transposed


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        ((4, 6, 3), dict(groups=0), r"groups must be a positive integer, got 0"),
        ((3, 6, 3), dict(groups=2), r"in_channels \(3\) must be divisible by groups \(2\)"),
        ((4, 5, 3), dict(groups=2), r"out_channels \(5\) must be divisible by groups \(2\)"),
        ((4, 6, 3), dict(padding_mode="reflect"), r'only "zeros" padding mode is supported .*got padding_mode='),
        ((4, 6, 3), dict(padding_mode="mirror"), r'only "zeros" padding mode is supported .*ConvTranspose2d'),
    ],
)
def test_bad_arguments_raise_like_torch(args, kwargs, pattern: str) -> None:
    with pytest.raises(ValueError):
        nn.ConvTranspose2d(*args, **kwargs)
    with pytest.raises(ValueError, match=rf"^BatchedConvTranspose2d: {pattern}"):
        BatchedConvTranspose2d(3, *args, **kwargs)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_string_padding_raises_at_construction(padding: str) -> None:
    """torch.nn.ConvTranspose2d takes a padding string apart into characters and fails at its first call."""
    with pytest.raises(TypeError):
        nn.ConvTranspose2d(2, 2, 3, padding=padding)(torch.randn(1, 2, 4, 4))
    with pytest.raises(
        ValueError,
        match=rf"^BatchedConvTranspose2d: padding must be an int or a tuple of ints, got "
        rf"'{padding}'",
    ):
        BatchedConvTranspose2d(3, 2, 2, 3, padding=padding)


class _Recorder:
    """Wraps every transposed strategy to record which ones ran."""

    def __init__(self, monkeypatch) -> None:
        self.ran: list[str] = []
        for name, (fn, channels_last) in list(conv_impl._TRANSPOSE_STRATEGIES.items()):
            monkeypatch.setitem(conv_impl._TRANSPOSE_STRATEGIES, name, (self._wrap(name, fn), channels_last))

    def _wrap(self, name, fn):
        def run(*args):
            self.ran.append(name)
            return fn(*args)

        return run


def test_heuristic_without_benchmark(monkeypatch) -> None:
    recorder = _Recorder(monkeypatch)
    x2, x1 = torch.randn(3, 2, 2, 5, 5), torch.randn(3, 2, 2, 5)
    layer2, layer1 = BatchedConvTranspose2d(3, 2, 4, 3), BatchedConvTranspose1d(3, 2, 4, 3)
    shared = x2[0].expand_as(x2)
    layer2(x2)
    layer2(shared)
    layer1(x1)
    assert recorder.ran == ["loop_channels_last", "grouped_channels_last", "grouped"]
    assert recorder.ran == [
        conv_impl.heuristic_transpose_strategy(x, layer.weight)
        for x, layer in [(x2, layer2), (shared, layer2), (x1, layer1)]
    ]
    assert backends.conv.cache == {}, "without benchmark nothing is measured or cached"


def test_heuristic_shared_batch_with_many_output_channels(monkeypatch) -> None:
    """A shared batch with gradients and 16 or more output channels per group runs as a loop of channels-last
    transposed convolutions (measured faster there), without gradients as one grouped one."""
    recorder = _Recorder(monkeypatch)
    x = torch.randn(2, 2, 5, 5)
    shared = x.expand(3, *x.shape)
    wide, grouped = BatchedConvTranspose2d(3, 2, 16, 3), BatchedConvTranspose2d(3, 2, 16, 3, groups=2)
    wide(shared)
    with torch.no_grad():
        wide(shared)
    grouped(shared)  # 8 output channels per group
    assert recorder.ran == ["loop_channels_last", "grouped_channels_last", "grouped_channels_last"]


def test_override_precedence(monkeypatch) -> None:
    recorder = _Recorder(monkeypatch)
    layer = BatchedConvTranspose1d(3, 2, 4, 3)
    x = torch.randn(3, 2, 2, 6)
    with backends.conv.flags(strategy="loop_channels_last"):
        layer(x)  # the global setting
        layer.strategy = "grouped"
        layer(x)  # the layer's own setting wins
    assert recorder.ran == ["loop_channels_last", "grouped"]


def test_benchmark_measures_once_per_key_apart_from_convolutions(monkeypatch) -> None:
    measured = []
    real_fastest = backends.fastest

    def counting_fastest(candidates, device, repeats=3):
        measured.append(sorted(candidates))
        return real_fastest(candidates, device, repeats=1)

    monkeypatch.setattr(backends, "fastest", counting_fastest)
    recorder = _Recorder(monkeypatch)
    # Same input and weight shapes and padding as the convolution below: the two must not share a cache entry.
    layer = BatchedConvTranspose2d(3, 4, 4, 3, padding=1)
    conv_layer = BatchedConv2d(3, 4, 4, 3, padding=1)
    assert layer.weight.shape == conv_layer.weight.shape
    x = torch.randn(3, 2, 4, 5, 5)
    with backends.conv.flags(benchmark=True):
        layer(x).sum().backward()
        assert measured == [sorted(backends.CONV_STRATEGIES)]
        ((key, winner),) = backends.conv.cache.items()
        assert winner in backends.CONV_STRATEGIES and recorder.ran[-1] == winner
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        layer(x).sum().backward()
        assert len(measured) == 1, "the second call with the same key measured again"
        assert recorder.ran[-1] == winner
        assert all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), grads)), "timing touched gradients"
        conv_layer(x).sum().backward()
        assert len(measured) == 2 and len(backends.conv.cache) == 2, "the convolution reused the transposed entry"
        BatchedConvTranspose1d(3, 2, 4, 3)(torch.randn(3, 2, 2, 5))  # 1-D: no channels-last candidates
    assert measured[-1] == ["grouped", "loop"]


def test_functional_accepts_ints_and_lists() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 3, 4, 5, 5), torch.randn(2, 4, 3, 3, 3), torch.randn(2, 6)
    with backends.conv.flags(benchmark=True):
        y = conv_transpose(x, weight, bias, stride=[2, 1], padding=1, output_padding=[1, 0], groups=2, dilation=[1, 2])
    expected = [
        nn.functional.conv_transpose2d(x[m], weight[m], bias[m], (2, 1), 1, (1, 0), 2, (1, 2)) for m in range(2)
    ]
    assert_close(y, torch.stack(expected), msg="output")
    with pytest.raises(ValueError, match=r"batchlayers.functional.conv_transpose: strategy must be"):
        conv_transpose(x, weight, strategy="vmap")
