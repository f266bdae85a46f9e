"""Every way a conversion can go wrong raises a clear error; none gives a silently wrong result."""

from __future__ import annotations

import models as zoo
import pytest
import torch
from convert_harness import seeded
from harness import assert_close
from torch import nn

from batchlayers import _fold, convert, registry
from batchlayers.convert import stack
from batchlayers.registry import isinstance_torch, register


class _Scale(nn.Module):
    """A user leaf with a parameter: multiplies features by a learned vector."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.scale


class _BatchedScale(nn.Module):
    torch_module = _Scale

    def __init__(self, num_models: int, features: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_models = num_models
        self.features = features
        self.scale = nn.Parameter(torch.ones(num_models, features, device=device, dtype=dtype))

    def forward(self, x):  # (M, B, *, features)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.features,)
        return x * self.scale.view(shape)


class _ScaleBuffer(nn.Module):
    """A user leaf like _Scale whose scale is a fixed buffer, not a parameter."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features
        self.register_buffer("scale", torch.randn(features))

    def forward(self, x):
        return x * self.scale


class _BatchedScaleBuffer(_BatchedScale):
    """A counterpart of _Scale that registers the scale as a buffer."""

    def __init__(self, num_models: int, features: int, device=None, dtype=None) -> None:
        super().__init__(num_models, features, device, dtype)
        scale = self.scale.detach()
        del self.scale
        self.register_buffer("scale", scale)


class _WithScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = _Scale(3)

    def forward(self, x):
        return self.scale(self.fc(x))


class _RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.offset = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.fc(x) + self.offset


class _MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.fixture
def restore_registry():
    """Restore the converter's registry after a test registers its own types."""
    registry.load_builtins()
    by_torch, by_batched = dict(registry._BY_TORCH), dict(registry._BY_BATCHED)
    yield
    registry._BY_TORCH.clear()
    registry._BY_TORCH.update(by_torch)
    registry._BY_BATCHED.clear()
    registry._BY_BATCHED.update(by_batched)


def test_every_batchlayers_layer_is_registered() -> None:
    registry.load_builtins()
    expected = [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d]
    expected += [nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Embedding]
    for torch_type in expected:
        batched_type = registry.counterpart_of(torch_type).batched_type
        assert batched_type.torch_module is torch_type and batched_type.__module__.startswith("batchlayers.")


def test_empty_list() -> None:
    with pytest.raises(ValueError, match="stack: got an empty list of models"):
        stack([])
    with pytest.raises(TypeError, match="expected a list of models"):
        stack(zoo.MLP())


def test_different_classes() -> None:
    with pytest.raises(TypeError, match="model 1 is a CNN, model 0 a MLP"):
        stack([zoo.MLP(), zoo.CNN()])


def test_different_shapes_name_the_first_key_and_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"'fc1.weight' has shape \(9, 6\) in model 2 but \(8, 6\) in model 0"):
        stack([zoo.MLP(), zoo.MLP(), zoo.MLP(hidden=9)])


def test_different_configuration() -> None:
    a, b = zoo.DepthwiseNet(), zoo.DepthwiseNet()
    b.features[6].stride = (1, 1)  # same weight shapes, different computation
    with pytest.raises(ValueError, match=r"'features.6' is configured differently in model 1.*'stride'"):
        stack([a, b])
    with pytest.raises(ValueError, match="the model itself is configured differently in model 1.*'config'"):
        stack([zoo.GPT(), zoo.GPT(zoo.GPTConfig(position_indices="T"))])
    c = zoo.CNN()
    c.layer1[0].shortcut = nn.Sequential(nn.Identity())
    with pytest.raises(TypeError, match="different module structure.*layer1.0.shortcut.0"):
        stack([zoo.CNN(), c])


