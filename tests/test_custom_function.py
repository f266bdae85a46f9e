"""Custom ``torch.autograd.Function``s in a stacked model's batched forward: each model's gradients are those of
its original model (a backward that reduces over the batch or into a per-model argument included), or the
Function is refused with its name. The reference is the N original models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from convert_harness import assert_exact_or_refused, compare_training, seeded
from torch import Tensor, nn

import batchlayers as bl
from batchlayers.convert import stack


class Center(torch.autograd.Function):
    """Subtracts the batch mean; its backward reduces over the batch too."""

    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class CenterWithSetupContext(torch.autograd.Function):
    """Center written with ``setup_context``: its forward has no ``ctx``."""

    @staticmethod
    def forward(x):
        return x - x.mean(0, keepdim=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class Scale(torch.autograd.Function):
    """``x * gamma`` with a per-model ``gamma``: the backward sums gamma's gradient over the batch, and reads a
    number and a size computed in forward."""

    @staticmethod
    def forward(ctx, x, gamma, power):
        ctx.save_for_backward(x, gamma)
        ctx.power, ctx.rows = power, x.shape[0]
        return x * gamma**power

    @staticmethod
    def backward(ctx, g):
        x, gamma = ctx.saved_tensors
        grad_gamma = (g * x).sum(0) * ctx.power * gamma ** (ctx.power - 1)
        return g * gamma**ctx.power, grad_gamma * ctx.rows / x.shape[0], None


class TwoOutputs(torch.autograd.Function):
    """Two tensor outputs (one per-model: a mean over the samples) and a number; the gradients of both used."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x), x.mean(0), 7

    @staticmethod
    def backward(ctx, g, g_mean, _):
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2) + g_mean / x.shape[0]


class MaskedDrop(torch.autograd.Function):
    """Drops entries by a random mask drawn in forward, by ``bernoulli_`` (as transformers' sew_d XDropout) or
    inside ``F.dropout``, its backward centred over the batch. ``given`` replaces the draw with a known mask
    for the reference models; ``drawn`` collects the masks drawn."""

    how = "bernoulli_"
    given: Tensor | None = None
    drawn: list[Tensor] = []

    @staticmethod
    def forward(ctx, x):
        if MaskedDrop.given is not None:
            out = x * MaskedDrop.given * 2
        elif MaskedDrop.how == "bernoulli_":
            out = x * torch.empty_like(x).bernoulli_(0.5) * 2
        else:
            out = torch.nn.functional.dropout(x, 0.5)
        mask = (out != 0).to(x.dtype)  # (x has no zeros)
        MaskedDrop.drawn.append(mask)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        h = g * mask * 2
        return h - h.mean(0, keepdim=True)


class Identity(torch.autograd.Function):
    """Returns its argument as it is (torch makes the output a view of it); the backward centres over the batch."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class RunningCenter(torch.autograd.Function):
    """A batch norm's centring as a Function: it writes its running mean, an argument without gradients, in
    place (as hand-written batch norms do); its backward reduces over the batch."""

    @staticmethod
    def forward(ctx, x, running_mean, momentum):
        mean = x.mean(0)
        running_mean.mul_(1 - momentum).add_(mean * momentum)
        return x - mean

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True), None, None


class Mix(torch.autograd.Function):
    """Takes a tensor every model shares (not a per-model value) and returns one made from it alone."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w, w * 2

    @staticmethod
    def backward(ctx, g, g_w):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0) + 2 * g_w


SHARED = torch.rand(5, dtype=torch.float64, requires_grad=True)


