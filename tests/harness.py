"""The reference-test harness: every batched layer against a loop over torch.nn modules.

A ``LayerCase`` describes one layer configuration: how to build the batched layer, how to build the
torch.nn module it stands for, and how to make one model's input. ``test_layers.py`` runs every case found
in ``tests/cases_*.py`` through the same checks; the family test files add what is special to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

TOLERANCES = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
}


def assert_close(actual: Tensor, expected: Tensor, *, msg: str = "") -> None:
    """One tolerance for the whole suite, by dtype; the failure reports the largest difference."""
    tol = TOLERANCES.get(expected.dtype, {"rtol": 0, "atol": 0})
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{msg}\n{m}" if msg else m, **tol)


@dataclass
class LayerCase:
    """One configuration of one batched layer.

    Attributes:
        id: test id, e.g. ``"Linear-nobias"``.
        batched: ``(num_models, dtype) -> batched layer``.
        torch: ``(dtype) -> the torch.nn module it stands for``, built with the same arguments.
        input: ``(leading_shape, dtype) -> input``; called with ``(M, B)`` for per-model input and ``(B,)``
            for a shared batch, it returns a tensor of shape ``(*leading_shape, *sample_shape)``.
        bad_inputs: ``(id, input maker (num_models, dtype) -> Tensor, exception type, regex)`` rows that must
            raise a clear error.
        steps: train-mode steps compared (more than one for layers with running statistics).
        input_requires_grad: whether the input is differentiable (not for index tensors).
        prepare: applied in place to the batched layer wherever it is compared with something else (the loop,
            its copies, its compiled self), never where its init is checked: e.g. moving constant inits
            (ones, zeros) off their values so that a mix-up between models shows. The torch.nn modules of
            the loop load the prepared layer's state.
    """

    id: str
    batched: Callable[[int, torch.dtype], nn.Module]
    torch: Callable[[torch.dtype], nn.Module]
    input: Callable[[Sequence[int], torch.dtype], Tensor]
    bad_inputs: list[tuple[str, Callable[[int, torch.dtype], object], type, str]] = field(default_factory=list)
    steps: int = 2
    input_requires_grad: bool = True
    prepare: Callable[[nn.Module], object] | None = None

    def build(self, num_models: int, dtype: torch.dtype) -> nn.Module:
        """The batched layer, prepared for comparisons (see ``prepare``)."""
        layer = self.batched(num_models, dtype)
        if self.prepare is not None:
            self.prepare(layer)
        return layer


def unbatch(batched: nn.Module, make_torch: Callable[[], nn.Module]) -> list[nn.Module]:
    """``M`` torch.nn modules holding the batched layer's slices; state-dict keys map one to one."""
    state = batched.state_dict()
    modules = []
    for i in range(batched.num_models):
        module = make_torch()
        module.load_state_dict({k: v[i].clone() for k, v in state.items()})
        module.train(batched.training)
        modules.append(module)
    return modules


def _leaf(x: Tensor, requires_grad: bool) -> Tensor:
    return x.detach().clone().requires_grad_(requires_grad and x.is_floating_point())


def compare_with_loop(
    batched: nn.Module,
    modules: Sequence[nn.Module],
    make_input: Callable[[Sequence[int]], Tensor],
    *,
    shared: bool,
    steps: int = 2,
    batch: int = 5,
    input_requires_grad: bool = True,
    check_eval: bool = True,
) -> None:
    """Run ``steps`` train-mode forward/backward passes and one eval pass through ``batched`` and through
    ``modules`` one by one, and compare outputs, input gradients, parameter gradients and buffers."""
    num_models = batched.num_models
    params = dict(batched.named_parameters())

    def ref_params(name: str) -> list[Tensor]:
        return [dict(m.named_parameters())[name] for m in modules]

    for step in range(steps + int(check_eval)):
        evaluating = step == steps
        if evaluating:
            batched.eval()
            for m in modules:
                m.eval()
        where = f"{'eval' if evaluating else f'train step {step}'}, {'shared' if shared else 'per-model'} input"
        x = make_input((batch,) if shared else (num_models, batch))
        xb = _leaf(x, input_requires_grad)
        xr = _leaf(x, input_requires_grad)
        y = batched(xb.expand(num_models, *xb.shape) if shared else xb)
        ys = [m(xr if shared else xr[i]) for i, m in enumerate(modules)]
        assert_close(y, torch.stack(ys), msg=f"output ({where})")
        if evaluating:
            break

        grad_out = torch.randn_like(y)
        batched.zero_grad()
        for m in modules:
            m.zero_grad()
        if y.requires_grad:
            y.backward(grad_out)
            for i, yi in enumerate(ys):
                yi.backward(grad_out[i])
        if xb.requires_grad:
            assert_close(xb.grad, xr.grad, msg=f"input gradient ({where})")
        for name, p in params.items():
            ref = ref_params(name)
            if p.grad is None:
                assert all(r.grad is None for r in ref), f"{name}: no gradient, but the reference has one"
                continue
            ref_grad = torch.stack([r.grad if r.grad is not None else torch.zeros_like(r) for r in ref])
            assert_close(p.grad, ref_grad, msg=f"gradient of {name} ({where})")
        for name, buf in batched.named_buffers():
            ref_buf = torch.stack([dict(m.named_buffers())[name] for m in modules])
            assert_close(buf, ref_buf, msg=f"buffer {name} ({where})")