def test_a_cache_with_an_autograd_history_is_named() -> None:
    """timm's EfficientFormer caches its attention biases in a dict on the first eval-mode forward; run with
    gradients enabled, the cached tensor has a history and deepcopy cannot copy it."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.biases = nn.Parameter(torch.ones(4))
            self.bias_cache: dict[str, torch.Tensor] = {}

        def forward(self, x):
            if "all" not in self.bias_cache:
                self.bias_cache["all"] = self.biases * 2
            return self.fc(x) + self.bias_cache["all"]

    models = [seeded(lambda: nn.Sequential(Cached()), 0) for _ in range(2)]
    for m in models:
        m(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"stack: '0.bias_cache' of the models holds a tensor computed with gradients"):
        stack(models)


class _PackedLSTM(nn.Module):
    """An LSTM over variable-length sequences, packed: pack_padded_sequence sorts the batch by length."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.rnn = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}[mode](2, 3, batch_first=True)

    def forward(self, x):
        lengths = (x[:, 0] > 0).long().cpu() + 1
        packed = nn.utils.rnn.pack_padded_sequence(x.view(-1, 2, 2), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=2)[0].flatten(1)


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_packed_sequences_are_refused_pointing_to_model_by_model(mode: str) -> None:
    models = [seeded(lambda: _PackedLSTM(mode), i) for i in range(3)]
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"PackedSequence.*execution='model_by_model'"):
        stack(models)(x)
    by_model = stack(models, execution="model_by_model")
    assert_close(by_model(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="model by model")


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(3)
        self.norm = nn.LazyBatchNorm1d()

    def forward(self, x):
        return self.norm(self.fc(x))


def test_lazy_modules_are_stacked_once_materialised() -> None:
    models = [seeded(_Lazy, i) for i in range(2)]
    with pytest.raises(ValueError, match=r"stack: 'fc.weight' of model 0 is an uninitialized parameter.*call each"):
        stack(models)
    with pytest.raises(ValueError, match=r"replicate: 'fc.weight' of model 0 is an uninitialized parameter"):
        convert.replicate(_Lazy, 2)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    for i, m in enumerate(models):
        m(x[i])  # (torch materialises the parameters and makes each a Linear and a BatchNorm1d)
    stacked = stack(models)
    assert_close(stacked(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="materialised")


def test_mixed_dtypes_and_devices() -> None:
    with pytest.raises(ValueError, match=r"'fc1.weight' is torch.float64 on cpu in model 1 but torch.float32"):
        stack([zoo.MLP(), zoo.MLP().double()])
    with pytest.raises(ValueError, match=r"'fc1.weight' is torch.float32 on meta in model 1 but .* on cpu"):
        stack([zoo.MLP(), zoo.MLP().to("meta")])


def test_train_eval_modes_differ() -> None:
    with pytest.raises(ValueError, match="'bn1' is in eval mode in model 1 but in train mode in model 0"):
        b = zoo.CNN()
        b.bn1.eval()
        stack([zoo.CNN(), b])


def test_requires_grad_differs() -> None:
    b = zoo.MLP()
    b.fc1.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="'fc1.weight' has requires_grad=False in model 1"):
        stack([zoo.MLP(), b])


@pytest.mark.parametrize(
    "factory",
    [_WithScale, lambda: nn.Sequential(_MyLinear(3, 2)), _RawParameter],
    ids=["unregistered leaf", "subclass of a torch layer", "parameter used in forward"],
)
def test_modules_without_a_counterpart_run_their_own_code_per_model(factory) -> None:
    """No batched counterpart: the module keeps its forward and runs it on per-model parameters, exactly."""
    models = [seeded(factory, i) for i in range(3)]
    batched = stack(models)
    features = 3 if factory not in (_WithScale, _RawParameter) else 4
    x = torch.randn(3, 2, features, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="output")
    assert not any(_fold.is_swapped_leaf(m) for m in batched.modules() if type(m) in (_Scale, _MyLinear))


def test_register_a_user_leaf(restore_registry) -> None:
    register(_Scale, _BatchedScale)
    models = [seeded(_WithScale, i) for i in range(3)]
    batched = stack(models)
    assert isinstance(batched.scale, _BatchedScale) and batched.scale.scale.shape == (3, 3)
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="output")
    back = convert.unstack(batched)
    assert type(back[2].scale) is _Scale and torch.equal(back[2].scale.scale, models[2].scale.scale)


def test_register_checks_the_counterpart(restore_registry) -> None:
    class WrongNames(_BatchedScale):
        def __init__(self, num_models, features, device=None, dtype=None):
            super().__init__(num_models, features, device, dtype)
            self.register_buffer("extra", torch.zeros(num_models))

    register(_Scale, WrongNames)
    with pytest.raises(TypeError, match=r"WrongNames has parameters/buffers \['extra', 'scale'\]"):
        stack([_WithScale()])
    with pytest.raises(TypeError, match="must be an nn.Module subclass"):
        register(_Scale, object)


@pytest.mark.parametrize(
    "torch_type, batched_type",
    [(_Scale, _BatchedScaleBuffer), (_ScaleBuffer, _BatchedScale)],
    ids=["parameter registered as a buffer", "buffer registered as a parameter"],
)
def test_register_checks_the_kind_of_each_tensor(restore_registry, torch_type, batched_type) -> None:
    """A counterpart holding a parameter of the torch layer as a buffer (never trained) or the reverse is refused,
    naming the module, the tensor and both kinds, on the way to the batched layer and back."""
    register(torch_type, batched_type)
    kinds = {True: "a parameter", False: "a buffer"}
    torch_kind = kinds[isinstance(torch_type(3).scale, nn.Parameter)]
    batched_kind = kinds[isinstance(batched_type(2, 3).scale, nn.Parameter)]
    with pytest.raises(TypeError) as info:
        stack([nn.Sequential(nn.Linear(4, 3), torch_type(3)) for _ in range(2)])
    expected = (
        "stack",
        "'1'",
        f"'scale' is {torch_kind} of {torch_type.__name__}",
        f"{batched_kind} of {batched_type.__name__}",
    )
    assert all(words in str(info.value) for words in expected), str(info.value)
    with pytest.raises(TypeError) as info:
        convert.unstack(batched_type(2, 3))
    expected = (
        "unstack",
        f"'scale' is {batched_kind} of {batched_type.__name__}",
        f"{torch_kind} of {torch_type.__name__}",
    )
    assert all(words in str(info.value) for words in expected), str(info.value)


