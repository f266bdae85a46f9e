"""Batched counterpart of ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

import numbers
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import init

from ._utils import check_device, check_input, check_num_models, check_size, init_per_model_, layer_name
from .functional._attention import multi_head_attention
from .linear import BatchedLinear

__all__ = ["BatchedMultiheadAttention"]


class BatchedMultiheadAttention(nn.Module):
    r"""``num_models`` independent :class:`torch.nn.MultiheadAttention` layers, computed together.

    The projections are batched matrix multiplies over the models; the attention itself runs once over all
    models' samples (``scaled_dot_product_attention``, or torch's explicit softmax when the weights are
    returned), with torch's mask rules.

    Args:
        num_models: number of models ``M``.
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first: as in
            :class:`torch.nn.MultiheadAttention`.

    Shape:
        - query: ``(M, B, L, E)`` if ``batch_first`` else ``(M, L, B, E)`` (the model dimension first, then
          torch's own layout); key ``(M, B, S, kdim)`` / ``(M, S, B, kdim)``, value likewise with ``vdim``.
        - key_padding_mask: ``(M, B, S)``, bool (True: ignored) or float (added).
        - attn_mask: ``(L, S)`` shared by all models, ``(M, L, S)`` per model, or ``(M, B * num_heads, L, S)``.
        - Output: ``(M, B, L, E)`` / ``(M, L, B, E)``, and the weights ``(M, B, L, S)``
          (``(M, B, num_heads, L, S)`` with ``average_attn_weights=False``) or ``None``.

    Attributes:
        in_proj_weight: ``(M, 3 * embed_dim, embed_dim)`` (or ``q_proj_weight``, ``k_proj_weight``,
            ``v_proj_weight`` ``(M, embed_dim, kdim/vdim)`` when kdim or vdim differ from embed_dim), each
            model's slice Xavier-uniform as in torch; in_proj_bias: ``(M, 3 * embed_dim)``, zeros;
            out_proj: a :class:`BatchedLinear` (``out_proj.weight`` ``(M, embed_dim, embed_dim)``); bias_k,
            bias_v: ``(M, 1, 1, embed_dim)``, Xavier-normal.

    Examples::

        >>> attention = BatchedMultiheadAttention(4, 64, 8, batch_first=True)
        >>> x = torch.randn(4, 16, 10, 64)
        >>> out, weights = attention(x, x, x)
        >>> out.shape, weights.shape
        (torch.Size([4, 16, 10, 64]), torch.Size([4, 16, 10, 10]))
    """

    torch_module = nn.MultiheadAttention

    def __init__(
        self,
        num_models: int,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        name = type(self).__name__
        check_size(name, "embed_dim", embed_dim)
        check_size(name, "num_heads", num_heads)
        for arg, value in (("kdim", kdim), ("vdim", vdim)):
            if value is not None:
                check_size(name, arg, value, 1)
        # (cast: to mypy a float is no numbers.Real, which would make the rest unreachable)
        if isinstance(dropout, bool) or not isinstance(cast(object, dropout), numbers.Real) or not 0 <= dropout <= 1:
            raise ValueError(f"{name}: dropout probability has to be between 0 and 1, got {dropout!r}")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"{type(self).__name__}: embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                f"and num_heads={num_heads}"
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"{type(self).__name__}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn
        m = num_models
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((m, 3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((m, embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((m, embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((m, embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty((m, 3 * embed_dim), **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = BatchedLinear(m, embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if add_bias_kv:
            self.bias_k: nn.Parameter | None = nn.Parameter(torch.empty((m, 1, 1, embed_dim), **factory_kwargs))
            self.bias_v: nn.Parameter | None = nn.Parameter(torch.empty((m, 1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def torch_kwargs(self) -> dict[str, object]:
        """The arguments of the ``nn.MultiheadAttention`` that one model of this layer is (``unstack``);
        ``bias`` and ``add_bias_kv`` are kept as tensors, as in torch."""
        return {
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "dropout": self.dropout,
            "bias": self.in_proj_bias is not None,
            "add_bias_kv": self.bias_k is not None,
            "add_zero_attn": self.add_zero_attn,
            "kdim": self.kdim,
            "vdim": self.vdim,
            "batch_first": self.batch_first,
        }

    def _reset_parameters(self) -> None:
        # torch.nn.MultiheadAttention._reset_parameters, one model's slice at a time; out_proj.weight keeps
        # its Linear init, as in torch.
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                init_per_model_(w, init.xavier_uniform_)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                init_per_model_(b, lambda t: init.xavier_normal_(t))

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        layout = "(M, B, L, E)" if self.batch_first else "(M, L, B, E)"
        check_input(self, query, trailing=[("embed_dim", self.embed_dim)], ndims=[4], what="query", layout=layout)
        check_input(self, key, trailing=[("kdim", self.kdim)], ndims=[4], what="key", layout=layout)
        check_input(self, value, trailing=[("vdim", self.vdim)], ndims=[4], what="value", layout=layout)
        shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        if not self.batch_first:  # (M, L, B, E) -> (M, B, L, E): views, transposed back at the end
            query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        batch, tgt_len, src_len = query.shape[1], query.shape[2], key.shape[2]
        if key.shape[1:3] != value.shape[1:3] or key.shape[1] != batch:
            raise ValueError(
                f"{layer_name(self)}: query, key and value must share the batch size, and key and value the "
                f"sequence length, in the layout {layout} (batch_first={self.batch_first}): got {shapes}"
            )
        self._check_masks(key_padding_mask, attn_mask, batch, tgt_len, src_len)
        out, weights = multi_head_attention(
            query,
            key,
            value,
            self.num_heads,
            self.in_proj_weight,
            self.in_proj_bias,
            self.bias_k,
            self.bias_v,
            self.add_zero_attn,
            self.dropout,
            self.out_proj.weight,
            self.out_proj.bias,
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        return (out if self.batch_first else out.transpose(1, 2)), weights

    def _check_masks(self, key_padding_mask, attn_mask, batch: int, tgt_len: int, src_len: int) -> None:
        m, rows = self.num_models, batch * self.num_heads
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if isinstance(mask, Tensor):
                check_device(self, mask, name)
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (m, batch, src_len):
            raise ValueError(
                f"{layer_name(self)}: expected key_padding_mask (M, B, S) = {(m, batch, src_len)}, got "
                f"{tuple(key_padding_mask.shape)}"
            )
        allowed = [(tgt_len, src_len), (m, tgt_len, src_len), (m, rows, tgt_len, src_len)]
        if attn_mask is not None and tuple(attn_mask.shape) not in allowed:
            raise ValueError(
                f"{layer_name(self)}: expected attn_mask (L, S) = {allowed[0]} (shared), (M, L, S) = {allowed[1]} "
                f"or (M, B * num_heads, L, S) = {allowed[2]}, got {tuple(attn_mask.shape)}"
            )

    def extra_repr(self) -> str:
        return (
            f"num_models={self.num_models}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"batch_first={self.batch_first}"
        )
