"""select, concat, replicate and the state-dict converters."""

from __future__ import annotations

import models as zoo
import pytest
import torch
from convert_harness import seeded
from harness import assert_close
from torch import nn

from batchlayers.convert import (
    concat,
    replicate,
    select,
    stack,
    stack_state_dicts,
    unstack,
    unstack_state_dict,
)


def _outputs_equal(a, b, x, logits=lambda out: out):
    a.eval()
    b.eval()
    assert_close(logits(a(x)), logits(b(x)), msg="outputs")


@pytest.mark.parametrize("factory", [zoo.CNN, zoo.GPT], ids=["CNN", "GPT"])
def test_select_equals_stack_of_those_models(factory) -> None:
    models = [seeded(factory, i) for i in range(4)]
    batched = stack(models)
    picked = select(batched, [3, 1, 1])
    assert picked.num_models == 3 and all(getattr(m, "num_models", 3) == 3 for m in picked.modules()), (
        "every num_models attribute is updated"
    )
    expected = stack([models[3], models[1], models[1]])
    for (k, v), w in zip(expected.state_dict().items(), picked.state_dict().values()):
        assert torch.equal(v, w), k
    if factory is zoo.GPT:
        x, logits = torch.randint(0, 11, (3, 2, 8)), (lambda out: out.logits)
        assert picked.transformer.h[0].mlpf.__closure__[0].cell_contents is picked.transformer.h[0].mlp
    else:
        x, logits = torch.randn(3, 2, 3, 8, 8, dtype=torch.float64), (lambda out: out)
    _outputs_equal(picked, expected, x, logits)
    # Nothing mutable is shared: training the selection leaves the source alone.
    before = {k: v.clone() for k, v in batched.state_dict().items()}
    picked.train()
    logits(picked(x)).sum().backward()
    with torch.no_grad():
        for p in picked.parameters():
            p.add_(1.0)
    for k, v in batched.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in batched.parameters())


def test_select_bad_indices() -> None:
    batched = stack([zoo.MLP(), zoo.MLP()])
    with pytest.raises(IndexError, match="index 2 is out of range for a stacked model of 2 models"):
        select(batched, [0, 2])
    with pytest.raises(ValueError, match="got no indices"):
        select(batched, [])
    with pytest.raises(TypeError, match="indices must be ints"):
        select(batched, [0.5])
    with pytest.raises(TypeError, match="select: indices must be a 1-D integer tensor or a list of ints, got 1"):
        select(batched, 1)
    with pytest.raises(TypeError, match="expected a stacked model"):
        select(zoo.MLP(), [0])
    assert select(batched, torch.tensor([-1])).num_models == 1