class Outer(torch.autograd.Function):
    """A Function whose forward applies another (which, under the outer one, records no graph of its own)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return Center.apply(x) * 2

    @staticmethod
    def backward(ctx, g):
        h = 2 * g
        return h - h.mean(0, keepdim=True)


class _WithFunction(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)
        self.gamma = nn.Parameter(torch.rand(5) + 0.5)
        self.register_buffer("running_mean", torch.rand(5))

    def forward(self, x):
        h = self.a(x)
        if self.kind == "center":
            h = Center.apply(h)
        elif self.kind == "setup_context":
            h = CenterWithSetupContext.apply(h)
        elif self.kind == "per-model argument":
            h = Scale.apply(h, self.gamma, 2)
        elif self.kind == "two outputs":
            h, mean, _ = TwoOutputs.apply(h)
            h = h * mean
        elif self.kind == "twice":
            h = Center.apply(torch.tanh(Center.apply(h)))
        elif self.kind == "nested":
            h = Outer.apply(h)
        elif self.kind == "an argument returned":
            h = Identity.apply(h)
        elif self.kind == "a shared argument":
            h, w = Mix.apply(h, SHARED)
            h = h + w
        elif self.kind == "random mask":
            h = MaskedDrop.apply(h)
        elif self.kind.startswith("a parameter read from outside"):
            _ReadsFromOutside.holder, _ReadsFromOutside.grad_enabled = self, self.kind.endswith("gradients on")
            h = _ReadsFromOutside.apply(h)
        elif self.kind == "a running statistic written":
            h = RunningCenter.apply(h, self.running_mean, 0.1)
        elif self.kind == "gradients enabled in forward":
            h = GradientsOn.apply(h)
        elif self.kind == "an in-place write":
            h = _InPlace.apply(h * 1)
        elif self.kind.startswith("checkpointed"):
            reentrant = self.kind == "checkpointed, reentrant"
            h = torch.utils.checkpoint.checkpoint(Center.apply, h * 1, use_reentrant=reentrant)
        elif self.kind == "rows picked by a mask":
            h = h + Center.apply(h[h > 0]).sum()
        return self.b(h) * self.gamma[:2]


KINDS = [
    "center",
    "setup_context",
    "per-model argument",
    "two outputs",
    "twice",
    "nested",
    "an argument returned",
    "a shared argument",
    "gradients enabled in forward",
    "a running statistic written",
]


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("kind", KINDS)
def test_custom_function_gradients_are_each_models_own(kind: str, shared: bool) -> None:
    factory = lambda: _WithFunction(kind)  # noqa: E731
    compare_training(
        stack([seeded(factory, i) for i in range(3)]),
        [seeded(factory, i) for i in range(3)],
        lambda lead: torch.randn(*lead, 4, dtype=torch.float64, requires_grad=True),
        shared=shared,
    )


def test_a_shared_arguments_gradient_is_the_sum_of_the_models() -> None:
    """A tensor that every model shares gets what the N original models give it together."""
    factory = lambda: _WithFunction("a shared argument")  # noqa: E731
    stacked, originals = stack([seeded(factory, i) for i in range(3)]), [seeded(factory, i) for i in range(3)]
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    cotangent = torch.randn(3, 6, 2, dtype=torch.float64)
    SHARED.grad = None
    (stacked(x) * cotangent).sum().backward()
    got, SHARED.grad = SHARED.grad, None
    for i, m in enumerate(originals):
        (m(x[i]) * cotangent[i]).sum().backward()
    torch.testing.assert_close(got, SHARED.grad, rtol=1e-10, atol=1e-10)
    SHARED.grad = None


def _assert_same_gradients(
    stacked: nn.Module, out: Tensor, originals: list[nn.Module], expected: list[Tensor], tolerance: float
) -> None:
    """Backward through the stacked output and through each original's for one cotangent (drawn from a
    generator of its own: torch's default one is left as it is); the parameters' gradients must agree."""
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    (out * cotangent).sum().backward()
    for i, o in enumerate(expected):
        (o * cotangent[i]).sum().backward()
    for name, p in stacked.named_parameters():
        reference = torch.stack([dict(m.named_parameters())[name].grad for m in originals])
        torch.testing.assert_close(p.grad, reference, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("how", ["bernoulli_", "F.dropout"])
def test_random_values_drawn_in_forward_are_given_back_to_each_models_backward(how: str) -> None:
    """The backward, recomputed per model, uses the mask the stacked forward drew: each model's part of it."""
    factory = lambda: _WithFunction("random mask")  # noqa: E731
    stacked, originals = stack([seeded(factory, i) for i in range(3)]), [seeded(factory, i) for i in range(3)]
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    MaskedDrop.how, MaskedDrop.given, MaskedDrop.drawn = how, None, []
    out = stacked(x)
    (mask,) = MaskedDrop.drawn
    assert mask.shape == (18, 5) and 0 < mask.sum() < mask.numel()
    try:
        expected = []
        for i, m in enumerate(originals):
            MaskedDrop.given = mask[6 * i : 6 * (i + 1)]
            expected.append(m(x[i]))
    finally:
        MaskedDrop.given = None
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-10, atol=1e-10)
    state = torch.get_rng_state()
    _assert_same_gradients(stacked, out, originals, expected, tolerance=1e-10)
    assert torch.equal(torch.get_rng_state(), state), "the per-model backward moved torch's generator"


class SquaredNorm(torch.autograd.Function):
    """Each row's squared norm by a batched matmul (which CPU autocast runs in bfloat16); the backward reads the
    saved result, so it differs unless the recomputation runs under autocast as the forward did."""

    @staticmethod
    def forward(ctx, x):
        y = torch.matmul(x.unsqueeze(1), x.unsqueeze(2)).flatten(1)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y.to(g.dtype) * x - (g * x).mean(0, keepdim=True)


