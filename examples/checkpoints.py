"""Separately trained models, converted into one batched model, evaluated and trained together, unstacked back.

The models are an ordinary PyTorch CNN class (``DigitsNet``, nothing batchlayers-specific in it), trained one
by one with different seeds the usual way and saved as checkpoint files (``.pt`` and ``.safetensors``) with
``batchlayers.save``, which never leaves a half-written file behind and here stores a checksum of the tensors.
Then:

1. ``batchlayers.stack_checkpoints`` loads all files into one stacked model, one file at a time, verifying
   each file's checksum;
2. every model is evaluated on the test set in one call (the batch given once, shared by all models), and
   matches the same model evaluated on its own;
3. all models are fine-tuned together (each on its own shuffled minibatches, each with exactly its own
   gradient: per-model losses are summed, not averaged);
4. ``batchlayers.unstack`` gives ordinary ``DigitsNet`` models back, saved as ordinary checkpoints.

    python examples/checkpoints.py                # 6 models, well under a minute on 2 CPU cores
    python examples/checkpoints.py --quick        # 3 models, a few seconds
    python examples/checkpoints.py --out results/ # where the checkpoint files go
"""

from __future__ import annotations

import argparse
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from digits_common import load_digits_split, predict_shared, train_epochs
from torch import Tensor, nn

from batchlayers.checkpoint import save, stack_checkpoints
from batchlayers.convert import unstack
from batchlayers.data import ModelTensorLoader


class DigitsNet(nn.Module):
    """An ordinary CNN for 8x8 digit images, written the way model code usually is."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.view(x.size(0), -1))


def train_one(seed: int, data, epochs: int, width: int, batch_size: int, lr: float) -> DigitsNet:
    """The ordinary way: one model, one optimizer, one loop."""
    torch.manual_seed(seed)
    model = DigitsNet(width)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = data["train"]
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    return model.eval()


def accuracy(logits: Tensor, target: Tensor) -> Tensor:
    return (logits.argmax(-1) == target).float().mean(-1)


@dataclass
class CheckpointsResult:
    paths: list[pathlib.Path]  # the separately trained models' files
    own_accuracy: Tensor  # (M,) test accuracy of each loaded model evaluated on its own
    stacked_accuracy: Tensor  # (M,) the same, from the stacked model in one call
    max_logit_difference: float  # stacked vs on its own, before fine-tuning
    finetuned_accuracy: Tensor  # (M,) after fine-tuning together
    unstacked_accuracy: Tensor  # (M,) of the unstacked ordinary models, each on its own
    unstacked_logit_difference: float  # unstacked vs stacked, after fine-tuning
    ensemble_accuracy: float  # averaged probabilities of the fine-tuned models
    unstacked_paths: list[pathlib.Path]
    seconds: float


def run(
    num_models: int, epochs: int, finetune_epochs: int, width: int, out: pathlib.Path, *, seed: int = 0
) -> CheckpointsResult:
    start = time.perf_counter()
    data = load_digits_split(seed, image=True)
    x_test, y_test = data["test"]
    out.mkdir(parents=True, exist_ok=True)

    # Separately trained models, saved as checkpoint files of both common formats: written to a temporary file
    # and renamed onto the name, so a crash never leaves a half-written checkpoint; checksum=True stores a
    # digest of the tensors, which stack_checkpoints verifies.
    paths, own = [], []
    for i in range(num_models):
        model = train_one(seed + i, data, epochs, width, batch_size=64, lr=3e-3)
        with torch.no_grad():
            own.append(model(x_test))
        path = out / (f"digits_{i}.safetensors" if i % 2 else f"digits_{i}.pt")
        save(model.state_dict(), path, checksum=True)
        paths.append(path)
        del model
    own_logits = torch.stack(own)

    # 1. All files into one stacked model (only the architecture of DigitsNet() is used, not its weights).
    batched = stack_checkpoints(DigitsNet(width).eval(), paths)

    # 2. Evaluate every model in one call, the test set given once for all.
    stacked_logits = predict_shared(batched, x_test, num_models)
    max_difference = (stacked_logits - own_logits).abs().max().item()

    # 3. Fine-tune all together: each model on its own shuffled minibatches; summing the per-model mean
    #    losses gives every model exactly its own gradient, and Adam works element by element.
    optimizer = torch.optim.Adam(batched.parameters(), lr=1e-3)
    loader = ModelTensorLoader(*data["train"], num_models=num_models, batch_size=64, seed=seed)
    train_epochs(batched, optimizer, loader, finetune_epochs)
    batched.eval()
    finetuned_logits = predict_shared(batched, x_test, num_models)

    # 4. Ordinary models again, each evaluated on its own and saved as an ordinary checkpoint.
    unstacked_paths, unstacked_logits = [], []
    for i, model in enumerate(unstack(batched)):
        assert type(model) is DigitsNet and not model.training
        with torch.no_grad():
            unstacked_logits.append(model(x_test))
        path = out / f"digits_{i}_finetuned.pt"
        save(model.state_dict(), path)
        unstacked_paths.append(path)
    unstacked_logits = torch.stack(unstacked_logits)
    ensemble = finetuned_logits.softmax(-1).mean(0)
    return CheckpointsResult(
        paths=paths,
        own_accuracy=accuracy(own_logits, y_test),
        stacked_accuracy=accuracy(stacked_logits, y_test),
        max_logit_difference=max_difference,
        finetuned_accuracy=accuracy(finetuned_logits, y_test),
        unstacked_accuracy=accuracy(unstacked_logits, y_test),
        unstacked_logit_difference=(unstacked_logits - finetuned_logits).abs().max().item(),
        ensemble_accuracy=accuracy(ensemble, y_test).item(),
        unstacked_paths=unstacked_paths,
        seconds=time.perf_counter() - start,
    )


def print_table(result: CheckpointsResult) -> None:
    print(f"{'model':>6} {'file':>24} {'own':>7} {'stacked':>8} {'fine-tuned':>10} {'unstacked':>9}")
    for i, path in enumerate(result.paths):
        print(
            f"{i:>6} {path.name:>24} {result.own_accuracy[i]:>7.4f} {result.stacked_accuracy[i]:>8.4f} "
            f"{result.finetuned_accuracy[i]:>10.4f} {result.unstacked_accuracy[i]:>9.4f}"
        )
    print(f"\nensemble of the fine-tuned models: {result.ensemble_accuracy:.4f}")
    print(f"largest logit difference, stacked vs each model on its own: {result.max_logit_difference:.2e}")
    print(f"largest logit difference, unstacked vs stacked:             {result.unstacked_logit_difference:.2e}")


def main(argv: list[str] | None = None) -> CheckpointsResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-models", type=int, default=6, help="separately trained models (default 6)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each model's own training")
    parser.add_argument("--finetune-epochs", type=int, default=3, help="epochs of training all together")
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/checkpoints"))
    parser.add_argument("--quick", action="store_true", help="3 small models, 2 + 2 epochs: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_models, args.epochs, args.finetune_epochs, args.width = 3, 2, 2, 8
    result = run(args.num_models, args.epochs, args.finetune_epochs, args.width, args.out, seed=args.seed)
    print_table(result)
    print(f"\n{args.num_models} models in {result.seconds:.1f} s; checkpoints in {args.out}")
    return result


if __name__ == "__main__":
    main()
