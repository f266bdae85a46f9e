"""unstack, select and concat on models built by hand from batched layers (not from ``stack``).

The reference is N ordinary torch.nn models: the hand-built model is loaded with their weights
(``stack_state_dicts``; a hand-built model's names are torch.nn's), and ``unstack`` must give them back.
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_close
from torch import nn

import batchlayers as bl
from batchlayers.convert import concat, select, stack_state_dicts, unstack

M = 3
F64 = torch.float64


def _mlp_pair():
    def plain():
        return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 2))

    batched = bl.BatchedSequential(
        bl.BatchedLinear(M, 5, 7), nn.ReLU(), bl.BatchedLinear(M, 7, 7), nn.Tanh(), bl.BatchedLinear(M, 7, 2)
    )
    return plain, batched, lambda lead: torch.randn(*lead, 4, 5, dtype=F64)


def _cnn_pair():
    def plain():
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.0),
            nn.Linear(4 * 4 * 4, 3),
        )

    batched = nn.Sequential(
        bl.BatchedConv2d(M, 3, 4, 3, padding=1),
        bl.BatchedBatchNorm2d(M, 4),
        nn.ReLU(),
        bl.Folded(nn.MaxPool2d(2)),
        bl.Folded(nn.Flatten()),
        nn.Dropout(0.0),
        bl.BatchedLinear(M, 4 * 4 * 4, 3),
    )
    return plain, batched, lambda lead: torch.randn(*lead, 4, 3, 8, 8, dtype=F64)


def _tokens_pair():
    def plain():
        return nn.ModuleDict({"embed": nn.Embedding(11, 6), "head": nn.Sequential(nn.LayerNorm(6), nn.GELU())})

    batched = nn.ModuleDict(
        {"embed": bl.BatchedEmbedding(M, 11, 6), "head": nn.Sequential(bl.BatchedLayerNorm(M, 6), nn.GELU())}
    )

    def call(model, x):
        return model["head"](model["embed"](x))

    return plain, batched, lambda lead: torch.randint(0, 11, (*lead, 4, 5)), call


def _sequence_pair():
    """Recurrent and attention layers, which stack leaves to per-model code (not registered counterparts)."""

    def plain():
        return nn.ModuleList(
            [
                nn.LSTM(5, 6, num_layers=2, batch_first=True),
                nn.MultiheadAttention(6, 2, batch_first=True, add_bias_kv=True, kdim=5, vdim=5),
            ]
        )

    batched = nn.ModuleList(
        [
            bl.BatchedLSTM(M, 5, 6, num_layers=2, batch_first=True),
            bl.BatchedMultiheadAttention(M, 6, 2, batch_first=True, add_bias_kv=True, kdim=5, vdim=5),
        ]
    )

    def call(model, x):
        return model[1](model[0](x)[0], x, x)[0]  # attention from the LSTM's states to the inputs

    return plain, batched, lambda lead: torch.randn(*lead, 4, 3, 5, dtype=F64), call


def _layer_pair():
    return (
        (lambda: nn.GroupNorm(2, 4)),
        bl.BatchedGroupNorm(M, 2, 4),
        lambda lead: torch.randn(*lead, 4, 4, 5, dtype=F64),
    )


def _recurrent_layer_pair():
    """A bare recurrent layer (no container around it): stack leaves these to per-model code, so the model is
    the layer itself."""
    return (
        (lambda: nn.GRU(5, 6, num_layers=2, bidirectional=True)),
        bl.BatchedGRU(M, 5, 6, num_layers=2, bidirectional=True),
        lambda lead: torch.randn(*lead, 3, 4, 5, dtype=F64),
        lambda model, x: model(x)[0],
    )


def _cell_pair():
    return (
        (lambda: nn.LSTMCell(5, 6)),
        bl.BatchedLSTMCell(M, 5, 6),
        lambda lead: torch.randn(*lead, 4, 5, dtype=F64),
        lambda model, x: model(x)[1],
    )


def _attention_pair():
    return (
        (lambda: nn.MultiheadAttention(6, 2, batch_first=True, add_bias_kv=True)),
        bl.BatchedMultiheadAttention(M, 6, 2, batch_first=True, add_bias_kv=True),
        lambda lead: torch.randn(*lead, 4, 3, 6, dtype=F64),
        lambda model, x: model(x, x, x)[0],
    )


PAIRS = {
    "one-layer": _layer_pair,
    "one-recurrent-layer": _recurrent_layer_pair,
    "one-cell": _cell_pair,
    "one-attention-layer": _attention_pair,
    "mlp": _mlp_pair,
    "cnn-bn-folded": _cnn_pair,
    "moduledict-tokens": _tokens_pair,
    "modulelist-lstm-attention": _sequence_pair,
}


def _build(name: str):
    """N torch.nn models, and the hand-built batched model holding their weights."""
    made = PAIRS[name]()
    plain, batched, make_input = made[:3]
    call = made[3] if len(made) > 3 else (lambda model, x: model(x))
    torch.manual_seed(0)
    models = [plain().double() for _ in range(M)]
    batched = batched.double()
    batched.load_state_dict(stack_state_dicts([m.state_dict() for m in models]))
    return models, batched, make_input, call


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_unstack_gives_the_torch_models_back(name: str, train: bool) -> None:
    models, batched, make_input, call = _build(name)
    batched.train(train)
    for m in models:
        m.train(train)
    for m in (batched, *models):  # requires_grad comes back too
        next(m.parameters()).requires_grad_(False)
    back = unstack(batched)
    assert len(back) == M
    x = make_input((M,))
    for i, (original, restored) in enumerate(zip(models, back)):
        assert [type(m) for m in restored.modules()] == [type(m) for m in original.modules()], f"model {i}"
        assert [(n, m.training) for n, m in restored.named_modules()] == [
            (n, m.training) for n, m in original.named_modules()
        ]
        assert [(n, p.requires_grad) for n, p in restored.named_parameters()] == [
            (n, p.requires_grad) for n, p in original.named_parameters()
        ]
        for (k, v), (k2, w) in zip(original.state_dict().items(), restored.state_dict().items()):
            assert k == k2 and torch.equal(v, w) and v.dtype == w.dtype, k
        assert_close(call(restored, x[i]), call(original, x[i]), msg=f"output of unstacked model {i}")
    # The restored models own their tensors: the batched model is unchanged by training them.
    before = {k: v.clone() for k, v in batched.state_dict().items()}
    with torch.no_grad():
        for p in back[0].parameters():
            p.add_(1.0)
    for k, v in batched.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("name", list(PAIRS))
def test_select_and_concat_equal_the_chosen_models(name: str) -> None:
    models, batched, make_input, call = _build(name)
    batched.eval()
    picked = select(batched, [2, 0, 2])
    assert type(picked) is type(batched)
    assert {m.num_models for m in picked.modules() if hasattr(m, "num_models")} == {3}
    x = make_input((3,))
    expected = torch.stack([call(models[i].eval(), x[j]) for j, i in enumerate([2, 0, 2])])
    assert_close(call(picked, x), expected, msg="selected models")
    whole = concat([select(batched, [0]), select(batched, [1, 2])])
    assert {m.num_models for m in whole.modules() if hasattr(m, "num_models")} == {M}
    for (k, v), w in zip(batched.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(v, w), k
    # Nothing mutable is shared with the source.
    before = {k: v.clone() for k, v in batched.state_dict().items()}
    with torch.no_grad():
        for p in [*picked.parameters(), *whole.parameters()]:
            p.add_(1.0)
    for k, v in batched.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_unstacked_batch_norm_continues_training_like_the_torch_model() -> None:
    """Running statistics and num_batches_tracked come back per model and keep updating as torch.nn's."""
    models, batched, make_input, _ = _build("cnn-bn-folded")
    batched.train()
    for m in models:
        m.train()
    first, second = make_input((M,)), make_input((M,))
    batched(first)
    back = unstack(batched)
    for i, (original, restored) in enumerate(zip(models, back)):
        original(first[i])
        bn, expected = restored[1], original[1]
        assert type(bn) is nn.BatchNorm2d and bn.num_batches_tracked.item() == 1
        assert bn.running_mean.data_ptr() != batched[1].running_mean.data_ptr()
        assert_close(restored(second[i]), original(second[i]), msg=f"second training step of model {i}")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_close(getattr(bn, name), getattr(expected, name), msg=f"{name} of model {i}")


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = bl.BatchedLinear(M, 4, 4)

    def forward(self, x):
        return self.fc(x).flatten(2)