class _Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.b = nn.Linear(1, 2)

    def forward(self, x):
        return self.b(SquaredNorm.apply(x * self.gamma).float())  # (a float32 argument, a bfloat16 result)


def test_custom_function_recomputed_under_the_forwards_autocast() -> None:
    stacked = stack([seeded(_Autocast, i).float() for i in range(2)])
    originals = [seeded(_Autocast, i).float() for i in range(2)]
    x = torch.randn(2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stacked(x)
        expected = [m(x[i]) for i, m in enumerate(originals)]
    _assert_same_gradients(stacked, out, originals, expected, tolerance=1e-6)


class _ReadsFromOutside(torch.autograd.Function):
    holder: nn.Module | None = None
    grad_enabled = False

    @staticmethod
    def forward(ctx, x):
        with torch.set_grad_enabled(_ReadsFromOutside.grad_enabled):
            return x * _ReadsFromOutside.holder.gamma  # type: ignore[union-attr]

    @staticmethod
    def backward(ctx, g):
        return g * _ReadsFromOutside.holder.gamma  # type: ignore[union-attr]


class GradientsOn(torch.autograd.Function):
    """Its forward computes with gradients enabled (as checkpoint-like code may); its backward centres over the
    batch."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            return x * 2

    @staticmethod
    def backward(ctx, g):
        h = 2 * g
        return h - h.mean(0, keepdim=True)


class _InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


REFUSED: dict[str, str] = {
    "a parameter read from outside": r"_ReadsFromOutside .*not among its arguments",
    "a parameter read from outside, gradients on": r"_ReadsFromOutside .*not among its arguments",
    "an in-place write": r"_InPlace .*writes in place into one of its arguments that requires gradients",
    "checkpointed, reentrant": r"Center runs inside torch.utils.checkpoint",
    "checkpointed, non-reentrant": r"Center runs inside torch.utils.checkpoint",
    "rows picked by a mask": r"Center .*is given a tensor made from the models' samples by indexing",
}


@pytest.mark.parametrize("kind", REFUSED)
def test_custom_function_that_cannot_run_per_model_is_refused_in_forward(kind: str) -> None:
    stacked = stack([seeded(lambda: _WithFunction(kind), i) for i in range(2)])
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=REFUSED[kind]):
        stacked(x)
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.parametrize("kind", ["center", "per-model argument", "two outputs", "a shared argument"])
def test_gradient_penalty_through_a_custom_function(kind: str) -> None:
    """A double backward (``create_graph=True``, a gradient penalty on the input, and on the shared tensor's
    gradient where the model uses one): each model's Function is differentiated in its arguments' graph, so
    the penalty's gradients reach each model's parameters."""
    factory = lambda: _WithFunction(kind)  # noqa: E731
    stacked, originals = stack([seeded(factory, i) for i in range(2)]), [seeded(factory, i) for i in range(2)]
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    cotangent = torch.randn(2, 3, 2, dtype=torch.float64)
    shared = kind == "a shared argument"

    def gradients(model: nn.Module, inputs: Tensor, weights: Tensor) -> tuple[Tensor, ...]:
        inputs = inputs.clone().requires_grad_()
        wrt = [inputs, SHARED] if shared else [inputs]
        return torch.autograd.grad((model(inputs) * weights).sum(), wrt, create_graph=True)

    SHARED.grad = None
    grads = gradients(stacked, x, cotangent)
    sum(g.pow(2).sum() for g in grads).backward()
    shared_grad, SHARED.grad = SHARED.grad, None
    expected = [gradients(m, x[i], cotangent[i]) for i, m in enumerate(originals)]
    # (the shared tensor's gradient is the sum of the originals', as the stacked model's is)
    references = [torch.stack([own[0] for own in expected]), *([sum(own[1] for own in expected)] if shared else [])]
    sum(g.pow(2).sum() for g in references).backward()
    for got, reference in zip(grads, references, strict=True):
        torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(shared_grad, SHARED.grad, rtol=1e-10, atol=1e-10)  # (None where not used)
    SHARED.grad = None
    zero_if_none = lambda p: torch.zeros_like(p) if p.grad is None else p.grad  # noqa: E731  (the last bias's)
    for name, p in stacked.named_parameters():
        reference = torch.stack([zero_if_none(dict(m.named_parameters())[name]) for m in originals])
        torch.testing.assert_close(zero_if_none(p), reference, rtol=1e-10, atol=1e-10, msg=name)


def test_custom_function_without_gradients_runs_as_it_is() -> None:
    """Without gradients recorded nothing is noted: the outputs are each original model's."""
    originals = [seeded(lambda: _WithFunction("center"), i) for i in range(2)]
    stacked = stack([seeded(lambda: _WithFunction("center"), i) for i in range(2)])
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with torch.no_grad():
        out = stacked(x)
        torch.testing.assert_close(out, torch.stack([m(x[i]) for i, m in enumerate(originals)]))


class CentredGradient(torch.autograd.Function):
    """Elementwise in forward (which torch.compile could trace whole), centred over the batch in backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        h = 2 * g
        return h - h.mean(0, keepdim=True)


class _Centred(nn.Module):
    """A Function in a module of its own (no per-model tensor in the architecture's code, which alone would
    make a stacked model run without compiling)."""

    def forward(self, x):
        return CentredGradient.apply(x)


# (as in test_compile.py: dynamo reads .grad of the stacked model's outputs while tracing the root's output hook;
# dynamo's tracing of an autograd.Function instantiates it, which this torch deprecates)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_stacked_model_runs_its_custom_function_without_compiling(fullgraph: bool) -> None:
    """torch.compile does not show batchlayers a Function's calls: the first compiled call's eager check finds
    them, and the calls run without compiling from then on (exact); with ``fullgraph=True`` they raise."""
    torch._dynamo.reset()
    factory = lambda: nn.Sequential(nn.Linear(4, 5), _Centred(), nn.Linear(5, 2))  # noqa: E731
    originals = [seeded(factory, i) for i in range(2)]
    stacked = stack([seeded(factory, i) for i in range(2)])
    compiled = torch.compile(stacked, backend="aot_eager", fullgraph=fullgraph)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    try:
        if fullgraph:
            bl.check_batched(stacked, x)
            with pytest.raises(torch._dynamo.exc.Unsupported):
                compiled(x)
            return
        out = compiled(x)
        expected = [m(x[i]) for i, m in enumerate(originals)]
        torch.testing.assert_close(out, torch.stack(expected), rtol=1e-10, atol=1e-10)
        _assert_same_gradients(stacked, out, originals, expected, tolerance=1e-10)
    finally:
        torch._dynamo.reset()


# Code in a Function's forward whose backward differentiates that code again with autograd (as checkpoint-like
# Functions do): the result batchlayers gives, "exact" or "refused", and never a silent wrong gradient.
AGAIN: dict[str, tuple[Callable[[Tensor], Tensor], str]] = {
    "a mean over the batch": (lambda x: x - x.mean(0), "exact"),
    "a softmax over the batch": (lambda x: torch.softmax(x, 0), "exact"),
    "a std over the batch": (lambda x: x / (x.std(0) + 1), "exact"),
    "a max over the batch": (lambda x: x * x.max(0).values, "exact"),
    "a logsumexp over the batch": (lambda x: x - x.logsumexp(0), "exact"),
    "a layer norm": (lambda x: F.layer_norm(x, x.shape[-1:]), "exact"),
    "a reshape by the batch size": (lambda x: x.reshape(x.shape[0], -1) * 2, "exact"),
    "a sort over the batch": (lambda x: x.sort(0).values, "refused"),
    "a norm over the batch": (lambda x: F.normalize(x, dim=0), "refused"),
}


class DifferentiatedAgain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.save_for_backward(x)
        ctx.name = name
        return AGAIN[name][0](x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad(AGAIN[ctx.name][0](x), x, g)
        return grad, None


class _Again(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(DifferentiatedAgain.apply(self.a(x), self.name))


@pytest.mark.parametrize("batch", [3, 5])
@pytest.mark.parametrize("name", AGAIN)
def test_backward_that_differentiates_the_forward_again(name: str, batch: int) -> None:
    make_input = lambda lead: torch.randn(*lead, 4, dtype=torch.float64)  # noqa: E731
    assert assert_exact_or_refused(lambda: _Again(name), 2, make_input, batch) == AGAIN[name][1]


class _Coinciding(nn.Module):
    """Widths equal to the folded batch (M * B = 2 * 3 = 6 features), a Function on the samples' dimension and one
    on a transposed batch (the samples on dimension 1): sizes cannot tell the dimensions apart, the tags do."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = self.a(x)
        h = Center.apply(h.t()).t() if self.transposed else Center.apply(h)
        return self.b(h * Center.apply(h).sum(0))


@pytest.mark.parametrize("transposed", [False, True], ids=["samples first", "transposed"])
def test_custom_function_where_the_folded_batch_equals_a_width(transposed: bool) -> None:
    factory = lambda: _Coinciding(transposed)  # noqa: E731
    compare_training(
        stack([seeded(factory, i) for i in range(2)]),
        [seeded(factory, i) for i in range(2)],
        lambda lead: torch.randn(*lead, 4, dtype=torch.float64, requires_grad=True),
        batch=3,
    )
