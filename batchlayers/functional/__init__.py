"""The batched math behind every layer, one function per layer family (like ``torch.nn.functional``).

Every function takes inputs with the model dimension first, ``(M, B, *)``, and per-model parameters
``(M, *torch shape)``, and computes all models in a few batched kernels without a Python loop over models.
"""

from ._linear import linear

__all__ = ["linear"]
