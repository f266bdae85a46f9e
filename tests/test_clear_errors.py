"""Errors that name the object, what was expected and what was got (issue 13, item 2)."""

from __future__ import annotations

import copy
import os

import models as zoo
import pytest
import torch
from safetensors.torch import save_file

from batchlayers import load_checkpoint, stack_checkpoints
from batchlayers.optim import SGD, Adam, AdamW, RMSprop

M = 3


# -- checkpoint files ----------------------------------------------------------------------------------


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _random(tmp_path, name):
    return _write(tmp_path / name, os.urandom(4096))


def _truncated(tmp_path, name, save):
    full = tmp_path / f"full-{name}"
    save(zoo.MLP().state_dict(), full)
    data = full.read_bytes()
    return _write(tmp_path / name, data[: len(data) // 2])


def _torch_save(state, path):
    torch.save(state, path)


def _legacy_save(state, path):
    torch.save(state, path, _use_new_zipfile_serialization=False)


def _safetensors_save(state, path):
    save_file(state, str(path))


# -- optimizers ----------------------------------------------------------------------------------------


def _params(num_models=M):
    return [torch.nn.Parameter(torch.randn(num_models, 4, 2)), torch.nn.Parameter(torch.randn(num_models, 2))]


def _stepped(cls, num_models=M, **kwargs):
    """An optimizer of ``cls`` over ``num_models`` models after one step (so it has state)."""
    params = _params(num_models)
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _load_other_m(cls, saved_m, **kwargs):
    saved = _stepped(cls, saved_m, **kwargs).state_dict()
    _stepped(cls, M, **kwargs).load_state_dict(saved)


def _tensor(*values):
    return torch.tensor(values, dtype=torch.float64)


CASES = [
    # 1. checkpoint files that are not checkpoints, or are cut short
    (
        "random-pt",
        lambda tmp: load_checkpoint(_random(tmp, "noise.pt")),
        ValueError,
        r"load_checkpoint: '[^']*noise\.pt' is not a checkpoint: it is neither a torch\.save zip archive nor",
    ),
    (
        "random-pt-mmap-stack",
        lambda tmp: stack_checkpoints(zoo.MLP(), [_random(tmp, "noise.pt")]),
        ValueError,
        r"stack_checkpoints \(file 1 of 1\): '[^']*noise\.pt' is not a checkpoint",
    ),
    (
        "truncated-pt",
        lambda tmp: load_checkpoint(_truncated(tmp, "cut.pt", _torch_save)),
        ValueError,
        r"'[^']*cut\.pt' is truncated or corrupt: it starts like a torch\.save zip archive but has no end record",
    ),
    (
        "truncated-pt-stack",
        lambda tmp: stack_checkpoints(zoo.MLP(), [_truncated(tmp, "cut.pt", _torch_save)]),
        ValueError,
        r"stack_checkpoints \(file 1 of 1\): '[^']*cut\.pt' is truncated or corrupt",
    ),
    (
        "truncated-legacy-pt",
        lambda tmp: load_checkpoint(_truncated(tmp, "cut.pt", _legacy_save)),
        ValueError,
        r"'[^']*cut\.pt' is truncated or corrupt: a legacy torch\.save file that could not be read to its end",
    ),
    (
        "empty-pt",
        lambda tmp: load_checkpoint(_write(tmp / "empty.pt", b"")),
        ValueError,
        r"'[^']*empty\.pt' is empty \(0 bytes\), not a checkpoint",
    ),
    (
        "random-safetensors",
        lambda tmp: load_checkpoint(_random(tmp, "noise.safetensors")),
        ValueError,
        r"'[^']*noise\.safetensors' is not a safetensors file, or is truncated: its first 8 bytes give a header of "
        r"\d+ bytes but the file has 4096 bytes",
    ),
    (
        "truncated-safetensors",
        lambda tmp: stack_checkpoints(zoo.MLP(), [_truncated(tmp, "cut.safetensors", _safetensors_save)]),
        ValueError,
        r"stack_checkpoints \(file 1 of 1\): '[^']*cut\.safetensors' is (truncated or corrupt: its header describes"
        r" \d+ bytes|not a safetensors file, or is truncated)",
    ),
    (
        "json-garbage-safetensors",
        lambda tmp: load_checkpoint(_write(tmp / "g.safetensors", (5).to_bytes(8, "little") + b"nope!")),
        ValueError,
        r"'[^']*g\.safetensors' is not a safetensors file: its header is not a safetensors JSON header",
    ),
    # 2. per-model hyperparameters given as something else than a float or an (M,) tensor
    (
        "lr-list",
        lambda tmp: SGD(_params(), lr=[0.1, 0.2, 0.3]),
        TypeError,
        r"SGD: lr must be a float or a tensor of shape \(M,\) = \(3,\), one value per model, got a list of 3 "
        r"values; pass torch\.tensor\(\[\.\.\.\]\)",
    ),
    (
        "beta-list",
        lambda tmp: Adam(_params(), betas=(0.9, [0.99, 0.9, 0.999])),
        TypeError,
        r"Adam: betas\[1\] must be a float or a tensor of shape \(M,\) = \(3,\).*got a list of 3 values",
    ),
    (
        "weight-decay-string",
        lambda tmp: RMSprop(_params(), weight_decay="0.1"),
        TypeError,
        r"RMSprop: weight_decay must be a float or a tensor of shape \(M,\) = \(3,\).*got a str$",
    ),
    (
        "lr-wrong-shape",
        lambda tmp: AdamW(_params(), lr=torch.full((M, 1), 1e-3)),
        ValueError,
        r"AdamW: lr must be a float or a tensor of shape \(M,\) = \(3,\), one value per model, got shape \(3, 1\)",
    ),
    (
        "eps-wrong-m",
        lambda tmp: Adam(_params(), eps=_tensor(1e-8, 1e-8)),
        ValueError,
        r"Adam: eps must be a float or a tensor of shape \(M,\) = \(3,\).*got shape \(2,\)",
    ),
    (
        "momentum-complex",
        lambda tmp: SGD(_params(), momentum=torch.zeros(M, dtype=torch.complex64)),
        TypeError,
        r"SGD: momentum must be a real tensor, got torch\.complex64",
    ),
    (
        "alpha-bool",
        lambda tmp: RMSprop(_params(), alpha=torch.ones(M, dtype=torch.bool)),
        TypeError,
        r"RMSprop: alpha must be a real tensor, got torch\.bool",
    ),
    (
        "lr-meta-device",
        lambda tmp: SGD(_params(), lr=torch.empty(M, device="meta")),
        ValueError,
        r"SGD: lr is a tensor on the meta device, which holds no values; expected a float or an \(M,\) = \(3,\)",
    ),
    (
        "lr-list-put-in-by-hand",
        lambda tmp: _set_and_step(SGD, "lr", [0.1, 0.2, 0.3]),
        TypeError,
        r"SGD: lr must be a float or a tensor of shape \(M,\) = \(3,\).*got a list of 3 values",
    ),
    # 3. an optimizer state saved for a different number of models
    (
        "load-other-m-sgd",
        lambda tmp: _load_other_m(SGD, 5, lr=0.1, momentum=0.9),
        ValueError,
        r"SGD\.load_state_dict: the state dict was saved for M = 5 models \(state 'step' of a parameter of shape "
        r"\(3, 4, 2\) in param group 0\), but this optimizer's parameters hold M = 3; nothing was loaded",
    ),
    (
        "load-other-m-adam-per-model-lr",
        lambda tmp: _load_adam_per_model_lr(),
        ValueError,
        r"Adam\.load_state_dict: the state dict was saved for M = 2 models \(lr in param group 0\), but this "
        r"optimizer's parameters hold M = 3",
    ),
    (
        "load-other-m-rmsprop",
        lambda tmp: _load_other_m(RMSprop, 4),
        ValueError,
        r"RMSprop\.load_state_dict: the state dict was saved for M = 4 models .* hold M = 3",
    ),
]


def _set_and_step(cls, key, value):
    opt = _stepped(cls)
    opt.param_groups[0][key] = value
    opt.step()


def _load_adam_per_model_lr():
    saved = _stepped(Adam, 2, lr=_tensor(1e-3, 1e-2)).state_dict()
    _stepped(Adam, M, lr=_tensor(1e-3, 1e-2, 1e-1)).load_state_dict(saved)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_clear_error(case, tmp_path) -> None:
    _, trigger, exc, pattern = case
    with pytest.raises(exc, match=pattern) as info:
        trigger(tmp_path)
    if trigger.__code__.co_names and {"load_checkpoint", "stack_checkpoints"} & set(trigger.__code__.co_names):
        assert info.value.__cause__ is not None  # the reader's own error is chained


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict()), copy.deepcopy(opt.param_groups)


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "cls, kwargs",
    [(SGD, {"lr": 0.1, "momentum": 0.9}), (Adam, {"lr": 1e-3}), (AdamW, {}), (RMSprop, {"momentum": 0.5})],
    ids=["SGD", "Adam", "AdamW", "RMSprop"],
)
@pytest.mark.parametrize("per_model_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_refused_load_changes_nothing(cls, kwargs, per_model_lr) -> None:
    saved_kwargs = {**kwargs, "lr": _tensor(0.01, 0.02)} if per_model_lr else kwargs
    live_kwargs = {**kwargs, "lr": _tensor(0.03, 0.04, 0.05)} if per_model_lr else kwargs
    saved = _stepped(cls, 2, **saved_kwargs).state_dict()
    opt = _stepped(cls, M, **live_kwargs)
    state_before, groups_before = _snapshot(opt)
    params_before = [p for g in opt.param_groups for p in g["params"]]
    with pytest.raises(ValueError, match=r"saved for M = 2 models .* hold M = 3; nothing was loaded"):
        opt.load_state_dict(saved)
    state_after, groups_after = _snapshot(opt)
    _assert_same(state_before, state_after)
    _assert_same(groups_before, groups_after)
    assert [p for g in opt.param_groups for p in g["params"]] == params_before  # the same Parameter objects
    assert all(p in opt.state for p in params_before)
    opt.step()  # still usable
