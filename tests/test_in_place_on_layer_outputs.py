"""In-place ops in a stacked model's own code on its batched layers' outputs (torchvision's and timm's
``nn.ReLU(inplace=True)`` and ``out += identity``): each layer's output folded into a tensor of its own
(``batchlayers._fold._FoldedOwnTensor``) and the in-place ReLU's gradient in kept memory
(``batchlayers.functional._kept.relu_``), against the original models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from convert_harness import compare_gradient_penalty, compare_training, seeded
from harness import assert_close
from torch import Tensor, nn

from batchlayers import _fold, _workspace
from batchlayers.convert import stack
from batchlayers.functional import _kept

RELUS = ["nn.ReLU", "F.relu", "Tensor.relu_", "torch.relu_", "channels-slice"]
ADDS = ["+=", "add_", "+"]
FORMATS = {"contiguous": torch.contiguous_format, "channels-last": torch.channels_last}


def _relu_(h: Tensor, form: str, module: nn.Module) -> Tensor:
    if form == "nn.ReLU":
        return module(h)
    if form == "F.relu":
        return F.relu(h, inplace=True)
    if form == "Tensor.relu_":
        h.relu_()  # (a statement: h itself is read on, not what relu_ returned)
        return h
    if form == "torch.relu_":
        return torch.relu_(h)
    h[:, :2].relu_()  # (a view of the layer's output written in place: its base's history rewritten by torch)
    return h


class Block(nn.Module):
    """A residual block written as torchvision's: conv, batch norm, an in-place ReLU, conv, batch norm, the
    identity added (in place but for "+"), the in-place ReLU again; then a mean and a linear head."""

    def __init__(self, relu: str, add: str, memory_format: torch.memory_format) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 5)
        self.form, self.add, self.memory_format = relu, add, memory_format

    def forward(self, x: Tensor) -> Tensor:
        h = _relu_(self.bn1(self.conv1(x.contiguous(memory_format=self.memory_format))), self.form, self.relu)
        out = self.bn2(self.conv2(h))
        if self.add == "+=":
            out += h
        elif self.add == "add_":
            out.add_(h)
        else:
            out = out + h
        return self.fc(_relu_(out, self.form, self.relu).mean((2, 3)))


def _images(lead) -> Tensor:
    return torch.randn(*lead, 3, 6, 6, dtype=torch.float64)


@pytest.fixture
def taken(monkeypatch):
    """Every output folded into its own tensor and every buffer kept whatever its size; counts both."""
    monkeypatch.setattr(_fold, "OWN_TENSOR_MIN_BYTES", 0)
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    counts = {"own": 0, "relu_": 0}
    fold_apply, kept_relu_ = _fold._FoldedOwnTensor.apply, _kept.relu_

    def own(t):
        counts["own"] += 1
        return fold_apply(t)

    def relu_(x):
        out = kept_relu_(x)
        counts["relu_"] += out is not None
        return out

    monkeypatch.setattr(_fold._FoldedOwnTensor, "apply", own)
    monkeypatch.setattr(_kept, "relu_", relu_)
    yield counts
    _workspace.release()


@pytest.mark.parametrize("relu", RELUS)
@pytest.mark.parametrize("add", ADDS)
@pytest.mark.parametrize("memory_format", list(FORMATS))
@pytest.mark.parametrize("num_models", [1, 3])
def test_matches_the_original_models(taken, relu: str, add: str, memory_format: str, num_models: int) -> None:
    """Two training steps and an eval pass: outputs, parameter gradients and batch norm statistics as the
    original models'."""

    def factory():
        return Block(relu, add, FORMATS[memory_format])

    batched = stack([seeded(factory, i) for i in range(num_models)])
    compare_training(batched, [seeded(factory, i) for i in range(num_models)], _images)
    passes = 3  # (two training steps, the eval pass records gradients too)
    assert taken["own"] == 4 * passes, taken  # conv1, bn1, conv2, bn2 (fc's output holds no images: a view)
    # both ReLUs (on the first batch norm's fold, on the second's or on a sum) but on a slice: torch's relu_
    per_pass = 0 if relu == "channels-slice" else 2
    assert taken["relu_"] == per_pass * passes, taken


