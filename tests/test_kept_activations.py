"""A stacked model's own ReLU and max pooling with their large results in kept memory
(``batchlayers/functional/_kept.py``), against the original models and torch's own ops."""

from __future__ import annotations

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from convert_harness import compare_gradient_penalty, compare_training, seeded
from harness import assert_close
from torch import Tensor, nn

from batchlayers import _workspace
from batchlayers.convert import stack
from batchlayers.functional import _kept

RELUS = ["F.relu", "torch.relu", "Tensor.relu", "nn.ReLU"]
POOLS = {
    "2": {"kernel_size": 2},
    "3-s2-p1": {"kernel_size": 3, "stride": 2, "padding": 1},
    "3-s1-p1-d2-ceil": {"kernel_size": 3, "stride": 1, "padding": 1, "dilation": 2, "ceil_mode": True},
    "(3,2)-s(2,1)-ceil": {"kernel_size": (3, 2), "stride": (2, 1), "ceil_mode": True},
}
FORMATS = {"contiguous": torch.contiguous_format, "channels-last": torch.channels_last}


class ReluPoolNet(nn.Module):
    """conv, a ReLU written one of :data:`RELUS`' ways, max pooling (``nn.MaxPool2d`` or ``F.max_pool2d`` with
    positional arguments), a mean over the pixels and a linear head; the activations in ``memory_format``."""

    def __init__(self, relu: str, pool: dict, memory_format: torch.memory_format, functional_pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(**pool)
        self.fc = nn.Linear(4, 5)
        self.relu, self.memory_format, self.functional_pool = relu, memory_format, functional_pool

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).contiguous(memory_format=self.memory_format)
        h = {"F.relu": F.relu, "torch.relu": torch.relu, "Tensor.relu": Tensor.relu, "nn.ReLU": self.act}[self.relu](h)
        if self.functional_pool:
            p = self.pool
            h = F.max_pool2d(h, p.kernel_size, p.stride, p.padding, p.dilation, p.ceil_mode)
        else:
            h = self.pool(h)
        return self.fc(F.relu(h).mean((2, 3)))


def _images(lead) -> Tensor:
    return torch.randn(*lead, 3, 9, 9, dtype=torch.float64)


@pytest.fixture
def calls(monkeypatch):
    """Every buffer kept whatever its size; counts the calls the kept functions took (not None)."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    counts = {"relu": 0, "max_pool2d": 0}

    def counted(name, fn):
        def call(*args):
            out = fn(*args)
            counts[name] += out is not None
            return out

        return call

    monkeypatch.setattr(_kept, "relu", counted("relu", _kept.relu))
    monkeypatch.setattr(_kept, "max_pool2d", counted("max_pool2d", _kept.max_pool2d))
    yield counts
    _workspace.release()


@pytest.mark.parametrize("relu", RELUS)
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("memory_format", list(FORMATS))
@pytest.mark.parametrize("num_models", [1, 3])
def test_matches_the_original_models(calls, relu: str, pool: str, memory_format: str, num_models: int) -> None:
    """Three training steps (kept buffers of the earlier ones reused, their old contents in them) and an eval
    pass: outputs, parameter gradients and buffers as the original models'."""
    functional_pool = relu == "torch.relu"  # (one of the ReLU forms with F.max_pool2d's positional arguments)

    def factory():
        return ReluPoolNet(relu, POOLS[pool], FORMATS[memory_format], functional_pool)

    batched = stack([seeded(factory, i) for i in range(num_models)])
    compare_training(batched, [seeded(factory, i) for i in range(num_models)], _images, steps=3)
    # per pass (the eval pass records gradients too): both ReLUs, one pooling
    assert calls == {"relu": 2 * 4, "max_pool2d": 4}, calls


@pytest.mark.parametrize("relu", ["F.relu", "nn.ReLU"])
@pytest.mark.parametrize("sizes", [(4, 4, 4), (1, 1, 4), (4, 1, 2), (2, 4, 4)], ids=lambda s: "M{}-B{}-HW{}".format(*s))
def test_sizes_that_coincide(calls, relu: str, sizes) -> None:
    """Models, samples, channels (4 after the convolution) and pixels equal, or ones among them: the same
    results as the original models."""
    num_models, batch, side = sizes

    def factory():
        return ReluPoolNet(relu, POOLS["2"], torch.channels_last, False)

    batched = stack([seeded(factory, i) for i in range(num_models)])
    compare_training(
        batched,
        [seeded(factory, i) for i in range(num_models)],
        lambda lead: torch.randn(*lead, 3, side, side, dtype=torch.float64),
        batch=batch,
    )
    # (one sample in all: the convolution's output has a size-1 dimension's free stride, not dense: torch's ReLU)
    relus = 1 if num_models * batch == 1 else 2
    assert calls == {"relu": relus * 3, "max_pool2d": 3}, calls


