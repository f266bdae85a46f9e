"""DistributedDataParallel wraps a batched model as it is: gradients and the optimizer step through DDP equal
those of the unwrapped model, which the layer tests compare with a loop over torch.nn models.

One gloo process in this process: how DDP averages over ranks is torch's own, elementwise on the (M, *)
gradients; what this checks is that batched models meet DDP's requirements (ordinary parameters, every one
used, buckets of stacked tensors). A two-process version hung about one run in fifty in gloo's
rendezvous/teardown, which a CI gate cannot afford.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from harness import assert_close
from torch import nn

from batchlayers import BatchedConv2d, BatchedLinear, Folded, losses

NUM_MODELS = 3


@pytest.fixture
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        BatchedConv2d(NUM_MODELS, 2, 4, 3, padding=1),
        nn.Tanh(),
        Folded(nn.Flatten()),
        BatchedLinear(NUM_MODELS, 4 * 5 * 5, 2),
    ).double()


def test_ddp_trains_a_batched_model_like_the_unwrapped_one(process_group) -> None:
    plain, wrapped = _model(), nn.parallel.DistributedDataParallel(_model())
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_wrapped = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(NUM_MODELS, 4, 2, 5, 5, generator=g, dtype=torch.float64)
        y = torch.randn(NUM_MODELS, 4, 2, generator=g, dtype=torch.float64)
        for model, opt in ((plain, opt_plain), (wrapped, opt_wrapped)):
            opt.zero_grad()
            losses.mse_loss(model(x), y).sum().backward()
            opt.step()
        for (name, p), q in zip(plain.named_parameters(), wrapped.module.parameters()):
            assert_close(q.grad, p.grad, msg=f"DDP gradient of {name}")
            assert_close(q, p, msg=f"{name} after the DDP step")
