"""ReLU (out of place and in place) and 2-d max pooling of a stacked model's own code, with their large results in
kept memory.

In a converted CNN the batched convolutions and batch norms keep their large results between steps
(:mod:`batchlayers._workspace`), but ``F.relu`` and ``F.max_pool2d`` in the architecture's ``forward`` are
torch's: their outputs, and in backward the ReLU's and the pooling's input gradients, are new tensors as large
as a layer's activations for all M models at once (32 MiB each in the benchmark's small CNN at M=16), which
glibc maps afresh from the OS and unmaps again every step (24.6k page faults a step). The stacked model's
tracker (:mod:`batchlayers._provenance`) routes those calls here, and these write torch's own kernels'
results (``clamp_min``, ``threshold_backward``, ``max_pool2d_with_indices_backward``, the ops torch's ReLU and
pooling run and differentiate with) into kept buffers: the same numbers bit for bit. An in-place ReLU
(``nn.ReLU(inplace=True)``) allocates nothing in forward; its input gradient goes into a kept buffer
(:func:`relu_`).

Measured on a 2-core CPU, 2 threads, without ``keep_freed_memory()``: the small CNN's training step went from
173.6 to 109.0 ms (medians of five alternating fresh processes each; the loop 146.6 ms), 41-45k to 2-12k page
faults a step; in three ``python -m benchmarks --quick`` runs 1.60-1.61x the loop (0.88-1.15x before) with no
page faults. The price is memory: the buffers are kept between steps, and the CNN's held memory plus step
peak went from 0.95x to 1.11x ``torch.func``'s (141 -> 165 MB, four buffers of 32, 32, 32 and 16 MiB; keeping
only results of 32 MiB and more, which glibc always maps afresh, gave the same 1.11x: what is not kept counts
in the step's peak instead), and to 1.00x once a miss dropped the free buffers too small for it (three
buffers, see :func:`batchlayers._workspace.take`). The ResNet's (M=4) stayed below ``torch.func``'s (0.69x)
and its step within noise (medians 107.9 and 111.7 ms).

Each function returns None where it does not apply, and the caller makes torch's call: a tensor below
:data:`batchlayers._workspace.MIN_BYTES`, not on the CPU, a subclass (a tracer's fake tensor), one that is not
dense (:func:`batchlayers._workspace._dense`), compiled code, a torch.func transform or forward AD (these
Functions have no rules for them), or keeping turned off (``batchlayers.backends.cpu.reuse_workspace``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _workspace

__all__ = ["max_pool2d", "relu", "relu_"]


def _keeps(x: Tensor) -> bool:
    return (
        x.is_floating_point()
        and _workspace.applies(x, x.numel())  # (a plain CPU tensor: no subclass)
        and _workspace._dense(x)
        and _workspace._own_functions_run()
    )


def _records(x: Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


class _ReLU(torch.autograd.Function):
    """``torch.relu``, which is ``clamp_min(x, 0)``, differentiated as torch's ``ReluBackward0``:
    ``threshold_backward(grad, result, 0)``, here into a kept buffer laid out as the result. With
    ``create_graph=True`` the gradient is torch's recorded op, differentiable again."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = _workspace.returned_like(x)
        torch.clamp_min(x, 0, out=out)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            return torch.ops.aten.threshold_backward(grad, out, 0)
        by_input = _workspace.returned_like(out)
        return torch.ops.aten.threshold_backward.grad_input(grad, out, 0, grad_input=by_input)


def relu(x: Tensor) -> Tensor | None:
    """``torch.relu(x)`` with its result (and, while gradients are recorded, its input gradient) in kept
    memory; None where that does not apply (see the module docstring)."""
    if not _keeps(x):
        return None
    if _records(x):
        return _ReLU.apply(x)
    return torch.clamp_min(x, 0, out=_workspace.returned_like(x))


class _ReLUInPlace(torch.autograd.Function):
    """``torch.relu_``, which is ``clamp_min_(x, 0)``, differentiated as torch's: ``threshold_backward(grad,
    result, 0)`` (the result is ``x`` itself, written), here into a kept buffer laid out as ``x``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        # below the version counter's dispatch key: mark_dirty counts the write, once, as torch's relu_ does
        with torch._C._AutoDispatchBelowADInplaceOrView():
            x.clamp_min_(0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return _ReLU.backward(ctx, grad)


def relu_(x: Tensor) -> Tensor | None:
    """``torch.relu_(x)`` (``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``) while gradients are recorded
    into ``x``, with its input gradient in kept memory: an in-place ReLU allocates nothing in forward, but torch's
    backward makes a new gradient as large as ``x``. None where that does not apply (see the module docstring),
    and for a leaf or a view (torch's own call then raises, or rebases the view's history, as it does)."""
    if not (_records(x) and _keeps(x)) or x.grad_fn is None or x._base is not None:
        return None
    return _ReLUInPlace.apply(x)


class _MaxPool2d(torch.autograd.Function):
    """``F.max_pool2d`` while gradients are recorded, which torch computes with ``max_pool2d_with_indices`` and
    differentiates with ``max_pool2d_with_indices_backward``: the same, the input gradient into a kept buffer
    laid out as the input (contiguous or channels-last, the layout torch's kernel gives it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool) -> Tensor:
        out, indices = torch._C._nn.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(x, indices)
        ctx.arguments = (kernel_size, stride, padding, dilation, ceil_mode)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, indices = ctx.saved_tensors
        if torch.is_grad_enabled():
            by_input = torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *ctx.arguments, indices)
        else:
            by_input = torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
                grad, x, *ctx.arguments, indices, grad_input=_workspace.returned_like(x)
            )
        return by_input, None, None, None, None, None


def max_pool2d(x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool) -> Tensor | None:
    """``F.max_pool2d(x, ...)`` (``return_indices=False``, ``stride`` None for the kernel size) of a batch of
    images ``(N, C, H, W)``, contiguous or channels-last, while gradients are recorded into it, with its input
    gradient in kept memory; None otherwise (see the module docstring)."""
    if not (_records(x) and x.dim() == 4 and _keeps(x)):
        return None
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return None  # (another dense order: torch's kernel would write its gradient elsewhere, then copy)
    return _MaxPool2d.apply(x, kernel_size, [] if stride is None else stride, padding, dilation, ceil_mode)