@pytest.mark.parametrize("memory_format", list(FORMATS))
def test_input_gradients_and_gradients_of_gradients(calls, memory_format: str) -> None:
    """The gradient by the input, and a penalty on it differentiated again (``create_graph=True``: torch's
    recorded ops), as each original model's."""

    def factory():
        return ReluPoolNet("F.relu", POOLS["3-s2-p1"], FORMATS[memory_format], False)

    models = [seeded(factory, i) for i in range(3)]
    batched = stack([seeded(factory, i) for i in range(3)])
    compare_gradient_penalty(batched, models, _images((3, 4)))
    assert calls == {"relu": 2, "max_pool2d": 1}, calls


def test_results_held_by_the_caller_are_never_written(calls) -> None:
    """A ReLU output and the gradients a hook keeps from one step are not the next step's buffers."""

    def factory():
        return ReluPoolNet("nn.ReLU", POOLS["2"], torch.channels_last, False)

    batched = stack([seeded(factory, i) for i in range(2)])
    held: dict[str, Tensor] = {}
    seen: dict[str, Tensor] = {}
    batched.act.register_forward_hook(lambda module, args, out: seen.update(input=args[0], output=out))
    out = batched(_images((2, 4)))
    held["relu output"] = seen["output"]
    # (gradient hooks outside the forward, which refuses them: see the tracker's escapes)
    seen["output"].register_hook(lambda grad: held.setdefault("pooling's input gradient", grad))
    seen["input"].register_hook(lambda grad: held.setdefault("relu's input gradient", grad))
    out.sum().backward()
    assert len(held) == 3
    copies = {k: v.detach().clone() for k, v in held.items()}
    for _ in range(2):
        batched(_images((2, 4))).sum().backward()
    for k, v in held.items():
        assert torch.equal(v, copies[k]), f"{k} was overwritten"
    assert calls["relu"] == 2 * 3 and calls["max_pool2d"] == 3, calls


def test_an_in_place_write_into_the_saved_output_raises_as_torch_does(calls) -> None:
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    for relu in (torch.relu, _kept.relu):
        y = relu(x)
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("memory_format", list(FORMATS))
@pytest.mark.parametrize("pool", list(POOLS))
def test_bit_equal_to_torch(calls, dtype, memory_format: str, pool: str) -> None:
    """The same numbers as torch's ReLU and pooling, forward and backward, twice (the second time into the first
    call's buffers), and without gradients; zeros and ties included."""
    args = POOLS[pool]
    base = torch.randn(6, 4, 9, 9, dtype=dtype).round(decimals=1)  # (ties for the pooling, zeros for the ReLU)
    base = base.contiguous(memory_format=FORMATS[memory_format])
    for _ in range(2):
        x, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        pooled = _kept.max_pool2d(
            _kept.relu(x),
            args["kernel_size"],
            args.get("stride"),
            args.get("padding", 0),
            args.get("dilation", 1),
            args.get("ceil_mode", False),
        )
        expected = F.max_pool2d(torch.relu(ref), **args)
        assert torch.equal(pooled, expected)
        g = torch.randn_like(expected)
        pooled.backward(g)
        expected.backward(g)
        assert torch.equal(x.grad, ref.grad) and x.grad.stride() == ref.grad.stride()
    with torch.no_grad():
        assert torch.equal(_kept.relu(base), torch.relu(base))
        assert _kept.max_pool2d(base, 2, None, 0, 1, False) is None  # (nothing to keep without gradients)
    assert calls == {"relu": 3, "max_pool2d": 2}, calls


