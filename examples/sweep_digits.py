"""Hyperparameter sweep: 64 MLPs trained at once, each with its own learning rate and weight decay.

Every model of the sweep is one slice of a batched MLP. They train together on scikit-learn's bundled
digits dataset (8x8 images, 10 classes, no download), each on its own shuffled minibatches and with its
own AdamW hyperparameters drawn log-uniformly. Successive halving keeps the better half on validation
accuracy after each rung (and doubles the training budget of the survivors) until the best few remain.
Prints a results table, writes a plot of validation accuracy per learning rate, and saves the best model
as an ordinary ``nn.Sequential`` (``batchlayers.unstack``), loadable without batchlayers.

    python examples/sweep_digits.py                  # 64 models, about 10 s on 2 CPU cores
    python examples/sweep_digits.py --quick          # 16 models, a few seconds
    python examples/sweep_digits.py --out results/   # where the plot goes
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time
from dataclasses import dataclass, field

import torch
from digits_common import load_digits_split, predict_shared, save_figure, train_epochs
from torch import Tensor, nn

from batchlayers.container import BatchedSequential
from batchlayers.convert import unstack
from batchlayers.data import ModelTensorLoader
from batchlayers.linear import BatchedLinear
from batchlayers.optim import AdamW
from batchlayers.population import keep_models_


def make_mlp(num_models: int, hidden: int) -> nn.Sequential:
    # BatchedSequential: an nn.Sequential that trains the Linear-ReLU-Linear run as one autograd node.
    return BatchedSequential(
        BatchedLinear(num_models, 64, hidden),
        nn.ReLU(),
        BatchedLinear(num_models, hidden, hidden),
        nn.ReLU(),
        BatchedLinear(num_models, hidden, 10),
    )


def accuracy(model: nn.Module, x: Tensor, y: Tensor, num_models: int) -> Tensor:
    """``(M,)`` accuracy of every model on one batch shared by all."""
    return (predict_shared(model, x, num_models).argmax(dim=-1) == y).double().mean(dim=1)


@dataclass
class Rung:
    epochs: int
    model_ids: list[int]
    val_accuracy: list[float]


@dataclass
class SweepResult:
    learning_rates: Tensor
    weight_decays: Tensor
    rungs: list[Rung] = field(default_factory=list)
    final_ids: list[int] = field(default_factory=list)
    final_val: list[float] = field(default_factory=list)
    final_test: list[float] = field(default_factory=list)
    best_model: nn.Sequential | None = None  # the best model as an ordinary nn.Sequential of nn.Linear
    seconds: float = 0.0


def log_uniform(n: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    return torch.exp(torch.empty(n).uniform_(math.log(low), math.log(high), generator=generator))


def run_sweep(
    num_models: int = 64,
    keep: int = 4,
    first_epochs: int = 4,
    hidden: int = 128,
    batch_size: int = 64,
    lr_range: tuple[float, float] = (1e-4, 1.0),
    wd_range: tuple[float, float] = (1e-5, 1.0),
    seed: int = 0,
) -> SweepResult:
    """Successive halving over ``num_models`` AdamW-trained MLPs down to ``keep`` models."""
    torch.manual_seed(seed)
    data = load_digits_split(seed)
    # One generator per hyperparameter: model i gets the same values whatever the sweep size.
    learning_rates = log_uniform(num_models, *lr_range, torch.Generator().manual_seed(seed))
    weight_decays = log_uniform(num_models, *wd_range, torch.Generator().manual_seed(seed + 1))
    result = SweepResult(learning_rates, weight_decays)
    start = time.perf_counter()

    model = make_mlp(num_models, hidden)
    # The optimizer keeps its own copies: keep_models_ below narrows those, not the sweep's record.
    optimizer = AdamW(model.parameters(), lr=result.learning_rates, weight_decay=result.weight_decays)
    loader = ModelTensorLoader(*data["train"], num_models=num_models, batch_size=batch_size, seed=seed)
    model_ids = torch.arange(num_models)  # which sweep member each slice is
    epochs = first_epochs
    while True:
        train_epochs(model, optimizer, loader, epochs)
        val = accuracy(model, *data["val"], len(model_ids))
        result.rungs.append(Rung(epochs, model_ids.tolist(), val.tolist()))
        if len(model_ids) <= keep:
            break
        survivors = val.argsort(descending=True, stable=True)[: max(keep, len(model_ids) // 2)]
        keep_models_(model, optimizer, survivors)
        loader.keep_models_(survivors)
        model_ids = model_ids[survivors]
        epochs *= 2

    order = val.argsort(descending=True, stable=True)
    test = accuracy(model, *data["test"], len(model_ids))
    result.final_ids = model_ids[order].tolist()
    result.final_val = val[order].tolist()
    result.final_test = test[order].tolist()
    result.best_model = unstack(model)[int(order[0])]
    result.seconds = time.perf_counter() - start
    return result


def print_table(result: SweepResult) -> None:
    print(f"{'rung':>4} {'epochs':>6} {'models':>6} {'best val':>8} {'median val':>10}")
    for k, rung in enumerate(result.rungs):
        accs = torch.tensor(rung.val_accuracy)
        print(f"{k:>4} {rung.epochs:>6} {len(rung.model_ids):>6} {accs.max():>8.3f} {accs.median():>10.3f}")
    print()
    print(f"{'rank':>4} {'model':>5} {'lr':>9} {'weight_decay':>12} {'val acc':>7} {'test acc':>8}")
    for rank, (i, val, test) in enumerate(zip(result.final_ids, result.final_val, result.final_test), 1):
        lr, wd = result.learning_rates[i].item(), result.weight_decays[i].item()
        print(f"{rank:>4} {i:>5} {lr:>9.2e} {wd:>12.2e} {val:>7.3f} {test:>8.3f}")


def plot(result: SweepResult, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    total = 0
    for k, rung in enumerate(result.rungs):
        total += rung.epochs
        lrs = result.learning_rates[rung.model_ids]
        ax.scatter(
            lrs, rung.val_accuracy, s=18 + 12 * k, label=f"rung {k}: {len(rung.model_ids)} models, {total} epochs"
        )
    best = result.final_ids[0]
    ax.scatter(
        result.learning_rates[best],
        result.final_val[0],
        s=250,
        marker="*",
        facecolors="none",
        edgecolors="black",
        label="best",
    )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (AdamW)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{len(result.learning_rates)} MLPs on digits, successive halving")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> SweepResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-models", type=int, default=64, help="sweep size (default 64)")
    parser.add_argument("--keep", type=int, default=4, help="models left after successive halving (default 4)")
    parser.add_argument("--first-epochs", type=int, default=4, help="epochs of the first rung; doubles each rung")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the MLPs (default 128)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for the plot")
    parser.add_argument("--quick", action="store_true", help="16 models, short rungs: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_models, args.first_epochs, args.hidden = 16, 2, 64
    result = run_sweep(args.num_models, args.keep, args.first_epochs, args.hidden, args.batch_size, seed=args.seed)
    print_table(result)
    path = args.out / "sweep_digits.png"
    plot(result, path)
    best_path = args.out / "best_mlp.pt"
    torch.save(result.best_model.state_dict(), best_path)  # an ordinary nn.Sequential's state dict
    print(f"\n{args.num_models} models in {result.seconds:.1f} s; plot written to {path}; best model to {best_path}")
    return result


if __name__ == "__main__":
    main()
