"""What the digits examples share: the data split, the training loop and shared-batch evaluation."""

from __future__ import annotations

import pathlib

import torch
from torch import Tensor, nn

from batchlayers.losses import cross_entropy

__all__ = ["load_digits_split", "predict_shared", "save_figure", "train_epochs"]


def load_digits_split(seed: int, image: bool = False) -> dict[str, tuple[Tensor, Tensor]]:
    """scikit-learn's bundled digits (1797 8x8 images, no download) as float32 in [0, 1], split 60/20/20
    into ``"train"``, ``"val"`` and ``"test"``; samples are ``(64,)`` vectors, or ``(1, 8, 8)`` images."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    if image:
        x = x.view(-1, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train, n_val = int(0.6 * len(x)), int(0.2 * len(x))
    parts = {"train": order[:n_train], "val": order[n_train : n_train + n_val], "test": order[n_train + n_val :]}
    return {name: (x[idx], y[idx]) for name, idx in parts.items()}


def train_epochs(model: nn.Module, optimizer: torch.optim.Optimizer, loader, epochs: int) -> None:
    """Train every model on its own minibatches from ``loader`` (``(M, B, *)`` inputs, ``(M, B)`` labels)."""
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            losses = cross_entropy(model(x), y)  # (M,): model m's own mean loss
            optimizer.zero_grad()
            # The sum, not the mean: every model gets exactly the gradient of its own mean loss (a mean
            # would divide each model's gradient by M).
            losses.sum().backward()
            optimizer.step()


@torch.no_grad()
def predict_shared(model: nn.Module, x: Tensor, num_models: int) -> Tensor:
    """``(M, N, classes)`` logits of every model on one batch given once (a stride-0 expand, not M copies)."""
    return model(x.expand(num_models, *x.shape))


def save_figure(fig, path: pathlib.Path) -> None:
    """Write a matplotlib figure to ``path`` (creating its folder) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