def test_forward_hooks_run_on_one_models_view() -> None:
    """A torch layer with a forward hook keeps its own code (the hook belongs to it) and runs per model."""

    def factory():
        model = zoo.MLP()
        model.fc2.register_forward_hook(lambda m, a, o: o * 2 + m.bias)
        return model

    models = [seeded(factory, i) for i in range(3)]
    batched = stack(models)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="output")


@pytest.mark.parametrize(
    "register_hook, kind",
    [
        (lambda m: m.register_full_backward_pre_hook(lambda m, g: g), "backward"),
        (lambda m: m.register_full_backward_hook(lambda m, gi, go: gi), "backward"),
        (lambda m: m.register_state_dict_post_hook(lambda m, sd, prefix, meta: None), "state-dict"),
        (lambda m: m.register_load_state_dict_post_hook(lambda m, keys: None), "load-state-dict"),
    ],
    ids=["backward-pre", "backward", "state-dict", "load-state-dict"],
)
def test_hooks_outside_forward_are_refused_all_at_once(register_hook, kind) -> None:
    """A hook that would see every model's tensors at once is refused, never run on them; every offending
    module is named in one error."""
    model = zoo.MLP()
    register_hook(model.fc2)
    register_hook(model)
    with pytest.raises(TypeError, match=rf"(?s)- the model itself \(MLP\) has {kind} hooks.*- 'fc2' \(Linear\)"):
        stack([model])


def test_buffer_that_differs_between_models_is_stored_per_model() -> None:
    a, b = seeded(zoo.GPT, 0), seeded(zoo.GPT, 1)
    b.transformer.h[1].attn.bias.fill_(1.0)  # a causal mask, lifted in one model only
    batched = stack([a, b])
    assert batched.transformer.h[1].attn.bias.shape[0] == 2
    assert batched.transformer.h[0].attn.bias.shape == a.transformer.h[0].attn.bias.shape  # equal: shared
    idx = torch.randint(0, 11, (2, 3, 8))
    assert_close(batched(idx).logits, torch.stack([a(idx[0]).logits, b(idx[1]).logits]), msg="logits")
    # replicate fills model by model: the buffer equal so far is stored per model when model 1's differs
    models = iter([a, b])
    replicated = convert.replicate(lambda: next(models), 2)
    assert replicated.transformer.h[1].attn.bias.shape[0] == 2
    assert_close(replicated(idx).logits, torch.stack([a(idx[0]).logits, b(idx[1]).logits]), msg="replicated")


def test_bad_inputs_to_the_stacked_model() -> None:
    batched = stack([zoo.MLP(), zoo.MLP()])
    with pytest.raises(
        ValueError, match=r"stacked MLP: expected every tensor input shaped \(M, B, \*\) with M=2.*\(3, 5, 6\)"
    ):
        batched(torch.randn(3, 5, 6))
    with pytest.raises(ValueError, match="with M=2, but args\\[0\\] has shape \\(2,\\)"):
        batched(torch.randn(2))
    with pytest.raises(ValueError, match="needs at least one tensor input"):
        batched(None)
    gpt = stack([zoo.GPT(), zoo.GPT()])
    # Inputs may hold different numbers of samples (CLIP's texts and images); where the model's own code needs
    # them equal, the error is the one the original model gives, or a clearer one.
    with pytest.raises(ValueError, match=r"expected target class indices of shape \(2, 24\), got \(2, 32\)"):
        gpt(torch.zeros(2, 3, 8, dtype=torch.long), targets=torch.zeros(2, 4, 8, dtype=torch.long))
    # After a refused call the stacked model still works.
    assert batched(torch.randn(2, 5, 6)).shape == (2, 5, 3)


def test_isinstance_torch_knows_a_registered_counterpart(restore_registry) -> None:
    class BatchedScaleWithoutAttribute(_BatchedScale):
        torch_module = None  # register(...) alone says what it stands for

    register(_Scale, BatchedScaleWithoutAttribute)
    batched = stack([_WithScale(), _WithScale()])
    assert isinstance_torch(batched.scale, _Scale) and not isinstance_torch(batched.scale, nn.Linear)
    assert isinstance_torch(batched.fc, nn.Linear)