def _hooked():
    model = nn.Sequential(bl.BatchedLinear(M, 4, 4), nn.ReLU())
    model[1].register_forward_hook(lambda module, args, out: out * 2)
    return model


def _state_dict_hooked():
    """A hook the torch.nn layer that unstack builds would not carry."""
    model = nn.Sequential(bl.BatchedLinear(M, 4, 4))
    model[0].register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)
    return model


class _OwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = bl.BatchedLinear(M, 4, 4)
        self.scale = nn.Parameter(torch.ones(M, 4))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: nn.Sequential(_Custom()),
            TypeError,
            r"unstack: cannot rebuild '0' \(_Custom\) as one model: its forward was written for \(M, B, \*\)",
        ),
        (
            lambda: nn.Sequential(bl.BatchedLinear(M, 4, 4), nn.Softmax(dim=1)),
            TypeError,
            r"unstack: cannot rebuild '1' \(Softmax\)",
        ),
        (_hooked, TypeError, r"unstack: '1' \(ReLU\) has hooks"),
        (_state_dict_hooked, TypeError, r"unstack: '0' \(BatchedLinear\) has hooks"),
        (
            lambda: nn.Sequential(bl.BatchedLinear(M, 4, 4), bl.BatchedLinear(M + 1, 4, 4)),
            ValueError,
            r"unstack: every parameter and buffer must hold the same number of models",
        ),
    ],
    ids=["custom-class", "not-elementwise", "hooks", "state-dict-hook", "different-M"],
)
def test_unstack_refuses_what_it_cannot_rebuild(make, error, match) -> None:
    with pytest.raises(error, match=match):
        unstack(make())


@pytest.mark.parametrize("op", ["unstack", "select", "concat"])
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: nn.Linear(4, 4), r"'weight' belongs to Linear, which holds one model"),
        (_OwnParameter, r"'scale' belongs to _OwnParameter, which holds one model"),
    ],
    ids=["torch-layer", "own-parameter"],
)
def test_models_that_are_not_batched_are_refused(op, make, match) -> None:
    """Only tensors of batched layers count as per-model: an nn.Linear(4, 4) has dimension 0 of size 4 in
    every tensor, and would otherwise pass for four models."""
    model = make()
    with pytest.raises(TypeError, match=match):
        {"unstack": lambda: unstack(model), "select": lambda: select(model, [0]), "concat": lambda: concat([model])}[
            op
        ]()


class _MyLinear(bl.BatchedLinear):
    """A subclass of a batched layer: its forward may differ from torch.nn.Linear's."""

    def forward(self, x):
        return super().forward(x) * 2


def test_a_subclass_of_a_batched_layer_is_not_taken_for_its_torch_layer() -> None:
    with pytest.raises(TypeError, match=r"unstack: cannot rebuild '0' \(_MyLinear\)"):
        unstack(nn.Sequential(_MyLinear(M, 4, 4)))
