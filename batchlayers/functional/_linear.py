from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["linear"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Apply model ``m``'s affine map to ``x[m]`` for every model at once.

    Args:
        x: ``(M, *, in_features)``; a shared batch may be a stride-0 expand, it is never copied.
        weight: ``(M, out_features, in_features)``.
        bias: ``(M, out_features)`` or ``None``.

    Returns:
        ``(M, *, out_features)``.
    """
    num_models, out_features, in_features = weight.shape
    batch_shape = x.shape[1:-1]
    # (M, *, in) -> (M, N, in): a view, also on a stride-0 expand, so a shared batch stays one copy.
    x3 = x.reshape(num_models, -1, in_features)
    if bias is None:
        y = torch.bmm(x3, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.unsqueeze(1), x3, weight.transpose(1, 2))
    return y.view(num_models, *batch_shape, out_features)
