"""batchlayers.verify: one call compares a stacked model with its originals, model by model, and changes
nothing."""

from __future__ import annotations

import models as zoo
import pytest
import torch
from convert_harness import seeded, snapshot

from batchlayers import stack, verify


def _assert_untouched(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, value in module.state_dict(keep_vars=True).items():
        assert torch.equal(value.detach(), before[name]), f"'{name}' changed"
        assert getattr(value, "grad", None) is None, f"'{name}' got a gradient"


@pytest.mark.parametrize("shared", [False, True], ids=["own batches", "shared batch"])
def test_an_exact_stack_passes_and_nothing_changes(shared: bool) -> None:
    """A CNN in train mode (BatchNorm statistics would move) and a float input whose gradient is compared."""
    models = [seeded(zoo.CNN, i).train() for i in range(3)]
    batched = stack(models)
    before = [snapshot(m) for m in (batched, *models)]
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    x = x.expand(3, *x.shape) if shared else torch.randn(3, 4, 3, 8, 8, dtype=torch.float64)
    result = verify(models, batched, x)
    assert result.passed.tolist() == [True] * 3, str(result)
    assert result.outputs.max() < 1e-12 and 0 < result.gradients.max() < 1e-10
    assert any(w.startswith("grad of ") for w in result.worst_gradient)
    for module, state in zip((batched, *models), before):
        _assert_untouched(module, state)
    assert x.grad is None


def test_a_wrong_model_is_named_with_where_it_differs() -> None:
    models = [seeded(zoo.GPT, i) for i in range(3)]
    batched = stack(models)
    with torch.no_grad():
        batched.transformer.h[0].mlp.c_fc.weight[1] += 1e-3 * torch.randn_like(
            batched.transformer.h[0].mlp.c_fc.weight[1]
        )
    idx = torch.randint(0, 11, (3, 2, 8))
    result = verify(models, batched, idx, targets=idx)
    assert result.passed.tolist() == [True, False, True]
    assert result.outputs[1] > 1e-6 and result.outputs[[0, 2]].max() < 1e-12
    assert result.worst_output[1] in ("output.logits", "output.loss")
    assert "model  output diff" in str(result) and "NO" in str(result).splitlines()[2]


def test_outputs_of_another_shape_are_refused() -> None:
    models = [seeded(lambda: torch.nn.Linear(4, 3), i) for i in range(2)]
    other = stack([seeded(lambda: torch.nn.Linear(4, 2), i) for i in range(2)])
    with pytest.raises(
        ValueError, match=r"verify: output of the stacked model has shape \(2, 5, 2\), model 0's \(5, 3\)"
    ):
        verify(models, other, torch.randn(2, 5, 4, dtype=torch.float64))


class _GrowingCache(torch.nn.Module):
    """A rotary-style cache that forward replaces when the sequence grows (transformers' ``cos_cached``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("cos_cached", torch.ones(1, 4), persistent=False)

    def forward(self, x):
        if x.shape[1] > self.cos_cached.shape[0]:
            steps = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * torch.arange(1, 5, dtype=x.dtype)
            self.cos_cached = steps.cos()
        return self.fc(x) * self.cos_cached[: x.shape[1]]


def test_buffers_that_forward_replaces_are_put_back() -> None:
    """verify restores the buffer objects themselves (forward assigned new ones), then their values."""
    models = [seeded(_GrowingCache, i) for i in range(2)]
    batched = stack(models)
    before = [(m.cos_cached, m.cos_cached.clone()) for m in models]
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    assert verify(models, batched, x).passed.all()
    for m, (buffer, value) in zip(models, before):
        assert m.cos_cached is buffer and torch.equal(buffer, value)
    fresh = [seeded(_GrowingCache, i) for i in range(2)]
    expected = torch.stack([m(x[i]) for i, m in enumerate(fresh)])
    assert torch.equal(torch.stack([m(x[i]) for i, m in enumerate(models)]), expected)
    torch.testing.assert_close(batched(x), expected)