class OtherActivations(nn.Module):
    """The convolution's output added in place to the batch norm's, then timm's and torchvision's other in-place
    activations (or ``mul_`` and ``clamp_`` in place)."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)
        self.act = {
            "SiLU": nn.SiLU(inplace=True),
            "Hardswish": nn.Hardswish(inplace=True),
            "ReLU6": nn.ReLU6(inplace=True),
            "LeakyReLU": nn.LeakyReLU(0.1, inplace=True),
            "ELU": nn.ELU(inplace=True),
        }.get(act)
        self.name = act

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        out = self.bn(h)
        out += h
        if self.act is not None:
            out = self.act(out)
        else:
            out.mul_(2).clamp_(-1, 1)
        return self.fc(out.mean((2, 3)))


@pytest.mark.parametrize("act", ["SiLU", "Hardswish", "ReLU6", "LeakyReLU", "ELU", "mul_ clamp_"])
def test_other_writes_in_place(taken, act: str) -> None:
    """Torch's own in-place ops on the batch norm's output (a tensor of its own): as the original models."""

    def factory():
        return OtherActivations(act)

    batched = stack([seeded(factory, i) for i in range(3)])
    compare_training(batched, [seeded(factory, i) for i in range(3)], _images)
    assert taken["own"] == 2 * 3, taken  # (conv, bn; fc's output is a view)


@pytest.mark.parametrize("memory_format", list(FORMATS))
def test_same_results_folded_as_views(monkeypatch, memory_format: str) -> None:
    """Below the size (the default here: these outputs are small) each output folds as a view, as before: the
    same results."""
    calls = []
    monkeypatch.setattr(_fold._FoldedOwnTensor, "apply", lambda t: calls.append(t))

    def factory():
        return Block("nn.ReLU", "+=", FORMATS[memory_format])

    compare_training(stack([seeded(factory, i) for i in range(2)]), [seeded(factory, i) for i in range(2)], _images)
    assert calls == []


def test_gradients_of_gradients(taken) -> None:
    """A penalty on the input gradient, differentiated again (``create_graph=True``), as each original
    model's."""

    def factory():
        return Block("nn.ReLU", "+=", torch.channels_last)

    models = [seeded(factory, i) for i in range(3)]
    compare_gradient_penalty(stack([seeded(factory, i) for i in range(3)]), models, _images((3, 4)))
    assert taken["own"] > 0


class WritesSavedInput(nn.Module):
    """An in-place ReLU on a convolution's output after the next layer took it as its input (out of place with
    ``in_place=False``)."""

    def __init__(self, norm: bool, in_place: bool = True) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.BatchNorm2d(4) if norm else nn.Conv2d(4, 4, 3, padding=1)
        self.in_place = in_place

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        y = self.b(h)
        return y + (h.relu_() if self.in_place else h.relu())


@pytest.mark.parametrize("norm", [False, True], ids=["convolution", "batch norm"])
def test_a_write_into_a_tensor_autograd_saved(taken, norm: bool) -> None:
    """The second convolution saved its input for its weight gradient: the write raises as in the original.
    The batched batch norm saves a copy of its own (the original saves the tensor written, and raises): the
    gradients are those of the models written out of place, which the write does not change."""
    x = torch.randn(2, 4, 3, 6, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        seeded(lambda: WritesSavedInput(norm), 0)(x[0]).sum().backward()
    batched = stack([seeded(lambda: WritesSavedInput(norm), i) for i in range(2)])
    if not norm:
        # (torch's check of the views the batched convolution made of its input, or of its saved tensors)
        with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace operation"):
            batched(x).sum().backward()
        assert taken["own"] == 2, taken
    else:
        out_of_place = [seeded(lambda: WritesSavedInput(norm, in_place=False), i) for i in range(2)]
        compare_training(batched, out_of_place, lambda lead: torch.randn(*lead, 3, 6, 6, dtype=torch.float64))
        assert taken["own"] == 2 * 3, taken


def test_the_fold_shares_the_outputs_version_counter() -> None:
    """A write into the fold is a write into the layer's output for autograd's checks: a tensor saved for
    backward (here ``exp``'s result) is found modified."""
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = x.exp()
    folded = _fold._FoldedOwnTensor.apply(y)
    assert folded._base is None and folded.shape == (6, 4)
    assert folded.data_ptr() == y.data_ptr()
    folded.mul_(2)
    assert y._version == folded._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("where", ["layer hook", "global hook"])
def test_a_hook_holding_the_output_sees_it_as_in_the_original(taken, where: str) -> None:
    """A forward hook keeps the first batch norm's output (a global hook sees the batched layer's own
    ``(M, B, *)`` tensor), the ReLU writes into it in place, and the loss reads the kept tensor again: torch
    rewrites the kept tensor's history with the write, so its gradient is the original models'. A layer with a
    hook, and every layer under a global hook, is folded as a view."""
    kept: list[Tensor] = []

    def keep(module, args, out):
        if not kept and type(module).__name__ in ("BatchNorm2d", "BatchedBatchNorm2d"):
            kept.append(out)

    def factory():
        return Block("nn.ReLU", "+", torch.contiguous_format)

    models = [seeded(factory, i) for i in range(2)]
    batched = stack([seeded(factory, i) for i in range(2)])
    x = _images((2, 4))
    handles = []
    if where == "global hook":
        handles.append(nn.modules.module.register_module_forward_hook(keep))
    try:
        for i, m in enumerate(models):
            if where == "layer hook":
                handles.append(m.bn1.register_forward_hook(keep))
            (m(x[i]).sum() + kept.pop().sum()).backward()
        if where == "layer hook":
            handles.append(batched.bn1.register_forward_hook(keep))
        (batched(x).sum() + kept.pop().sum()).backward()
    finally:
        for h in handles:
            h.remove()
    for name, p in batched.named_parameters():
        expected = torch.stack([m.get_parameter(name).grad for m in models])
        torch.testing.assert_close(p.grad, expected, msg=f"gradient of {name}")
    assert taken["own"] == {"layer hook": 3, "global hook": 0}[where], taken


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_without_gradients_folded_as_views(taken, mode) -> None:
    def factory():
        return Block("nn.ReLU", "+=", torch.channels_last)

    models = [seeded(factory, i) for i in range(2)]
    batched = stack([seeded(factory, i) for i in range(2)])
    x = _images((2, 4))
    with mode():
        torch.testing.assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))
    assert taken == {"own": 0, "relu_": 0}, taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("memory_format", list(FORMATS))
