"""Reference architectures written the way real repositories write them, for the converter tests.

Each is small (fast on CPU) but keeps the habits that trip converters up: ``x.view(x.size(0), -1)``,
``torch.flatten(x, 1)``, ``F.avg_pool2d(out, out.size(2))``, residual blocks adding in place into an empty
``nn.Sequential()`` shortcut, ``B, T, C = x.size()``, a sliced causal-mask buffer, position indices without
a batch dimension, a loss inside ``forward``, a lambda that captured a submodule container in ``__init__``,
and an output projection tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CNN", "GPT", "MLP", "DepthwiseNet", "GPTConfig", "GroupNormNet", "SENet", "TransformerOutput"]


class MLP(nn.Module):
    def __init__(self, in_features: int = 6, hidden: int = 8, out_features: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_features)

    def forward(self, x):
        x = self.act(self.fc1(x))
        x = F.gelu(self.fc2(x))
        return self.fc3(x)


class BasicBlock(nn.Module):
    """The kuangliu/pytorch-cifar ResNet block."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class CNN(nn.Module):
    """A tiny CIFAR-style ResNet: BatchNorm, residual blocks, ``F.avg_pool2d(out, out.size(2))``, ``view``."""

    def __init__(self, num_classes: int = 4, width: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.linear = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer2(self.layer1(out))
        out = F.avg_pool2d(out, out.size(2))
        out = out.view(out.size(0), -1)
        return self.linear(out)


class SEBlock(nn.Module):
    """Squeeze-and-excitation with 1x1 convolutions on pooled features (kuangliu SENet)."""

    def __init__(self, planes: int, reduced: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(planes, planes, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(planes)
        self.fc1 = nn.Conv2d(planes, reduced, kernel_size=1)
        self.fc2 = nn.Conv2d(reduced, planes, kernel_size=1)

    def forward(self, x):
        out = F.relu(self.bn(self.conv(x)))
        w = F.avg_pool2d(out, out.size(2))
        w = F.relu(self.fc1(w))
        w = torch.sigmoid(self.fc2(w))
        return out * w + x


class SENet(nn.Module):
    def __init__(self, num_classes: int = 3, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.block = SEBlock(width, 2)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        out = self.block(self.stem(x))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.head(torch.flatten(out, 1))


class DepthwiseNet(nn.Module):
    """MobileNet-style depthwise-separable and grouped convolutions, in a Sequential with Flatten."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU6(inplace=True),
            nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False),  # depthwise
            nn.Conv2d(6, 8, 1),  # pointwise
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),  # grouped
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class GroupNormNet(nn.Module):
    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn1 = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.gn2 = nn.GroupNorm(2, 8, affine=False)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = F.relu(self.gn1(self.conv1(x)))
        x = F.relu(self.gn2(self.conv2(x)))
        x = F.adaptive_max_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


@dataclass
class GPTConfig:
    vocab_size: int = 11
    block_size: int = 8
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 8
    dropout: float = 0.0
    position_indices: str = "1T"  # "1T": arange(T).unsqueeze(0) as minGPT, "T": arange(T) as nanoGPT


@dataclass
class TransformerOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: ``B, T, C = x.size()``, heads by ``view``/``transpose``, a sliced mask buffer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(
            dict(c_fc=nn.Linear(config.n_embd, 4 * config.n_embd), c_proj=nn.Linear(4 * config.n_embd, config.n_embd))
        )
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(F.gelu(m.c_fc(x)))  # minGPT: a lambda that captured a container

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    """minGPT/nanoGPT: tied output head, position indices without a batch dimension, loss in ``forward``."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = config or GPTConfig()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        if self.config.position_indices == "1T":
            pos = pos.unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return TransformerOutput(logits, loss)


class TinyUNet(nn.Module):
    """A small U-Net: strided convolutions down, transposed convolutions up (one grouped), skip connections
    joined with ``cat``, and ``output_size`` taken from the skip's ``size()`` (folded inside a stacked model)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(16, 16, 3, stride=2, padding=1)  # odd maps: needs output_size
        self.dec2 = nn.Sequential(nn.Conv2d(32, 8, 3, padding=1), nn.ReLU())
        self.up1 = nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1, groups=2)
        self.dec1 = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        u2 = self.up2(self.mid(e2), output_size=e2.size())
        d2 = self.dec2(torch.cat([u2, e2], dim=1))
        u1 = self.up1(d2, output_size=e1.shape[-2:])
        return self.dec1(torch.cat([u1, e1], dim=1))


class Seq2SeqGRU(nn.Module):
    """An attention seq2seq model: bidirectional GRU encoder, a GRUCell decoder stepped in Python with dot
    attention over the encoder states (``bmm``), the decoder's state bridged from both final encoder states."""

    def __init__(self, vocab: int = 12, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.attend = nn.Linear(hidden, 2 * hidden, bias=False)
        self.decoder = nn.GRUCell(3 * hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, src, tgt):
        encoded, final = self.encoder(self.embed(src))  # (B, S, 2H), (2, B, H)
        state = torch.tanh(self.bridge(torch.cat([final[0], final[1]], dim=-1)))
        logits = []
        for t in range(tgt.size(1)):
            scores = torch.bmm(encoded, self.attend(state).unsqueeze(-1)).squeeze(-1)  # (B, S)
            context = torch.bmm(scores.softmax(-1).unsqueeze(1), encoded).squeeze(1)  # (B, 2H)
            state = self.decoder(torch.cat([self.embed(tgt[:, t]), context], dim=-1), state)
            logits.append(self.out(state))
        return torch.stack(logits, dim=1)


class LSTMLanguageModel(nn.Module):
    """A 2-layer LSTM language model with the output head tied to the embedding, loss in forward."""

    def __init__(self, vocab: int = 11, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx, targets=None):
        out, _ = self.lstm(self.embed(idx))
        logits = self.head(out)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
