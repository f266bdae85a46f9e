"""stack/unstack on real-world architectures, against the N original models."""

from __future__ import annotations

import copy
import pickle

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from convert_harness import assert_unchanged, compare_gradient_penalty, compare_training, seeded, snapshot
from harness import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchlayers import backends
from batchlayers.convert import shared_buffers, stack, unstack
from batchlayers.linear import BatchedLinear
from batchlayers.registry import isinstance_torch


def _images(lead, dtype=torch.float64):
    return torch.randn(*lead, 3, 8, 8, dtype=dtype)


ARCHITECTURES = {
    "MLP": (zoo.MLP, lambda lead: torch.randn(*lead, 6, dtype=torch.float64)),
    "CNN-BN-residual": (zoo.CNN, _images),
    "SE": (zoo.SENet, _images),
    "depthwise-grouped": (zoo.DepthwiseNet, _images),
    "GroupNorm": (zoo.GroupNormNet, _images),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("num_models", [1, 3])
def test_matches_original_models(arch: str, num_models: int, kept: bool) -> None:
    factory, make_input = ARCHITECTURES[arch]
    models = [seeded(factory, i) for i in range(num_models)]
    references = [seeded(factory, i) for i in range(num_models)]
    before = [snapshot(m) for m in models]
    batched = stack(models)
    assert type(batched) is factory
    compare_training(batched, references, make_input)
    for m, b in zip(models, before):
        assert_unchanged(m, b)


@pytest.mark.parametrize("arch", ["MLP", "CNN-BN-residual"])
def test_shared_input(arch: str) -> None:
    factory, make_input = ARCHITECTURES[arch]
    batched = stack([seeded(factory, i) for i in range(3)])
    compare_training(batched, [seeded(factory, i) for i in range(3)], make_input, shared=True)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_unstack_of_stack_is_the_originals(arch: str) -> None:
    factory, make_input = ARCHITECTURES[arch]
    models = [seeded(factory, i).eval() for i in range(3)]
    back = unstack(stack(models))
    x = make_input((2,))
    for original, restored in zip(models, back):
        assert type(restored) is type(original)
        assert list(restored.state_dict()) == list(original.state_dict())
        for (k, v), w in zip(original.state_dict().items(), restored.state_dict().values()):
            assert torch.equal(v, w) and v.dtype == w.dtype and v.device == w.device, k
        modes = [(n, m.training) for n, m in original.named_modules()]
        assert [(n, m.training) for n, m in restored.named_modules()] == modes
        assert_close(restored(x), original(x), msg="output of the unstacked model")


def test_unstack_carries_training_state() -> None:
    """Trained weights, BatchNorm statistics, requires_grad and the mode come back; nothing is shared."""
    models = [seeded(zoo.CNN, i) for i in range(2)]
    for m in models:
        m.conv1.weight.requires_grad_(False)
    batched = stack(models)
    batched(_images((2, 4))).sum().backward()
    with torch.no_grad():
        for p in batched.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    batched.eval()
    back = unstack(batched)
    state = batched.state_dict()
    for i, model in enumerate(back):
        assert not model.training and not model.bn1.training
        assert not model.conv1.weight.requires_grad and model.linear.weight.requires_grad
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k][i]), k
        assert model.bn1.running_mean.data_ptr() != state["bn1.running_mean"].data_ptr()
        assert model.bn1.num_batches_tracked.item() == 1
    # The current dtype (and device) come back, not the original models' ones.
    back = unstack(batched.float())
    assert all(p.dtype == torch.float32 for m in back for p in m.parameters())
    assert back[0].bn1.num_batches_tracked.dtype == torch.long


def test_state_dict_keys_are_the_architectures() -> None:
    models = [seeded(zoo.CNN, i) for i in range(3)]
    batched = stack(models)
    ref = models[0].state_dict()
    state = batched.state_dict()
    assert list(state) == list(ref)
    for k, v in ref.items():
        assert state[k].shape == (3, *v.shape), k
    assert batched.num_models == 3