def test_kept_in_place_relu_bit_equal_to_torch(taken, dtype, memory_format: str) -> None:
    """The same numbers as ``torch.relu_``, forward and backward, twice (the second gradient into the first's
    buffer), zeros included; the result is the input itself, written."""
    base = torch.randn(6, 4, 5, 5, dtype=dtype).round(decimals=1).contiguous(memory_format=FORMATS[memory_format])
    for _ in range(2):
        leaf, ref_leaf = base.clone().requires_grad_(), base.clone().requires_grad_()
        x, ref = leaf * 1, ref_leaf * 1
        y = _kept.relu_(x)
        expected = torch.relu_(ref)
        assert y is x and torch.equal(y, expected) and y._version == expected._version
        g = torch.randn_like(expected)
        y.backward(g)
        expected.backward(g)
        assert torch.equal(leaf.grad, ref_leaf.grad) and leaf.grad.stride() == ref_leaf.grad.stride()
    assert taken["relu_"] == 2


def test_kept_in_place_relu_left_to_torch(taken) -> None:
    """A leaf (torch raises), a view (torch rewrites its base's history), no gradient recorded, a strided
    tensor: None, and the caller makes torch's call."""
    leaf = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    x = leaf * 1
    assert _kept.relu_(leaf) is None
    assert _kept.relu_(x[0]) is None and _kept.relu_(x[..., ::2]) is None
    assert _kept.relu_(x.detach()) is None
    with torch.no_grad():
        assert _kept.relu_(x) is None
    assert x._version == 0 and taken["relu_"] == 0


TRANSFORMERS_CNNS = {
    # (transformers' ResNet adds its residual in place: hidden_state += residual)
    "resnet": lambda tf: tf.ResNetModel(tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
    "regnet": lambda tf: tf.RegNetModel(
        tf.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4)
    ),
    "convnext": lambda tf: tf.ConvNextModel(tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
    # (not MobileNet: at this size its training gradients are ill-conditioned, V2's original's stem gradient
    # moving 3e-7 of 3e5 when the input moves by 1e-15)
}


@pytest.mark.parametrize("name", list(TRANSFORMERS_CNNS))
def test_transformers_cnns(taken, name: str) -> None:
    """Code nobody here wrote, every image output folded into a tensor of its own: outputs and parameter
    gradients in training mode as the original models' (float64)."""
    tf = pytest.importorskip("transformers")

    def factory():
        return TRANSFORMERS_CNNS[name](tf).train()

    models = [seeded(factory, i) for i in range(2)]
    batched = stack([seeded(factory, i) for i in range(2)])
    x = torch.randn(2, 3, 3, 32, 32, dtype=torch.float64)
    out = batched(pixel_values=x).last_hidden_state
    expected = [m(pixel_values=x[i]).last_hidden_state for i, m in enumerate(models)]
    assert_close(out, torch.stack(expected), msg="output")
    g = torch.randn_like(out)
    (out * g).sum().backward()
    for i, e in enumerate(expected):
        (e * g[i]).sum().backward()
    for n, p in batched.named_parameters():
        own = [m.get_parameter(n).grad for m in models]
        if own[0] is None:  # (a parameter the output does not use: the pooler's)
            assert p.grad is None or not p.grad.any(), n
            continue
        assert_close(p.grad, torch.stack(own), msg=f"gradient of {n}")
    assert taken["own"] > 0, taken
