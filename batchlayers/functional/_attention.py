from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .._utils import check_call_input, check_parameter, check_size, check_weight
from . import _short_attention
from ._linear import unchecked_linear as linear

__all__ = ["multi_head_attention"]


def multi_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    *,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    r"""Model ``m``'s :func:`torch.nn.functional.multi_head_attention_forward` on ``query[m]``, ``key[m]``,
    ``value[m]``, for every model at once, batch first.

    The projections are batched matrix multiplies over the models (:func:`linear`); attention itself has no
    weights, so it runs as one call over all models' samples folded into the batch, ``(M * B, heads, L, d)``
    (``scaled_dot_product_attention``, or torch's explicit softmax where the weights are returned), with
    torch's own mask rules.

    Args:
        query: ``(M, B, L, E)``; key: ``(M, B, S, kdim)``; value: ``(M, B, S, vdim)``. A batch shared by all
            models may be a stride-0 expand.
        in_proj_weight: ``(M, 3 * E, E)`` packed (``None`` with separate ``q/k/v_proj_weight`` ``(M, E, *)``);
            in_proj_bias: ``(M, 3 * E)``; bias_k, bias_v: ``(M, 1, 1, E)``; out_proj_weight ``(M, E, E)``,
            out_proj_bias ``(M, E)``.
        key_padding_mask: ``(M, B, S)`` (bool: True is ignored; float: added).
        attn_mask: ``(L, S)`` shared by all models, ``(M, L, S)`` per model, or ``(M, B * heads, L, S)``.
        Everything else: as in torch.

    Returns:
        ``(M, B, L, E)`` and the attention weights ``(M, B, L, S)`` (``(M, B, heads, L, S)`` without
        averaging) or ``None``.
    """
    _check_arguments(
        query,
        key,
        value,
        num_heads,
        in_proj_weight,
        in_proj_bias,
        bias_k,
        bias_v,
        out_proj_weight,
        out_proj_bias,
        key_padding_mask,
        attn_mask,
        q_proj_weight,
        k_proj_weight,
        v_proj_weight,
    )
    num_models, batch, tgt_len, embed_dim = query.shape
    head_dim = embed_dim // num_heads
    q, k, v = _projections(query, key, value, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight)
    folded = num_models * batch

    key_padding_mask = _canonical(key_padding_mask, query.dtype, "key_padding_mask", attn_mask)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.reshape(folded, -1)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = _canonical(attn_mask, query.dtype, "attn_mask", None)
        if key_padding_mask is not None:
            is_causal = False
    if attn_mask is not None:
        attn_mask = _folded_mask(attn_mask, num_models, batch * num_heads)

    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, bias_k.expand(num_models, batch, 1, embed_dim)], dim=2)
        v = torch.cat([v, bias_v.expand(num_models, batch, 1, embed_dim)], dim=2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    elif bias_k is not None or bias_v is not None:
        raise ValueError("multi_head_attention: bias_k and bias_v are given together or not at all")

    # (M, B, L, E) -> (M * B, heads, L, d), torch's (bsz, heads, L, d) with the models in the batch: views of
    # the projections (as torch's own attention takes them), which scaled_dot_product_attention reads as they
    # are; the explicit-weights path below flattens them into (M * B * heads, L, d) for its batched GEMMs.
    q, k, v = (t.reshape(folded, -1, num_heads, head_dim).transpose(1, 2) for t in (q, k, v))
    if add_zero_attn:
        zeros = q.new_zeros(folded, num_heads, 1, head_dim)
        k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src_len = k.shape[2]
    if key_padding_mask is not None:
        key_padding_mask = (
            key_padding_mask.view(folded, 1, 1, src_len)
            .expand(-1, num_heads, -1, -1)
            .reshape(folded * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0

    weights = None
    if need_weights:
        q, k, v = (t.reshape(folded * num_heads, -1, head_dim) for t in (q, k, v))
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        if attn_mask is not None:
            scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            scores = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = torch.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).view(folded, num_heads, tgt_len, head_dim)
        weights = weights.view(num_models, batch, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=2)
    else:
        if attn_mask is not None:
            attn_mask = (
                attn_mask.unsqueeze(0)
                if attn_mask.dim() == 3 and attn_mask.shape[0] == 1
                else (attn_mask.view(folded, num_heads, -1, src_len))
            )
        explicit = _short_attention.attention(q, k, v, attn_mask, dropout_p, is_causal)  # (short sequences)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal) if explicit is None else explicit
    out = out.transpose(1, 2).reshape(num_models, batch * tgt_len, embed_dim)
    out = linear(out, out_proj_weight, out_proj_bias).view(num_models, batch, tgt_len, -1)
    return out, weights


def _check_arguments(
    query,
    key,
    value,
    num_heads,
    in_proj_weight,
    in_proj_bias,
    bias_k,
    bias_v,
    out_proj_weight,
    out_proj_bias,
    key_padding_mask,
    attn_mask,
    q_weight,
    k_weight,
    v_weight,
) -> None:
    """Refuse, naming the function, arguments whose shapes do not fit together (torch's messages would name the
    folded ``(M * B * heads, ...)`` shapes)."""
    function = "batchlayers.functional.multi_head_attention"
    num_models, embed_dim, _ = check_weight(function, "out_proj_weight", out_proj_weight, 3, "(M, E, E)")
    check_call_input(
        function, query, num_models, trailing=[("E", embed_dim)], ndims=[4], what="query", layout="(M, B, L, E)"
    )
    if check_size(function, "num_heads", num_heads, 1) and embed_dim % num_heads:
        raise ValueError(f"{function}: embed_dim E={embed_dim} must be divisible by num_heads={num_heads}")
    if in_proj_weight is not None:
        check_parameter(
            function, "in_proj_weight", in_proj_weight, (num_models, 3 * embed_dim, embed_dim), "(M, 3 * E, E)", query
        )
        kdim = vdim = embed_dim
    else:
        for name, w in (("q_proj_weight", q_weight), ("k_proj_weight", k_weight), ("v_proj_weight", v_weight)):
            if w is None:
                raise ValueError(
                    f"{function}: without in_proj_weight, q_proj_weight, k_proj_weight and "
                    f"v_proj_weight are needed; {name} is None"
                )
            check_weight(function, name, w, 3, f"(M, E, {name[0]}dim)")
        check_parameter(function, "q_proj_weight", q_weight, (num_models, embed_dim, embed_dim), "(M, E, E)", query)
        kdim, vdim = k_weight.shape[2], v_weight.shape[2]
        check_parameter(function, "k_proj_weight", k_weight, (num_models, embed_dim, kdim), "(M, E, kdim)", query)
        check_parameter(function, "v_proj_weight", v_weight, (num_models, embed_dim, vdim), "(M, E, vdim)", query)
    check_call_input(
        function, key, num_models, trailing=[("kdim", kdim)], ndims=[4], what="key", layout="(M, B, S, kdim)"
    )
    check_call_input(
        function, value, num_models, trailing=[("vdim", vdim)], ndims=[4], what="value", layout="(M, B, S, vdim)"
    )
    batch, tgt_len, src_len = query.shape[1], query.shape[2], key.shape[2]
    if key.shape[1] != batch or value.shape[1:3] != key.shape[1:3]:
        raise ValueError(
            f"{function}: query (M, B, L, E), key (M, B, S, kdim) and value (M, B, S, vdim) must share B, and key and "
            f"value S: got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    check_parameter(function, "in_proj_bias", in_proj_bias, (num_models, 3 * embed_dim), "(M, 3 * E)", query)
    check_parameter(function, "out_proj_bias", out_proj_bias, (num_models, embed_dim), "(M, E)", query)
    for name, bias in (("bias_k", bias_k), ("bias_v", bias_v)):
        check_parameter(function, name, bias, (num_models, 1, 1, embed_dim), "(M, 1, 1, E)", query)
    check_parameter(function, "key_padding_mask", key_padding_mask, (num_models, batch, src_len), "(M, B, S)", key)
    rows = batch * num_heads
    allowed = [(tgt_len, src_len), (num_models, tgt_len, src_len), (num_models, rows, tgt_len, src_len)]
    if attn_mask is not None and tuple(attn_mask.shape) not in allowed:
        raise ValueError(
            f"{function}: expected attn_mask (L, S) = {allowed[0]} (shared), (M, L, S) = {allowed[1]} or "
            f"(M, B * num_heads, L, S) = {allowed[2]}, got {tuple(attn_mask.shape)}"
        )


def _projections(query, key, value, in_proj_weight, in_proj_bias, q_weight, k_weight, v_weight):
    """q, k, v as torch's ``_in_projection_packed`` / ``_in_projection`` compute them, per model."""
    if in_proj_weight is not None:
        embed_dim = query.shape[-1]
        if key is value and query is key:  # self-attention: one projection
            qkv = linear(query, in_proj_weight, in_proj_bias)
            return qkv.split(embed_dim, dim=-1)
        w_q, w_kv = in_proj_weight.split([embed_dim, 2 * embed_dim], dim=1)
        b_q, b_kv = (None, None) if in_proj_bias is None else in_proj_bias.split([embed_dim, 2 * embed_dim], dim=1)
        if key is value:  # encoder-decoder attention: keys and values in one projection
            return (linear(query, w_q, b_q), *linear(key, w_kv, b_kv).split(embed_dim, dim=-1))
        q_weight, k_weight, v_weight = in_proj_weight.split(embed_dim, dim=1)
    biases = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3, dim=1)
    return (
        linear(query, q_weight, biases[0]),
        linear(key, k_weight, biases[1]),
        linear(value, v_weight, biases[2]),
    )


def _canonical(mask: Tensor | None, dtype: torch.dtype, name: str, other: Tensor | None) -> Tensor | None:
    """torch's ``_canonical_mask``: a bool mask (True: not attended) becomes 0 / -inf of ``dtype``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"multi_head_attention: only bool and floating {name} are supported, got {mask.dtype}")
    if other is not None and other.dtype != mask.dtype:  # (torch's own warning, word for word)
        warnings.warn(
            f"Support for mismatched {name} and attn_mask is deprecated. Use same type for both instead.",
            stacklevel=3,
        )
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask


def _folded_mask(mask: Tensor, num_models: int, rows: int) -> Tensor:
    """``(L, S)`` (shared) stays; ``(M, L, S)`` and ``(M, B * heads, L, S)`` become torch's
    ``(M * B * heads, L, S)``."""
    if mask.dim() == 2:
        return mask.unsqueeze(0)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1).expand(num_models, rows, *mask.shape[1:])
    return mask.reshape(num_models * rows, *mask.shape[2:])
