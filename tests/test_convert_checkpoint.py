"""Checkpoint files (torch.save and safetensors) loaded into one stacked model, one file at a time."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import models as zoo
import pytest
import torch
from convert_harness import seeded
from safetensors.torch import save_model
from torch import nn

from batchlayers.checkpoint import stack_checkpoints
from batchlayers.convert import stack, unstack


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k, v in sa.items():
        assert torch.equal(v, sb[k]), k


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "nested"])
def test_checkpoints_equal_stack_of_the_models(tmp_path, fmt: str) -> None:
    models = [seeded(zoo.GPT, i) for i in range(3)]
    paths = []
    for i, m in enumerate(models):
        if fmt == "safetensors":
            path = tmp_path / f"gpt{i}.safetensors"
            save_model(m, str(path))  # keeps one name of the tied weight
        else:
            path = tmp_path / f"gpt{i}.pt"
            torch.save({"model": m.state_dict(), "step": 7} if fmt == "nested" else m.state_dict(), path)
        paths.append(path)
    template = zoo.GPT().double()
    batched = stack_checkpoints(template, paths, key="model" if fmt == "nested" else None)
    _assert_same_state(batched, stack(models))
    assert batched.lm_head.weight is batched.transformer.wte.weight
    for restored, original in zip(unstack(batched), models):
        _assert_same_state(restored, original)


def test_checkpoint_errors(tmp_path) -> None:
    good, wide = tmp_path / "good.pt", tmp_path / "wide.pt"
    torch.save(zoo.MLP().state_dict(), good)
    torch.save(zoo.MLP(hidden=9).state_dict(), wide)
    with pytest.raises(ValueError, match=r"'fc1.weight' has shape \(9, 6\) in '.*wide.pt' but \(8, 6\) in MLP"):
        stack_checkpoints(zoo.MLP(), [good, wide])
    with pytest.raises(ValueError, match=r"'.*good.pt' does not fit CNN: missing keys \['conv1.weight'"):
        stack_checkpoints(zoo.CNN(), [good])
    with pytest.raises(KeyError, match="holds no entry 'model'"):
        stack_checkpoints(zoo.MLP(), [good], key="model")
    with pytest.raises(ValueError, match="empty list of checkpoint files"):
        stack_checkpoints(zoo.MLP(), [])


class _Payload:
    """Stands for an arbitrary object in a checkpoint file: unpickling it could run code."""


def test_weights_only_by_default(tmp_path) -> None:
    path = tmp_path / "unsafe.pt"
    torch.save({"fc1.weight": torch.zeros(8, 6), "extra": _Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        stack_checkpoints(zoo.MLP(), [path])


_MEASURE = textwrap.dedent(
    """
    import gc, sys, torch
    from torch import nn
    from batchlayers.checkpoint import stack_checkpoints
    from batchlayers.convert import stack_state_dicts

    def status_mb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024

    mode, paths = sys.argv[1], sys.argv[2:]
    template = nn.Sequential(nn.Linear(1000, 5000))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident size
    before = status_mb("VmRSS")
    if mode == "stream":
        batched = stack_checkpoints(template, paths)
    else:  # the naive way: every checkpoint in memory, then stacked
        batched = stack_state_dicts([torch.load(p, weights_only=True) for p in paths])
    print(status_mb("VmHWM") - before)
    """
)


def test_loading_checkpoints_holds_one_model_at_a_time(tmp_path) -> None:
    """Peak memory: about the stacked model plus one checkpoint, where reading all files first needs 2x."""
    num_models = 6
    paths = []
    for i in range(num_models):
        torch.manual_seed(i)
        path = tmp_path / f"m{i}.pt"
        torch.save(nn.Sequential(nn.Linear(1000, 5000)).state_dict(), path)  # 20 MB each
        paths.append(str(path))
    model_mb = 5001 * 1000 * 4 / 2**20
    stacked_mb = num_models * model_mb

    def peak_mb(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, mode, *paths], capture_output=True, text=True, check=True
        ).stdout
        return float(out.strip().splitlines()[-1])

    bound = stacked_mb + 2 * model_mb
    streamed, naive = peak_mb("stream"), peak_mb("naive")
    assert streamed < bound, f"stack_checkpoints peaked at +{streamed:.0f} MB, bound {bound:.0f} MB"
    assert naive > bound, f"the naive way peaked at +{naive:.0f} MB: the bound {bound:.0f} MB proves nothing"


def test_a_buffer_that_differs_in_a_later_checkpoint_is_stored_per_model(tmp_path) -> None:
    """Files are read one at a time: a causal mask equal in the first checkpoints is kept once until one
    differs, then stored per model, each model holding its own (as stack of the models would)."""
    models = [seeded(zoo.GPT, i) for i in range(3)]
    with torch.no_grad():
        models[2].transformer.h[1].attn.bias.fill_(1.0)  # lifted in the last model only
    paths = []
    for i, m in enumerate(models):
        paths.append(tmp_path / f"m{i}.pt")
        torch.save(m.state_dict(), paths[-1])
    batched = stack_checkpoints(seeded(zoo.GPT, 9), paths)
    assert batched.transformer.h[1].attn.bias.shape[0] == 3
    _assert_same_state(batched, stack(models))
    idx = torch.randint(0, 11, (3, 2, 8))
    expected = torch.stack([m(idx[i]).logits for i, m in enumerate(models)])
    assert torch.allclose(batched(idx).logits, expected, atol=1e-10)
