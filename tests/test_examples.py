"""Every example in examples/ runs in a shortened form (its ``--quick`` flag, in-process) and reaches its
outcome. One test per example; an example's own helpers may get a small reference test next to it."""

from __future__ import annotations

import importlib
import pathlib
import types

import pytest
import torch
from torch import nn

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def load_example(monkeypatch: pytest.MonkeyPatch):
    """Import ``examples/<name>.py`` the way ``python examples/<name>.py`` sees its neighbours."""
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str) -> types.ModuleType:
        return importlib.import_module(name)

    return load


def test_sweep_digits(load_example, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    sweep = load_example("sweep_digits")
    result = sweep.main(["--quick", "--out", str(tmp_path)])
    assert [len(r.model_ids) for r in result.rungs] == [16, 8, 4]
    for before, after in zip(result.rungs, result.rungs[1:]):
        assert set(after.model_ids) <= set(before.model_ids)
        # The survivors are the better half of the rung before.
        ranked = sorted(zip(before.val_accuracy, before.model_ids), reverse=True)
        assert min(acc for acc, i in ranked if i in after.model_ids) >= ranked[len(after.model_ids) - 1][0]
    assert result.final_val[0] > 0.9 and min(result.final_test) > 0.85  # chance is 0.1
    best_lr = result.learning_rates[result.final_ids[0]].item()
    assert 1e-3 <= best_lr <= 1e-1, f"AdamW's sensible learning rates are 1e-3..1e-1, the sweep chose {best_lr}"
    assert (tmp_path / "sweep_digits.png").stat().st_size > 10_000
    assert "weight_decay" in capsys.readouterr().out
    # The best model, unstacked and saved, is an ordinary MLP with the batched model's test accuracy.
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    plain.load_state_dict(torch.load(tmp_path / "best_mlp.pt", weights_only=True))
    assert [type(m) for m in result.best_model] == [type(m) for m in plain]
    x_test, y_test = sweep.load_digits_split(0)["test"]
    with torch.no_grad():
        accuracy = (plain(x_test).argmax(-1) == y_test).double().mean().item()
    assert accuracy == pytest.approx(result.final_test[0], abs=1e-12)


def test_checkpoints(load_example, tmp_path: pathlib.Path) -> None:
    example = load_example("checkpoints")
    result = example.main(["--quick", "--out", str(tmp_path)])
    assert [p.suffix for p in result.paths] == [".pt", ".safetensors", ".pt"]
    # Evaluated together, each loaded model gives what it gives on its own; unstacked, what it gave stacked.
    assert result.max_logit_difference < 1e-4 and result.unstacked_logit_difference < 1e-4
    assert torch.equal(result.stacked_accuracy, result.own_accuracy)
    assert torch.equal(result.unstacked_accuracy, result.finetuned_accuracy)
    assert min(result.own_accuracy) > 0.8 and result.finetuned_accuracy.mean() > result.own_accuracy.mean()
    assert all(p.stat().st_size > 0 for p in result.unstacked_paths)


def test_ensemble_digits(load_example, tmp_path: pathlib.Path) -> None:
    example = load_example("ensemble_digits")
    result = example.main(["--quick", "--out", str(tmp_path)])
    members, ensemble = result.members, result.ensemble
    assert len(members.accuracy) == 4 and members.accuracy.min() > 0.8  # chance is 0.1
    # Averaging probabilities never raises the NLL above the members' mean (-log is convex).
    assert ensemble.nll <= members.nll.mean()
    assert ensemble.accuracy >= members.accuracy.mean() - 0.01
    assert 0 <= ensemble.ece <= 0.2 and bool((members.ece <= 0.2).all())
    assert torch.allclose(result.ensemble_probs.sum(-1), torch.ones(()).double())
    assert (tmp_path / "ensemble_digits_reliability.png").stat().st_size > 10_000


def test_expected_calibration_error_matches_a_loop(load_example) -> None:
    example = load_example("ensemble_digits")
    torch.manual_seed(0)
    probs = torch.randn(3, 50, 4).double().softmax(-1)
    target = torch.randint(4, (50,))
    for m in range(3):
        confidence, prediction = probs[m].max(-1)
        ece = 0.0
        for b in range(10):
            in_bin = (confidence > b / 10) & (confidence <= (b + 1) / 10)
            if in_bin.any():
                gap = confidence[in_bin].mean() - (prediction[in_bin] == target[in_bin]).double().mean()
                ece += in_bin.double().mean() * gap.abs()
        assert abs(example.expected_calibration_error(probs, target)[m].item() - float(ece)) < 1e-12


def test_generate(load_example) -> None:
    example = load_example("generate")
    result = example.main(["--quick"])
    # Greedy decoding of the stacked models gives every model exactly its own generate()'s tokens.
    assert torch.equal(result.stacked_tokens, result.own_tokens)
    assert result.sampled.shape == result.own_tokens.shape
    prompt_length = result.own_tokens.shape[-1] - 8
    assert torch.equal(result.sampled[..., :prompt_length], result.own_tokens[..., :prompt_length])
