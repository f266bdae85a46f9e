"""Every torch.nn module with parameters, stacked: exact against the N originals (swapped for a batched
layer, computed by a batched function inside the module's own code, or that code run per model), or refused
with a clear error. The table of torch.nn layers in docs/conversion.md comes from here."""

from __future__ import annotations

import models as zoo
import pytest
import torch
from convert_harness import compare_training, seeded
from harness import assert_close
from torch import nn

from batchlayers import stack


class _Single(nn.Module):
    """One tensor in, one tensor out, around a torch.nn module with another calling convention."""

    def __init__(self, module: nn.Module, call) -> None:
        super().__init__()
        self.module = module
        self.call = call

    def forward(self, x):
        return self.call(self.module, x)


def _causal(x):
    return nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)


def _first(m, x):
    return m(x)[0]


def _rnn_all(m, x):  # the output sequence and the final hidden state, side by side
    out, state = m(x)
    h = state[0] if isinstance(state, tuple) else state
    return torch.cat([out[:, -1], h.transpose(0, 1).flatten(1)], dim=1)


# name: (factory, input features after (B,), how to call it)
LAYERS = {
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True), (5, 8), lambda m, x: m(x, x, x)[0]),
    "MultiheadAttention kdim/vdim, bias_kv, zero_attn, weights": (
        lambda: nn.MultiheadAttention(8, 2, kdim=6, vdim=4, add_bias_kv=True, add_zero_attn=True, batch_first=True),
        (5, 8),
        lambda m, x: torch.cat([o.flatten(1) for o in m(x, x[..., :6], x[..., :4], average_attn_weights=False)], 1),
    ),
    "TransformerEncoderLayer norm_first gelu": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, norm_first=True),
        (5, 8),
        None,
    ),
    "TransformerDecoderLayer": (
        lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        (5, 8),
        lambda m, x: m(x, x.flip(1)),
    ),
    "Transformer causal": (
        lambda: nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True),
        (5, 8),
        lambda m, x: m(x, x, tgt_mask=_causal(x), tgt_is_causal=True),
    ),
    "RNN relu 2 layers": (lambda: nn.RNN(4, 6, num_layers=2, nonlinearity="relu", batch_first=True), (5, 4), _rnn_all),
    "LSTM bidirectional": (lambda: nn.LSTM(4, 6, batch_first=True, bidirectional=True), (5, 4), _rnn_all),
    "LSTM proj_size": (lambda: nn.LSTM(4, 6, proj_size=3, batch_first=True), (5, 4), _rnn_all),
    "GRU": (lambda: nn.GRU(4, 6, num_layers=2, batch_first=True), (5, 4), _rnn_all),
    "RNNCell": (lambda: nn.RNNCell(4, 6), (4,), None),
    "LSTMCell": (lambda: nn.LSTMCell(4, 6), (4,), _first),
    "GRUCell": (lambda: nn.GRUCell(4, 6), (4,), None),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (3, 7), None),
    "ConvTranspose2d groups output_padding": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        (4, 5, 5),
        None,
    ),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (2, 3, 3, 3), None),
    "PReLU per channel": (lambda: nn.PReLU(3), (3, 5), None),
    "PReLU one": (lambda: nn.PReLU(), (3, 5), None),
    "Bilinear": (lambda: nn.Bilinear(3, 4, 5), (7,), lambda m, x: m(x[..., :3], x[..., 3:])),
    "EmbeddingBag max": (lambda: nn.EmbeddingBag(10, 4, mode="max"), "ids", None),
    "InstanceNorm2d affine, running stats": (
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        (3, 5, 5),
        None,
    ),
}  # fmt: skip


# torch.nn types that stack swaps for a batched layer (the others keep their code, see the module docstring)
SWAPPED = (
    nn.PReLU,
    nn.Bilinear,
    nn.InstanceNorm2d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.EmbeddingBag,
)


@pytest.mark.parametrize("name", list(LAYERS))
def test_torch_layers_stack_exactly(name: str) -> None:
    """Train steps (outputs, gradients, running statistics) and eval, against the originals."""
    factory, features, call = LAYERS[name]
    make = (lambda: factory()) if call is None else (lambda: _Single(factory(), call))
    if features == "ids":
        make_input = lambda lead: torch.randint(0, 10, (*lead, 3))  # noqa: E731
    else:
        make_input = lambda lead: torch.randn(*lead, *features, dtype=torch.float64)  # noqa: E731
    batched = stack([seeded(make, i) for i in range(3)])
    original = factory()
    layer = batched if call is None else batched.module
    assert type(layer).__name__.startswith("Batched") == isinstance(original, SWAPPED), type(layer)
    compare_training(batched, [seeded(make, i) for i in range(3)], make_input)


def _adaptive(m, x):
    return m(x[:, 0], x[:, 0, 0].long() % 20)[0]


