"""Sharded hyperparameter sweep: the models of a sweep split over processes, successive halving across them.

The sweep of ``sweep_digits.py`` (MLPs on scikit-learn's digits, log-uniform AdamW learning rates and weight
decays, successive halving on validation accuracy) with its models sharded over the ranks of ``torchrun``:
each rank builds and trains only its own slice of the population, with no gradient traffic. Ranks meet to
gather validation accuracies, keep the better half (the survivors are spread evenly over the ranks again,
with their optimizer state), save the population with ``torch.distributed.checkpoint`` and export the best
model to rank 0 as an ordinary ``torch.nn`` model.

    torchrun --nproc-per-node=2 examples/distributed_sweep.py     # gloo on CPU, nccl on GPUs (one per rank)
    torchrun --nproc-per-node=2 examples/distributed_sweep.py --quick
    python examples/distributed_sweep.py --quick                  # one process holding every model

Every model is initialised from its own seed and reads its own data stream, so the sweep's results do not
depend on the number of ranks (bit for bit with one thread per process, as torchrun sets by default).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from digits_common import load_digits_split
from sweep_digits import Rung, accuracy, log_uniform, make_mlp
from torch import Tensor, nn

from batchlayers.checkpoint import save
from batchlayers.convert import unstack_state_dict
from batchlayers.data import ModelTensorLoader
from batchlayers.distributed import (
    ModelShard,
    build_shard,
    gather_models,
    gather_per_model,
    keep_models_across_ranks_,
    save_population,
    shard_data_,
    top_k_models,
)
from batchlayers.losses import cross_entropy
from batchlayers.optim import AdamW


@dataclass
class ShardedSweepResult:
    world_size: int
    learning_rates: Tensor
    weight_decays: Tensor
    rungs: list[Rung] = field(default_factory=list)
    final_ids: list[int] = field(default_factory=list)
    final_test: list[float] = field(default_factory=list)
    exported_test: float | None = None  # rank 0: the best model as an ordinary torch.nn MLP
    seconds: float = 0.0


def train_epochs(model: nn.Module, optimizer: torch.optim.Optimizer, loader, epochs: int) -> None:
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            losses = cross_entropy(model(x), y)  # (M_local,): each model's own mean loss
            optimizer.zero_grad()
            losses.sum().backward()  # the sum: every model gets exactly its own gradient
            optimizer.step()


def torch_mlp(hidden: int) -> nn.Sequential:
    """The ordinary torch.nn model each slice of ``make_mlp`` is (same state-dict keys)."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def run_sweep(
    num_models: int = 64,
    keep: int = 4,
    first_epochs: int = 4,
    hidden: int = 128,
    batch_size: int = 64,
    seed: int = 0,
    out: pathlib.Path | None = None,
    device: torch.device | None = None,
) -> ShardedSweepResult:
    """Successive halving of ``num_models`` MLPs down to ``keep``, the models sharded over the default group."""
    device = device or torch.device("cpu")
    data = {name: (x.to(device), y.to(device)) for name, (x, y) in load_digits_split(seed).items()}
    shard = ModelShard.from_group(num_models)  # this rank's slice; every model when run as one process
    if keep < shard.world_size:
        raise ValueError(f"--keep {keep}: every one of the {shard.world_size} ranks needs at least one model")
    # Every rank draws the whole sweep's values (tiny) and takes its own: model i's values whatever the ranks.
    learning_rates = log_uniform(num_models, 1e-4, 1.0, torch.Generator().manual_seed(seed))
    weight_decays = log_uniform(num_models, 1e-5, 1.0, torch.Generator().manual_seed(seed + 1))
    result = ShardedSweepResult(shard.world_size, learning_rates, weight_decays)
    start = time.perf_counter()

    # Only this rank's models are built; model i is initialised from its own seed (model_seed(seed, i)).
    model = build_shard(lambda n: make_mlp(n, hidden), shard, seed=seed, device=device)
    mine = slice(shard.start, shard.stop)
    optimizer = AdamW(model.parameters(), lr=learning_rates[mine], weight_decay=weight_decays[mine])
    # Each model reads its own stream, keyed by its model id: the same batches on any number of ranks.
    loader = ModelTensorLoader(*data["train"], num_models=shard.num_local, batch_size=batch_size, seed=seed)
    shard_data_(loader, shard)
    epochs = first_epochs
    while True:
        train_epochs(model, optimizer, loader, epochs)
        local_val = accuracy(model, *data["val"], shard.num_local)
        val = gather_per_model(local_val, shard)  # (M,) on every rank
        result.rungs.append(Rung(epochs, list(shard.model_ids), val.tolist()))
        if shard.num_models <= keep:
            break
        survivors = top_k_models(local_val, shard, max(keep, shard.num_models // 2))
        shard = keep_models_across_ranks_(model, optimizer, shard, survivors)  # rebalanced over the ranks
        shard_data_(loader, shard)
        epochs *= 2

    order = val.argsort(descending=True, stable=True)
    test = gather_per_model(accuracy(model, *data["test"], shard.num_local), shard)
    result.final_ids = [shard.model_ids[i] for i in order.tolist()]
    result.final_test = test[order].tolist()
    if out is not None:
        save_population(out / "population", model, shard, optimizer)
    best = gather_models(model, shard, [int(order[0])], dst=0)  # from whichever rank holds it
    if best is not None:
        exported = torch_mlp(hidden).to(device)
        exported.load_state_dict(unstack_state_dict(best)[0])
        with torch.no_grad():
            x_test, y_test = data["test"]
            result.exported_test = (exported(x_test).argmax(-1) == y_test).double().mean().item()
        if out is not None:
            save(exported.state_dict(), out / "best_model.pt")
    result.seconds = time.perf_counter() - start
    return result


def print_table(result: ShardedSweepResult) -> None:
    print(f"{'rung':>4} {'epochs':>6} {'models':>6} {'best val':>8} {'median val':>10}")
    for k, rung in enumerate(result.rungs):
        accs = torch.tensor(rung.val_accuracy)
        print(f"{k:>4} {rung.epochs:>6} {len(rung.model_ids):>6} {accs.max():>8.3f} {accs.median():>10.3f}")
    print(f"\n{'rank':>4} {'model':>5} {'lr':>9} {'weight_decay':>12} {'test acc':>8}")
    for place, (i, test) in enumerate(zip(result.final_ids, result.final_test), 1):
        lr, wd = result.learning_rates[i].item(), result.weight_decays[i].item()
        print(f"{place:>4} {i:>5} {lr:>9.2e} {wd:>12.2e} {test:>8.3f}")
    print(f"\nbest model exported as a torch.nn MLP: test accuracy {result.exported_test:.3f}")


def main(argv: list[str] | None = None) -> ShardedSweepResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-models", type=int, default=64, help="sweep size (default 64)")
    parser.add_argument("--keep", type=int, default=4, help="models left after successive halving (default 4)")
    parser.add_argument("--first-epochs", type=int, default=4, help="epochs of the first rung; doubles each rung")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the MLPs (default 128)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the checkpoint and best model")
    parser.add_argument("--quick", action="store_true", help="16 models, short rungs: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_models, args.first_epochs, args.hidden = 16, 2, 64

    # Under torchrun (RANK set), join its process group; without it, one process holds every model.
    started = "RANK" in os.environ and not dist.is_initialized()
    device = torch.device("cpu")
    if started:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)  # before the first collective, as nccl needs
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        result = run_sweep(
            args.num_models, args.keep, args.first_epochs, args.hidden, args.batch_size, args.seed, args.out, device
        )
    finally:
        if started:
            dist.destroy_process_group()
    if result.exported_test is not None:  # rank 0
        print_table(result)
        print(f"{args.num_models} models on {result.world_size} process(es) in {result.seconds:.1f} s")
    return result


if __name__ == "__main__":
    main()
