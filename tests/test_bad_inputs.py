"""A table of wrong inputs to every public function and class (issue 13, item 5).

The contract: bad input gets a clear ``ValueError``/``TypeError`` naming the layer, function or module path, the
expected and the actual value or shape; nothing is silently broadcast, rounded or fixed, and nothing the caller
holds is changed. (Dtype and device mixes raise a ``RuntimeError``, the error torch raises for them.) Each row
is a call, the exception type and the words its message must contain. Rows already in ``test_clear_errors.py``
and ``test_convert_errors.py`` are not repeated here.
"""

from __future__ import annotations

import copy
import json

import models as zoo
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import batchlayers as bl
import batchlayers.functional as BF
from batchlayers import losses as L
from batchlayers.distributed import ModelShard, load_population_, save_population
from batchlayers.functional._norm import instance_norm
from batchlayers.optim import SGD, Adam, AdamW, RMSprop
from batchlayers.optim.lr_scheduler import ReduceLROnPlateau

M = 3  # models in every row


def r(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, dtype=dtype)


def idx(*shape: int, high: int = 5) -> Tensor:
    return torch.randint(high, shape)


def per_model(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def params(num_models: int = M) -> list[nn.Parameter]:
    out = [nn.Parameter(r(num_models, 4, 2)), nn.Parameter(r(num_models, 2))]
    for p in out:
        p.grad = torch.ones_like(p)
    return out


def stepped(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def set_and_step(opt, key, value):
    opt.param_groups[0][key] = value
    return stepped(opt)


def lstm_weights(num_models: int = M, input_size: int = 4, hidden: int = 5) -> list[Tensor]:
    g = 4 * hidden
    return [r(num_models, g, input_size), r(num_models, g, hidden), r(num_models, g), r(num_models, g)]


def rnn(mode, x, hx=None, weights=None, **kwargs):
    options = dict(num_layers=1, bias=True, batch_first=False, dropout=0.0, training=False, bidirectional=False)
    return BF.rnn(mode, x, hx, lstm_weights() if weights is None else weights, **{**options, **kwargs})


def mha(query, key, value, heads=2, in_proj=None, out_proj=None, **kwargs):
    in_proj = r(M, 24, 8) if in_proj is None else in_proj
    out_proj = r(M, 8, 8) if out_proj is None else out_proj
    extra = {k: kwargs.pop(k) for k in ("in_proj_bias", "bias_k", "bias_v", "out_proj_bias") if k in kwargs}
    return BF.multi_head_attention(
        query,
        key,
        value,
        heads,
        in_proj,
        extra.get("in_proj_bias"),
        extra.get("bias_k"),
        extra.get("bias_v"),
        False,
        0.0,
        out_proj,
        extra.get("out_proj_bias"),
        **kwargs,
    )


def qkv(batch: int = 2, tgt: int = 5, src: int = 6, embed: int = 8, num_models: int = M):
    return r(num_models, batch, tgt, embed), r(num_models, batch, src, embed), r(num_models, batch, src, embed)


def stacked_mlp():
    return bl.stack([zoo.MLP() for _ in range(M)])


def linear_with(optimizer_factory):
    layer = bl.BatchedLinear(M, 4, 2)
    return layer, optimizer_factory(layer.parameters())


def keep_with_stale_step_scheduler():
    layer, opt = linear_with(lambda p: Adam(p, lr=per_model(0.1, 0.2, 0.3)))
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    bl.keep_models_(layer, opt, [2, 0, 1])


def plateau_after_index_models():
    layer, opt = linear_with(lambda p: SGD(p, lr=per_model(0.1, 0.2, 0.3)))
    scheduler = ReduceLROnPlateau(opt)
    bl.index_models_(layer, [0, 2])  # the model only, where keep_models_ would have kept the optimizer too
    scheduler.step(per_model(1.0, 2.0))


def copy_with_stale_step_scheduler():
    layer, opt = linear_with(lambda p: SGD(p, lr=per_model(0.1, 0.2, 0.3)))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    bl.copy_model_(layer, opt, 0, 2)


def keep_with_foreign_scheduler():
    layer, opt = linear_with(lambda p: SGD(p, lr=per_model(0.1, 0.2, 0.3)))
    other = SGD(params(), lr=0.1)
    bl.keep_models_(layer, opt, [0], schedulers=[torch.optim.lr_scheduler.StepLR(other, 1)])


def schedulers_of(opt, kinds):
    make = {
        "StepLR": lambda: torch.optim.lr_scheduler.StepLR(opt, 1),
        "ExponentialLR": lambda: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9),
        "ReduceLROnPlateau": lambda: ReduceLROnPlateau(opt),
    }
    return [make[kind]() for kind in kinds]


def save_population_with_foreign_scheduler(tmp, with_optimizer=True):
    layer, opt = linear_with(lambda p: SGD(p, lr=per_model(0.1, 0.2, 0.3)))
    foreign = schedulers_of(SGD(params(), lr=0.1), ["StepLR"])
    save_population(tmp / "population", layer, ModelShard(M), opt if with_optimizer else None, schedulers=foreign)


class PerModelFactor:
    """A callable object LambdaLR saves in its state_dict(), holding an (M,) tensor."""

    def __init__(self) -> None:
        self.factor = per_model(1.0, 0.5, 0.25)

    def __call__(self, epoch: int) -> float:
        return 1.0


def save_population_with_scheduler(tmp, make_optimizer, make_scheduler):
    layer = bl.BatchedLinear(M, 4, 2)
    opt = make_optimizer(layer.parameters())
    save_population(tmp / "population", layer, ModelShard(M), opt, schedulers=[make_scheduler(opt)])


def load_population_with(tmp, kinds, saved=("StepLR", "ReduceLROnPlateau"), float_lr=False, foreign=False):
    """Save a population of M linear models with schedulers of the kinds ``saved`` (``None``: without schedulers),
    load it with schedulers of ``kinds`` (of another optimizer with ``foreign``); a refused load changes nothing."""
    layer, opt = linear_with(lambda p: SGD(p, lr=per_model(0.1, 0.2, 0.3)))
    save_population(tmp / "population", layer, ModelShard(M), opt, schedulers=saved and schedulers_of(opt, saved))
    layer, opt = linear_with(lambda p: SGD(p, lr=0.1 if float_lr else per_model(0.4, 0.5, 0.6)))
    schedulers = schedulers_of(SGD(params(), lr=0.1) if foreign else opt, kinds)
    before = _snapshot(layer, opt, *schedulers)
    try:
        load_population_(tmp / "population", layer, ModelShard(M), opt, schedulers=schedulers)
    except (TypeError, ValueError):
        _assert_same(before, _snapshot(layer, opt, *schedulers))
        raise


def plateau(**kwargs):
    return ReduceLROnPlateau(SGD(params(), lr=per_model(0.1, 0.2, 0.3)), **kwargs)


def verify_mlp(x, **kwargs):
    models = [zoo.MLP() for _ in range(M)]
    return bl.verify(models, bl.stack(models), x, **kwargs)


CONSTRUCTORS = [
    pytest.param(lambda: bl.BatchedConv2d(M, -3, 4, 3), ValueError, ("BatchedConv2d", "in_channels", "-3"), id="conv2d-negative-in-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, "4", 3), TypeError, ("BatchedConv2d", "out_channels", "'4'"), id="conv2d-str-out-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 0), ValueError, ("BatchedConv2d", "kernel_size", ">= 1", "got 0"), id="conv2d-kernel-0"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 2.5), TypeError, ("BatchedConv2d", "kernel_size", "2.5"), id="conv2d-float-kernel"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, (3, 3, 3)), TypeError, ("BatchedConv2d", "kernel_size", "2 ints", "(3, 3, 3)"), id="conv2d-kernel-of-3d"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv1d(M, 3, 4, 3, stride=0), ValueError, ("BatchedConv1d", "stride", "got 0"), id="conv1d-stride-0"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv1d(M, 3, 4, 3, dilation=0), ValueError, ("BatchedConv1d", "dilation", "got 0"), id="conv1d-dilation-0"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv3d(M, 3, 4, 3, padding=-1), ValueError, ("BatchedConv3d", "padding", ">= 0", "-1"), id="conv3d-negative-padding"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv3d(M, 3, 4, 3, padding=(1, 1)), TypeError, ("BatchedConv3d", "padding", "3 ints", "(1, 1)"), id="conv3d-padding-of-2d"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 4, 4, 3, groups=2.0), ValueError, ("BatchedConv2d", "groups", "2.0"), id="conv2d-float-groups"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConvTranspose2d(M, 3, 4, 3, output_padding=-1), ValueError, ("BatchedConvTranspose2d", "output_padding", "-1"), id="convtranspose2d-negative-output-padding"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConvTranspose1d(M, 3, 4, 3, stride=(2, 2)), TypeError, ("BatchedConvTranspose1d", "stride", "1 ints", "(2, 2)"), id="convtranspose1d-stride-of-2d"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConvTranspose3d(M, 3.0, 4, 3), TypeError, ("BatchedConvTranspose3d", "in_channels", "3.0"), id="convtranspose3d-float-in-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLayerNorm(M, -4), ValueError, ("BatchedLayerNorm", "normalized_shape", "-4"), id="layernorm-negative"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLayerNorm(M, 4.0), TypeError, ("BatchedLayerNorm", "normalized_shape", "4.0"), id="layernorm-float"),  # noqa: E501
    pytest.param(lambda: bl.BatchedRMSNorm(M, [4, -1]), ValueError, ("BatchedRMSNorm", "normalized_shape", "-1"), id="rmsnorm-negative-entry"),  # noqa: E501
    pytest.param(lambda: bl.BatchedRMSNorm(M, "4"), TypeError, ("BatchedRMSNorm", "normalized_shape", "str"), id="rmsnorm-str"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGroupNorm(M, 0, 4), ValueError, ("BatchedGroupNorm", "num_groups", "got 0"), id="groupnorm-0-groups"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGroupNorm(M, 2, 4.0), TypeError, ("BatchedGroupNorm", "num_channels", "4.0"), id="groupnorm-float-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm1d(M, -4), ValueError, ("BatchedBatchNorm1d", "num_features", "-4"), id="batchnorm1d-negative"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm2d(M, 4.0), TypeError, ("BatchedBatchNorm2d", "num_features", "4.0"), id="batchnorm2d-float"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm2d(M, 4, momentum=torch.full((2,), 0.1)), TypeError, ("BatchedBatchNorm2d", "momentum", "(2,)"), id="batchnorm2d-tensor-momentum"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm3d(M, 4, momentum="0.1"), TypeError, ("BatchedBatchNorm3d", "momentum", "'0.1'"), id="batchnorm3d-str-momentum"),  # noqa: E501
    pytest.param(lambda: bl.BatchedInstanceNorm1d(M, 4.5), TypeError, ("BatchedInstanceNorm1d", "num_features", "4.5"), id="instancenorm1d-float"),  # noqa: E501
    pytest.param(lambda: bl.BatchedPReLU(M, 0), ValueError, ("BatchedPReLU", "num_parameters", "got 0"), id="prelu-0-parameters"),  # noqa: E501
    pytest.param(lambda: bl.BatchedPReLU(M, 2.0), TypeError, ("BatchedPReLU", "num_parameters", "2.0"), id="prelu-float"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbedding(M, -5, 4), ValueError, ("BatchedEmbedding", "num_embeddings", "-5"), id="embedding-negative"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbedding(M, 5, 4.0), TypeError, ("BatchedEmbedding", "embedding_dim", "4.0"), id="embedding-float-dim"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag(M, 5, -4), ValueError, ("BatchedEmbeddingBag", "embedding_dim", "-4"), id="embeddingbag-negative-dim"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag(M, 5, 4, padding_idx=5), ValueError, ("BatchedEmbeddingBag", "padding_idx", "num_embeddings=5", "got 5"), id="embeddingbag-padding-idx"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag.from_pretrained(r(5, 4)), ValueError, ("BatchedEmbeddingBag.from_pretrained", "(M, num_embeddings, embedding_dim)", "(5, 4)"), id="embeddingbag-pretrained-2d"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8.0, 2), TypeError, ("BatchedMultiheadAttention", "embed_dim", "8.0"), id="mha-float-embed-dim"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 3), ValueError, ("BatchedMultiheadAttention", "embed_dim (8)", "num_heads (3)"), id="mha-heads-not-dividing"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2, dropout=1.5), ValueError, ("BatchedMultiheadAttention", "dropout", "1.5"), id="mha-dropout-above-1"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2, kdim=0), ValueError, ("BatchedMultiheadAttention", "kdim", "got 0"), id="mha-kdim-0"),  # noqa: E501
    pytest.param(lambda: bl.BatchedRNNCell(M, -4, 5), ValueError, ("BatchedRNNCell", "input_size", "-4"), id="rnncell-negative-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLSTMCell(M, 4, 5.0), TypeError, ("BatchedLSTMCell", "hidden_size", "5.0"), id="lstmcell-float-hidden"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGRUCell(0, 4, 5), ValueError, ("BatchedGRUCell", "num_models", "got 0"), id="grucell-0-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLSTM(M, 4, 5, bidirectional=1), TypeError, ("BatchedLSTM", "bidirectional", "bool"), id="lstm-int-bidirectional"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGRU(M, 4, 5, num_layers=0), ValueError, ("BatchedGRU", "num_layers", "got 0"), id="gru-0-layers"),  # noqa: E501
    pytest.param(lambda: bl.BatchedRNN(M, 4, 5, num_layers=2, dropout=-0.1), ValueError, ("BatchedRNN", "dropout", "-0.1"), id="rnn-negative-dropout"),  # noqa: E501
    pytest.param(lambda: bl.Folded(nn.BatchNorm1d(4)), ValueError, ("Folded(BatchNorm1d)", "weight", "share"), id="folded-module-with-parameters"),  # noqa: E501
    pytest.param(lambda: setattr(bl.BatchedConv2d(M, 3, 4, 3), "strategy", "fast"), ValueError, ("BatchedConv2d", "strategy", "'fast'"), id="conv2d-strategy"),  # noqa: E501
]  # fmt: skip