def test_deepcopy_pickle_and_load_state_dict() -> None:
    batched = stack([seeded(zoo.CNN, i) for i in range(3)])
    x = _images((3, 2))
    batched.eval()
    for clone in (copy.deepcopy(batched), pickle.loads(pickle.dumps(batched))):
        assert_close(clone(x), batched(x), msg="copy")
        assert clone.conv1.weight.data_ptr() != batched.conv1.weight.data_ptr()
    other = stack([seeded(zoo.CNN, i) for i in range(10, 13)]).eval()
    other.load_state_dict(batched.state_dict())
    assert_close(other(x), batched(x), msg="after load_state_dict")


def test_stacking_a_single_layer_gives_the_batched_layer() -> None:
    layers = [nn.Linear(4, 3).double() for _ in range(3)]
    batched = stack(layers)
    assert type(batched) is BatchedLinear
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(layers)]), msg="output")
    back = unstack(batched)
    assert all(type(m) is nn.Linear and torch.equal(m.weight, o.weight) for m, o in zip(back, layers))


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.a = nn.Linear(5, 2)
        self.b = nn.Linear(5, 3)

    def forward(self, x, *, scale=1.0):
        h = torch.tanh(self.body(x)) * scale
        return {"a": self.a(h), "pair": (self.b(h), [h]), "none": None, "n": 3, "mean": h.mean()}


def test_structured_outputs_keep_their_structure() -> None:
    models = [seeded(_Heads, i) for i in range(3)]
    batched = stack(models)
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    out = batched(x, scale=2.0)
    assert set(out) == {"a", "pair", "none", "n", "mean"} and out["none"] is None and out["n"] == 3
    refs = [m(x[i], scale=2.0) for i, m in enumerate(models)]
    assert_close(out["a"], torch.stack([r["a"] for r in refs]), msg="dict entry")
    assert isinstance(out["pair"], tuple) and isinstance(out["pair"][1], list)
    assert_close(out["pair"][0], torch.stack([r["pair"][0] for r in refs]), msg="tuple entry")
    assert_close(out["pair"][1][0], torch.stack([r["pair"][1][0] for r in refs]), msg="list entry")
    # A 0-dim output reduced over the samples inside forward: each model's own, (M,).
    assert_close(out["mean"], torch.stack([r["mean"] for r in refs]), msg="0-dim output")


# ------------------------------------------------------------------------------------------------------
# GPT-style transformers


@pytest.mark.parametrize("positions", ["1T", "T"])
@pytest.mark.parametrize("num_models", [1, 3])
def test_gpt_matches_original_models(positions: str, num_models: int) -> None:
    def factory():
        return zoo.GPT(zoo.GPTConfig(position_indices=positions))

    models = [seeded(factory, i) for i in range(num_models)]
    before = [snapshot(m) for m in models]
    batched = stack(models)
    compare_training(
        batched,
        [seeded(factory, i) for i in range(num_models)],
        lambda lead: torch.randint(0, 11, (*lead, 8)),
        logits=lambda out: out.logits,
    )
    for m, b in zip(models, before):  # also: the stored lambda no longer calls the originals' modules
        assert_unchanged(m, b)


def test_gpt_ties_output_projection_to_token_embedding() -> None:
    models = [seeded(zoo.GPT, i) for i in range(3)]
    batched = stack(models)
    assert batched.lm_head.weight is batched.transformer.wte.weight
    names = [n for n, _ in batched.named_parameters()]
    assert "lm_head.weight" not in names and names.count("transformer.wte.weight") == 1
    back = unstack(batched)
    assert all(m.lm_head.weight is m.transformer.wte.weight for m in back)
    assert back[0].lm_head.weight is not back[1].lm_head.weight