REFUSED = {
    "MultiheadAttention time-major": (
        lambda: _Single(nn.MultiheadAttention(8, 2), lambda m, x: m(x, x, x)[0]),
        r"multi_head_attention_forward.*samples on the batch dimension",
    ),
    "GRU time-major": (lambda: _Single(nn.GRU(8, 6), _first), r"torch.gru.*samples on the batch dimension"),
    "EmbeddingBag with offsets": (
        lambda: _Single(nn.EmbeddingBag(10, 8), lambda m, x: m(x.flatten().long().abs() % 10, torch.arange(0, 6, 2))),
        r"cannot be split among the models|ambiguous",
    ),
    "AdaptiveLogSoftmaxWithLoss": (
        lambda: _Single(nn.AdaptiveLogSoftmaxWithLoss(8, 20, [5, 10], div_value=2.0), _adaptive),
        r"Tensor.numel reads the size of a tensor computed from the models. samples \(Tensor.nonzero of",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_torch_layers_that_cannot_run_per_model_are_refused(name: str) -> None:
    """stack folds the models into the inputs' first dimension: a time-major input (T, B, *) would fold
    the models into time. Refused, naming the function, as is code without a rule."""
    factory, match = REFUSED[name]
    batched = stack([seeded(factory, i) for i in range(2)])
    with pytest.raises(ValueError, match=match):
        batched(torch.randn(2, 5, 3, 8, dtype=torch.float64))


def _encoders(nested: bool) -> list[nn.Module]:
    def make():
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)

    return [seeded(make, i).eval() for i in range(3)]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("nested", [True, False], ids=["nested fast path", "enable_nested_tensor=False"])
def test_transformer_encoder_with_padding_in_inference(nested: bool) -> None:
    """torch's nested-tensor fast path (eval, no gradients, a padding mask) zeroes padded positions, a path
    the stacked model cannot take: refused there; exact everywhere else, and after unstack the originals'
    own fast path is back."""
    from batchlayers import unstack

    models = _encoders(nested)
    batched = stack(models)
    x = torch.randn(3, 4, 6, 8, dtype=torch.float64)
    padding = torch.zeros(3, 4, 6, dtype=torch.bool)
    padding[:, :2, -2:] = True
    with torch.no_grad():
        if nested:
            with pytest.raises(ValueError, match=r"TransformerEncoder: in eval mode.*nested-tensor fast path"):
                batched(x, src_key_padding_mask=padding)
        else:
            out = batched(x, src_key_padding_mask=padding)
            expected = torch.stack([m(x[i], src_key_padding_mask=padding[i]) for i, m in enumerate(models)])
            assert_close(out, expected, msg="eval, no gradients, padding")
        assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="without padding")
        back = unstack(batched)[1]
        assert_close(back(x[1], src_key_padding_mask=padding[1]), models[1](x[1], src_key_padding_mask=padding[1]))
    out = batched(x, src_key_padding_mask=padding)  # with gradients: torch's ordinary path for both
    expected = torch.stack([m(x[i], src_key_padding_mask=padding[i]) for i, m in enumerate(models)])
    assert_close(out, expected, msg="with gradients")


@pytest.mark.parametrize("shared", [False, True], ids=["own batches", "shared batch"])
def test_unet_with_transposed_convolutions(shared: bool) -> None:
    compare_training(
        stack([seeded(zoo.TinyUNet, i) for i in range(3)]),
        [seeded(zoo.TinyUNet, i) for i in range(3)],
        lambda lead: torch.randn(*lead, 3, 10, 10, dtype=torch.float64),
        shared=shared,
    )


class _Pair(nn.Module):
    """Source and target token ids side by side in one (B, S + T) input, for compare_training."""

    def __init__(self, model: nn.Module, split: int) -> None:
        super().__init__()
        self.model, self.split = model, split

    def forward(self, ids):
        return self.model(ids[:, : self.split], ids[:, self.split :])


@pytest.mark.parametrize("shared", [False, True], ids=["own batches", "shared batch"])
def test_seq2seq_gru_with_attention(shared: bool) -> None:
    make = lambda: _Pair(zoo.Seq2SeqGRU(), 5)  # noqa: E731
    compare_training(
        stack([seeded(make, i) for i in range(3)]),
        [seeded(make, i) for i in range(3)],
        lambda lead: torch.randint(0, 12, (*lead, 9)),
        shared=shared,
    )


def test_lstm_language_model_with_tied_weights() -> None:
    """Training against the originals, the in-forward loss per model, and unstack keeps the tie."""
    from batchlayers import unstack

    models = [seeded(zoo.LSTMLanguageModel, i) for i in range(3)]
    references = [seeded(zoo.LSTMLanguageModel, i) for i in range(3)]
    batched = stack(models)
    compare_training(batched, references, lambda lead: torch.randint(0, 11, (*lead, 6)))
    idx, targets = torch.randint(0, 11, (3, 4, 6)), torch.randint(0, 11, (3, 4, 6))
    _, losses = batched(idx, targets)
    assert_close(losses, torch.stack([r(idx[i], targets[i])[1] for i, r in enumerate(references)]), msg="loss")
    for back, reference in zip(unstack(batched), references):
        assert back.head.weight is back.embed.weight
        assert_close(back(idx[0]), reference(idx[0]), msg="unstacked")
