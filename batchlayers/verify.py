"""Checking a stacked model against the N models it was made from, in one line."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._fold import check_batched_forward, map_tensors

__all__ = ["Verification", "check_batched", "verify"]


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` measured. Every field is per model, ``(M,)`` or a list of M entries.

    Attributes:
        outputs: the largest ``|stacked - original|`` over every element of every output tensor.
        gradients: the same over the gradients of every parameter and every floating-point input, for one
            random cotangent of the outputs (the same for both).
        worst_output, worst_gradient: where each largest difference is (``output.logits``, ``grad of
            h.0.attn.c_attn.weight``, ``grad of input[0]``).
        passed: every compared element within ``atol + rtol * |original|``.
    """

    outputs: Tensor
    gradients: Tensor
    worst_output: list[str]
    worst_gradient: list[str]
    passed: Tensor

    def __str__(self) -> str:
        lines = ["model  output diff  gradient diff  ok   largest at"]
        for i in range(len(self.outputs)):
            where = self.worst_gradient[i] if self.gradients[i] > self.outputs[i] else self.worst_output[i]
            lines.append(
                f"{i:>5}  {self.outputs[i].item():11.3g}  {self.gradients[i].item():13.3g}  "
                f"{'yes' if self.passed[i] else 'NO ':3}  {where}"
            )
        return "\n".join(lines)


def verify(
    models: Sequence[nn.Module],
    stacked: nn.Module,
    *inputs: object,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    **kwargs: object,
) -> Verification:
    """Run ``stacked`` and each of ``models`` on the same inputs and compare outputs and gradients, model by
    model, so you can check that ``stack`` is exact on your own architecture.

    Nothing is changed: gradients are computed with :func:`torch.autograd.grad` (no ``.grad`` is written),
    and every buffer (BatchNorm running statistics) of ``stacked`` and of ``models`` is restored afterwards.
    Compare in eval mode, or without dropout: the models draw their own random numbers.

    Args:
        models: the N original models.
        stacked: the stacked model (``stack(models)``) or a batched layer holding the same N models.
        *inputs, **kwargs: the stacked model's inputs, every tensor ``(N, B, *)`` (or a stride-0 expand);
            model ``i`` gets ``t[i]`` of each, non-tensor values as they are.
        rtol, atol: tolerances for ``passed`` (default: ``torch.testing.assert_close``'s for the dtype).
        seed: for the random cotangents.

    Returns:
        A :class:`Verification`; ``print(result)`` shows one line per model.

    Example::

        >>> result = batchlayers.verify(models, batchlayers.stack(models), x)
        >>> assert result.passed.all(), result
    """
    if isinstance(models, nn.Module) or not isinstance(models, Sequence):
        raise TypeError(f"verify: expected a list of the original models, got {type(models).__name__}")
    models = list(models)
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise TypeError(f"verify: models[{i}] is a {type(m).__name__}, not an nn.Module")
    if not isinstance(stacked, nn.Module):
        raise TypeError(f"verify: expected the stacked model (an nn.Module), got {type(stacked).__name__}")
    num_models = getattr(stacked, "num_models", len(models))
    if num_models != len(models):
        raise ValueError(f"verify: the stacked model holds {num_models} models, got {len(models)} originals")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0):
            raise ValueError(f"verify: {name} must be a number >= 0 or None, got {value!r}")

    def check(t: Tensor, where: str) -> None:
        if t.dim() == 0 or t.shape[0] != num_models:
            raise ValueError(
                f"verify: every tensor input must be (N, B, *) with N={num_models} (model i gets t[i]), but "
                f"{where} has shape {tuple(t.shape)}"
            )

    def leaf(t: Tensor, where: str) -> Tensor:
        return t.detach().requires_grad_() if t.is_floating_point() else t

    def model_leaf(i: int) -> Callable[[Tensor, str], Tensor]:
        return lambda t, where: leaf(t[i], where)

    map_tensors(list(inputs), lambda t, where: check(t, f"inputs{where}"))
    map_tensors(dict(kwargs), lambda t, where: check(t, f"kwargs{where}"))
    stacked_in = map_tensors((inputs, kwargs), leaf)
    own_in = [map_tensors(stacked_in, model_leaf(i)) for i in range(len(models))]
    # Every buffer's module, name, tensor and value: forward may update a buffer in place (BatchNorm statistics)
    # or assign a new tensor to it (a cache), and both are undone.
    saved = [
        (owner, key, buffer, buffer.detach().clone())
        for module in (stacked, *models)
        for owner in module.modules()
        for key, buffer in owner._buffers.items()
        if buffer is not None
    ]
    try:
        result = _measure(models, stacked, stacked_in, own_in, rtol, atol, seed)
    finally:  # (after the gradients: autograd may have saved a buffer, and checks its version)
        with torch.no_grad():
            for owner, key, buffer, before in saved:
                owner._buffers[key] = buffer
                buffer.copy_(before)
    return result


