"""The batched math behind every layer, one function per layer family (like ``torch.nn.functional``).

Every function takes inputs with the model dimension first, ``(M, B, *)``, and per-model parameters
``(M, *torch shape)``, and computes all models in a few batched kernels without a Python loop over models.
"""

from ._attention import multi_head_attention
from ._batchnorm import batch_norm
from ._conv import conv, conv_transpose
from ._embedding import embedding, embedding_bag
from ._linear import linear
from ._norm import group_norm, layer_norm, rms_norm
from ._recurrent import rnn

__all__ = [
    "batch_norm",
    "conv",
    "conv_transpose",
    "embedding",
    "embedding_bag",
    "group_norm",
    "layer_norm",
    "rms_norm",
    "linear",
    "multi_head_attention",
    "rnn",
]
