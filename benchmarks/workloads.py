"""The benchmarked workloads: ordinary torch.nn models, their data, and hand-written batched references.

Each workload names one torch.nn architecture (what a user has), how to make a batch of its data and, where
one exists, a hand-written batched reference (raw ``baddbmm`` / grouped convolution) that is the floor for
batchlayers' own overhead. The batched model is built from the M torch.nn models by the contender, so every
contender starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "WORKLOADS",
    "Workload",
    "GPTMini",
    "SmallCNN",
    "SmallResNet",
    "RecurrentClassifier",
    "TinyEncoder",
    "mlp",
    "per_model_loss",
]


def mlp(*sizes: int) -> nn.Sequential:
    """``Linear -> ReLU -> ... -> Linear`` with the given layer sizes."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """conv 3->16, pool, conv 16->32, global pool, linear: the issue's small CNN."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _TorchvisionBlock(_BasicBlock):
    """:class:`_BasicBlock` as torchvision writes it: one ``nn.ReLU(inplace=True)``, the shortcut added in place."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__(in_channels, channels, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return self.relu(out)


class SmallResNet(nn.Module):
    """A small ResNet with BatchNorm: a stem and two basic blocks (16 and 32 channels)."""

    block: type[_BasicBlock] = _BasicBlock
    relu_in_place = False

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=self.relu_in_place)
        )
        self.layer1 = self.block(16, 16)
        self.layer2 = self.block(16, 32, stride=2)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class TorchvisionStyleResNet(SmallResNet):
    """:class:`SmallResNet` written as torchvision writes its ResNets: ``nn.ReLU(inplace=True)`` and
    ``out += identity`` on batch norm's outputs (timm's are written so too)."""

    block = _TorchvisionBlock
    relu_in_place = True


class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTMini(nn.Module):
    """A nanoGPT-style decoder (token + position embeddings, pre-norm blocks, tied head), written the way
    users write it: ``B, T = idx.size()`` and ``torch.arange(T)`` position indices inside ``forward``."""

    def __init__(
        self, vocab_size: int = 65, block_size: int = 32, d_model: int = 64, n_head: int = 4, n_layer: int = 2
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.size()
        pos = torch.arange(T, device=idx.device).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TinyEncoder(nn.Module):
    """``nn.TransformerEncoder`` (2 post-norm layers, d=64, 4 heads, feed-forward 256), mean-pooled, a linear
    classifier: torch.nn's own transformer, as users build it."""

    def __init__(self, d_model: int = 64, n_head: int = 4, num_layers: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(1))