def _measure(models, stacked, stacked_in, own_in, rtol, atol, seed) -> Verification:
    num_models = len(models)
    out = stacked(*stacked_in[0], **stacked_in[1])
    refs = [m(*own_in[i][0], **own_in[i][1]) for i, m in enumerate(models)]
    outputs = _tensors(out, "output")
    references = [_tensors(r, "output") for r in refs]
    worst_out = [(0.0, "") for _ in range(num_models)]
    passed = [True] * num_models
    generator = torch.Generator().manual_seed(seed)
    cotangents = {}
    for name, t in outputs.items():
        for i in range(num_models):
            expected = references[i].get(name)
            if expected is None or t[i].shape != expected.shape:
                raise ValueError(
                    f"verify: {name} of the stacked model has shape {tuple(t.shape)}, model {i}'s "
                    f"{'is missing' if expected is None else tuple(expected.shape)}; expected (N, *its shape)"
                )
            worst_out[i], ok = _compare(t[i], expected, name, worst_out[i], rtol, atol)
            passed[i] = passed[i] and ok
        if t.requires_grad and t.is_floating_point():
            cotangents[name] = torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device)

    worst_grad = [(0.0, "") for _ in range(num_models)]
    if cotangents:
        stacked_grads = _gradients(stacked, stacked_in, outputs, cotangents, lambda g: g)
        for i, model in enumerate(models):
            own = _gradients(model, own_in[i], references[i], cotangents, lambda g, i=i: g[i])
            for name, expected in own.items():
                got = stacked_grads.get(name)
                if got is None:
                    continue  # (a parameter of the original without a counterpart in the stacked model)
                worst_grad[i], ok = _compare(got[i], expected, f"grad of {name}", worst_grad[i], rtol, atol)
                passed[i] = passed[i] and ok

    return Verification(
        outputs=torch.tensor([w[0] for w in worst_out], dtype=torch.float64),
        gradients=torch.tensor([w[0] for w in worst_grad], dtype=torch.float64),
        worst_output=[w[1] for w in worst_out],
        worst_gradient=[w[1] for w in worst_grad],
        passed=torch.tensor(passed),
    )


def _tensors(obj: object, prefix: str) -> dict[str, Tensor]:
    found: dict[str, Tensor] = {}
    map_tensors(obj, lambda t, where: found.setdefault(f"{prefix}{where}", t))
    return found


def _gradients(
    module: nn.Module, inputs: object, outputs: dict[str, Tensor], cotangents: dict[str, Tensor], part
) -> dict[str, Tensor]:
    """Gradients of ``sum(output * cotangent)`` for every parameter and floating input, without ``.grad``."""
    wrt: dict[str, Tensor] = {f"grad of {n}": p for n, p in module.named_parameters() if p.requires_grad}
    wrt.update({f"grad of {k}": t for k, t in _tensors(inputs, "input").items() if t.requires_grad})
    total = sum((outputs[n] * part(g)).sum() for n, g in cotangents.items() if outputs[n].requires_grad)
    if not wrt or not isinstance(total, Tensor):
        return {}
    grads = torch.autograd.grad(total, list(wrt.values()), allow_unused=True)
    return {n.removeprefix("grad of "): g for n, g in zip(wrt, grads) if g is not None}


def _compare(
    got: Tensor, expected: Tensor, name: str, worst: tuple[float, str], rtol: float | None, atol: float | None
) -> tuple[tuple[float, str], bool]:
    got, expected = got.detach(), expected.detach().to(got.device)
    if got.is_floating_point() or expected.is_floating_point():
        diff = (got.double() - expected.double()).abs()
        default_rtol, default_atol = _TOLERANCES.get(got.dtype, (0.0, 0.0))
        rtol = default_rtol if rtol is None else rtol
        atol = default_atol if atol is None else atol
        ok = bool((diff <= atol + rtol * expected.double().abs()).all()) and got.dtype == expected.dtype
    else:
        diff = (got != expected).double()
        ok = bool(diff.sum() == 0)
    largest = diff.max().item() if diff.numel() else 0.0
    return ((largest, name) if largest > worst[0] or not worst[1] else worst), ok


# torch.testing.assert_close's defaults: (rtol, atol) by dtype.
_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}


def check_batched(stacked: nn.Module, *inputs: object, **kwargs: object) -> None:
    """Run the batched forward of a stacked model once, eagerly and without effects, so that batchlayers
    checks it; then ``torch.compile`` runs calls like it in one graph.

    Under ``torch.compile`` batchlayers cannot follow a batch size that ``forward`` reads (``x.size(0)``):
    code such as ``h / x.size(0)`` (each model's own ``B`` in an eager call) would give every model a wrong
    result without an error. So the first compiled call with inputs of a kind (each tensor input's number of
    dimensions and dtype, train or eval mode) runs this check itself, as a graph break. With
    ``fullgraph=True`` it cannot: call this (or the stacked model itself, a real call) once before compiling.
    Where the check finds such code, the stacked model's calls run without compiling from then on (with
    ``fullgraph=True`` they raise). It also checks the batched forward of a model stacked with
    ``execution="model_by_model"``, which compiled runs batched.

    Args:
        stacked: a model from :func:`batchlayers.stack`.
        *inputs, **kwargs: what you will call it with, ``(M, B, *)`` tensors.

    Raises:
        ValueError, TypeError: what an eager call would raise (the code that batchlayers refuses, named).

    Nothing is changed: the call runs on copies of the arguments, with the random number generators forked,
    and every buffer put back (its graph is recorded, as the call's would be, and dropped).
    """
    check_batched_forward(stacked, inputs, kwargs)
