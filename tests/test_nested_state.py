"""State dicts of a stacked model nested inside another module: its shared buffers (one copy for all models,
e.g. a causal mask of a module without parameters) appear under the outer module's prefix, and still save,
load and unstack like every other entry."""

from __future__ import annotations

import models as zoo
import pytest
import torch
from convert_harness import seeded
from harness import assert_close
from torch import nn

from batchlayers.convert import shared_buffers, stack, unstack_state_dict

NUM_MODELS = 3


class CausalMask(nn.Module):
    """No parameters: its mask is one buffer shared by all models once stacked."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(t, t)))

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.mask == 0, float("-inf")).softmax(-1)


class Mixer(nn.Module):
    def __init__(self, t: int = 5, d: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.causal = CausalMask(t)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.norm(self.causal(h @ h.transpose(-1, -2)) @ x)


# (factory, input of (M, B) samples, output tensor of a forward's result)
ARCHITECTURES = {
    "gpt": (zoo.GPT, lambda lead: torch.randint(11, (*lead, 6)), lambda out: out.logits),
    "mixer": (Mixer, lambda lead: torch.randn(*lead, 5, 4, dtype=torch.float64), lambda out: out),
}


class Holder(nn.Module):
    """The stacked model one level down, as an attribute."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.ens = inner

    def forward(self, x):
        return self.ens(x)


class DeepHolder(nn.Module):
    """The stacked model two levels down, inside a container."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.body = nn.ModuleDict({"stack": inner})

    def forward(self, x):
        return self.body["stack"](x)


WRAPPERS = {"attribute": (Holder, "ens."), "container": (DeepHolder, "body.stack.")}


def _build(arch: str, wrapper: str, seeds: range):
    factory, make_input, logits = ARCHITECTURES[arch]
    cls, prefix = WRAPPERS[wrapper]
    originals = [seeded(factory, s) for s in seeds]
    return originals, cls(stack(originals)), prefix, make_input, logits


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_nested_state_dict_round_trip(arch: str, wrapper: str) -> None:
    torch.manual_seed(0)
    _, outer, prefix, make_input, logits = _build(arch, wrapper, range(NUM_MODELS))
    inner = outer.get_submodule(prefix[:-1])
    shared = shared_buffers(inner)
    assert shared, "the architecture should have a buffer shared by all models"
    state = outer.state_dict()
    reference = inner.state_dict()
    assert list(state) == [prefix + k for k in reference], "the nested state dict is not the stacked one, prefixed"
    for k, v in reference.items():
        assert state[prefix + k].shape == v.shape, f"{prefix + k}: {tuple(state[prefix + k].shape)} != {v.shape}"
        assert torch.equal(state[prefix + k], v), f"{prefix + k} differs from the stacked model's own entry"
    for name in shared:
        assert state[prefix + name].shape[0] == NUM_MODELS, f"shared buffer {prefix + name} saved without (M, *)"

    _, fresh, _, _, _ = _build(arch, wrapper, range(10, 10 + NUM_MODELS))
    fresh.load_state_dict(state)  # strict
    for k, v in fresh.state_dict().items():
        assert v.shape == state[k].shape and torch.equal(v, state[k]), f"{k} differs after the round trip"
    fresh_inner = fresh.get_submodule(prefix[:-1])
    for name in shared:
        assert fresh_inner.get_buffer(name).shape == inner.get_buffer(name).shape, f"{name} loaded with a new shape"
    x = make_input((NUM_MODELS, 2))
    assert_close(logits(fresh(x)), logits(outer(x)), msg="outputs after loading the nested state dict")

    # an entry that differs per model (each original loads its own): that buffer is stored per model from then on
    differing = {k: v.clone() for k, v in state.items()}
    differing[prefix + shared[0]][1].mul_(0.5)
    fresh.load_state_dict(differing)
    assert torch.equal(fresh.state_dict()[prefix + shared[0]], differing[prefix + shared[0]])
    assert fresh_inner.get_buffer(shared[0]).shape == differing[prefix + shared[0]].shape


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_nested_unstack_state_dict_gives_each_models_own(arch: str, wrapper: str) -> None:
    torch.manual_seed(0)
    originals, outer, prefix, make_input, logits = _build(arch, wrapper, range(NUM_MODELS))
    factory = ARCHITECTURES[arch][0]
    # Train-time changes after stacking: each model's state must come from the stacked model, not the originals.
    with torch.no_grad():
        for p in outer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    x = make_input((NUM_MODELS, 2))
    stacked_out = logits(outer(x))
    states = unstack_state_dict(outer.state_dict())
    assert len(states) == NUM_MODELS
    for i, state in enumerate(states):
        assert all(k.startswith(prefix) for k in state), f"model {i}: keys without the prefix {prefix!r}"
        own = {k.removeprefix(prefix): v for k, v in state.items()}
        model = seeded(factory, 100 + i)
        expected_keys = model.state_dict()
        assert list(own) == list(expected_keys), f"model {i}: keys differ from the architecture's"
        for k, v in expected_keys.items():
            assert own[k].shape == v.shape, f"model {i}: {k} has shape {tuple(own[k].shape)}, not {tuple(v.shape)}"
        model.load_state_dict(own)  # strict
        for k, v in originals[i].named_buffers():
            assert torch.equal(model.get_buffer(k), v), f"model {i}: buffer {k} is not the model's own"
        assert_close(logits(model(x[i])), stacked_out[i], msg=f"model {i}'s output")


class _Holder(nn.Module):
    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("m", buffer)


class _TwoHolders(nn.Module):
    """One buffer registered in two modules without parameters: equal in every model (kept once) or not."""

    def __init__(self, differs: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)  # (float64 already: .double() would copy each holder's)
        buffer = torch.randn(4, dtype=torch.float64) if differs else torch.arange(4.0, dtype=torch.float64)
        self.a, self.b = _Holder(buffer), _Holder(buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.a.m) * self.b.m


@pytest.mark.parametrize("differs", [False, True], ids=["equal", "differing"])
def test_a_buffer_held_by_two_modules(differs: bool) -> None:
    models = [seeded(lambda: _TwoHolders(differs), i) for i in range(NUM_MODELS)]
    assert all(m.a.m is m.b.m for m in models)
    batched = stack(models)
    assert batched.a.m is batched.b.m
    x = torch.randn(NUM_MODELS, 2, 4, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="output")
    state = batched.state_dict()
    for key in ("a.m", "b.m"):
        assert_close(state[key], torch.stack([m.state_dict()[key] for m in models]), msg=key)
    for i, own in enumerate(unstack_state_dict(state)):
        assert_close(own["b.m"], models[i].b.m, msg=f"unstacked model {i}")