class RecurrentClassifier(nn.Module):
    """``nn.LSTM`` (batch first) over a sequence, a linear head on the last step's output: a recurrent policy
    or sequence classifier as users write it."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, num_classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class SmallUNet(nn.Module):
    """A small U-Net for segmentation: two strided convolutions down, two transposed convolutions up, skip
    connections by ``cat``, BatchNorm; per-pixel class scores, channels last (``(B, H, W, classes)``)."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(32, 32, 4, stride=2, padding=1)
        self.dec2 = nn.Sequential(nn.Conv2d(64, 16, 3, padding=1), nn.ReLU())
        self.up1 = nn.ConvTranspose2d(16, 16, 4, stride=2, padding=1)
        self.head = nn.Conv2d(32, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        d2 = self.dec2(torch.cat([self.up2(self.mid(e2)), e2], dim=1))
        return self.head(torch.cat([self.up1(d2), e1], dim=1)).permute(0, 2, 3, 1)


def _segmentation_data(sample_shape: tuple[int, ...], num_classes: int):
    def make(lead: Sequence[int], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x = torch.randn(*lead, *sample_shape, generator=generator)
        y = torch.randint(num_classes, (*lead, *sample_shape[1:]), generator=generator)
        return x, y

    return make


def per_model_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Each model's mean cross entropy: ``(M, B, *, C)`` logits and ``(M, B, *)`` targets -> ``(M,)``."""
    num_models = logits.shape[0]
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return losses.view(num_models, -1).mean(1)


# --- hand-written batched references: raw parameter tensors with the model dimension first -------------


def _stack_params(models: Sequence[nn.Module], names: Sequence[str]) -> list[Tensor]:
    return [torch.stack([m.get_parameter(n).detach() for m in models]).clone().requires_grad_() for n in names]


def _mlp_reference(models: Sequence[nn.Module]) -> tuple[list[Tensor], Callable[[list[Tensor], Tensor], Tensor]]:
    names = [n for n, _ in models[0].named_parameters()]
    params = _stack_params(models, names)

    def forward(p: list[Tensor], x: Tensor) -> Tensor:
        # x: (M, B, in), possibly a stride-0 expand; baddbmm reads it without a copy.
        for i in range(0, len(p), 2):
            if i:
                x = torch.relu(x)
            x = torch.baddbmm(p[i + 1].unsqueeze(1), x, p[i].transpose(1, 2))
        return x

    return params, forward


def _cnn_reference(models: Sequence[nn.Module]) -> tuple[list[Tensor], Callable[[list[Tensor], Tensor], Tensor]]:
    names = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias"]
    params = _stack_params(models, names)

    def forward(p: list[Tensor], x: Tensor) -> Tensor:
        # Channel packing: (M, B, C, H, W) -> (B, M*C, H, W), then grouped convolution with groups=M.
        num_models, batch = x.shape[:2]
        w1, b1, w2, b2, wf, bf = p
        h = x.transpose(0, 1).reshape(batch, -1, *x.shape[3:])
        h = F.conv2d(h, w1.flatten(0, 1), b1.flatten(), padding=1, groups=num_models)
        h = F.max_pool2d(F.relu(h), 2)
        h = F.relu(F.conv2d(h, w2.flatten(0, 1), b2.flatten(), padding=1, groups=num_models))
        h = h.mean((2, 3)).view(batch, num_models, -1).transpose(0, 1)
        return torch.baddbmm(bf.unsqueeze(1), h, wf.transpose(1, 2))

    return params, forward


# --- the workloads --------------------------------------------------------------------------------------


def _classification_data(sample_shape: tuple[int, ...], num_classes: int):
    def make(lead: Sequence[int], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x = torch.randn(*lead, *sample_shape, generator=generator)
        y = torch.randint(num_classes, tuple(lead), generator=generator)
        return x, y

    return make


def _token_data(vocab_size: int, block_size: int):
    def make(lead: Sequence[int], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(vocab_size, (*lead, block_size + 1), generator=generator)
        return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()

    return make


def _linear_flops(model: nn.Module, samples: int) -> tuple[float, float]:
    """Matrix-multiply FLOPs of one forward pass and of one training step (forward + backward; the first
    layer computes no input gradient) of an MLP over ``samples`` rows."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    forward = sum(2.0 * samples * m.in_features * m.out_features for m in linears)
    first = 2.0 * samples * linears[0].in_features * linears[0].out_features
    return forward, 3 * forward - first


@dataclass
class Workload:
    """One benchmarked architecture and its data.

    Attributes:
        name: CLI name.
        description: one line for the report.
        make_model: builds one ordinary torch.nn model.
        make_data: ``(leading shape, generator) -> (inputs, targets)``; ``(M, B)`` per model, ``(B,)`` shared.
        batch_size: default samples per model and step.
        num_models: default numbers of models for a full run and for ``--quick``.
        shared: whether all models see one batch (passed to batchlayers as a stride-0 expand).
        batched: ``"layers"`` builds the batchlayers model from batched layers by hand, ``"stack"`` converts
            the torch.nn models with ``batchlayers.stack``.
        reference: builds the hand-written reference from the M models: ``(params, forward(params, x))``.
        flops: ``(model, samples) -> (forward FLOPs, training-step FLOPs)`` where countable.
    """

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_data: Callable[[Sequence[int], torch.Generator], tuple[Tensor, Tensor]]
    batch_size: int
    num_models: tuple[int, ...]
    quick_num_models: tuple[int, ...]
    shared: bool = False
    batched: str = "stack"
    reference: Callable[[Sequence[nn.Module]], tuple[list[Tensor], Callable]] | None = None
    flops: Callable[[nn.Module, int], tuple[float, float]] | None = None
    notes: list[str] = field(default_factory=list)


def _mlp_workload(name: str, sizes: tuple[int, ...], batch_size: int, num_models, quick_num_models, shared: bool):
    layers = "-".join(str(n) for n in sizes)
    data = "one batch shared by all models" if shared else "per-model data"
    return Workload(
        name,
        f"{layers} MLP, {data}",
        lambda: mlp(*sizes),
        _classification_data((sizes[0],), sizes[-1]),
        batch_size=batch_size,
        num_models=num_models,
        quick_num_models=quick_num_models,
        shared=shared,
        batched="layers",
        reference=_mlp_reference,
        flops=_linear_flops,
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        # The 10-20-2 MLP of the classic vmap-ensembling question.
        _mlp_workload("mlp-tiny", (10, 20, 2), 64, (1, 4, 16, 64, 256, 1024, 4096), (64, 1024), shared=False),
        _mlp_workload("mlp-tiny-shared", (10, 20, 2), 64, (64, 1024), (64,), shared=True),
        _mlp_workload("mlp-wide", (784, 256, 256, 10), 128, (1, 16, 64), (64,), shared=False),
        _mlp_workload("mlp-wide-shared", (784, 256, 256, 10), 128, (64,), (64,), shared=True),
        Workload(
            "cnn",
            "small CNN (conv 3->16, pool, conv 16->32, global pool, linear), 3x32x32, converted with stack",
            SmallCNN,
            _classification_data((3, 32, 32), 10),
            batch_size=32,
            num_models=(4, 16),
            quick_num_models=(16,),
            reference=_cnn_reference,
        ),
        Workload(
            "resnet",
            "small ResNet with BatchNorm (stem + 2 basic blocks), 3x32x32, converted with stack",
            SmallResNet,
            _classification_data((3, 32, 32), 10),
            batch_size=32,
            num_models=(4, 8),
            quick_num_models=(4,),
        ),
        Workload(
            "resnet-tv",
            "the small ResNet written as torchvision writes it (nn.ReLU(inplace=True), out += identity), stacked",
            TorchvisionStyleResNet,
            _classification_data((3, 32, 32), 10),
            batch_size=32,
            num_models=(4,),
            quick_num_models=(4,),
        ),
        Workload(
            "unet",
            "small U-Net (convs down, ConvTranspose2d up, skips, BatchNorm), 3x32x32 segmentation, stacked",
            SmallUNet,
            _segmentation_data((3, 32, 32), 4),
            batch_size=8,
            num_models=(8,),
            quick_num_models=(8,),
        ),
        Workload(
            "transformer",
            "nn.TransformerEncoder (2 layers, d=64, 4 heads, T=32), mean-pooled classifier, converted with stack",
            TinyEncoder,
            _classification_data((32, 64), 10),
            batch_size=16,
            num_models=(8,),
            quick_num_models=(8,),
        ),
        Workload(
            "lstm-policy",
            "LSTM policy (1 layer, hidden 64, T=16, 16 inputs), linear head on the last step, converted with stack",
            lambda: RecurrentClassifier(16, 64, 1),
            _classification_data((16, 16), 10),
            batch_size=8,
            num_models=(32,),
            quick_num_models=(32,),
        ),
        Workload(
            "lstm",
            "LSTM (2 layers, hidden 256, T=32, 64 inputs), linear head on the last step, converted with stack",
            lambda: RecurrentClassifier(64, 256, 2),
            _classification_data((32, 64), 10),
            batch_size=64,
            num_models=(8,),
            quick_num_models=(8,),
        ),
        Workload(
            "gpt",
            "GPT-mini (d=64, 4 heads, 2 layers, T=32, vocab 65, tied head), converted with stack",
            GPTMini,
            _token_data(65, 32),
            batch_size=16,
            num_models=(8,),
            quick_num_models=(8,),
        ),
    ]
}