def test_gpt_lambda_is_rebound_to_the_stacked_modules() -> None:
    models = [seeded(zoo.GPT, i) for i in range(2)]
    batched = stack(models)
    block, original = batched.transformer.h[0], models[0].transformer.h[0]
    assert block.mlpf is not original.mlpf
    assert block.mlpf.__closure__[0].cell_contents is block.mlp
    assert original.mlpf.__closure__[0].cell_contents is original.mlp  # the original is untouched
    back = unstack(batched)
    assert back[1].transformer.h[0].mlpf.__closure__[0].cell_contents is back[1].transformer.h[0].mlp


class _PlainContainers(nn.Module):
    """Layers and a parameter also held in a plain list and dict, which nn.Module does not register."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 3)
        self.layers = [self.fc1, nn.Tanh(), self.fc2]
        self.named = {"scale": self.fc2.bias}

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.named["scale"]


def test_layers_held_in_plain_lists_and_dicts_are_the_stacked_ones() -> None:
    """Such a list in the copy held the first model's own layers (and tensors): every model computed with
    model 0's weights (0.9 off, no error) and training changed the user's model 0."""
    models = [seeded(_PlainContainers, i) for i in range(3)]
    before = [snapshot(m) for m in models]
    batched = stack(models)
    assert batched.layers[0] is batched.fc1 and batched.layers[2] is batched.fc2
    assert batched.named["scale"] is batched.fc2.bias
    references = [seeded(_PlainContainers, i) for i in range(3)]
    compare_training(batched, references, lambda lead: torch.randn(*lead, 4, dtype=torch.float64))
    for m, b in zip(models, before):
        assert_unchanged(m, b)
    back = unstack(batched)
    assert back[1].layers[0] is back[1].fc1 and back[1].named["scale"] is back[1].fc2.bias


def test_gpt_causal_mask_is_one_shared_buffer() -> None:
    models = [seeded(zoo.GPT, i) for i in range(3)]
    batched = stack(models)
    mask = batched.transformer.h[0].attn.bias
    assert shared_buffers(batched) == ["transformer.h.0.attn.bias", "transformer.h.1.attn.bias"]
    assert mask.shape == (1, 1, 8, 8)  # the forward slices it as the architecture's own code expects
    state = batched.state_dict()
    assert state["transformer.h.0.attn.bias"].shape == (3, 1, 1, 8, 8)  # saved like every other entry
    assert state["transformer.h.0.attn.bias"].stride(0) == 0
    other = stack([seeded(zoo.GPT, i) for i in range(5, 8)])
    other.load_state_dict(state)
    assert torch.equal(other.transformer.h[0].attn.bias, mask)
    # A state dict whose entry differs per model (each original loads its own): stored per model from then on
    differing = {k: v.clone() for k, v in state.items()}
    differing["transformer.h.0.attn.bias"][1].tril_(-1)
    other.load_state_dict(differing)
    assert shared_buffers(other) == ["transformer.h.1.attn.bias"]
    assert torch.equal(other.state_dict()["transformer.h.0.attn.bias"], differing["transformer.h.0.attn.bias"])


def test_gpt_loss_in_forward_is_each_models_own() -> None:
    """The loss computed in forward is (M,), each model's own (nanoGPT's ignore_index=-1 included);
    ``.sum().backward()`` gives each model exactly its own gradient."""
    models = [seeded(zoo.GPT, i) for i in range(3)]
    references = [seeded(zoo.GPT, i) for i in range(3)]
    batched = stack(models)
    idx = torch.randint(0, 11, (3, 4, 8))
    targets = torch.randint(0, 11, (3, 4, 8))
    targets[0, :2] = -1
    out = batched(idx, targets=targets)
    ref_losses = torch.stack([r(idx[i], targets[i]).loss for i, r in enumerate(references)])
    assert_close(out.loss, ref_losses, msg="loss")
    out.loss.sum().backward()
    ref_losses.sum().backward()
    for name, p in batched.named_parameters():
        ref = torch.stack([dict(r.named_parameters())[name].grad for r in references])
        assert_close(p.grad, ref, msg=f"gradient of {name}")


@pytest.mark.parametrize("batch", [4, 3], ids=["T == M*B", "T != M*B"])
def test_gpt_positions_as_long_as_the_folded_batch_are_exact(batch: int) -> None:
    """nanoGPT's ``arange(T)`` positions, also where T == M*B (8 = 2 * 4): made from T, not from the read
    batch size, so they are one sequence shared by every sample, as in each original model."""
    factory = lambda: zoo.GPT(zoo.GPTConfig(position_indices="T"))  # noqa: E731
    make_input = lambda lead: torch.randint(0, 11, (*lead, 8))  # noqa: E731
    compare_training(stack([seeded(factory, i) for i in range(2)]), [seeded(factory, i) for i in range(2)],
                     make_input, batch=batch, logits=lambda out: out.logits)  # fmt: skip


# Dynamo itself reads .grad of the output dataclass's tensors while tracing the root's output hook.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_torch_compile_with_a_loss_in_forward() -> None:
    """A loss in forward reduces over the samples into per-model values, whose sizes torch.compile would read
    as (M,): that part runs eagerly, exact. (The GPT without targets compiles into one graph, trained against
    the original models in test_compile.py.)"""
    models = [seeded(zoo.GPT, i) for i in range(2)]
    batched = stack(models)
    compiled = torch.compile(batched, backend="aot_eager")
    idx, labels = torch.randint(0, 11, (2, 3, 8)), torch.randint(0, 11, (2, 3, 8))
    try:
        out = compiled(idx, targets=labels)
        out.loss.sum().backward()
        grads = {n: p.grad.clone() for n, p in batched.named_parameters()}
        batched.zero_grad()
        expected = batched(idx, targets=labels)
        expected.loss.sum().backward()
    finally:
        torch._dynamo.reset()
    assert_close(out.logits, expected.logits, msg="compiled logits")
    assert_close(out.loss, expected.loss, msg="compiled losses")
    for n, p in batched.named_parameters():
        assert_close(grads[n], p.grad, msg=f"compiled gradient of {n}")


def test_batch_norm_without_parameters_is_batched_too() -> None:
    """BatchNorm without affine parameters or running stats still mixes a batch's samples: it is swapped."""

    def factory():
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=False))

    batched = stack([seeded(factory, i) for i in range(3)])
    compare_training(
        batched, [seeded(factory, i) for i in range(3)], lambda lead: torch.randn(*lead, 3, dtype=torch.float64)
    )


