"""DistributedDataParallel over a batched model: two CPU processes (gloo) each train all M models on half of
every model's batch; the averaged gradients must equal one process on the whole batch, model by model."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import assert_close
from torch import nn

from batchlayers import BatchedLinear, losses

NUM_MODELS, BATCH = 3, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(BatchedLinear(NUM_MODELS, 4, 8), nn.Tanh(), BatchedLinear(NUM_MODELS, 8, 2)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(NUM_MODELS, BATCH, 4, generator=g, dtype=torch.float64), torch.randn(
        NUM_MODELS, BATCH, 2, generator=g, dtype=torch.float64
    )


def _worker(rank: int, world_size: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = nn.parallel.DistributedDataParallel(_model())
        x, y = _data()
        half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        losses.mse_loss(model(x[:, half]), y[:, half]).sum().backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in model.module.named_parameters()}, out_file)
    finally:
        dist.destroy_process_group()


def test_ddp_averages_each_models_gradients(tmp_path) -> None:
    out_file = tmp_path / "grads.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    ddp_grads = torch.load(out_file)

    model = _model()
    x, y = _data()
    losses.mse_loss(model(x), y).sum().backward()  # each model's mean over its whole batch
    for name, p in model.named_parameters():
        assert_close(ddp_grads[name], p.grad, msg=f"DDP gradient of {name}")