def test_concat_restores_the_whole() -> None:
    models = [seeded(zoo.GPT, i) for i in range(3)]
    batched = stack(models)
    whole = concat([select(batched, [0]), select(batched, [1, 2])])
    assert whole.num_models == 3
    for (k, v), w in zip(batched.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(v, w), k
    assert whole.lm_head.weight is whole.transformer.wte.weight
    _outputs_equal(whole, batched, torch.randint(0, 11, (3, 2, 8)), lambda out: out.logits)
    with pytest.raises(TypeError, match="model 1 is a MLP, model 0 a GPT"):
        concat([batched, stack([zoo.MLP()])])
    with pytest.raises(ValueError, match="has shape"):
        concat([batched, stack([zoo.GPT(zoo.GPTConfig(n_embd=4))])])


class _MovingAverage(nn.Module):
    """A buffer equal in every fresh model (stored once when stacked) that training writes per model."""

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("avg", torch.full((3,), start, dtype=torch.float64))

    def forward(self, x):
        if self.training:
            self.avg.lerp_(x.detach().mean(0), 0.1)
        return self.fc(x - self.avg)


@pytest.mark.parametrize("parts", ["trained, fresh", "fresh, trained", "fresh, fresh of another value"])
def test_concat_of_a_buffer_stored_once_in_some_parts(parts: str) -> None:
    """A buffer stored once (equal in every model) in one part and per model in another, or stored once in both
    with different values, is stored per model in the result: each model keeps its value, exactly as the
    originals. It was refused (a shape or a value that differed)."""
    models = [seeded(lambda: _MovingAverage(0.0), i).double() for i in range(3)]
    models += [seeded(lambda: _MovingAverage(1.0 if "another" in parts else 0.0), i).double() for i in range(3, 5)]
    first, second = stack(models[:3]), stack(models[3:])
    if "trained" in parts:
        trained, originals = (first, models[:3]) if parts.startswith("trained") else (second, models[3:])
        x = torch.randn(len(originals), 4, 3, dtype=torch.float64)
        trained(x)
        for m, xi in zip(originals, x):
            m(xi)
        assert trained.avg.dim() == 2, "the forward stored the buffer per model"
    joined = concat([first, second])
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    for step in range(2):
        expected = torch.stack([m(xi) for m, xi in zip(models, x)])
        assert_close(joined(x), expected, msg=f"{parts}: output at step {step}")
        assert_close(joined.avg, torch.stack([m.avg for m in models]), msg=f"{parts}: buffer at step {step}")
    assert_close(unstack(joined)[4].avg, models[4].avg, msg=f"{parts}: unstacked")


def test_replicate_respects_the_users_initialisation() -> None:
    torch.manual_seed(0)
    batched = replicate(zoo.GPT, 3)
    torch.manual_seed(0)
    expected = [zoo.GPT() for _ in range(3)]
    assert batched.num_models == 3
    for name, p in batched.named_parameters():
        assert torch.equal(p, torch.stack([dict(m.named_parameters())[name] for m in expected])), name
    # GPT._init_weights draws N(0, 0.02), not torch's default init.
    assert batched.transformer.h[0].attn.c_attn.weight.std() < 0.03
    with pytest.raises(ValueError, match="num_models must be a positive int"):
        replicate(zoo.MLP, 0)


def test_state_dict_round_trip() -> None:
    models = [seeded(zoo.CNN, i) for i in range(3)]
    stacked_state = stack_state_dicts([m.state_dict() for m in models])
    batched = stack([seeded(zoo.CNN, i) for i in range(10, 13)])
    batched.load_state_dict(stacked_state)
    for (k, v), w in zip(stack(models).state_dict().items(), batched.state_dict().values()):
        assert torch.equal(v, w), k
    states = unstack_state_dict(batched.state_dict())
    for m, s in zip(models, states):
        assert list(s) == list(m.state_dict())
        for k, v in m.state_dict().items():
            assert torch.equal(v, s[k]) and s[k].untyped_storage().nbytes() == v.untyped_storage().nbytes(), k


def test_state_dicts_of_a_gpt_load_into_a_stacked_gpt() -> None:
    models = [seeded(zoo.GPT, i) for i in range(2)]
    batched = stack([seeded(zoo.GPT, i) for i in range(5, 7)])
    batched.load_state_dict(stack_state_dicts([m.state_dict() for m in models]))
    for restored, original in zip(unstack(batched), models):
        for k, v in original.state_dict().items():
            assert torch.equal(restored.state_dict()[k], v), k
    for s, m in zip(unstack_state_dict(batched.state_dict()), models):
        m.load_state_dict(s)


def test_state_dict_errors() -> None:
    with pytest.raises(ValueError, match="empty list"):
        stack_state_dicts([])
    a, b = zoo.MLP().state_dict(), zoo.MLP(hidden=9).state_dict()
    with pytest.raises(ValueError, match=r"'fc1.weight' has shape \(9, 6\) in state dict 1 but \(8, 6\)"):
        stack_state_dicts([a, b])
    with pytest.raises(ValueError, match="state dict 1 has different keys.*'fc3.bias' is missing"):
        stack_state_dicts([a, {k: v for k, v in a.items() if k != "fc3.bias"}])
    with pytest.raises(ValueError, match="'fc1.weight' is torch.float64"):
        stack_state_dicts([a, {k: v.double() for k, v in a.items()}])
    with pytest.raises(ValueError, match=r"'fc1.bias' has shape \(2,\) but the first entry has M=3"):
        unstack_state_dict({"fc1.weight": torch.zeros(3, 2), "fc1.bias": torch.zeros(2)})


class _Scale(nn.Module):
    """No parameters, one buffer equal in every model: kept as one shared copy in a stacked model."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.arange(1.0, 5.0, dtype=torch.float64))

    def forward(self, x):
        return x * self.scale


class _ReusedScale(nn.Module):
    """The same buffer-holding module under two names (``scale`` and ``after.0``), as a shared rotary
    embedding is in many transformers: ``state_dict()`` holds its buffer under both names."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = _Scale()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)
        self.after = nn.Sequential(self.scale)

    def forward(self, x):
        return self.after(self.fc(self.scale(x)))


def test_shared_buffer_of_a_module_reused_under_two_names() -> None:
    models = [seeded(_ReusedScale, i) for i in range(3)]
    batched = stack(models)
    state = batched.state_dict()
    assert list(state) == list(models[0].state_dict())
    for s, m in zip(unstack_state_dict(state), models):
        for k, v in m.state_dict().items():
            assert torch.equal(s[k], v), k
    other = stack([seeded(_ReusedScale, i) for i in range(5, 8)])
    other.load_state_dict(stack_state_dicts([m.state_dict() for m in models]))
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    assert_close(other(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="outputs")


def test_unstack_state_dict_gives_copies() -> None:
    """Writing into an unstacked state dict never changes the stacked model."""
    batched = stack([nn.Linear(3, 2) for _ in range(3)])
    before = {k: v.clone() for k, v in batched.state_dict().items()}
    for state in unstack_state_dict(batched.state_dict()):
        for v in state.values():
            v.add_(1.0)
    for k, v in batched.state_dict().items():
        assert torch.equal(v, before[k]), k
