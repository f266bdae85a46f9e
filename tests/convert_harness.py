"""Comparing a stacked model with the N ordinary models it was made from, step by step."""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable, Sequence

import torch
from harness import assert_close
from torch import Tensor, nn

from batchlayers.convert import stack


def seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory().double()


def rows(lead: Sequence[int]) -> Tensor:
    """Float64 inputs of 4 features for a lead shape: ``(B,)`` for one model, ``(M, B)`` for a stacked one."""
    return torch.randn(*lead, 4, dtype=torch.float64)


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


def compare_gradient_penalty(stacked: nn.Module, models: Sequence[nn.Module], x: Tensor) -> None:
    """The stacked model's output for ``x`` ``(M, B, *)``, its gradient by the input, and a penalty on that
    gradient differentiated again (``create_graph=True``) into the parameters, against each original model's."""
    x = x.detach().requires_grad_()
    out = stacked(x)
    (by_input,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    by_input.pow(2).sum().backward()
    for i, model in enumerate(models):
        xi = x[i].detach().requires_grad_()
        expected = model(xi)
        assert_close(out[i], expected, msg=f"model {i}: output")
        (own,) = torch.autograd.grad(expected.pow(2).sum(), xi, create_graph=True)
        own.pow(2).sum().backward()
        assert_close(by_input[i], own, msg=f"model {i}: input gradient")
        for name, p in model.named_parameters():
            assert_close(stacked.get_parameter(name).grad[i], p.grad, msg=f"model {i}: {name}'s penalty gradient")


def assert_exact_or_refused(
    factory: Callable[[], nn.Module], num_models: int, make_input: Callable[[Sequence[int]], Tensor], batch: int
) -> str:
    """The oracle of the adversarial hunts: a stacked model (default execution) of ``num_models`` seeded
    ``factory()`` models either equals the original models (output, parameter gradients for a random cotangent,
    buffers after the call) or raises batchlayers' own ValueError/TypeError, leaving no mode behind. Never
    a silent wrong result. Returns "exact" or "refused"."""
    originals = [seeded(factory, i) for i in range(num_models)]
    stacked = stack([seeded(factory, i) for i in range(num_models)])
    x = make_input((num_models, batch))
    expected = torch.stack([m(x[i]) for i, m in enumerate(originals)])
    try:
        out = stacked(x)
    except (ValueError, TypeError) as error:
        raised_in = traceback.extract_tb(error.__traceback__)[-1].filename
        assert f"{os.sep}batchlayers{os.sep}" in raised_in, f"not batchlayers' refusal: {error!r}"
        assert torch.overrides._get_current_function_mode_stack() == []
        return "refused"
    assert_close(out, expected, msg="silent wrong result")
    cotangent = torch.randn_like(expected)
    (expected * cotangent).sum().backward()
    (out * cotangent).sum().backward()
    for key, p in stacked.named_parameters():
        grads = [dict(m.named_parameters())[key] for m in originals]
        expected_grad = torch.stack([q.grad if q.grad is not None else torch.zeros_like(q) for q in grads])
        assert_close(p.grad if p.grad is not None else torch.zeros_like(p), expected_grad, msg=f"gradient of {key}")
    for key, buf in stacked.named_buffers():
        own = [dict(m.named_buffers())[key] for m in originals]
        assert_close(buf, own[0] if buf.shape == own[0].shape else torch.stack(own), msg=f"buffer {key}")
    return "exact"


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
