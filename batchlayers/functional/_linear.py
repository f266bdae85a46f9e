from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _workspace
from .._utils import (
    autocast_enabled,
    check_call_input,
    check_parameter,
    check_weight,
    is_shared,
    no_function_transforms,
)

__all__ = ["SHARED_PATHS", "fusable_context", "linear"]

SHARED_PATHS = ("gemm", "bmm")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, shared: str = "bmm") -> Tensor:
    """Apply model ``m``'s affine map to ``x[m]`` for every model at once.

    Args:
        x: ``(M, *, in_features)``; a shared batch may be a stride-0 expand, it is never copied.
        weight: ``(M, out_features, in_features)``.
        bias: ``(M, out_features)`` or ``None``.
        shared: how a shared batch (a stride-0 expand) is computed; neither way copies it.
            ``"bmm"`` (default): ``baddbmm`` on the stride-0 view, M small multiplies.
            ``"gemm"``: one multiply of the batch against all models' weights viewed as
            ``(M * out_features, in_features)``; its weight gradient is one GEMM as well.
            Measured on a 2-core CPU (torch 2.13, float32, 2 threads, interleaved medians of whole MLP steps
            with a shared first layer, so the next layer's cost of reading the GEMM's ``(*, M, out)`` layout
            counts), ``"bmm"`` was faster everywhere: 10-20-2 training 1.20x (M=64) and 1.29x (M=1024),
            inference 1.05x and 1.15x; 784-256-256-10 at M=64 training 1.03x, inference 1.22x. It also ran
            within noise of per-model copies of the batch.

    Returns:
        ``(M, *, out_features)``. For a shared batch computed with ``"gemm"`` the result is a permuted view
        of a ``(*, M, out_features)`` tensor; the layers after it read it as it is.
    """
    function = "batchlayers.functional.linear"
    layout = "(M, out_features, in_features)"
    num_models, out_features, in_features = check_weight(function, "weight", weight, 3, layout)
    check_call_input(function, x, num_models, trailing=[("in_features", in_features)], layout="(M, *, in_features)")
    check_parameter(function, "bias", bias, (num_models, out_features), "(M, out_features)", x)
    return unchecked_linear(x, weight, bias, shared=shared)


def unchecked_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, shared: str = "bmm") -> Tensor:
    """:func:`linear` without the argument checks, for callers that checked them already (the layers)."""
    num_models, out_features, in_features = weight.shape
    if shared not in SHARED_PATHS:
        raise ValueError(f"linear: shared must be one of {SHARED_PATHS}, got {shared!r}")
    if shared == "gemm" and is_shared(x):
        return _shared_gemm(x, weight, bias)
    if x.dim() == 3:  # the common (M, B, in) case: no reshape or view nodes in the autograd graph
        x3, batch_shape = x, None
    else:
        # (M, *, in) -> (M, N, in): a view, also on a stride-0 expand, so a shared batch stays one copy.
        x3, batch_shape = x.reshape(num_models, -1, in_features), x.shape[1:-1]
    if _weight_grad_out_major(x3, weight):
        y = _AffineWeightGradOutMajor.apply(x3, weight, bias)
    else:
        y = _affine(x3, weight, bias)
    return y if batch_shape is None else y.view(num_models, *batch_shape, out_features)


def _affine(x3: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if bias is None:
        return torch.bmm(x3, weight.transpose(1, 2))
    if x3.device.type == "cpu" and torch.compiler.is_compiling():
        # inductor keeps baddbmm as one library call, which on CPU copies the bias in model by model; a
        # separate add it fuses into the next elementwise kernel. Compiled stacked GPT-mini (M=8) training
        # step, interleaved against compiled torch.func in one process: 0.97-1.00x -> 1.00-1.05x (3 runs
        # each), its matrix products then the same calls and times as torch.func's. GPUs keep baddbmm
        # (unmeasured).
        return torch.bmm(x3, weight.transpose(1, 2)) + bias.unsqueeze(1)
    return torch.baddbmm(bias.unsqueeze(1), x3, weight.transpose(1, 2))


# Below this many multiply-adds per call the custom Function's Python overhead (about 40 us a step for a
# 10-20-2 MLP at M=64 on 2 cores, 164k multiply-adds in its 20 -> 2 layer) outweighs what its orientation
# saves; at M=256 (655k) it already won.
OUT_MAJOR_MIN_MACS = 1 << 19


def fusable_context(x: Tensor) -> bool:
    """No machinery that needs the layers' own ops, so that batchlayers' own autograd Functions may compute
    them: autocast (whose casts happen per op), compile (the compiler derives its own backward and fuses by
    itself), a torch.func transform or forward-mode AD (the Functions have no vmap or jvp rule)."""
    return not autocast_enabled(x) and not torch.compiler.is_compiling() and no_function_transforms()


def _weight_grad_out_major(x3: Tensor, weight: Tensor) -> bool:
    # Not outside a fusable_context: under autocast the Function's products would not make autocast's casts
    # (its backward multiplied a bfloat16 gradient with the float32 input and raised), under vmap it has no
    # rule (it raised).
    out_features, in_features = weight.shape[1:]
    return (
        out_features < in_features
        and x3.numel() * out_features >= OUT_MAJOR_MIN_MACS
        and weight.requires_grad
        and torch.is_grad_enabled()
        and fusable_context(x3)
    )


class _AffineWeightGradOutMajor(torch.autograd.Function):
    """``baddbmm(bias, x, weight^T)`` whose weight gradient is computed as ``grad^T @ x``, already in the
    weight's ``(M, out, in)`` layout.

    Autograd computes ``x^T @ grad`` as ``(M, in, out)`` and copies its transpose into the gradient. When
    ``out < in`` the direct product has the long side last, which small CPU GEMMs run much faster, and the
    transposing copy is gone: measured on a 2-core CPU (interleaved medians of whole training steps), a
    784-256-256-10 MLP ran 1.27x faster at M=16 and 1.26x at M=64, a 10-20-2 MLP 1.03x at M=256 and 1024.
    For ``out >= in`` autograd's own orientation was as fast or faster, and below
    :data:`OUT_MAJOR_MIN_MACS` this class's Python overhead costs more than it saves (10-20-2 at M=64:
    0.93x), so plain autograd runs there.
    """

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return _affine(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # (in memory kept between backwards where large: autograd keeps it as the weight's .grad)
            shape = (grad.shape[0], grad.shape[2], x.shape[2])
            out = _workspace.returned(grad, *shape) if _workspace.applies(grad, *shape) else None
            grad_weight = torch.bmm(grad.transpose(1, 2), x, out=out)
        grad_bias = grad.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def _shared_gemm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    # One (*, in) @ (in, M*out) multiply; its backward is one GEMM for all weight gradients too.
    num_models, out_features, in_features = weight.shape
    sample = x[0]  # the shared batch itself: a view of the one copy
    flat_bias = None if bias is None else bias.reshape(num_models * out_features)
    y = F.linear(sample, weight.reshape(num_models * out_features, in_features), flat_bias)
    return y.view(*sample.shape[:-1], num_models, out_features).movedim(-2, 0)