def ks_statistic(a: Tensor, b: Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True) / a.numel()
    cdf_b = torch.searchsorted(b, grid, right=True) / b.numel()
    return (cdf_a - cdf_b).abs().max().item()


def ks_critical(n: int, m: int, alpha: float = 1e-6) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def check_init_matches_torch(case: LayerCase, num_models: int = 8, torch_samples: int = 16) -> None:
    """Each model's slice is drawn like a fresh torch.nn module's parameters (KS test per slice), slices are
    independent of each other, and ``reset_parameters()`` draws them again in place."""
    torch.manual_seed(0)
    batched = case.batched(num_models, torch.float64)
    reference = [case.torch(torch.float64) for _ in range(torch_samples)]
    for name, p in batched.named_parameters():
        ref = torch.cat([dict(m.named_parameters())[name].detach().flatten() for m in reference])
        constant = bool((ref == ref[0]).all())
        # Pooled over models the test is sharp enough to see a slightly wrong bound or gain; per slice it
        # catches a fan computed from the stacked tensor, or one model initialised differently.
        stat = ks_statistic(p.detach(), ref)
        crit = ks_critical(p.numel(), ref.numel())
        assert stat <= crit, f"{name} is not distributed like torch's init: KS {stat:.3f} > {crit:.3f}"
        for i in range(num_models):
            stat = ks_statistic(p[i].detach(), ref)
            crit = ks_critical(p[i].numel(), ref.numel())
            assert stat <= crit, f"{name}[{i}] is not distributed like torch's init: KS {stat:.3f} > {crit:.3f}"
        if not constant and num_models > 1:
            for i in range(1, num_models):
                assert not torch.equal(p[0], p[i]), f"{name}: models 0 and {i} got the same initial values"
    before = {n: p.detach().clone() for n, p in batched.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in batched.named_parameters()}
    batched.reset_parameters()
    for name, p in batched.named_parameters():
        assert p.data_ptr() == ptrs[name], f"reset_parameters replaced {name} instead of filling it in place"
        ref = torch.cat([dict(m.named_parameters())[name].detach().flatten() for m in reference])
        if not bool((ref == ref[0]).all()):
            assert not torch.equal(before[name], p), f"reset_parameters did not redraw {name}"


def check_state_dict_layout(case: LayerCase, num_models: int = 3) -> None:
    """State-dict keys are torch.nn's, each shaped ``(M, *torch shape)``, and a round trip is exact."""
    batched = case.batched(num_models, torch.float64)
    ref_state = case.torch(torch.float64).state_dict()
    state = batched.state_dict()
    assert list(state) == list(ref_state), f"keys {list(state)} != torch.nn's {list(ref_state)}"
    for k, v in ref_state.items():
        assert state[k].shape == (num_models, *v.shape), f"{k}: {tuple(state[k].shape)} != (M, *{tuple(v.shape)})"
        assert state[k].dtype == v.dtype, f"{k}: dtype {state[k].dtype} != {v.dtype}"
    other = case.batched(num_models, torch.float64)
    other.load_state_dict(state)
    for k, v in other.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} differs after a state_dict round trip"


def outputs_equal(a: nn.Module, b: nn.Module, case: LayerCase, num_models: int, dtype=torch.float64) -> None:
    torch.manual_seed(1)
    x = case.input((num_models, 4), dtype)
    assert_close(a(x.clone()), b(x.clone()), msg="outputs")


class RecordOps(TorchDispatchMode):
    """Records every aten op below autograd with the number of elements of its (first) output."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        numel = first.numel() if isinstance(first, torch.Tensor) else 0
        self.ops.append((str(func), func.is_view, numel))
        return out


def assert_uniform_init(p: Tensor, bound: float, name: str) -> None:
    """``p`` ``(M, *)`` holds M independent draws of U(-bound, bound): with enough models the largest |value|
    comes close to the bound (a halved or doubled bound shows), no model's slice goes past it, the values are
    centred and every model gets values of its own."""
    per_model = p.detach().flatten(1).abs().amax(dim=1)
    assert (per_model <= bound).all(), f"{name}: a model's max |value| {per_model.max():.4f} > bound {bound:.4f}"
    assert per_model.max() > 0.9 * bound, f"{name}: max |value| {per_model.max():.4f} <= 0.9 * bound {bound:.4f}"
    assert p.mean().abs() < 0.2 * bound, f"{name}: mean {p.mean():.4f} is not centred"
    assert not torch.equal(p[0], p[1]), f"{name}: models 0 and 1 got the same values"
