"""batchlayers: run and train many PyTorch models of one architecture at once.

Shape legend, used in every ``Shape:`` section:

- ``M``: number of models (``num_models``), always the first dimension.
- ``B``: batch size per model.
- ``C``: channels; ``L``, ``H``, ``W``, ``D``: length, height, width, depth.
- ``*``: any number of further dimensions, as in torch.nn.

Every batched layer takes ``(M, B, *)`` and returns ``(M, B, *)``. A batch shared by every model is passed
as a stride-0 expand, ``x.expand(M, *x.shape)``, which batchlayers never copies M times.
"""

from . import amp, backends, functional, losses, optim
from .activation import BatchedPReLU
from .attention import BatchedMultiheadAttention
from .batchnorm import BatchedBatchNorm1d, BatchedBatchNorm2d, BatchedBatchNorm3d
from .checkpoint import load, load_checkpoint, save, stack_checkpoints
from .clip_grad import clip_grad_norm_, clip_grad_value_, nonfinite_models
from .container import BatchedSequential, Folded
from .conv import (
    BatchedConv1d,
    BatchedConv2d,
    BatchedConv3d,
    BatchedConvTranspose1d,
    BatchedConvTranspose2d,
    BatchedConvTranspose3d,
)
from .convert import (
    concat,
    replicate,
    select,
    set_execution,
    stack,
    stack_state_dicts,
    unstack,
    unstack_state_dict,
)
from .data import ModelBatchSampler, ModelTensorLoader, model_data_loader
from .linear import BatchedBilinear, BatchedLinear
from .normalization import (
    BatchedGroupNorm,
    BatchedInstanceNorm1d,
    BatchedInstanceNorm2d,
    BatchedInstanceNorm3d,
    BatchedLayerNorm,
    BatchedRMSNorm,
)
from .population import copy_model_, index_models_, keep_models_
from .recurrent import BatchedGRU, BatchedGRUCell, BatchedLSTM, BatchedLSTMCell, BatchedRNN, BatchedRNNCell
from .registry import isinstance_torch, register
from .sparse import BatchedEmbedding, BatchedEmbeddingBag
from .train_state import TrainState
from .verify import Verification, check_batched, verify

__version__ = "0.1.0"

__all__ = [
    # layers
    "BatchedLinear",
    "BatchedBilinear",
    "BatchedConv1d",
    "BatchedConv2d",
    "BatchedConv3d",
    "BatchedConvTranspose1d",
    "BatchedConvTranspose2d",
    "BatchedConvTranspose3d",
    "BatchedLayerNorm",
    "BatchedRMSNorm",
    "BatchedGroupNorm",
    "BatchedInstanceNorm1d",
    "BatchedInstanceNorm2d",
    "BatchedInstanceNorm3d",
    "BatchedPReLU",
    "BatchedBatchNorm1d",
    "BatchedBatchNorm2d",
    "BatchedBatchNorm3d",
    "BatchedEmbedding",
    "BatchedEmbeddingBag",
    "BatchedMultiheadAttention",
    "BatchedRNN",
    "BatchedLSTM",
    "BatchedGRU",
    "BatchedRNNCell",
    "BatchedLSTMCell",
    "BatchedGRUCell",
    "Folded",
    "BatchedSequential",
    # converters
    "set_execution",
    "stack",
    "unstack",
    "stack_state_dicts",
    "unstack_state_dict",
    "stack_checkpoints",
    "load_checkpoint",
    "save",
    "load",
    "select",
    "concat",
    "replicate",
    "register",
    "isinstance_torch",
    "verify",
    "Verification",
    "check_batched",
    # training toolkit
    "clip_grad_norm_",
    "clip_grad_value_",
    "nonfinite_models",
    "index_models_",
    "keep_models_",
    "copy_model_",
    "ModelBatchSampler",
    "ModelTensorLoader",
    "model_data_loader",
    "TrainState",
    # submodules
    "amp",
    "backends",
    "functional",
    "losses",
    "optim",
]
