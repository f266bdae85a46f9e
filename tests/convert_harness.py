"""Comparing a stacked model with the N ordinary models it was made from, step by step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from harness import assert_close
from torch import Tensor, nn


def seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory().double()


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model: nn.Module, before: dict[str, Tensor], what: str = "input model") -> None:
    for k, v in model.state_dict(keep_vars=True).items():
        assert torch.equal(v.detach(), before[k]), f"{what}: '{k}' was modified"
        assert getattr(v, "grad", None) is None, f"{what}: '{k}' received a gradient"


def compare_training(
    batched: nn.Module,
    references: Sequence[nn.Module],
    make_input: Callable[[Sequence[int]], Tensor],
    *,
    logits: Callable[[object], Tensor] = lambda out: out,
    shared: bool = False,
    steps: int = 2,
    batch: int = 4,
    lr: float = 0.1,
) -> None:
    """Train-mode steps (forward, backward, plain SGD update) and one eval pass through ``batched`` and through
    each reference model; outputs, parameter gradients and buffers (BatchNorm statistics) must agree."""
    num_models = len(references)
    for step in range(steps + 1):
        evaluating = step == steps
        if evaluating:
            batched.eval()
            for r in references:
                r.eval()
        where = "eval" if evaluating else f"train step {step}"
        x = make_input((batch,) if shared else (num_models, batch))
        out = logits(batched(x.expand(num_models, *x.shape) if shared else x))
        ref_out = [logits(r(x if shared else x[i])) for i, r in enumerate(references)]
        assert_close(out, torch.stack(ref_out), msg=f"output ({where})")
        for name, buf in batched.named_buffers():
            ref_bufs = [dict(r.named_buffers())[name] for r in references]
            if buf.shape == ref_bufs[0].shape:  # one buffer shared by all models (e.g. a causal mask)
                for r in ref_bufs:
                    assert_close(buf, r, msg=f"{name} ({where})")
            else:
                assert_close(buf, torch.stack(ref_bufs), msg=f"{name} ({where})")
        if evaluating:
            break
        grad_out = torch.randn_like(out)
        (out * grad_out).sum().backward()
        for i, o in enumerate(ref_out):
            (o * grad_out[i]).sum().backward()
        with torch.no_grad():
            for name, p in batched.named_parameters():
                ref_params = [dict(r.named_parameters())[name] for r in references]
                assert_close(p.grad, torch.stack([q.grad for q in ref_params]), msg=f"gradient of {name} ({where})")
                p -= lr * p.grad
                p.grad = None
                for q in ref_params:
                    q -= lr * q.grad
                    q.grad = None


def assert_threads_get_their_own(
    batched: nn.Module,
    references: Sequence[nn.Module],
    inputs: Sequence[Tensor],
    output: Callable[[object], Tensor] = lambda out: out,
) -> None:
    """One thread per input, each calling ``batched`` on it five times at once with the others: each gets
    what the reference models give for its input."""
    results: dict[int, Tensor] = {}

    def run(k: int) -> None:
        for _ in range(5):
            results[k] = output(batched(inputs[k]))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, x in enumerate(inputs):
        expected = torch.stack([output(r(xi)) for r, xi in zip(references, x)])
        assert_close(results[k], expected, msg=f"thread {k}")