# ------------------------------------------------------------------------------------------------------
# isinstance: batched layers do not subclass torch.nn layers


def test_isinstance_sees_batched_layers_as_not_torch_layers() -> None:
    batched = stack([seeded(zoo.GPT, i) for i in range(2)])
    assert not isinstance(batched.lm_head, nn.Linear)
    assert isinstance_torch(batched.lm_head, nn.Linear)
    assert isinstance_torch(batched.transformer.wte, (nn.Linear, nn.Embedding))
    assert isinstance_torch(batched.transformer.drop, nn.Dropout)
    assert not isinstance_torch(batched.transformer.ln_f, nn.Linear)

    # An init function keyed on isinstance(m, nn.Linear) does not touch (and cannot corrupt) stacked weights.
    before = snapshot(batched)
    batched.apply(batched._init_weights)
    for k, v in batched.state_dict().items():
        assert torch.equal(v, before[k]), k

    # minGPT's optimizer-group builder, written with isinstance_torch, sorts every parameter.
    decay, no_decay = set(), set()
    for mn, m in batched.named_modules():
        for pn, _ in m.named_parameters(recurse=False):
            full = f"{mn}.{pn}" if mn else pn
            if pn.endswith("bias"):
                no_decay.add(full)
            elif pn.endswith("weight") and isinstance_torch(m, nn.Linear):
                decay.add(full)
            elif pn.endswith("weight") and isinstance_torch(m, (nn.LayerNorm, nn.Embedding)):
                no_decay.add(full)
    params = {n for n, _ in batched.named_parameters(remove_duplicate=False)}
    assert (decay | no_decay) == params and "transformer.h.0.attn.c_attn.weight" in decay


