"""Every batched layer under ``torch.func`` transforms: per-sample gradients (``vmap(grad(...))`` over each
model's samples, through ``functional_call``) and forward-mode tangents (``torch.autograd.forward_ad``),
against each model's torch.nn layer (from ``unstack``) sample by sample, in float64.

The layers' own autograd Functions, channels-last copies and index checks must step aside under a transform
(see the torch-func guide); a layer that computed a wrong per-sample gradient there would do so silently.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, grad, vmap

import batchlayers as bl

M, B = 3, 4
F64 = torch.float64


def _tokens(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, 10, (M, B, *shape))


def _floats(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(M, B, *shape, dtype=F64)


# name: (layer, input, how many times the input is passed: attention takes it as query, key and value)
LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], int]] = {
    "linear": (lambda: bl.BatchedLinear(M, 4, 2), _floats(4), 1),
    "bilinear": (lambda: bl.BatchedBilinear(M, 3, 3, 2), _floats(3), 2),
    "chain": (
        lambda: bl.BatchedSequential(bl.BatchedLinear(M, 4, 8), nn.GELU(), bl.BatchedLinear(M, 8, 2)),
        _floats(4),
        1,
    ),
    "conv1d-same": (lambda: bl.BatchedConv1d(M, 3, 4, 3, padding="same"), _floats(3, 8), 1),
    "conv2d": (lambda: bl.BatchedConv2d(M, 3, 4, 3), _floats(3, 6, 6), 1),
    "conv3d": (lambda: bl.BatchedConv3d(M, 2, 3, 2), _floats(2, 4, 4, 4), 1),
    "conv-transpose2d": (lambda: bl.BatchedConvTranspose2d(M, 3, 4, 3, stride=2), _floats(3, 4, 4), 1),
    "embedding": (lambda: bl.BatchedEmbedding(M, 10, 4, padding_idx=0), _tokens(3), 1),
    "embedding-scale-grad": (lambda: bl.BatchedEmbedding(M, 10, 4, scale_grad_by_freq=True), _tokens(3), 1),
    "embedding-bag-mean": (lambda: bl.BatchedEmbeddingBag(M, 10, 4, mode="mean"), _tokens(3), 1),
    "embedding-bag-max": (lambda: bl.BatchedEmbeddingBag(M, 10, 4, mode="max"), _tokens(3), 1),
    "layer-norm": (lambda: bl.BatchedLayerNorm(M, 6), _floats(6), 1),
    "rms-norm": (lambda: bl.BatchedRMSNorm(M, 6), _floats(6), 1),
    "group-norm": (lambda: bl.BatchedGroupNorm(M, 2, 4), _floats(4, 3), 1),
    "instance-norm2d": (lambda: bl.BatchedInstanceNorm2d(M, 3, affine=True), _floats(3, 4, 4), 1),
    "batch-norm-eval": (lambda: bl.BatchedBatchNorm1d(M, 3).eval(), _floats(3), 1),
    "prelu": (lambda: bl.BatchedPReLU(M, 3), _floats(3, 5), 1),
    "gru": (lambda: bl.BatchedGRU(M, 4, 5, batch_first=True), _floats(6, 4), 1),
    "lstm-proj": (lambda: bl.BatchedLSTM(M, 4, 6, batch_first=True, proj_size=3), _floats(6, 4), 1),
    "rnn-bidirectional": (
        lambda: bl.BatchedRNN(M, 4, 5, num_layers=2, batch_first=True, bidirectional=True),
        _floats(6, 4),
        1,
    ),
    "lstm-cell": (lambda: bl.BatchedLSTMCell(M, 4, 5), _floats(4), 1),
    "gru-cell": (lambda: bl.BatchedGRUCell(M, 4, 5), _floats(4), 1),
    "attention": (
        lambda: bl.BatchedMultiheadAttention(M, 8, 2, batch_first=True, add_bias_kv=True, add_zero_attn=True),
        _floats(5, 8),
        3,
    ),
}
# torch's own layer has no forward-mode formula here (aten::_embedding_bag), so neither does the batched one
NO_FORWARD_AD = {"embedding-bag-mean", "embedding-bag-max"}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _setup(name: str):
    torch.manual_seed(0)
    make_layer, make_input, uses = LAYERS[name]
    layer = make_layer().double()
    params = {k: v.detach() for k, v in layer.named_parameters()}
    return layer, bl.unstack(layer), params, make_input(), uses


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # (torch's fallback for EmbeddingBag)
@pytest.mark.parametrize("name", list(LAYERS))
def test_per_sample_gradients_under_vmap_equal_each_models_layer(name: str) -> None:
    layer, models, params, x, uses = _setup(name)

    def loss(p, sample):  # one sample of every model: (M, 1, *)
        return _first(functional_call(layer, p, (sample.unsqueeze(1),) * uses)).square().sum()

    found = vmap(grad(loss), in_dims=(None, 1))(params, x)  # each gradient (B, M, *)
    for m, model in enumerate(models):
        for b in range(B):
            model.zero_grad()
            _first(model(*(x[m, b : b + 1],) * uses)).square().sum().backward()
            for key, p in model.named_parameters():
                expected = torch.zeros_like(p) if p.grad is None else p.grad
                torch.testing.assert_close(found[key][b, m], expected, msg=f"{key}, model {m}, sample {b}")


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # (torch's, on first use)
@pytest.mark.parametrize("name", sorted(set(LAYERS) - NO_FORWARD_AD))
def test_forward_mode_tangents_equal_each_models_layer(name: str) -> None:
    layer, models, params, x, uses = _setup(name)
    key = next(iter(params))
    tangent = torch.randn_like(params[key])

    def output_and_tangent(module, weights, inputs, direction):
        with fwAD.dual_level():
            dual = fwAD.make_dual(weights[key], direction)
            out = _first(functional_call(module, {**weights, key: dual}, (inputs,) * uses))
            return fwAD.unpack_dual(out)

    out, out_tangent = output_and_tangent(layer, params, x, tangent)
    for m, model in enumerate(models):
        weights = {k: v.detach() for k, v in model.named_parameters()}
        expected, expected_tangent = output_and_tangent(model, weights, x[m], tangent[m])
        torch.testing.assert_close(out[m], expected, msg=f"output, model {m}")
        torch.testing.assert_close(out_tangent[m], expected_tangent, msg=f"tangent, model {m}")
