"""Tensors that a model's forward keeps on the module as plain attributes (the previous step's hidden state,
a history list, a dict cache): a stacked model holds them for all models, and ``unstack``, ``select`` and
``concat`` give each model its own part, as if each original model had run the same calls. A value made from
every model's samples together is no model's: refused, never handed to each model whole."""

from __future__ import annotations

import types
from typing import NamedTuple

import pytest
import torch
from convert_harness import seeded
from harness import assert_close
from torch import nn

from batchlayers.convert import concat, select, stack, unstack


class _Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Remembers(nn.Module):
    """Adds what it kept from its last call (``pattern`` says how it keeps it) to this call's hidden state."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.prev: torch.Tensor | None = None
        self.history: list[torch.Tensor] = []
        self.cache: dict[str, torch.Tensor] = {}
        self.ns = types.SimpleNamespace(h=None)
        self.deep: list = []
        self.pair: _Pair | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.pattern == "attribute":
            if self.prev is not None:
                h = h + self.prev
            self.prev = h.detach()
        elif self.pattern == "transposed":  # the samples on dimension 1 of the kept tensor
            if self.prev is not None:
                h = h + self.prev.t()
            self.prev = h.detach().t()
        elif self.pattern == "history":
            for old in self.history:
                h = h + 0.5 * old
            self.history.append(h.detach())
        elif self.pattern == "total":  # each model's sum over its samples (a per-model value)
            if self.prev is not None:
                h = h + self.prev
            self.prev = h.detach().sum(0)
        elif self.pattern == "picked":  # the row of the largest first feature: stacked, among all models' rows
            self.prev = h.detach()[h.detach()[:, 0].argmax()]
        elif self.pattern == "namespace, deep list, namedtuple":  # (other objects' attributes, any depth)
            if self.ns.h is not None:
                h = h + self.ns.h + self.deep[0][0][0][0][0] * self.pair.second
            self.ns.h, self.deep = h.detach(), [[[[[h.detach() * 2]]]]]
            self.pair = _Pair(h.detach(), h.detach() - 1)
        elif self.pattern == "dict":
            if "h" in self.cache:
                h = h * self.cache["scale"] + self.cache["h"]
            self.cache.update(h=h.detach(), scale=self.scale * 2)  # samples, and a per-model value
        return h


PATTERNS = ["attribute", "transposed", "history", "dict", "namespace, deep list, namedtuple", "total"]
SIZES = [(3, 2), (2, 3), (2, 1)]  # (models, batch): M * B of one equals B of another


def _models(pattern: str, num_models: int) -> list[nn.Module]:
    return [seeded(lambda: Remembers(pattern), seed) for seed in range(num_models)]


def _inputs(num_models: int, batch: int, seed: int) -> torch.Tensor:
    return torch.randn(num_models, batch, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run_both(stacked: nn.Module, models: list[nn.Module], batch: int, seed: int) -> None:
    x = _inputs(len(models), batch, seed)
    assert_close(stacked(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=f"stacked call {seed}")


def _after_two_calls(pattern: str, num_models: int, batch: int) -> tuple[nn.Module, list[nn.Module]]:
    models = _models(pattern, num_models)
    stacked = stack(models)
    for seed in range(2):
        _run_both(stacked, models, batch, seed)
    return stacked, models


@pytest.mark.parametrize("num_models,batch", SIZES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_unstack_gives_each_model_its_own_kept_samples(pattern: str, num_models: int, batch: int) -> None:
    stacked, models = _after_two_calls(pattern, num_models, batch)
    x = _inputs(num_models, batch, 2)
    for i, (one, original) in enumerate(zip(unstack(stacked), models)):
        assert_close(one(x[i]), original(x[i]), msg=f"model {i}'s next call after unstack")


@pytest.mark.parametrize("num_models,batch", SIZES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_select_and_concat_keep_each_models_samples(pattern: str, num_models: int, batch: int) -> None:
    stacked, models = _after_two_calls(pattern, num_models, batch)
    order = list(range(num_models))[::-1]
    chosen = select(stacked, order)
    _run_both(chosen, [models[i] for i in order], batch, 2)
    joined = concat([select(chosen, [k]) for k in range(num_models)])
    _run_both(joined, [models[i] for i in order], batch, 3)


@pytest.mark.parametrize("what", ["unstack", "select"])
def test_a_value_from_every_models_samples_is_refused(what: str) -> None:
    stacked = stack(_models("picked", 2))
    stacked(_inputs(2, 3, 0))
    message = rf"{what}: the attribute 'prev' holds a tensor \(shape \(4,\)\).*every model's samples together"
    with pytest.raises(ValueError, match=message):
        unstack(stacked) if what == "unstack" else select(stacked, [0])


class Counts(nn.Module):
    """A buffer equal in every model (stored once when stacked) that forward writes, as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(4))
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        mean = h.detach().mean(0)  # each model's own
        writes = {
            "+= 1": lambda: self.steps.__iadd__(1),
            "a view of it, += 1": lambda: self.steps[0].add_(1),
            ".data": lambda: self.steps.data.mul_(2).add_(1),
            "copy_ of a constant": lambda: self.steps.copy_(self.steps + torch.arange(4, dtype=x.dtype)),
            "moving average, lerp_": lambda: self.steps.lerp_(mean, 0.3),
            "moving average, mul_ then add_": lambda: self.steps.mul_(0.7).add_(mean, alpha=0.3),
            "moving average, assigned": lambda: setattr(self, "steps", 0.7 * self.steps + 0.3 * mean),
            "moving average of x.mean(0), with its gradient": lambda: self.steps.lerp_(x.mean(0), 0.3),
            "a per-model value into an element": lambda: self.steps.__setitem__(1, h.mean()),
            "a sum over the samples": lambda: self.steps.add_(h.detach().sum(0)),
            "out= of the samples' mean": lambda: torch.mean(h.detach(), 0, out=self.steps),
            "a view of it, lerp_": lambda: self.steps[:2].lerp_(mean[:2], 0.3),
            # (stored per model, the view would keep the old storage)
            "a view kept, then a moving average": lambda: (
                self.kept.append(self.steps.detach()),
                self.steps.lerp_(mean, 0.3),
            ),
        }
        writes[self.how]()
        return h * self.steps