# ------------------------------------------------------------------------------------------------------
# Property test


@settings(max_examples=20, deadline=None)
@given(
    num_models=st.integers(1, 4),
    batch=st.integers(1, 3),
    sizes=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    shared=st.booleans(),
    bias=st.booleans(),
)
def test_property_random_mlps(num_models, batch, sizes, shared, bias) -> None:
    def factory():
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b, bias=bias), nn.Tanh()]
        return nn.Sequential(*layers, nn.LayerNorm(sizes[-1]))

    batched = stack([seeded(factory, i) for i in range(num_models)])
    compare_training(
        batched,
        [seeded(factory, i) for i in range(num_models)],
        lambda lead: torch.randn(*lead, sizes[0], dtype=torch.float64),
        shared=shared,
        batch=batch,
        steps=1,
    )


def test_functional_losses_outside_forward() -> None:
    """Per-model losses from the (M, B, *) outputs, summed: each model gets exactly its own gradient."""
    models = [seeded(zoo.MLP, i) for i in range(3)]
    references = [seeded(zoo.MLP, i) for i in range(3)]
    batched = stack(models)
    x, y = torch.randn(3, 5, 6, dtype=torch.float64), torch.randint(0, 3, (3, 5))
    out = batched(x)
    losses = F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)
    losses.sum().backward()
    for i, r in enumerate(references):
        F.cross_entropy(r(x[i]), y[i]).backward()
    assert_close(batched.fc1.weight.grad, torch.stack([r.fc1.weight.grad for r in references]), msg="grad")


class _KeywordCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.emb = nn.Embedding(5, 3)

    def forward(self, x):
        positions = torch.arange(x.size(1))  # (T,): no batch dimension
        return self.fc(input=x) + self.emb(input=positions)


def test_batched_layers_called_with_keywords() -> None:
    models = [seeded(_KeywordCall, i) for i in range(3)]
    batched = stack(models)
    x = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="output")


class _FlattenByView(nn.Module):
    """conv -> (BatchNorm) -> ReLU -> ``.view(B, -1)`` -> Linear, optionally writing in place into the view or
    into its source afterwards (an alias in the original: the write reaches both)."""

    def __init__(self, norm: bool, write: str | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4) if norm else nn.Identity()
        self.fc = nn.Linear(4 * 5 * 5, 2)
        self.write = write

    def forward(self, x):
        h = torch.relu(self.norm(self.conv(x)))
        y = h.view(h.size(0), -1)
        if self.write == "view":
            y.mul_(2)
        elif self.write == "source":
            h[:, 0] = 0
        return self.fc(y) + h.mean()


@pytest.mark.parametrize("strategy", ["loop", "loop_channels_last", "grouped", "grouped_channels_last"])
@pytest.mark.parametrize("norm", [False, True], ids=["conv", "conv-bn"])
def test_view_of_a_layer_output_in_any_memory_format(strategy: str, norm: bool) -> None:
    """Batched layers keep the memory format they compute in (channels-last stays channels-last); a
    ``.view`` that torch.nn's contiguous outputs allow works on them too, exactly."""
    references = [seeded(lambda: _FlattenByView(norm, None), seed) for seed in range(3)]
    with backends.conv.flags(strategy=strategy):
        compare_training(stack(references), references, lambda lead: torch.randn(*lead, 3, 5, 5, dtype=torch.float64))


