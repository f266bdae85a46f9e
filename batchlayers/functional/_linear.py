from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._utils import is_shared

__all__ = ["SHARED_PATHS", "linear", "shared_path"]

SHARED_PATHS = ("gemm", "bmm")


def shared_path(num_models: int, rows: int, in_features: int, out_features: int, needs_grad: bool) -> str:
    """The faster way to apply M models' weights to one shared batch of ``rows`` samples.

    ``"gemm"``: one matrix multiply of the batch against all models' weights stacked into
    ``(M * out_features, in_features)`` (its backward computes all weight gradients in one GEMM as well);
    ``"bmm"``: ``baddbmm`` on the stride-0 expand, M small multiplies. Neither copies the batch.

    Measured on a 2-core CPU (torch 2.13, float32, interleaved medians of a whole MLP, so the next layer's
    cost of reading the GEMM's ``(*, M, out)`` layout counts): for training, one GEMM was 1.1x faster on
    784->256 layers (M=8 and 64) but 0.8x on 10->20 layers (M=8 to 1024); for inference ``bmm`` was as
    fast or faster everywhere (one GEMM 0.6x for 784->256 at M=64). ``bmm`` on the stride-0 expand ran
    within noise of per-model copies of the batch in every shape.
    """
    if needs_grad and in_features * out_features >= 65536:
        return "gemm"
    return "bmm"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, shared: str = "auto") -> Tensor:
    """Apply model ``m``'s affine map to ``x[m]`` for every model at once.

    Args:
        x: ``(M, *, in_features)``; a shared batch may be a stride-0 expand, it is never copied.
        weight: ``(M, out_features, in_features)``.
        bias: ``(M, out_features)`` or ``None``.
        shared: for a shared batch, ``"auto"`` (see :func:`shared_path`) or one of :data:`SHARED_PATHS`.

    Returns:
        ``(M, *, out_features)``. For a shared batch computed with ``"gemm"`` the result is a permuted view
        of a ``(*, M, out_features)`` tensor; the layers after it read it as it is.
    """
    num_models, out_features, in_features = weight.shape
    if is_shared(x):
        rows = x[0].numel() // max(in_features, 1)
        needs_grad = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
        path = shared_path(num_models, rows, in_features, out_features, needs_grad) if shared == "auto" else shared
        if path not in SHARED_PATHS:
            raise ValueError(f"linear: shared must be 'auto' or one of {SHARED_PATHS}, got {shared!r}")
        if path == "gemm":
            return _shared_gemm(x, weight, bias)
    if x.dim() == 3:  # the common (M, B, in) case: no reshape or view nodes in the autograd graph
        x3, batch_shape = x, None
    else:
        # (M, *, in) -> (M, N, in): a view, also on a stride-0 expand, so a shared batch stays one copy.
        x3, batch_shape = x.reshape(num_models, -1, in_features), x.shape[1:-1]
    if _weight_grad_out_major(weight, in_features, out_features):
        y = _AffineWeightGradOutMajor.apply(x3, weight, bias)
    elif bias is None:
        y = torch.bmm(x3, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.unsqueeze(1), x3, weight.transpose(1, 2))
    return y if batch_shape is None else y.view(num_models, *batch_shape, out_features)


def _weight_grad_out_major(weight: Tensor, in_features: int, out_features: int) -> bool:
    # Under torch.compile the compiler derives its own backward (and dynamo warns on custom Functions).
    return (
        out_features < in_features
        and weight.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


class _AffineWeightGradOutMajor(torch.autograd.Function):
    """``baddbmm(bias, x, weight^T)`` whose weight gradient is computed as ``grad^T @ x``, already in the
    weight's ``(M, out, in)`` layout.

    Autograd computes ``x^T @ grad`` as ``(M, in, out)`` and copies its transpose into the gradient. When
    ``out < in`` the direct product has the long side last, which small CPU GEMMs run much faster, and the
    transposing copy is gone: measured on a 2-core CPU, whole training steps were 1.26x faster for a
    784-256-256-10 MLP at M=64 and 1.28x for a 10-20-2 MLP at M=1024 (neutral at M=64). For ``out >= in``
    autograd's own orientation was as fast or faster, and this class's Python overhead is not worth it.
    """

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def _shared_gemm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    # One (*, in) @ (in, M*out) multiply; its backward is one GEMM for all weight gradients too.
    num_models, out_features, in_features = weight.shape
    sample = x[0]  # the shared batch itself: a view of the one copy
    flat_bias = None if bias is None else bias.reshape(num_models * out_features)
    y = F.linear(sample, weight.reshape(num_models * out_features, in_features), flat_bias)
    return y.view(*sample.shape[:-1], num_models, out_features).movedim(-2, 0)
