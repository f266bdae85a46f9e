"""Model code the converter has no batched layer for, written the way timm, transformers and torch.nn users
write it: parameters held by non-leaf modules, subclasses of torch.nn layers with their own forward,
look-alikes calling torch functions on their own weights, parametrizations. Each must stack exactly."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, prune, spectral_norm, weight_norm


class TinyViT(nn.Module):
    """ViT/DeiT/Swin patterns: class token and position embedding parameters used in forward, a layer-scale
    gamma, a relative-position bias table indexed by a buffer, a LayerNorm subclass."""

    def __init__(self, img: int = 8, patch: int = 4, dim: int = 8, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.heads = heads
        n = (img // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.norm1 = _PlainLayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.gamma = nn.Parameter(torch.rand(dim))
        self.bias_table = nn.Parameter(torch.randn(2 * (n + 1) - 1, heads))
        idx = torch.arange(n + 1)
        self.register_buffer("rel_index", (idx[:, None] - idx[None, :] + n), persistent=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        b, n, c = x.shape
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1) + self.pos_embed
        h = self.norm1(x)
        q, k, v = self.qkv(h).reshape(b, n + 1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.bias_table[self.rel_index.view(-1)].view(n + 1, n + 1, -1).permute(2, 0, 1)
        attn = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads) + bias.unsqueeze(0)
        h = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n + 1, c)
        x = x + self.gamma * self.proj(h)
        return self.head(x[:, 0])


class _PlainLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass (timm's LayerNorm): the converter cannot assume it computes like nn.LayerNorm."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: channels-first input, permuted around F.layer_norm."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: F.batch_norm on its own buffers (updated in train mode), then an activation."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        y = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        return F.silu(y)


class StdConv2d(nn.Conv2d):
    """timm's StdConv2d: the weight standardised per output channel in every forward."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0)
        return F.conv2d(x, w.reshape_as(self.weight), self.bias, self.stride, self.padding)


class GroupNormAct(nn.GroupNorm):
    """timm's GroupNormAct: F.group_norm on its own affine parameters, then an activation."""

    def forward(self, x):
        return F.gelu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class ConvNeXtish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = StdConv2d(3, 6, 3, padding=1)
        self.bn = BatchNormAct2d(6)
        self.gn = GroupNormAct(2, 6)
        self.norm = LayerNorm2d(6)
        self.layer_scale = nn.Parameter(torch.full((6, 1, 1), 0.5))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.gn(self.bn(self.stem(x)))
        x = x + self.layer_scale * self.norm(x)
        return self.head(x.mean((2, 3)))


class Conv1D(nn.Module):
    """transformers' Conv1D (GPT-2): a linear as torch.addmm on a (in, out) weight."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm: computed in float32, scaled by its weight in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class FusedRMSNorm(nn.RMSNorm):
    """An nn.RMSNorm subclass calling F.rms_norm itself."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class ScaledEmbedding(nn.Embedding):
    """BART's scaled word embedding."""

    def __init__(self, num: int, dim: int, scale: float) -> None:
        super().__init__(num, dim)
        self.scale = scale

    def forward(self, ids):
        return super().forward(ids) * self.scale


class OffsetPositions(nn.Embedding):
    """OPT's learned positional embedding: positions from the attention mask, shifted by an offset."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num + 2, dim)
        self.offset = 2

    def forward(self, mask):
        positions = (torch.cumsum(mask, dim=1) * mask).long() - 1
        return super().forward(positions + self.offset)


class TinyLM(nn.Module):
    """GPT-2/LLaMA/OPT/BART pieces together; reads a configuration from a weight in forward."""

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        self.wte = ScaledEmbedding(vocab, dim, scale=math.sqrt(dim))
        self.wpe = OffsetPositions(16, dim)
        self.c_attn = Conv1D(dim, dim)
        self.norm = RMSNorm(dim)
        self.final_norm = FusedRMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        mask = torch.ones_like(ids)
        x = self.wte(ids) + self.wpe(mask)
        x = x + self.c_attn(self.norm(x)) / self.lm_head.weight.shape[0]  # one model's vocabulary size
        return self.lm_head(self.final_norm(x))


class Parametrized(nn.Module):
    """torch.nn.utils.parametrizations (weight_norm, orthogonal) and the hook-based spectral_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(4, 5))
        self.b = parametrizations.orthogonal(nn.Linear(5, 5))
        self.c = spectral_norm(nn.Linear(5, 3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Pruned(nn.Module):
    """torch.nn.utils.prune (a mask buffer, the weight recomputed by a forward pre-hook before every call; pruned
    twice, a PruningContainer) and the deprecated hook-based torch.nn.utils.weight_norm, whose weights are
    plain attributes with an autograd history from the start."""

    def __init__(self) -> None:
        super().__init__()
        self.a = prune.random_unstructured(nn.Linear(4, 5), "weight", amount=0.4)
        self.b = prune.l1_unstructured(prune.ln_structured(nn.Linear(5, 5), "weight", 0.4, n=2, dim=0), "bias", 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (deprecated for parametrizations.weight_norm)
            self.c = weight_norm(nn.Linear(5, 3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Gate(nn.Module):
    """Python control flow on a per-model value: exact where all models agree, refused otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.fc(x) if self.gate.item() > 0 else x


class RelativePositionAttention(nn.Module):
    """DeBERTa / SEW-D disentangled attention: relative-position keys computed from a per-model embedding,
    ``(heads, 2 * span, d)``, tiled to the folded batch of the heads with ``repeat(q.size(0) // heads, 1, 1)``
    (or ``tile``) and multiplied with the queries in one ``bmm``."""

    def __init__(self, dim: int = 4, heads: int = 2, span: int = 3, tile: bool = False) -> None:
        super().__init__()
        self.heads, self.tile = heads, tile
        self.q = nn.Linear(dim, dim * heads)
        self.rel = nn.Parameter(torch.randn(2 * span, dim * heads))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):  # (B, 2 * span, dim)
        B, T, D = x.shape
        q = self.q(x).view(B, T, self.heads, D).transpose(1, 2).reshape(B * self.heads, T, D)
        keys = self.rel.view(T, self.heads, D).transpose(0, 1)  # (heads, 2 * span, d)
        count = q.size(0) // self.heads
        keys = keys.tile(count, 1, 1) if self.tile else keys.repeat(count, 1, 1)
        scores = torch.bmm(q, keys.transpose(1, 2)).softmax(-1)
        return self.out(torch.bmm(scores, q).view(B, self.heads, T, D).sum(1))