@pytest.mark.parametrize("write", ["view", "source"])
def test_in_place_write_through_a_copied_view_is_refused(write: str) -> None:
    """Where the stacked model's ``.view`` had to copy (a channels-last output), an in-place write to the view
    or to its source would not reach the other as in the original: refused, never a silent difference."""
    references = [seeded(lambda: _FlattenByView(False, write), seed) for seed in range(2)]
    stacked = stack(references)
    x = torch.randn(2, 4, 3, 5, 5, dtype=torch.float64)
    with backends.conv.flags(strategy="loop_channels_last"), pytest.raises(RuntimeError, match="written in place"):
        stacked(x)
    with backends.conv.flags(strategy="loop"):  # contiguous outputs: the view is an alias, exact
        assert_close(stacked(x), torch.stack([r(xi) for r, xi in zip(references, x)]))


class _ReturnsNumbers(nn.Module):
    """Outputs beside the samples' one: a 0-dim constant and a 0-dim buffer equal in every model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x), torch.tensor(2.0, dtype=x.dtype), self.scale * 3


@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
def test_a_0_dim_output_is_one_per_model(execution: str) -> None:
    """``(M, *)`` out for every output, a 0-dim one the same in every model included (model by model it always
    was; the batched forward returned it 0-dim)."""
    models = [seeded(_ReturnsNumbers, i).double() for i in range(3)]
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    outs = stack(models, execution=execution)(x)
    for k, out in enumerate(outs):
        expected = torch.stack([m(x[i])[k] for i, m in enumerate(models)])
        assert out.shape == expected.shape, f"output {k}: {tuple(out.shape)} instead of {tuple(expected.shape)}"
        assert_close(out, expected, msg=f"output {k}")


class _GlobalPool(nn.Module):
    """conv, ReLU, global average pooling, linear: the pooled activation is channels-last on the CPU."""

    def __init__(self, module: bool) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)
        self.pool = nn.AdaptiveAvgPool2d((1, 1)) if module else None

    def forward(self, x):
        h = F.relu(self.conv(x))
        h = self.pool(h) if self.pool is not None else F.adaptive_avg_pool2d(h, 1)
        return self.fc(torch.flatten(h, 1))


@pytest.mark.parametrize("module", [False, True], ids=["F.adaptive_avg_pool2d(h, 1)", "nn.AdaptiveAvgPool2d((1, 1))"])
def test_global_average_pooling_is_exact_with_a_channels_last_gradient(module: bool) -> None:
    """Global average pooling of a channels-last activation is torch's ``mean`` over the image, whose gradient
    torch makes contiguous; the activation's backward before it then mixes two layouts (threshold_backward
    5.75 ms against 176 us on (128, 16, 32, 32)). The stacked forward gives the same numbers with a
    channels-last gradient: outputs, parameter gradients and a gradient penalty's second derivatives equal
    the original models'."""
    models = [seeded(lambda: _GlobalPool(module), i) for i in range(3)]
    stacked = stack(models)
    compare_gradient_penalty(stacked, models, torch.randn(3, 2, 3, 6, 6, dtype=torch.float64))


def test_the_pooled_gradient_is_an_expand_the_activation_reads_channels_last() -> None:
    """The pooling's gradient is torch's, as a stride-0 expand (no full-size tensor written); the backward of
    a ReLU before the pooling turns it into a channels-last gradient, where torch's own contiguous gradient
    gives a contiguous one (mixing layouts with the channels-last saved output)."""
    from batchlayers._provenance import MeanWithExpandedGradient

    x = torch.randn(4, 3, 5, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = MeanWithExpandedGradient.apply(x)
    assert torch.equal(y, F.adaptive_avg_pool2d(x, 1))
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, g)
    (expected,) = torch.autograd.grad(F.adaptive_avg_pool2d(x, 1), x, g)
    assert torch.equal(grad, expected) and grad.stride()[-2:] == (0, 0), f"strides {grad.stride()}"
    relu_out = torch.relu(x.detach())
    by_relu = torch.ops.aten.threshold_backward(grad, relu_out, 0)
    assert torch.equal(by_relu, torch.ops.aten.threshold_backward(expected, relu_out, 0))
    assert by_relu.is_contiguous(memory_format=torch.channels_last)
    assert not expected.is_contiguous(memory_format=torch.channels_last), "torch's own is contiguous"