EXACT = [
    "+= 1",
    "a view of it, += 1",
    ".data",
    "copy_ of a constant",
    "moving average, lerp_",  # (the buffer is stored per model from the first call on)
    "moving average, mul_ then add_",
    "moving average, assigned",
    "moving average of x.mean(0), with its gradient",
    "a per-model value into an element",
    "a sum over the samples",
]
REFUSED = [
    "out= of the samples' mean",
    "a view of it, lerp_",
    "a view kept, then a moving average",
]


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode])
@pytest.mark.parametrize("how", EXACT)
def test_a_shared_buffer_written_in_forward_is_each_models_own(how: str, mode: type) -> None:
    """Values equal in every model keep the one shared copy each model's; per-model values written into the
    buffer itself make it a per-model buffer from then on (in state dicts, unstack and the next calls)."""
    models = [seeded(lambda: Counts(how), seed) for seed in range(3)]
    stacked = stack(models)
    for seed in range(3):
        with mode():
            _run_both(stacked, models, 2, seed)
        for i, one in enumerate(unstack(stacked)):
            assert_close(one.steps, models[i].steps, msg=f"model {i}'s steps after call {seed}")
        assert_close(stacked.state_dict()["steps"], torch.stack([m.steps for m in models]), msg="state dict")
    stacked.eval()
    for m in models:
        m.eval()
    _run_both(stacked, models, 2, 3)


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("how", REFUSED)
def test_a_shared_buffer_written_with_what_differs_per_model_is_refused_before_the_write(how: str, mode: type) -> None:
    stacked = stack([seeded(lambda: Counts(how), seed) for seed in range(2)])
    with pytest.raises(ValueError, match=r"stacked Counts: forward writes .* into (a view of )?the buffer 'steps'"):
        with mode():
            stacked(_inputs(2, 3, 0))
    assert torch.equal(stacked.steps, torch.zeros(4, dtype=torch.float64))


def test_a_moving_average_of_inputs_that_require_grad() -> None:
    """Inputs that require grad (an input-gradient attack, a saliency map): the average then carries their
    gradient, written into each model's slice of the buffer one after the other (autograd refused the second
    model's write before: its slice was a view made before the first write)."""
    how = "moving average of x.mean(0), with its gradient"
    models = [seeded(lambda: Counts(how), seed) for seed in range(3)]
    stacked = stack([seeded(lambda: Counts(how), seed) for seed in range(3)])
    x = _inputs(3, 2, 0).requires_grad_()
    out = stacked(x)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(out, expected, msg="output")
    (grad,) = torch.autograd.grad(out.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert_close(grad, expected_grad, msg="input gradient")


@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
def test_a_state_dict_of_a_buffer_stored_per_model_loads_into_a_fresh_stack(execution: str) -> None:
    """Resuming: a freshly stacked model keeps the buffer once (equal at stack time); the saved state dict holds
    each model's own values, so loading stores it per model, and the next calls are each original's."""
    how = "moving average, lerp_"
    models = [seeded(lambda: Counts(how), seed) for seed in range(3)]
    trained = stack([seeded(lambda: Counts(how), seed) for seed in range(3)])
    _run_both(trained, models, 2, 0)
    fresh = stack([seeded(lambda: Counts(how), seed) for seed in range(3)], execution=execution)
    fresh.load_state_dict(trained.state_dict())
    assert_close(fresh.state_dict()["steps"], torch.stack([m.steps for m in models]), msg="loaded")
    x = _inputs(3, 2, 1)
    assert_close(fresh(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="next call")