def test_left_to_torch(calls, monkeypatch) -> None:
    """With indices, a strided input, a 3-d input, integers, below the size: torch's own calls, the same
    results. (In place: ``tests/test_in_place_on_layer_outputs.py``.)"""
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    assert _kept.relu(x[..., ::2]) is None
    assert _kept.relu(torch.arange(4)) is None
    assert _kept.max_pool2d(x[..., ::2], 2, None, 0, 1, False) is None
    assert _kept.max_pool2d(x[0], 2, None, 0, 1, False) is None
    assert _kept.max_pool2d(x.permute(0, 2, 1, 3), 2, None, 0, 1, False) is None  # (dense, another order)
    monkeypatch.setattr(_workspace, "MIN_BYTES", x.nbytes + 1)
    assert _kept.relu(x) is None and _kept.max_pool2d(x, 2, None, 0, 1, False) is None
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)

    class Strided(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            h = F.relu(self.conv(x)[..., ::2])
            return F.max_pool2d(h, 2, return_indices=True)[0]

    models = [seeded(Strided, i) for i in range(2)]
    batched = stack([seeded(Strided, i) for i in range(2)])
    compare_training(batched, models, _images)
    assert calls == {"relu": 0, "max_pool2d": 0}, calls


def test_inference_mode_and_no_grad_between_training_steps(calls) -> None:
    """Forwards under ``torch.inference_mode()`` and ``torch.no_grad()`` (the ReLUs' results kept, the pooling
    left to torch) between training steps, sharing the kept buffers: each as the original models'."""

    def factory():
        return ReluPoolNet("F.relu", POOLS["3-s2-p1"], torch.channels_last, False)

    models = [seeded(factory, i) for i in range(2)]
    batched = stack([seeded(factory, i) for i in range(2)])
    for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad, torch.inference_mode, torch.enable_grad):
        x = _images((2, 4))
        with mode():
            out = batched(x)
            expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
        assert_close(out, expected, msg=f"output under {mode.__name__}")
        if mode is torch.enable_grad:
            out.sum().backward()
            expected.sum().backward()
            for name, p in batched.named_parameters():
                own = torch.stack([m.get_parameter(name).grad for m in models])
                assert_close(p.grad, own, msg=f"gradient of {name}")
                p.grad = None
            for m in models:
                m.zero_grad(set_to_none=True)
    assert calls == {"relu": 2 * 5, "max_pool2d": 2}, calls


def test_a_free_buffer_too_small_for_a_missed_request_is_dropped(monkeypatch) -> None:
    """The small CNN's order of kept results, in units of 8 MiB: conv1's output (4) that ReLU (4) consumes,
    conv2's (2) and its ReLU's (2); in backward the ReLU's gradient (2), conv2's input gradient (1), the
    pooling's (4) and the first ReLU's (4), while the first ReLU's output is saved. A miss for 4 while a free
    buffer of 2 waits drops it (the new one serves its requests too): three buffers, which the next steps reuse,
    where keeping it made four."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    like = torch.empty(0)

    def step() -> None:
        conv1 = _workspace.take(like, 4, fits=True)
        relu1 = _workspace.take(like, 4, fits=True)
        del conv1
        conv2 = _workspace.take(like, 2, fits=True)
        relu2 = _workspace.take(like, 2, fits=True)
        del conv2
        relu2_grad = _workspace.take(like, 2, fits=True)
        del relu2
        conv2_grad = _workspace.take(like, 1, fits=True)
        del relu2_grad
        pool_grad = _workspace.take(like, 4, fits=True)
        del conv2_grad
        relu1_grad = _workspace.take(like, 4, fits=True)
        del pool_grad, relu1_grad, relu1

    step()
    kept = [id(t) for t in _workspace._pool()]
    assert sorted(t.numel() for t in _workspace._pool()) == [4, 4, 4]
    for _ in range(2):
        step()
        assert sorted(id(t) for t in _workspace._pool()) == sorted(kept), "new buffers where kept ones would do"
    # A free buffer of another dtype serves none of this one's requests: it stays.
    held = [_workspace.take(like, 4, fits=True) for _ in range(3)]
    other = _workspace.take(torch.empty(0, dtype=torch.float64), 1, fits=True)
    del other
    larger = _workspace.take(like, 8, fits=True)
    assert [t.dtype for t in _workspace._pool()].count(torch.float64) == 1
    del held, larger
    _workspace.release()


@pytest.mark.parametrize("factory", ["ReluPoolNet", "CNN-BN-residual"])
def test_training_steps_reuse_the_buffers_kept_in_the_first_ones(calls, factory: str) -> None:
    """Every buffer kept (the convolutions', batch norms', ReLUs' and pooling's results of every size): from the
    third training step on, no step takes a new buffer, and the steps still equal the original models'."""

    def make():
        if factory == "ReluPoolNet":
            return ReluPoolNet("F.relu", POOLS["3-s2-p1"], torch.channels_last, False)
        return zoo.CNN()

    models = [seeded(make, i) for i in range(3)]
    batched = stack([seeded(make, i) for i in range(3)])
    for step in range(5):
        x = _images((3, 4))
        out = batched(x)
        expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
        assert_close(out, expected, msg=f"output, step {step}")
        out.sum().backward()
        expected.sum().backward()
        for name, p in batched.named_parameters():
            assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in models]), msg=f"{name}, step {step}")
        batched.zero_grad(set_to_none=True)
        for m in models:
            m.zero_grad(set_to_none=True)
        if step == 1:
            kept = sorted(id(t) for t in _workspace._pool())
        elif step > 1:
            assert sorted(id(t) for t in _workspace._pool()) == kept, f"step {step} took new buffers"
    assert calls["relu"] > 0
