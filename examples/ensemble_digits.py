"""Deep ensemble: 8 small CNNs trained at once on the digits images, members compared with the ensemble.

Every member is one slice of a batched CNN (BatchedConv2d + BatchedBatchNorm2d, torch.nn pooling through
Folded, BatchedLinear). Members differ by their random initialisation and their own shuffled minibatches
(``--mode bootstrap`` trains each on its own bootstrap resample instead, i.e. bagging). The ensemble
averages the members' predicted probabilities. Prints accuracy, negative log-likelihood (NLL) and expected
calibration error (ECE) of every member and of the ensemble, and writes a reliability diagram.

    python examples/ensemble_digits.py                # 8 members, well under a minute on 2 CPU cores
    python examples/ensemble_digits.py --quick        # 4 members, a few seconds
    python examples/ensemble_digits.py --out results/ # where the plot goes
"""

from __future__ import annotations

import argparse
import pathlib
import time
from dataclasses import dataclass

import torch
from digits_common import load_digits_split, predict_shared, save_figure, train_epochs
from torch import Tensor, nn

from batchlayers.batchnorm import BatchedBatchNorm2d
from batchlayers.container import Folded
from batchlayers.conv import BatchedConv2d
from batchlayers.data import ModelTensorLoader
from batchlayers.linear import BatchedLinear


def make_cnn(num_models: int, width: int = 16) -> nn.Sequential:
    """``(M, B, 1, 8, 8)`` images to ``(M, B, 10)`` logits."""
    return nn.Sequential(
        BatchedConv2d(num_models, 1, width, 3, padding=1, bias=False),
        BatchedBatchNorm2d(num_models, width),
        nn.ReLU(),
        BatchedConv2d(num_models, width, 2 * width, 3, padding=1, bias=False),
        BatchedBatchNorm2d(num_models, 2 * width),
        nn.ReLU(),
        Folded(nn.MaxPool2d(2)),
        Folded(nn.Flatten()),
        BatchedLinear(num_models, 2 * width * 4 * 4, 10),
    )


def expected_calibration_error(probs: Tensor, target: Tensor, bins: int = 10) -> Tensor:
    """``(M,)`` ECE of ``(M, N, classes)`` probabilities: the sample-weighted gap between confidence and
    accuracy over ``bins`` equal-width confidence bins, for every model at once."""
    confidence, prediction = probs.max(dim=-1)
    correct = (prediction == target).to(probs.dtype)
    bin_index = (confidence * bins).long().clamp_(max=bins - 1)
    gap = torch.zeros(probs.shape[0], bins, dtype=probs.dtype)
    gap.scatter_add_(1, bin_index, confidence - correct)
    return gap.abs().sum(dim=1) / probs.shape[1]


def reliability_curve(probs: Tensor, target: Tensor, bins: int = 10) -> tuple[Tensor, Tensor, Tensor]:
    """Per confidence bin of ``(N, classes)`` probabilities: mean confidence, accuracy and sample count."""
    confidence, prediction = probs.max(dim=-1)
    correct = (prediction == target).to(probs.dtype)
    bin_index = (confidence * bins).long().clamp_(max=bins - 1)
    count = torch.bincount(bin_index, minlength=bins).to(probs.dtype)
    mean_conf = torch.bincount(bin_index, confidence, minlength=bins) / count.clamp(min=1)
    accuracy = torch.bincount(bin_index, correct, minlength=bins) / count.clamp(min=1)
    return mean_conf, accuracy, count


@dataclass
class Metrics:
    accuracy: Tensor  # (K,) for K members, or a 0-D tensor for the ensemble
    nll: Tensor
    ece: Tensor


def evaluate(probs: Tensor, target: Tensor) -> Metrics:
    """Metrics of ``(K, N, classes)`` probabilities, one row per predictor."""
    correct = (probs.argmax(dim=-1) == target).double()
    nll = -probs.gather(-1, target.expand(probs.shape[0], -1).unsqueeze(-1)).clamp_min(1e-12).log().squeeze(-1)
    return Metrics(correct.mean(dim=1), nll.mean(dim=1), expected_calibration_error(probs, target))


@dataclass
class EnsembleResult:
    members: Metrics
    ensemble: Metrics
    member_probs: Tensor  # (M, N, 10) test probabilities
    ensemble_probs: Tensor  # (N, 10)
    test_target: Tensor
    seconds: float


