"""Scaled dot-product attention over short sequences on the CPU, computed explicitly.

torch's CPU ``scaled_dot_product_attention`` runs its flash kernel wherever it can (4-D inputs without a mask
or with a causal one), which blocks over the query and key positions so that it never holds an ``L x S``
score matrix: built for long sequences. For short ones without a mask, the two matrix products and the softmax
it avoids are faster. Measured on a 2-core AMD EPYC (torch 2.13, float32, 2 threads, medians): the op alone,
forward and backward of contiguous ``(N, heads, T, d)`` inputs, flash's time over the explicit ops' 1.37x
(128, 4, 16, 16), 2.28x (128, 4, 32, 16), 1.74x (128, 4, 32, 64), 1.61x (64, 8, 64, 32), 1.54x (64, 8, 64, 64),
1.43x (16, 8, 128, 64), 0.95x (8, 8, 256, 64) and 0.56x (4, 12, 512, 64), where the explicit ops' ``L x S``
matrices also cost memory; with the heads viewed from a packed projection (as user code and
``BatchedMultiheadAttention`` make them; the products copy them) 1.16-1.74x at T=24-64, d=8-32. The
benchmark's stacked ``nn.TransformerEncoder`` (T=32, M=8, batch 16) trained in 38.4 and 40.8 ms a step against
42.5 and 43.6 ms with torch's call (two processes, steps alternating, 100 each; 3-10% faster over six such
processes). With ``is_causal`` (GPT-mini,
T=32) the step took the same time either way (46.9-49.6 ms, explicit ops saving the probabilities or
recomputing them in backward as flash does), so causal attention stays torch's.

Without gradients the explicit ops measured no better (heads viewed from a packed projection, T=16-64: 0.47-1.49x
torch's speed by shape; the transformer's inference step 14.3 against 14.0 ms): they allocate the ``L x S``
scores and probabilities that flash never holds, with nothing saved to amortise them. So while gradients are
recorded into them, query and key sequences of at most :data:`MAX_LENGTH` positions without a mask take
:func:`attention`: ``softmax(q @ k^T * scale) @ v`` by torch's ops, recorded by autograd as they run (the
probabilities are saved for backward, ``heads * L * S`` numbers a sample; a second derivative is exact), the
result laid out as torch's kernel lays out its own. Results equal torch's up to the summation order (float64
to ~1e-15).

Everything else takes torch's call (:func:`attention` returns None): no gradient recorded (inference,
``no_grad``), any mask or ``is_causal``, dropout, grouped-query attention, longer sequences, another device,
dtypes other than float32 and float64, autocast, compiled code (inductor plans attention itself), torch.func
transforms and forward AD (unmeasured there), tensor subclasses, and batch dimensions that differ between the
three inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._utils import autocast_enabled, no_function_transforms

__all__ = ["MAX_LENGTH", "attention"]

# The longest query or key sequence computed explicitly (see the module docstring); 0: none.
# ``batchlayers.backends.cpu.explicit_attention_max_length`` sets it.
MAX_LENGTH = 64


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | None:
    """``F.scaled_dot_product_attention(query, key, value, ...)`` computed explicitly where the sequences are
    short and nothing is masked (see the module docstring); None where torch's call is made instead."""
    if not _applies(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return _laid_out_as(_attend(query, key, value, scale), query, key, value)


def _applies(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    tensors = (query, key, value)
    if not all(type(t) is Tensor for t in tensors) or attn_mask is not None or is_causal or enable_gqa:
        return False
    if dropout_p != 0.0 or not all(t.device.type == "cpu" for t in tensors):
        return False
    if not all(t.dtype == query.dtype for t in tensors) or query.dtype not in (torch.float32, torch.float64):
        return False
    if not query.dim() == key.dim() == value.dim() >= 3:
        return False
    batch = query.shape[:-2]
    if key.shape[:-2] != batch or value.shape[:-2] != batch or key.shape[-1] != query.shape[-1]:
        return False
    lengths = query.shape[-2], key.shape[-2]
    if value.shape[-2] != lengths[1] or not 0 < min(lengths) <= max(lengths) <= MAX_LENGTH:
        return False
    if any(t.numel() == 0 for t in tensors) or autocast_enabled(query) or torch.compiler.is_compiling():
        return False
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and no_function_transforms()


def _attend(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """``softmax(query @ key^T * scale) @ value``, contiguous."""
    return torch.matmul(torch.softmax(torch.matmul(query, key.transpose(-2, -1)) * scale, dim=-1), value)


def _laid_out_as(out: Tensor, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """``out`` laid out as torch's call lays out its result: where its CPU flash kernel runs (4-D inputs with
    one head size and contiguous rows), as ``torch.empty_like(query)`` (a transposed view of ``(N, L, heads,
    d)`` memory for a query viewed so from a projection), else contiguous (its explicit path's ``matmul``).
    Autograd records the copy."""
    if query.dim() != 4 or value.shape[-1] != query.shape[-1] or query.stride() == out.stride():
        return out
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return out
    like = torch.empty_like(query)
    return out if like.stride() == out.stride() else like.copy_(out)
