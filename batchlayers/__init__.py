"""batchlayers: run and train many PyTorch models of one architecture at once.

Shape legend, used in every ``Shape:`` section:

- ``M``: number of models (``num_models``), always the first dimension.
- ``B``: batch size per model.
- ``C``: channels; ``L``, ``H``, ``W``, ``D``: length, height, width, depth.
- ``*``: any number of further dimensions, as in torch.nn.

Every batched layer takes ``(M, B, *)`` and returns ``(M, B, *)``. A batch shared by every model is passed
as a stride-0 expand, ``x.expand(M, *x.shape)``, which batchlayers never copies M times.
"""

from . import functional
from .container import Folded
from .linear import BatchedLinear

__version__ = "0.1.0"

__all__ = [
    "BatchedLinear",
    "Folded",
    "functional",
]