# Inputs in the wrong layout (models on another dimension, a missing M, features swapped): the layer that
# receives the input raises, naming itself (and its path in a stacked model), the expected and the actual shape.
FORWARD = [
    pytest.param(lambda: bl.BatchedLinear(M, 4, 5)(r(5, M, 4)), ValueError, ("BatchedLinear", "(M, *, in_features)", "dimension 0 (models) is 5, not 3", "(5, 3, 4)"), id="linear-batch-before-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLinear(M, 4, 5)(idx(M, 2, 4)), RuntimeError, ("BatchedLinear", "torch.float32", "torch.int64"), id="linear-integer-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLinear(M, 4, 5)(r(M, 2, 4, dtype=torch.float64)), RuntimeError, ("BatchedLinear", "torch.float32", "torch.float64"), id="linear-float64-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBilinear(M, 4, 6, 5)(r(M, 2, 6), r(M, 2, 4)), ValueError, ("BatchedBilinear", "input1", "in1_features=4", "(3, 2, 6)"), id="bilinear-inputs-swapped"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBilinear(M, 4, 6, 5)(r(M, 2, 4), r(M, 3, 6)), ValueError, ("BatchedBilinear", "same (M, *)", "(3, 2, 4)", "(3, 3, 6)"), id="bilinear-batch-differs"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBilinear(M, 4, 6, 5)(r(M, 2, 4), r(M, 2, 6, dtype=torch.float64)), RuntimeError, ("BatchedBilinear", "input2", "torch.float64"), id="bilinear-float64-input2"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 3)(r(2, 3, 8, 8)), ValueError, ("BatchedConv2d", "5-D", "(M, B, C_in, H, W)", "(2, 3, 8, 8)"), id="conv2d-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 3)(r(2, M, 3, 8, 8)), ValueError, ("BatchedConv2d", "dimension 0 (models) is 2, not 3", "(2, 3, 3, 8, 8)"), id="conv2d-batch-before-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 3)(r(M, 2, 8, 8, 3)), ValueError, ("BatchedConv2d", "C_in=3", "dimension 2 (channels) is 8", "(3, 2, 8, 8, 3)"), id="conv2d-channels-last"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 3)(r(M, 2, 3, 2, 8)), ValueError, ("BatchedConv2d", "H=2", "kernel_size=3", "(3, 2, 3, 2, 8)"), id="conv2d-smaller-than-kernel"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv2d(M, 3, 4, 3)(r(M, 2, 3, 8, 8, dtype=torch.float64)), RuntimeError, ("BatchedConv2d", "torch.float32", "torch.float64"), id="conv2d-float64-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv1d(M, 3, 4, 3)(r(2, 3, 8)), ValueError, ("BatchedConv1d", "4-D", "(M, B, C_in, L)", "(2, 3, 8)"), id="conv1d-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConv3d(M, 3, 4, 3)(r(M, 2, 4, 5, 5, 5)), ValueError, ("BatchedConv3d", "C_in=3", "is 4", "(3, 2, 4, 5, 5, 5)"), id="conv3d-wrong-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConvTranspose2d(M, 3, 4, 3)(r(2, 3, 8, 8)), ValueError, ("BatchedConvTranspose2d", "5-D", "(2, 3, 8, 8)"), id="convtranspose2d-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConvTranspose1d(M, 3, 4, 3)(idx(M, 2, 3, 8)), RuntimeError, ("BatchedConvTranspose1d", "torch.float32", "torch.int64"), id="convtranspose1d-integer-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedConvTranspose3d(M, 3, 4, 3)(r(M, 2, 5, 4, 4, 4)), ValueError, ("BatchedConvTranspose3d", "C_in=3", "is 5"), id="convtranspose3d-wrong-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLayerNorm(M, 4)(r(2, M, 4)), ValueError, ("BatchedLayerNorm", "dimension 0 (models) is 2, not 3", "(2, 3, 4)"), id="layernorm-batch-before-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLayerNorm(M, (2, 4))(r(M, 5, 4, 2)), ValueError, ("BatchedLayerNorm", "normalized_shape[0]=2", "(3, 5, 4, 2)"), id="layernorm-trailing-transposed"),  # noqa: E501
    pytest.param(lambda: bl.BatchedRMSNorm(M, 4)(r(M, 4)[None]), ValueError, ("BatchedRMSNorm", "dimension 0 (models) is 1, not 3", "(1, 3, 4)"), id="rmsnorm-extra-leading-dim"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGroupNorm(M, 2, 4)(r(2, 4, 5)), ValueError, ("BatchedGroupNorm", "(M, B, C, *)", "dimension 0 (models) is 2", "(2, 4, 5)"), id="groupnorm-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGroupNorm(M, 2, 4)(r(M, 2, 5, 4)), ValueError, ("BatchedGroupNorm", "C=4", "dimension 2 (channels) is 5", "(3, 2, 5, 4)"), id="groupnorm-channels-last"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm1d(M, 4)(r(M, 4)), ValueError, ("BatchedBatchNorm1d", "3 or 4-D", "(M, B, C)", "(3, 4)"), id="batchnorm1d-missing-batch"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm2d(M, 4)(r(2, 4, 5, 5)), ValueError, ("BatchedBatchNorm2d", "5-D", "(M, B, C, H, W)", "(2, 4, 5, 5)"), id="batchnorm2d-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm2d(M, 4)(r(2, M, 4, 5, 5)), ValueError, ("BatchedBatchNorm2d", "dimension 0 (models) is 2, not 3"), id="batchnorm2d-batch-before-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm3d(M, 4)(r(M, 2, 3, 4, 4, 4)), ValueError, ("BatchedBatchNorm3d", "C=4", "is 3"), id="batchnorm3d-wrong-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBatchNorm2d(M, 4)(r(M, 2, 4, 5, 5, dtype=torch.float64)), RuntimeError, ("BatchedBatchNorm2d", "torch.float64", "torch.float32"), id="batchnorm2d-float64-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedInstanceNorm1d(M, 4)(r(M, 4, 5)), ValueError, ("BatchedInstanceNorm1d", "4-D", "(M, B, C, L)", "(3, 4, 5)"), id="instancenorm1d-missing-batch"),  # noqa: E501
    pytest.param(lambda: bl.BatchedInstanceNorm3d(M, 4)(r(M, 2, 4, 5, 5)), ValueError, ("BatchedInstanceNorm3d", "6-D", "(M, B, C, D, H, W)", "(3, 2, 4, 5, 5)"), id="instancenorm3d-2d-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedInstanceNorm2d(M, 4)(r(M, 2, 4, 1, 1)), ValueError, ("BatchedInstanceNorm2d", "more than 1 spatial element", "(3, 2, 4, 1, 1)"), id="instancenorm2d-one-pixel"),  # noqa: E501
    pytest.param(lambda: bl.BatchedPReLU(M, 4)(r(M, 2, 5)), ValueError, ("BatchedPReLU", "num_parameters=4", "is 5"), id="prelu-wrong-channels"),  # noqa: E501
    pytest.param(lambda: bl.BatchedPReLU(M)(r(M, 2, 5, dtype=torch.float64)), RuntimeError, ("BatchedPReLU", "torch.float32", "torch.float64"), id="prelu-float64-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbedding(M, 5, 4)(idx(7, 2)), ValueError, ("BatchedEmbedding", "indices", "dimension 0 (models) is 7, not 3"), id="embedding-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbedding(M, 5, 4)(idx(M)), ValueError, ("BatchedEmbedding", "(M, B, *)", "too few dimensions", "(3)"), id="embedding-missing-batch"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbedding(M, 5, 4)(r(M, 2, dtype=torch.float64)), TypeError, ("BatchedEmbedding", "integer indices", "torch.float64"), id="embedding-float64-indices"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag(M, 5, 4)(idx(M, 4)), ValueError, ("BatchedEmbeddingBag", "(M, B, bag)", "need offsets", "(3, 4)"), id="embeddingbag-2d-without-offsets"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag(M, 5, 4)(idx(2, 3, 2)), ValueError, ("BatchedEmbeddingBag", "dimension 0 (models) is 2, not 3"), id="embeddingbag-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag(M, 5, 4, mode="sum")(idx(M, 2, 3), per_sample_weights=r(M, 3, 2)), ValueError, ("BatchedEmbeddingBag", "per_sample_weights", "(3, 2, 3)", "(3, 3, 2)"), id="embeddingbag-per-sample-weights-shape"),  # noqa: E501
    pytest.param(lambda: bl.BatchedEmbeddingBag(M, 5, 4)(idx(M, 4), torch.zeros(2, dtype=torch.long)), ValueError, ("BatchedEmbeddingBag", "offsets", "(M, B)", "(2)"), id="embeddingbag-offsets-missing-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2)(*qkv()), ValueError, ("BatchedMultiheadAttention", "(M, L, B, E)", "batch_first=False", "(3, 2, 5, 8)"), id="mha-batch-first-input-to-sequence-first"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2, batch_first=True)(*qkv(embed=6)), ValueError, ("BatchedMultiheadAttention", "query", "embed_dim=8", "is 6"), id="mha-wrong-embed-dim"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2, batch_first=True)(*qkv(), attn_mask=torch.zeros(5, 6, dtype=torch.long)), TypeError, ("attn_mask", "bool and floating", "torch.int64"), id="mha-integer-attn-mask"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2, batch_first=True)(*qkv(), attn_mask=torch.zeros(2, 5, 6, dtype=torch.bool)), ValueError, ("BatchedMultiheadAttention", "attn_mask", "(M, L, S) = (3, 5, 6)", "(2, 5, 6)"), id="mha-attn-mask-per-batch"),  # noqa: E501
    pytest.param(lambda: bl.BatchedMultiheadAttention(M, 8, 2, batch_first=True)(*(t.double() for t in qkv())), RuntimeError, ("BatchedMultiheadAttention", "query", "torch.float32", "torch.float64"), id="mha-float64-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLSTM(M, 4, 5, batch_first=True)(r(M, 2, 0, 4)), ValueError, ("BatchedLSTM", "at least one time step", "(3, 2, 0, 4)"), id="lstm-no-time-steps"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLSTM(M, 4, 5)(r(M, 7, 2, 4), (r(1, 2, 5), r(1, 2, 5))), ValueError, ("BatchedLSTM", "h_0", "(3, 1, 2, 5)", "(1, 2, 5)"), id="lstm-state-without-models"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGRU(M, 4, 5)(r(M, 7, 2, 4), (r(M, 1, 2, 5),)), TypeError, ("BatchedGRU", "h_0", "Tensor", "tuple"), id="gru-state-in-tuple"),  # noqa: E501
    pytest.param(lambda: bl.BatchedRNN(M, 4, 5)(r(M, 7, 2, 4), r(1, M, 2, 5)), ValueError, ("BatchedRNN", "(3, 1, 2, 5)", "(1, 3, 2, 5)"), id="rnn-state-layers-first"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLSTMCell(M, 4, 5)(r(M, 2, 4), r(M, 2, 5)), TypeError, ("BatchedLSTMCell", "hx", "(h, c)"), id="lstmcell-state-not-a-pair"),  # noqa: E501
    pytest.param(lambda: bl.BatchedGRUCell(M, 4, 5)(r(M, 2, 4), r(2, 5)), ValueError, ("BatchedGRUCell", "(3, 2, 5)", "(2, 5)"), id="grucell-state-without-models"),  # noqa: E501
    pytest.param(lambda: bl.Folded(nn.Flatten())(r(M)), ValueError, ("Folded(Flatten)", "(M, B, *)", "(3,)"), id="folded-1d"),  # noqa: E501
    pytest.param(lambda: nn.Sequential(bl.BatchedLinear(M, 4, 8), nn.ReLU(), bl.BatchedLinear(M, 8, 2))(r(5, M, 4)), ValueError, ("BatchedLinear", "in_features=4", "dimension 0 (models) is 5"), id="sequential-first-layer-blames-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedSequential(bl.BatchedLinear(M, 4, 8), nn.ReLU(), bl.BatchedLinear(M, 8, 2))(r(M, 5, 3)), ValueError, ("BatchedLinear", "in_features=4", "is 3", "(3, 5, 3)"), id="batched-sequential-bad-input"),  # noqa: E501
    pytest.param(lambda: bl.BatchedSequential(bl.BatchedLinear(M, 4, 8), nn.ReLU(), bl.BatchedLinear(M, 9, 2))(r(M, 5, 4)), ValueError, ("BatchedLinear", "in_features=9", "is 8", "(3, 5, 8)"), id="batched-sequential-unchained"),  # noqa: E501
    pytest.param(lambda: stacked_mlp()(r(M, 5, 7)), ValueError, ("BatchedLinear at 'fc1'", "in_features=6", "is 7", "(3, 5, 7)"), id="stacked-first-layer-named-by-path"),  # noqa: E501
    pytest.param(lambda: bl.stack([zoo.CNN() for _ in range(M)])(r(2, 3, 32, 32)), ValueError, ("stacked CNN", "(M, B, *) with M=3", "(2, 3, 32, 32)"), id="stacked-cnn-missing-models"),  # noqa: E501
    pytest.param(lambda: stacked_mlp().load_state_dict(bl.stack_state_dicts([zoo.MLP().state_dict()] * 2)), RuntimeError, ("fc1.weight", "[2, 8, 6]", "[3, 8, 6]"), id="stacked-load-state-dict-of-2-models"),  # noqa: E501
]  # fmt: skip

FUNCTIONAL = [
    pytest.param(lambda: BF.conv(r(2, 2, 3, 8, 8), r(M, 4, 3, 3, 3)), ValueError, ("batchlayers.functional.conv", "M=3", "dimension 0 (models) is 2"), id="F.conv-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 5, 8, 8), r(M, 4, 3, 3, 3)), ValueError, ("batchlayers.functional.conv", "C_in=3", "is 5"), id="F.conv-wrong-channels"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 3, 8, 8), r(M, 4, 3, 3, 3), r(M, 5)), ValueError, ("batchlayers.functional.conv", "bias", "(3, 4)", "(3, 5)"), id="F.conv-bias-other-channels"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 3, 8, 8), r(M, 4, 3, 3, 3), r(4)), ValueError, ("batchlayers.functional.conv", "bias", "(M, C_out) = (3, 4)", "(4)"), id="F.conv-bias-without-models"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 3, 8, 8), r(M, 4, 3, 3, 3)), ValueError, ("batchlayers.functional.conv", "5-D", "(3, 3, 8, 8)"), id="F.conv-missing-batch"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 3, 8), r(4, 3, 3)), ValueError, ("batchlayers.functional.conv", "weight", "(M, C_out, C_in // groups, *kernel_size)", "(4, 3, 3)"), id="F.conv-weight-without-models"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 4, 8, 8), r(M, 4, 2, 3, 3), groups=3), ValueError, ("batchlayers.functional.conv", "C_out=4", "groups=3"), id="F.conv-groups-not-dividing"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 3, 8, 8), r(M, 4, 3, 3, 3), padding="full", padding_mode="reflect"), ValueError, ("batchlayers.functional.conv", "'valid', 'same'", "'full'"), id="F.conv-unknown-padding-string"),  # noqa: E501
    pytest.param(lambda: BF.conv(r(M, 2, 3, 8, 8), r(M, 4, 3, 3, 3), padding=1, padding_mode="mirror"), ValueError, ("batchlayers.functional.conv", "padding_mode", "'mirror'"), id="F.conv-unknown-padding-mode"),  # noqa: E501
    pytest.param(lambda: BF.conv_transpose(r(2, 2, 3, 8, 8), r(M, 3, 4, 3, 3)), ValueError, ("batchlayers.functional.conv_transpose", "dimension 0 (models) is 2, not 3"), id="F.conv_transpose-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: BF.conv_transpose(r(M, 2, 4, 8, 8), r(M, 3, 4, 3, 3)), ValueError, ("batchlayers.functional.conv_transpose", "C_in=3", "is 4"), id="F.conv_transpose-wrong-channels"),  # noqa: E501
    pytest.param(lambda: BF.conv_transpose(r(M, 2, 3, 8), r(M, 3, 4, 3), r(M, 3)), ValueError, ("batchlayers.functional.conv_transpose", "bias", "(3, 4)", "(3, 3)"), id="F.conv_transpose-bias-other-channels"),  # noqa: E501
    pytest.param(lambda: BF.batch_norm(r(2, 4, 5), torch.zeros(M, 5), torch.ones(M, 5), training=True), ValueError, ("batchlayers.functional.batch_norm", "running_mean", "(2, 5)", "(2, 4, 5)", "(3, 5)"), id="F.batch_norm-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: BF.batch_norm(r(M, 4, 6), torch.zeros(M, 5), torch.ones(M, 5)), ValueError, ("batchlayers.functional.batch_norm", "(M, C) = (3, 6)", "(3, 5)"), id="F.batch_norm-other-channels"),  # noqa: E501
    pytest.param(lambda: BF.batch_norm(r(M, 4, 5), None, None, r(5), r(5), training=True), ValueError, ("batchlayers.functional.batch_norm", "weight", "(3, 5)", "(5)"), id="F.batch_norm-weight-without-models"),  # noqa: E501
    pytest.param(lambda: BF.batch_norm(r(M, 4, 5), torch.zeros(M, 5), torch.ones(M, 5), training=True, momentum=torch.full((1,), 0.1)), ValueError, ("batchlayers.functional.batch_norm", "momentum", "(3,)", "(1,)"), id="F.batch_norm-momentum-of-one-value"),  # noqa: E501
    pytest.param(lambda: BF.batch_norm(r(M, 5), None, None, training=True), ValueError, ("batchlayers.functional.batch_norm", "(M, B, C, *)", "(3, 5)"), id="F.batch_norm-missing-batch"),  # noqa: E501
    pytest.param(lambda: BF.batch_norm(r(M, 4, 5), torch.zeros(M, 5), None, training=True), ValueError, ("batchlayers.functional.batch_norm", "running_mean and running_var"), id="F.batch_norm-mean-without-var"),  # noqa: E501
    pytest.param(lambda: instance_norm(r(M, 4, 5, 6), torch.zeros(M, 5), None), ValueError, ("instance_norm", "running_mean was given without running_var"), id="instance_norm-mean-without-var"),  # noqa: E501
    pytest.param(lambda: instance_norm(r(M, 4, 5, 6), None, torch.ones(M, 5)), ValueError, ("instance_norm", "running_var was given without running_mean"), id="instance_norm-var-without-mean"),  # noqa: E501
    pytest.param(lambda: BF.layer_norm(r(M, 2, 4), (4,), r(4), r(4)), ValueError, ("batchlayers.functional.layer_norm", "weight", "(3, 4)", "(4)"), id="F.layer_norm-weight-without-models"),  # noqa: E501
    pytest.param(lambda: BF.layer_norm(r(M, 2, 4), (4,), r(1, 4)), ValueError, ("batchlayers.functional.layer_norm", "weight", "(3, 4)", "(1, 4)"), id="F.layer_norm-weight-of-one-model"),  # noqa: E501
    pytest.param(lambda: BF.layer_norm(r(M, 2, 4), (5,)), ValueError, ("batchlayers.functional.layer_norm", "normalized_shape=5", "is 4"), id="F.layer_norm-other-shape"),  # noqa: E501
    pytest.param(lambda: BF.layer_norm(r(M, 2, 4), 4), TypeError, ("batchlayers.functional.layer_norm", "normalized_shape", "int 4"), id="F.layer_norm-int-shape"),  # noqa: E501
    pytest.param(lambda: BF.rms_norm(r(M, 2, 4), (4,), r(2, 4)), ValueError, ("batchlayers.functional.rms_norm", "weight", "(3, 4)", "(2, 4)"), id="F.rms_norm-weight-of-other-models"),  # noqa: E501
    pytest.param(lambda: BF.rms_norm(r(M, 2, 4), (3,)), ValueError, ("batchlayers.functional.rms_norm", "normalized_shape=3", "is 4"), id="F.rms_norm-other-shape"),  # noqa: E501
    pytest.param(lambda: BF.group_norm(r(M, 2, 6, 5), 4), ValueError, ("batchlayers.functional.group_norm", "C=6", "num_groups=4"), id="F.group_norm-groups-not-dividing"),  # noqa: E501
    pytest.param(lambda: BF.group_norm(r(M, 2, 6, 5), 0), ValueError, ("batchlayers.functional.group_norm", "num_groups", "got 0"), id="F.group_norm-0-groups"),  # noqa: E501
    pytest.param(lambda: BF.group_norm(r(M, 2, 6, 5), 3, r(1, 6), r(1, 6)), ValueError, ("batchlayers.functional.group_norm", "weight", "(3, 6)", "(1, 6)"), id="F.group_norm-weight-of-one-model"),  # noqa: E501
    pytest.param(lambda: BF.embedding(idx(2, 4), r(M, 5, 4)), ValueError, ("batchlayers.functional.embedding", "M=3", "dimension 0 (models) is 2"), id="F.embedding-indices-of-other-models"),  # noqa: E501
    pytest.param(lambda: BF.embedding(r(M, 4), r(M, 5, 4)), TypeError, ("batchlayers.functional.embedding", "integer indices", "torch.float32"), id="F.embedding-float-indices"),  # noqa: E501
    pytest.param(lambda: BF.embedding(idx(M, 4), r(5, 4)), ValueError, ("batchlayers.functional.embedding", "3-D weight", "(5, 4)"), id="F.embedding-weight-without-models"),  # noqa: E501
    pytest.param(lambda: BF.embedding(torch.full((M, 4), 5), r(M, 5, 4)), IndexError, ("batchlayers.functional.embedding", "index 5", "model 0", "num_embeddings=5"), id="F.embedding-index-out-of-range"),  # noqa: E501
    pytest.param(lambda: BF.embedding(idx(M, 4), r(M, 5, 4), padding_idx=7), ValueError, ("batchlayers.functional.embedding", "padding_idx", "num_embeddings=5", "got 7"), id="F.embedding-padding-idx"),  # noqa: E501
    pytest.param(lambda: BF.embedding_bag(idx(M, 4, 2), r(5, 4)), ValueError, ("batchlayers.functional.embedding_bag", "3-D weight", "(5, 4)"), id="F.embedding_bag-weight-without-models"),  # noqa: E501
    pytest.param(lambda: BF.embedding_bag(idx(M, 4, 2), r(M, 5, 4), padding_idx=-6), ValueError, ("batchlayers.functional.embedding_bag", "padding_idx", "got -6"), id="F.embedding_bag-padding-idx"),  # noqa: E501
    pytest.param(lambda: BF.embedding_bag(idx(M, 4, 2), r(M, 5, 4), mode="median"), ValueError, ("embedding_bag", "mode", "'median'"), id="F.embedding_bag-mode"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(), in_proj=r(M, 24, 6)), ValueError, ("batchlayers.functional.multi_head_attention", "in_proj_weight", "(3, 24, 8)", "(3, 24, 6)"), id="F.mha-in-proj-of-other-dim"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(num_models=2)), ValueError, ("batchlayers.functional.multi_head_attention", "query", "dimension 0 (models) is 2, not 3"), id="F.mha-inputs-of-other-models"),  # noqa: E501
    pytest.param(lambda: mha(r(M, 5, 8), r(M, 6, 8), r(M, 6, 8)), ValueError, ("batchlayers.functional.multi_head_attention", "4-D query", "(3, 5, 8)"), id="F.mha-missing-batch"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(), heads=3), ValueError, ("batchlayers.functional.multi_head_attention", "E=8", "num_heads=3"), id="F.mha-heads-not-dividing"),  # noqa: E501
    pytest.param(lambda: mha(r(M, 2, 5, 8), r(M, 2, 6, 8), r(M, 2, 7, 8)), ValueError, ("batchlayers.functional.multi_head_attention", "(3, 2, 6, 8)", "(3, 2, 7, 8)"), id="F.mha-key-value-lengths"),  # noqa: E501
    pytest.param(lambda: BF.multi_head_attention(*qkv(), 2, None, None, None, None, False, 0.0, r(M, 8, 8), None), ValueError, ("batchlayers.functional.multi_head_attention", "q_proj_weight is None"), id="F.mha-no-projection-weights"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(), attn_mask=torch.zeros(6, 5, dtype=torch.bool)), ValueError, ("batchlayers.functional.multi_head_attention", "attn_mask", "(5, 6)", "(6, 5)"), id="F.mha-attn-mask-transposed"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(), key_padding_mask=torch.zeros(2, 6, dtype=torch.bool)), ValueError, ("batchlayers.functional.multi_head_attention", "key_padding_mask", "(3, 2, 6)", "(2, 6)"), id="F.mha-padding-mask-without-models"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(), out_proj_bias=r(8)), ValueError, ("batchlayers.functional.multi_head_attention", "out_proj_bias", "(3, 8)", "(8)"), id="F.mha-out-bias-without-models"),  # noqa: E501
    pytest.param(lambda: mha(*qkv(), bias_k=r(M, 8), bias_v=r(M, 8)), ValueError, ("batchlayers.functional.multi_head_attention", "bias_k", "(3, 1, 1, 8)", "(3, 8)"), id="F.mha-bias-k-shape"),  # noqa: E501
    pytest.param(lambda: rnn("LSTM", r(2, 7, 2, 4)), ValueError, ("batchlayers.functional.rnn", "M=3", "dimension 0 (models) is 2"), id="F.rnn-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: rnn("LSTM", r(M, 7, 2, 6)), ValueError, ("batchlayers.functional.rnn", "input_size=4", "is 6"), id="F.rnn-wrong-input-size"),  # noqa: E501
    pytest.param(lambda: rnn("LSTM", r(M, 7, 2, 4), (r(M, 1, 2, 6), r(M, 1, 2, 5))), ValueError, ("batchlayers.functional.rnn", "h_0", "(3, 1, 2, 5)", "(3, 1, 2, 6)"), id="F.rnn-h0-shape"),  # noqa: E501
    pytest.param(lambda: rnn("LSTM", r(M, 7, 2, 4), r(M, 1, 2, 5)), TypeError, ("batchlayers.functional.rnn", "(h_0, c_0)", "Tensor"), id="F.rnn-lstm-state-not-a-pair"),  # noqa: E501
    pytest.param(lambda: rnn("GRU", r(M, 7, 2, 4)), ValueError, ("batchlayers.functional.rnn", "G=3", "GRU", "20"), id="F.rnn-lstm-weights-for-gru"),  # noqa: E501
    pytest.param(lambda: rnn("LSTM", r(7, 2, 4)), ValueError, ("batchlayers.functional.rnn", "4-D", "(7, 2, 4)"), id="F.rnn-missing-models"),  # noqa: E501
    pytest.param(lambda: rnn("LSTM", r(M, 7, 2, 4), weights=[*lstm_weights()[:2], r(M, 20), r(20)]), ValueError, ("batchlayers.functional.rnn", "weights[3] (b_hh_l0)", "(3, 20)", "(20)"), id="F.rnn-bias-without-models"),  # noqa: E501
]  # fmt: skip

CONVERTERS = [
    pytest.param(lambda: bl.stack([zoo.MLP(), "MLP"]), TypeError, ("stack", "item 1", "str"), id="stack-string-item"),  # noqa: E501
    pytest.param(lambda: bl.unstack(zoo.MLP()), TypeError, ("unstack", "stacked model", "MLP"), id="unstack-plain-model"),  # noqa: E501
    pytest.param(lambda: bl.unstack([stacked_mlp()]), TypeError, ("unstack", "stacked model", "list"), id="unstack-list"),  # noqa: E501
    pytest.param(lambda: bl.select(stacked_mlp(), torch.tensor([[0, 1]])), TypeError, ("select", "1-D integer tensor", "[[0, 1]]"), id="select-2d-indices"),  # noqa: E501
    pytest.param(lambda: bl.select(stacked_mlp(), torch.tensor([True, False, True])), TypeError, ("select", "1-D integer tensor", "True"), id="select-bool-mask"),  # noqa: E501
    pytest.param(lambda: bl.set_execution(stacked_mlp(), "loop"), ValueError, ("set_execution", "must be one of", "'loop'"), id="set-execution-unknown"),  # noqa: E501
    pytest.param(lambda: bl.set_execution(zoo.MLP(), "model_by_model"), TypeError, ("set_execution", "batchlayers.stack", "MLP"), id="set-execution-plain-model"),  # noqa: E501
    pytest.param(lambda: bl.stack([zoo.MLP(), zoo.MLP()], execution="loop"), ValueError, ("stack", "must be one of", "'loop'"), id="stack-execution-unknown"),  # noqa: E501
    pytest.param(lambda: bl.concat([]), ValueError, ("concat", "empty list"), id="concat-empty"),  # noqa: E501
    pytest.param(lambda: bl.concat([stacked_mlp(), zoo.MLP()]), TypeError, ("concat", "stacked model", "MLP"), id="concat-plain-model"),  # noqa: E501
    pytest.param(lambda: bl.concat(stacked_mlp()), TypeError, ("concat", "list of models", "MLP"), id="concat-not-a-list"),  # noqa: E501
    pytest.param(lambda: bl.replicate(zoo.MLP(), 2), TypeError, ("replicate", "factory", "instance of MLP", "stack("), id="replicate-instance-not-factory"),  # noqa: E501
    pytest.param(lambda: bl.replicate(lambda: 3, 2), TypeError, ("replicate", "nn.Module", "int"), id="replicate-factory-returns-int"),  # noqa: E501
    pytest.param(lambda: bl.replicate(zoo.MLP, 2.0), ValueError, ("replicate", "num_models", "2.0"), id="replicate-float-count"),  # noqa: E501
    pytest.param(lambda: bl.stack_state_dicts(zoo.MLP().state_dict()), TypeError, ("stack_state_dicts", "list of state dicts", "one state dict"), id="stack_state_dicts-one-dict"),  # noqa: E501
    pytest.param(lambda: bl.stack_state_dicts([zoo.MLP(), zoo.MLP()]), TypeError, ("stack_state_dicts", "state dict 0", "MLP", "state_dict()"), id="stack_state_dicts-models"),  # noqa: E501
    pytest.param(lambda: bl.stack_state_dicts([{"w": 1.0}, {"w": 2.0}]), TypeError, ("stack_state_dicts", "state dict 0", "'w'", "float"), id="stack_state_dicts-float-entry"),  # noqa: E501
    pytest.param(lambda: bl.unstack_state_dict({"w": torch.tensor(1.0)}), ValueError, ("unstack_state_dict", "'w'", "0-d"), id="unstack_state_dict-0d-entry"),  # noqa: E501
    pytest.param(lambda: bl.unstack_state_dict({"w": [1.0, 2.0]}), TypeError, ("unstack_state_dict", "'w'", "list"), id="unstack_state_dict-list-entry"),  # noqa: E501
    pytest.param(lambda: bl.unstack_state_dict(stacked_mlp()), TypeError, ("unstack_state_dict", "MLP", "state_dict()"), id="unstack_state_dict-model"),  # noqa: E501
    pytest.param(lambda: verify_mlp(r(2, 4, 6)), ValueError, ("verify", "N=3", "inputs[0]", "(2, 4, 6)"), id="verify-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: verify_mlp(r(M, 4, 7)), ValueError, ("BatchedLinear at 'fc1'", "in_features=6", "is 7"), id="verify-input-of-other-features"),  # noqa: E501
    pytest.param(lambda: verify_mlp(r(M, 4, 6), rtol=-1.0), ValueError, ("verify", "rtol", "-1.0"), id="verify-negative-rtol"),  # noqa: E501
    pytest.param(lambda: bl.verify([zoo.MLP()] * 2, stacked_mlp(), r(M, 4, 6)), ValueError, ("verify", "holds 3 models", "2 originals"), id="verify-model-count"),  # noqa: E501
    pytest.param(lambda: bl.verify(zoo.MLP(), stacked_mlp(), r(M, 4, 6)), TypeError, ("verify", "list of the original models", "MLP"), id="verify-one-model"),  # noqa: E501
    pytest.param(lambda: bl.verify([zoo.MLP()] * M, "stacked", r(M, 4, 6)), TypeError, ("verify", "stacked model", "str"), id="verify-stacked-not-module"),  # noqa: E501
    pytest.param(lambda: bl.check_batched(nn.Sequential(bl.BatchedLinear(M, 6, 3)), r(M, 4, 6)), TypeError, ("check_batched", "stacked model", "Sequential"), id="check-batched-not-stacked"),  # noqa: E501
    pytest.param(lambda: bl.check_batched("stacked", r(M, 4, 6)), TypeError, ("check_batched", "stacked model", "str"), id="check-batched-not-module"),  # noqa: E501
    pytest.param(lambda: bl.check_batched(stacked_mlp(), r(2, 4, 6)), ValueError, ("MLP", "M=3", "(2, 4, 6)"), id="check-batched-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: bl.register(nn.Linear(2, 2), bl.BatchedLinear), TypeError, ("register", "torch_type", "nn.Module subclass"), id="register-instance"),  # noqa: E501
    pytest.param(lambda: bl.isinstance_torch(bl.BatchedLinear(M, 2, 2), "Linear"), TypeError, ("isinstance_torch", "classinfo", "'Linear'"), id="isinstance_torch-string"),  # noqa: E501
]  # fmt: skip

OPTIMIZERS = [
    pytest.param(lambda: SGD([nn.Parameter(torch.tensor(1.0))]), ValueError, ("SGD", "model dimension first", "0-d"), id="sgd-0d-parameter"),  # noqa: E501
    pytest.param(lambda: SGD(params(), lr=None), TypeError, ("SGD", "lr", "(M,) = (3,)", "NoneType"), id="sgd-lr-none"),  # noqa: E501
    pytest.param(lambda: Adam(params(), eps=per_model(1e-8, float("nan"), 1e-8)), ValueError, ("Adam", "eps", "nan"), id="adam-nan-eps-for-one-model"),  # noqa: E501
    pytest.param(lambda: Adam(params(), betas=0.9), ValueError, ("Adam", "betas", "pair", "0.9"), id="adam-betas-not-a-pair"),  # noqa: E501
    pytest.param(lambda: AdamW(params(), weight_decay=per_model(0.1, -0.1, 0.0)), ValueError, ("AdamW", "weight_decay", "-0.1"), id="adamw-negative-weight-decay"),  # noqa: E501
    pytest.param(lambda: RMSprop(params(), alpha=torch.full((M, M), 0.9)), ValueError, ("RMSprop", "alpha", "(M,) = (3,)", "(3, 3)"), id="rmsprop-alpha-matrix"),  # noqa: E501
    pytest.param(lambda: RMSprop(params(), momentum=per_model(0.5, -0.5, 0.0)), ValueError, ("RMSprop", "momentum", "-0.5"), id="rmsprop-negative-momentum"),  # noqa: E501
    pytest.param(lambda: SGD(params()).step(active=[True] * M), TypeError, ("SGD.step", "active", "bool tensor", "list"), id="sgd-active-list"),  # noqa: E501
    pytest.param(lambda: set_and_step(Adam(params()), "betas", (per_model(0.9, 0.8), 0.999)), ValueError, ("Adam", "betas[0]", "(2,)", "3 models"), id="adam-betas-of-2-models-by-hand"),  # noqa: E501
    pytest.param(lambda: Adam(params(), lr=per_model(0.1, 0.2, 0.3)).param_groups[0]["lr"].fill_(torch.ones(M, 1)), ValueError, ("per-model hyperparameter", "(3,)", "(3, 1)"), id="per-model-value-fill-matrix"),  # noqa: E501
    pytest.param(lambda: plateau().step(1.0), TypeError, ("ReduceLROnPlateau.step", "(M,) = (3,)", "float"), id="plateau-one-metric"),  # noqa: E501
    pytest.param(lambda: plateau().step([1.0, 2.0, 3.0]), TypeError, ("ReduceLROnPlateau.step", "list of 3 values", "torch.tensor"), id="plateau-metric-list"),  # noqa: E501
    pytest.param(lambda: plateau().step(torch.ones(M, 1)), ValueError, ("ReduceLROnPlateau.step", "(M,) = (3,)", "(3, 1)"), id="plateau-metric-matrix"),  # noqa: E501
    pytest.param(lambda: plateau().step(torch.ones(M, dtype=torch.complex64)), TypeError, ("ReduceLROnPlateau.step", "real", "complex64"), id="plateau-complex-metric"),  # noqa: E501
    pytest.param(lambda: ReduceLROnPlateau(torch.optim.SGD(params(), lr=0.1)), TypeError, ("ReduceLROnPlateau", "batchlayers.optim", "SGD", "torch.optim.lr_scheduler.ReduceLROnPlateau"), id="plateau-torch-optimizer"),  # noqa: E501
    pytest.param(lambda: plateau(min_lr=per_model(0.1, 0.2)), ValueError, ("ReduceLROnPlateau", "min_lr", "(M,) = (3,)", "(2,)"), id="plateau-min-lr-of-2-models"),  # noqa: E501
    pytest.param(lambda: plateau(min_lr="0"), TypeError, ("ReduceLROnPlateau", "min_lr", "str"), id="plateau-str-min-lr"),  # noqa: E501
    pytest.param(lambda: plateau(factor=1.5), ValueError, ("ReduceLROnPlateau", "factor", "1.5"), id="plateau-factor-above-1"),  # noqa: E501
    pytest.param(lambda: plateau(patience=-1), ValueError, ("ReduceLROnPlateau", "patience", "-1"), id="plateau-negative-patience"),  # noqa: E501
    pytest.param(lambda: plateau(mode="minimum"), ValueError, ("ReduceLROnPlateau", "mode", "'minimum'"), id="plateau-mode"),  # noqa: E501
    pytest.param(lambda: plateau().load_state_dict(ReduceLROnPlateau(SGD(params(2), lr=per_model(0.1, 0.2))).state_dict()), ValueError, ("ReduceLROnPlateau.load_state_dict", "M = 3", "(2,)", "nothing was loaded"), id="plateau-load-state-of-2-models"),  # noqa: E501
    pytest.param(plateau_after_index_models, ValueError, ("ReduceLROnPlateau", "holds 2 models", "3", "keep_models_"), id="plateau-stepped-after-index-models"),  # noqa: E501
]  # fmt: skip

TRAINING = [
    pytest.param(lambda: bl.clip_grad_norm_(params(), "1.0"), TypeError, ("clip_grad_norm_", "max_norm", "'1.0'"), id="clip_grad_norm_-str-max-norm"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_norm_(params(), [1.0] * M), TypeError, ("clip_grad_norm_", "max_norm", "list of 3 values"), id="clip_grad_norm_-list-max-norm"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_norm_(params(), -1.0), ValueError, ("clip_grad_norm_", "max_norm", ">= 0", "-1.0"), id="clip_grad_norm_-negative-max-norm"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_norm_(params(), per_model(1.0, -1.0, 1.0)), ValueError, ("clip_grad_norm_", "max_norm", "[-1.0]", "[1]"), id="clip_grad_norm_-negative-for-one-model"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_norm_(params(), 1.0, norm_type="l2"), ValueError, ("clip_grad_norm_", "norm_type", "'l2'"), id="clip_grad_norm_-norm-type"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_norm_(bl.BatchedLinear(M, 2, 2), 1.0), TypeError, ("clip_grad_norm_", "BatchedLinear", "model.parameters()"), id="clip_grad_norm_-module"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_norm_([*params(), None], 1.0), TypeError, ("clip_grad_norm_", "parameters[2]", "NoneType"), id="clip_grad_norm_-none-in-list"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_value_(params(), [1.0] * M), TypeError, ("clip_grad_value_", "clip_value", "list of 3 values"), id="clip_grad_value_-list"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_value_(params(), -0.5), ValueError, ("clip_grad_value_", "clip_value", "-0.5"), id="clip_grad_value_-negative"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad_value_([nn.Parameter(torch.tensor(1.0))], 1.0), ValueError, ("clip_grad_value_", "model dimension first", "()"), id="clip_grad_value_-0d-parameter"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad.get_total_norm([r(M, 2)], norm_type="fro"), ValueError, ("get_total_norm", "norm_type", "'fro'"), id="get_total_norm-norm-type"),  # noqa: E501
    pytest.param(lambda: bl.clip_grad.clip_grads_with_norm_(params(), 1.0, 2.0), ValueError, ("clip_grads_with_norm_", "total_norm", "(M,) = (3,)", "float"), id="clip_grads_with_norm_-float-total"),  # noqa: E501
    pytest.param(lambda: bl.nonfinite_models(), ValueError, ("nonfinite_models", "no tensors"), id="nonfinite_models-nothing"),  # noqa: E501
    pytest.param(lambda: bl.nonfinite_models([1.0, 2.0]), TypeError, ("nonfinite_models", "losses", "list"), id="nonfinite_models-list"),  # noqa: E501
    pytest.param(lambda: bl.nonfinite_models(torch.tensor(1.0)), ValueError, ("nonfinite_models", "model dimension first", "()"), id="nonfinite_models-0d-loss"),  # noqa: E501
    pytest.param(lambda: bl.ModelBatchSampler(0, 10, 2), ValueError, ("ModelBatchSampler", "num_models", "got 0"), id="sampler-0-models"),  # noqa: E501
    pytest.param(lambda: bl.ModelBatchSampler(2, 10.0, 2), TypeError, ("ModelBatchSampler", "num_samples", "float"), id="sampler-float-samples"),  # noqa: E501
    pytest.param(lambda: bl.ModelBatchSampler(2, 10, 2, seed="0"), TypeError, ("ModelBatchSampler", "seed", "str"), id="sampler-str-seed"),  # noqa: E501
    pytest.param(lambda: bl.ModelBatchSampler(2, 10, 2).set_epoch(-1), ValueError, ("ModelBatchSampler", "epoch", "-1"), id="sampler-negative-epoch"),  # noqa: E501
    pytest.param(lambda: bl.ModelBatchSampler(2, 10, 2).keep_models_(torch.tensor([[0]])), ValueError, ("ModelBatchSampler", "1-D", "[[0]]"), id="sampler-keep-2d"),  # noqa: E501
    pytest.param(lambda: bl.ModelBatchSampler(2, 10, 2).keep_models_([]), ValueError, ("ModelBatchSampler", "[]"), id="sampler-keep-nothing"),  # noqa: E501
    pytest.param(lambda: bl.ModelTensorLoader(torch.tensor(1.0), num_models=2, batch_size=2), ValueError, ("ModelTensorLoader", "tensor 0", "0-D"), id="loader-0d-tensor"),  # noqa: E501
    pytest.param(lambda: bl.ModelTensorLoader([1, 2, 3], num_models=2, batch_size=2), TypeError, ("ModelTensorLoader", "argument 0", "list"), id="loader-list"),  # noqa: E501
    pytest.param(lambda: bl.ModelTensorLoader(num_models=2, batch_size=2), ValueError, ("ModelTensorLoader", "at least one tensor"), id="loader-no-tensors"),  # noqa: E501
    pytest.param(lambda: bl.ModelTensorLoader(torch.zeros(4), num_models=2, batch_size="2"), TypeError, ("batch_size", "str"), id="loader-str-batch-size"),  # noqa: E501
    pytest.param(lambda: bl.model_data_loader(TensorDataset(torch.zeros(4)), 0, 2), ValueError, ("num_models", "got 0"), id="model_data_loader-0-models"),  # noqa: E501
    pytest.param(lambda: next(iter(bl.model_data_loader(["a", "b", "c", "d"], 2, 2, collate_fn=list))), TypeError, ("model_data_loader", "str", "(M, B, *)"), id="model_data_loader-strings"),  # noqa: E501
    pytest.param(lambda: bl.keep_models_("model", None, [0]), TypeError, ("keep_models_", "nn.Module", "str"), id="keep_models_-not-a-module"),  # noqa: E501
    pytest.param(lambda: bl.keep_models_(bl.BatchedLinear(M, 4, 2), "adam", [0]), TypeError, ("keep_models_", "Optimizer", "str"), id="keep_models_-optimizer-str"),  # noqa: E501
    pytest.param(lambda: bl.keep_models_(bl.BatchedLinear(M, 4, 2), None, None), TypeError, ("keep_models_", "indices", "NoneType"), id="keep_models_-indices-none"),  # noqa: E501
    pytest.param(lambda: bl.keep_models_(bl.BatchedLinear(M, 4, 2), None, "0"), TypeError, ("keep_models_", "indices", "'0'"), id="keep_models_-indices-str"),  # noqa: E501
    pytest.param(lambda: bl.keep_models_(bl.BatchedLinear(M, 4, 2), SGD(params(2)), [0]), ValueError, ("keep_models_", "SGD", "none of the model's parameters"), id="keep_models_-optimizer-of-another-model"),  # noqa: E501
    pytest.param(lambda: bl.index_models_(bl.BatchedLinear(M, 4, 2), torch.tensor([0.5])), TypeError, ("index_models_", "integers", "torch.float32"), id="index_models_-float-tensor"),  # noqa: E501
    pytest.param(lambda: bl.copy_model_(bl.BatchedLinear(M, 4, 2), None, 0, 5), ValueError, ("copy_model_", "dst [5]", "3 models"), id="copy_model_-dst-out-of-range"),  # noqa: E501
    pytest.param(lambda: bl.copy_model_(bl.BatchedLinear(M, 4, 2), None, 0.0, 1), TypeError, ("copy_model_", "src", "0.0"), id="copy_model_-float-src"),  # noqa: E501
    pytest.param(lambda: bl.copy_model_(*linear_with(lambda p: SGD(p)), 0, 1, schedulers=[1]), TypeError, ("copy_model_", "schedulers[0]", "int"), id="copy_model_-scheduler-int"),  # noqa: E501
    pytest.param(keep_with_stale_step_scheduler, ValueError, ("keep_models_", "initial_lr", "schedulers=[scheduler]"), id="keep_models_-torch-scheduler-not-passed"),  # noqa: E501
    pytest.param(copy_with_stale_step_scheduler, ValueError, ("copy_model_", "initial_lr", "schedulers=[scheduler]"), id="copy_model_-torch-scheduler-not-passed"),  # noqa: E501
    pytest.param(keep_with_foreign_scheduler, ValueError, ("keep_models_", "schedulers[0]", "StepLR", "another optimizer"), id="keep_models_-scheduler-of-another-optimizer"),  # noqa: E501
    pytest.param(lambda: L.mse_loss(r(M, 4, 1), r(M, 4, 5)), ValueError, ("batchlayers.losses.mse_loss", "(3, 4, 1)", "(3, 4, 5)"), id="mse_loss-target-would-broadcast"),  # noqa: E501
    pytest.param(lambda: L.huber_loss(r(M, 4), r(2, 4)), ValueError, ("batchlayers.losses.huber_loss", "(3, 4)", "(2, 4)"), id="huber_loss-target-of-2-models"),  # noqa: E501
    pytest.param(lambda: L.l1_loss(r(4), r(4)), ValueError, ("batchlayers.losses.l1_loss", "(M, B, *)", "(4,)"), id="l1_loss-missing-models"),  # noqa: E501
    pytest.param(lambda: L.cross_entropy(r(M, 4, 5), r(M, 4)), ValueError, ("batchlayers.losses.cross_entropy", "class probabilities", "(3, 4, 5)", "(3, 4)"), id="cross_entropy-float-target-of-indices-shape"),  # noqa: E501
    pytest.param(lambda: L.cross_entropy(r(M, 5), idx(M)), ValueError, ("batchlayers.losses.cross_entropy", "(M, B, C, *d)", "(3, 5)"), id="cross_entropy-missing-batch"),  # noqa: E501
    pytest.param(lambda: L.cross_entropy([1.0], idx(M, 4)), TypeError, ("batchlayers.losses.cross_entropy", "input", "list"), id="cross_entropy-list"),  # noqa: E501
    pytest.param(lambda: L.nll_loss(r(M, 4, 5), r(M, 4)), TypeError, ("batchlayers.losses.nll_loss", "integer", "torch.float32"), id="nll_loss-float-target"),  # noqa: E501
    pytest.param(lambda: L.kl_div(r(M, 4), r(M, 4), reduction="batchsum"), ValueError, ("batchlayers.losses.kl_div", "reduction", "'batchsum'"), id="kl_div-reduction"),  # noqa: E501
    pytest.param(lambda: L.smooth_l1_loss(r(M, 4), r(M, 4), reduction="avg"), ValueError, ("batchlayers.losses.smooth_l1_loss", "reduction", "'avg'"), id="smooth_l1_loss-reduction"),  # noqa: E501
    pytest.param(lambda: setattr(bl.backends.conv, "strategy", "fastest"), ValueError, ("batchlayers.backends.conv", "strategy", "'fastest'"), id="backends-strategy"),  # noqa: E501
    pytest.param(lambda: bl.backends.conv.flags(strategy="x").__enter__(), ValueError, ("batchlayers.backends.conv", "strategy", "'x'"), id="backends-flags-strategy"),  # noqa: E501
    pytest.param(lambda: setattr(bl.backends.conv, "benchmark", "yes"), TypeError, ("batchlayers.backends.conv", "benchmark", "'yes'"), id="backends-benchmark-str"),  # noqa: E501
    pytest.param(lambda: setattr(bl.backends.conv, "benchmark_repeats", 0), ValueError, ("batchlayers.backends.conv", "benchmark_repeats", "0"), id="backends-benchmark-repeats-0"),  # noqa: E501
]  # fmt: skip

FILES = [
    pytest.param(lambda tmp: bl.load_checkpoint(tmp / "missing.pt"), FileNotFoundError, ("missing.pt",), id="load_checkpoint-missing-file"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints("MLP", [tmp / "a.pt"]), TypeError, ("stack_checkpoints", "str", "nn.Module"), id="stack_checkpoints-model-name"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints(zoo.MLP(), [tmp / "list.pt"]), TypeError, ("stack_checkpoints", "list.pt", "list", "state dict"), id="stack_checkpoints-list-in-file"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints(zoo.MLP(), [tmp]), ValueError, ("stack_checkpoints", "test_bad_checkpoint_input", "directory without a checkpoint", "model.safetensors.index.json", "a.pt"), id="stack_checkpoints-directory-without-checkpoint"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints(zoo.MLP(), [sharded(tmp, lambda m: m.update({"fc1.weight": "model-00009-of-00009.safetensors"}))]), ValueError, ("stack_checkpoints", "model.safetensors.index.json", "'fc1.weight'", "model-00009-of-00009.safetensors", "does not exist"), id="stack_checkpoints-index-shard-missing"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints(zoo.MLP(), [sharded(tmp, lambda m: m.update({"fc9.weight": m["fc1.weight"]}))]), ValueError, ("stack_checkpoints", "model.safetensors.index.json", "MLP", "unexpected keys ['fc9.weight']"), id="stack_checkpoints-index-names-unknown-tensor"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints(zoo.MLP(), [sharded(tmp, lambda m: m.pop("fc2.bias"))]), ValueError, ("stack_checkpoints", "model.safetensors.index.json", "MLP", "missing keys ['fc2.bias']"), id="stack_checkpoints-index-lacks-tensor"),  # noqa: E501
    pytest.param(lambda tmp: bl.stack_checkpoints(zoo.MLP(), [sharded(tmp)], key="model"), ValueError, ("stack_checkpoints", "key='model'", "sharded", "save_pretrained folder"), id="stack_checkpoints-key-with-folder"),  # noqa: E501
    pytest.param(save_population_with_foreign_scheduler, ValueError, ("save_population", "schedulers[0]", "StepLR", "another optimizer"), id="save_population-scheduler-of-another-optimizer"),  # noqa: E501
    pytest.param(lambda tmp: save_population_with_foreign_scheduler(tmp, with_optimizer=False), ValueError, ("save_population", "schedulers", "without their optimizer"), id="save_population-schedulers-without-optimizer"),  # noqa: E501
    pytest.param(lambda tmp: save_population_with_scheduler(tmp, lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)), lambda o: torch.optim.lr_scheduler.StepLR(o, 1)), ValueError, ("save_population", "schedulers[0] (StepLR)", "state_dict()['base_lrs'][0]", "shape ()", "(3,)"), id="save_population-scheduler-with-0d-tensor-lr"),  # noqa: E501
    pytest.param(lambda tmp: save_population_with_scheduler(tmp, lambda p: SGD(p, lr=per_model(0.1, 0.2, 0.3)), lambda o: torch.optim.lr_scheduler.LambdaLR(o, PerModelFactor())), ValueError, ("save_population", "schedulers[0] (LambdaLR)", "holds 3 per-model tensors", "2 are where"), id="save_population-scheduler-with-tensor-in-lambda"),  # noqa: E501
    pytest.param(lambda tmp: load_population_with(tmp, ["StepLR", "ReduceLROnPlateau"], foreign=True), ValueError, ("load_population_", "schedulers[0]", "StepLR", "another optimizer"), id="load_population_-scheduler-of-another-optimizer"),  # noqa: E501
    pytest.param(lambda tmp: load_population_with(tmp, ["StepLR"]), ValueError, ("load_population_", "holds 2 schedulers (StepLR, ReduceLROnPlateau)", "schedulers= has 1 (StepLR)"), id="load_population_-fewer-schedulers-than-saved"),  # noqa: E501
    pytest.param(lambda tmp: load_population_with(tmp, ["StepLR"], saved=None), ValueError, ("load_population_", "saved without schedulers", "schedulers= has 1 (StepLR)"), id="load_population_-schedulers-not-saved"),  # noqa: E501
    pytest.param(lambda tmp: load_population_with(tmp, ["ExponentialLR", "ReduceLROnPlateau"]), ValueError, ("load_population_", "schedulers[0] is ExponentialLR", "checkpoint's schedulers[0] is StepLR"), id="load_population_-scheduler-of-another-type"),  # noqa: E501
    pytest.param(lambda tmp: load_population_with(tmp, ["StepLR", "ReduceLROnPlateau"], float_lr=True), ValueError, ("load_population_", "different per-model (M,) tensors", "schedulers[0] (StepLR) 2 in the checkpoint, 0 here"), id="load_population_-float-lr-where-saved-per-model"),  # noqa: E501
]  # fmt: skip


def sharded(tmp, edit=lambda weight_map: None):
    """A sharded checkpoint folder of an MLP, as save_pretrained writes one (model.safetensors.index.json and
    the shards it lists), its index's weight_map changed by ``edit``."""
    from huggingface_hub import save_torch_state_dict

    folder = tmp / "sharded"
    folder.mkdir()
    save_torch_state_dict(zoo.MLP().state_dict(), folder, max_shard_size=200)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    edit(data["weight_map"])
    index.write_text(json.dumps(data))
    return folder


# Unclear today, to be fixed in files owned by others (each reason names the change); strict: a fix makes them
# pass, and the marker must then go.
PENDING = [
    pytest.param(lambda: bl.BatchedLinear(M, -1, 5), ValueError, ("BatchedLinear", "in_features", "-1"), id="linear-negative-in-features"),  # noqa: E501
    pytest.param(lambda: bl.BatchedLinear(M, 4.5, 5), TypeError, ("BatchedLinear", "in_features", "4.5"), id="linear-float-in-features"),  # noqa: E501
    pytest.param(lambda: bl.BatchedBilinear(M, 4, -2, 5), ValueError, ("BatchedBilinear", "in2_features", "-2"), id="bilinear-negative-in2-features"),  # noqa: E501
    pytest.param(lambda: BF.linear(r(2, 2, 4), r(M, 5, 4)), ValueError, ("batchlayers.functional.linear", "dimension 0 (models) is 2, not 3"), id="F.linear-input-of-other-models"),  # noqa: E501
    pytest.param(lambda: BF.linear(r(M, 2, 4), r(M, 5, 4), r(1, 5)), ValueError, ("batchlayers.functional.linear", "bias", "(3, 5)", "(1, 5)"), id="F.linear-bias-of-one-model"),  # noqa: E501
    pytest.param(lambda: BF.linear(r(M, 2, 4), r(5, 4)), ValueError, ("batchlayers.functional.linear", "3-D weight", "(5, 4)"), id="F.linear-weight-without-models"),  # noqa: E501
    pytest.param(lambda: torch_plateau_over_per_model_lr(), ValueError, ("per-model", "batchlayers.optim.lr_scheduler.ReduceLROnPlateau"), id="torch-plateau-over-per-model-lr"),  # noqa: E501
    pytest.param(lambda: L.cross_entropy(r(M, 4, 5), idx(M, 4), weight=torch.ones(4)), ValueError, ("batchlayers.losses.cross_entropy", "weight", "(5,)", "(4,)"), id="cross_entropy-weight-of-other-classes"),  # noqa: E501
    pytest.param(lambda: L.cross_entropy(r(M, 4, 5), torch.full((M, 4), 7)), IndexError, ("batchlayers.losses.cross_entropy", "7", "C=5"), id="cross_entropy-class-out-of-range"),  # noqa: E501
    pytest.param(lambda: L.binary_cross_entropy(torch.rand(M, 4, 2), torch.rand(M, 4, 2), weight=torch.ones(3)), ValueError, ("batchlayers.losses.binary_cross_entropy", "weight", "(3,)"), id="binary_cross_entropy-weight-shape"),  # noqa: E501
    pytest.param(lambda: set_and_step(SGD(params()), "weight_decay", -1.0), ValueError, ("SGD", "weight_decay", "-1.0"), id="sgd-negative-weight-decay-by-hand"),  # noqa: E501
    pytest.param(lambda: bl.load_checkpoint(3.5), TypeError, ("load_checkpoint", "path", "float"), id="load_checkpoint-float-path"),  # noqa: E501
    pytest.param(lambda: bl.stack_checkpoints(zoo.MLP(), "model.pt"), TypeError, ("stack_checkpoints", "list", "'model.pt'"), id="stack_checkpoints-one-path-string"),  # noqa: E501
    pytest.param(lambda: bl.model_data_loader(iter(range(4)), 2, 2), TypeError, ("model_data_loader", "map-style", "range_iterator"), id="model_data_loader-iterator"),  # noqa: E501
]  # fmt: skip


def torch_plateau_over_per_model_lr():
    opt = SGD(params(), lr=per_model(0.1, 0.2, 0.3))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    for loss in (1.0, 2.0):
        scheduler.step(loss)


def _check(call, exc, keywords, *args) -> None:
    with pytest.raises(exc) as info:
        call(*args)
    message = str(info.value)
    missing = [k for k in keywords if k not in message]
    assert not missing, f"the message lacks {missing}: {message!r}"


ROWS = CONSTRUCTORS + FORWARD + FUNCTIONAL + CONVERTERS + OPTIMIZERS + TRAINING


@pytest.mark.parametrize("call, exc, keywords", ROWS)
def test_bad_input_raises_a_clear_error(call, exc, keywords) -> None:
    saved = bl.backends.conv.strategy, bl.backends.conv.benchmark, bl.backends.conv.benchmark_repeats
    try:
        _check(call, exc, keywords)
    finally:
        bl.backends.conv.strategy, bl.backends.conv.benchmark, bl.backends.conv.benchmark_repeats = saved


@pytest.mark.parametrize("call, exc, keywords", FILES)
def test_bad_checkpoint_input_raises_a_clear_error(call, exc, keywords, tmp_path) -> None:
    torch.save(zoo.MLP().state_dict(), tmp_path / "a.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    _check(call, exc, keywords, tmp_path)


@pytest.mark.parametrize("call, exc, keywords", PENDING)
def test_bad_input_of_the_second_round_raises_a_clear_error(call, exc, keywords) -> None:
    _check(call, exc, keywords)


NO_INPUT = ("Verification",)  # the record verify returns; users do not construct it
NEWER = ("save", "load", "TrainState")  # added after this table (issue 13 item 3); their rows come with them


def test_the_table_covers_every_public_name() -> None:
    """Every public name of batchlayers (and of its public submodules) appears in a row of the table."""
    import inspect

    tables = ROWS + FILES + PENDING
    sources = "\n".join(inspect.getsource(p.values[0]) for p in tables)
    sources += inspect.getsource(inspect.getmodule(test_the_table_covers_every_public_name))
    names = [n for n in bl.__all__ if n not in ("backends", "functional", "losses", "optim", *NO_INPUT, *NEWER)]
    names += [f"BF.{n}" for n in BF.__all__ if n != "linear"] + ["BF.linear"]
    names += [f"L.{n}" for n in L.__all__ if n not in ("binary_cross_entropy_with_logits",)]
    names += ["SGD(", "Adam(", "AdamW(", "RMSprop(", "ReduceLROnPlateau("]
    missing = [n for n in names if n not in sources]
    assert not missing, f"no bad-input row for {missing}"
    assert len(tables) >= 150, len(tables)


# -- nothing the caller holds is changed by a refused call ------------------------------------------------------


def _snapshot(*objects) -> list:
    return copy.deepcopy([o.state_dict() if hasattr(o, "state_dict") else vars(o) for o in objects])


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where  # (nan == nan)


def _population(scheduler: str):
    torch.manual_seed(0)
    layer = bl.BatchedLinear(M, 4, 2)
    opt = Adam(layer.parameters(), lr=per_model(0.1, 0.2, 0.3))
    if scheduler == "plateau":
        sched = ReduceLROnPlateau(opt, patience=0)
        stepped(opt)
        sched.step(per_model(1.0, 2.0, 3.0))
        sched.step(per_model(2.0, 1.0, 3.0))
    else:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        stepped(opt)
        sched.step()
    return layer, opt, sched


REFUSED_POPULATION_CALLS = [
    ("keep-reordered-without-scheduler", "cosine", lambda layer, opt, sched: bl.keep_models_(layer, opt, [1, 0, 2])),
    ("copy-without-scheduler", "cosine", lambda layer, opt, sched: bl.copy_model_(layer, opt, 0, 2)),
    *[
        (f"{name}-{kind}", kind, call)
        for kind in ("plateau", "cosine")
        for name, call in [
            ("keep-out-of-range", lambda layer, opt, sched: bl.keep_models_(layer, opt, [0, 3], schedulers=[sched])),
            (
                "keep-foreign-scheduler",
                lambda layer, opt, sched: bl.keep_models_(
                    layer, opt, [0], schedulers=[sched, torch.optim.lr_scheduler.StepLR(SGD(params()), 1)]
                ),
            ),
            ("copy-not-a-scheduler", lambda layer, opt, sched: bl.copy_model_(layer, opt, 0, 1, schedulers=[opt])),
            ("keep-optimizer-str", lambda layer, opt, sched: bl.keep_models_(layer, "opt", [0])),
        ]
    ],
]


@pytest.mark.parametrize(
    "scheduler, call", [r[1:] for r in REFUSED_POPULATION_CALLS], ids=[r[0] for r in REFUSED_POPULATION_CALLS]
)
def test_refused_population_calls_change_nothing(scheduler, call) -> None:
    layer, opt, sched = _population(scheduler)
    before = _snapshot(layer, opt, sched)
    with pytest.raises((ValueError, TypeError)):
        call(layer, opt, sched)
    _assert_same(before, _snapshot(layer, opt, sched))
    assert layer.num_models == M


def test_refused_functional_calls_change_no_running_statistics() -> None:
    """A batch_norm refused for a mismatched shape leaves the caller's running statistics alone."""
    mean, var = torch.zeros(M, 5), torch.ones(M, 5)
    for bad in (r(2, 4, 5), r(M, 4, 6)):
        with pytest.raises(ValueError):
            BF.batch_norm(bad, mean, var, training=True)
    with pytest.raises(ValueError):
        BF.batch_norm(r(M, 4, 5), mean, var, training=True, momentum=torch.full((2,), 0.5))
    assert torch.equal(mean, torch.zeros(M, 5)) and torch.equal(var, torch.ones(M, 5))