def run_ensemble(
    num_models: int = 8,
    epochs: int = 15,
    width: int = 16,
    batch_size: int = 64,
    lr: float = 3e-3,
    mode: str = "shuffle",
    seed: int = 0,
) -> EnsembleResult:
    torch.manual_seed(seed)
    data = load_digits_split(seed, image=True)
    start = time.perf_counter()
    model = make_cnn(num_models, width)
    # One hyperparameter set for all members: torch.optim.Adam works elementwise, so on the stacked
    # parameters it is exactly one independent Adam per member.
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loader = ModelTensorLoader(*data["train"], num_models=num_models, batch_size=batch_size, mode=mode, seed=seed)
    train_epochs(model, optimizer, loader, epochs)
    model.eval()
    x_test, y_test = data["test"]
    member_probs = predict_shared(model, x_test, num_models).double().softmax(dim=-1)
    ensemble_probs = member_probs.mean(dim=0)
    members = evaluate(member_probs, y_test)
    ensemble = evaluate(ensemble_probs.unsqueeze(0), y_test)
    ensemble = Metrics(ensemble.accuracy[0], ensemble.nll[0], ensemble.ece[0])
    return EnsembleResult(members, ensemble, member_probs, ensemble_probs, y_test, time.perf_counter() - start)


def print_table(result: EnsembleResult) -> None:
    print(f"{'':>10} {'accuracy':>8} {'NLL':>7} {'ECE':>7}")
    members = result.members
    for i in range(len(members.accuracy)):
        print(f"{'member ' + str(i):>10} {members.accuracy[i]:>8.4f} {members.nll[i]:>7.4f} {members.ece[i]:>7.4f}")
    print(f"{'mean':>10} {members.accuracy.mean():>8.4f} {members.nll.mean():>7.4f} {members.ece.mean():>7.4f}")
    ens = result.ensemble
    print(f"{'ensemble':>10} {ens.accuracy:>8.4f} {ens.nll:>7.4f} {ens.ece:>7.4f}")


def plot_reliability(result: EnsembleResult, path: pathlib.Path, bins: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(2, 1, figsize=(5, 6.5), height_ratios=(3, 1), sharex=True)
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", label="perfect calibration")
    num_models = result.member_probs.shape[0]
    curves = {
        "members (pooled)": (result.member_probs.flatten(0, 1), result.test_target.repeat(num_models), "tab:blue"),
        "ensemble": (result.ensemble_probs, result.test_target, "tab:red"),
    }
    edges = torch.linspace(0, 1, bins + 1)
    for label, (probs, target, color) in curves.items():
        conf, acc, count = reliability_curve(probs, target, bins)
        seen = count > 0
        # Marker area shows how many samples a bin holds: most digits sit in the top bin.
        sizes = 20 + 200 * (count[seen] / count.sum()).sqrt()
        ax.plot(conf[seen], acc[seen], color=color, alpha=0.8, label=label)
        ax.scatter(conf[seen], acc[seen], s=sizes, color=color, alpha=0.8)
        hist.stairs(count / count.sum(), edges, color=color, label=label)
    hist.set_yscale("log")
    hist.set_xlabel("confidence")
    hist.set_ylabel("fraction of samples")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    members, ens = result.members, result.ensemble
    ax.set_title(
        f"{num_models} CNNs on digits: ECE members {members.ece.mean():.3f}, ensemble {ens.ece:.3f}",
        fontsize=9,
    )
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> EnsembleResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-models", type=int, default=8, help="ensemble members (default 8)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv (default 16)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--mode", choices=["shuffle", "bootstrap"], default="shuffle", help="members' data streams")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for the plot")
    parser.add_argument("--quick", action="store_true", help="4 members, 4 epochs: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_models, args.epochs, args.width = 4, 4, 8
    result = run_ensemble(args.num_models, args.epochs, args.width, args.batch_size, args.lr, args.mode, seed=args.seed)
    print_table(result)
    path = args.out / "ensemble_digits_reliability.png"
    plot_reliability(result, path)
    print(f"\n{args.num_models} members in {result.seconds:.1f} s; reliability diagram written to {path}")
    return result


if __name__ == "__main__":
    main()
