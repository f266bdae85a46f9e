"""torch.compile with the default (inductor) backend and ``fullgraph=True``: a compiled forward, the backward
AOT autograd compiled with it, and a compiled per-model optimizer step train N models exactly as the N
original torch.nn models do, each with its own ``torch.optim`` optimizer and its own learning rate."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from convert_harness import seeded
from harness import assert_close
from models import CNN, GPT, MLP
from torch import nn

import batchlayers as bl

# Inductor's first compile in a process imports torch code that calls the deprecated torch.jit.script_method;
# dynamo itself reads .grad of the stacked model's output tensors while tracing the root's output hook.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]

M, STEPS = 3, 3
LRS = [1e-3, 3e-3, 1e-2]


def _batched_layers() -> tuple[list[nn.Module], nn.Module]:
    """An MLP written with batched layers, and its slices as torch.nn models."""
    batched = nn.Sequential(bl.BatchedLinear(M, 6, 8), nn.ReLU(), bl.BatchedLinear(M, 8, 3)).double()
    models = []
    for i in range(M):
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
        model.load_state_dict({k: v[i] for k, v in batched.state_dict().items()})
        models.append(model)
    return models, batched


def _stacked(factory) -> Callable[[], tuple[list[nn.Module], nn.Module]]:
    def make() -> tuple[list[nn.Module], nn.Module]:
        models = [seeded(factory, i) for i in range(M)]
        return models, bl.stack(models)

    return make


CASES = {
    # id: (() -> (the models, the batched model), one model's input shape, "classes" or "tokens")
    "batched-layers": (_batched_layers, (4, 6), "classes"),
    "stacked-MLP": (_stacked(MLP), (4, 6), "classes"),
    "stacked-ResNet-BatchNorm": (_stacked(CNN), (4, 3, 8, 8), "classes"),
    "stacked-GPT": (_stacked(GPT), (2, 8), "tokens"),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Each case compiles a forward, a backward and a step with inductor (10-30 s each on 2 CPU cores): Adam, or
# SGD with momentum for the ResNet (Adam's compiled step is the same over any parameters: the other cases run
# it), and the GPT also with nn.Module.compile, which runs a stacked root's folding hooks inside its compiled
# frame; one Adam with fused=True, whose kernel the compiled step then takes in.
@pytest.mark.parametrize(
    ("case", "optimizer", "how"),
    [(case, "Adam", "torch.compile") for case in CASES if case != "stacked-ResNet-BatchNorm"]
    + [
        ("stacked-ResNet-BatchNorm", "SGD", "torch.compile"),
        ("stacked-GPT", "Adam", "module.compile"),
        ("batched-layers", "Adam fused=True", "torch.compile"),
    ],
)
def test_inductor_fullgraph_training_equals_the_original_models(case: str, optimizer: str, how: str) -> None:
    optimizer, _, fused = optimizer.partition(" fused=")
    make, sample_shape, kind = CASES[case]
    originals, batched = make()  # the reference trains the originals themselves, each with torch.optim
    gen = torch.Generator().manual_seed(0)
    if kind == "tokens":
        xs = torch.randint(0, 11, (STEPS, M, *sample_shape), generator=gen)
        targets = torch.randint(0, 11, (STEPS, M, *sample_shape), generator=gen)
    else:
        xs = torch.randn(STEPS, M, *sample_shape, generator=gen, dtype=torch.float64)
        targets = torch.randint(0, 3, (STEPS, M, sample_shape[0]), generator=gen)
    options = {"momentum": 0.9} if optimizer == "SGD" else {}
    if case != "batched-layers":
        # fullgraph=True: the batched forward is checked first (see test_a_compiled_stacked_forward_is_checked_...)
        bl.check_batched(batched, xs[0])

    references = [getattr(torch.optim, optimizer)(m.parameters(), lr=lr, **options) for m, lr in zip(originals, LRS)]
    expected_outputs = []
    for step in range(STEPS):
        outs = []
        for i, (model, opt) in enumerate(zip(originals, references)):
            out = model(xs[step, i])
            logits = out.logits if kind == "tokens" else out
            loss = nn.functional.cross_entropy(logits.flatten(0, -2), targets[step, i].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            outs.append(logits.detach())
        expected_outputs.append(torch.stack(outs))

    opt = getattr(bl.optim, optimizer)(
        batched.parameters(), lr=torch.tensor(LRS, dtype=torch.float64), fused=bool(fused) or None, **options
    )
    if how == "module.compile":
        batched.compile(fullgraph=True)
        forward = batched
    else:
        forward = torch.compile(batched, fullgraph=True)
    step_fn = torch.compile(opt.step, fullgraph=True)
    for step in range(STEPS):
        out = forward(xs[step])
        logits = out.logits if kind == "tokens" else out
        losses = bl.losses.cross_entropy(logits.flatten(1, -2), targets[step].flatten(1))
        opt.zero_grad()
        losses.sum().backward()
        step_fn()
        assert_close(logits.detach(), expected_outputs[step], msg=f"{case}: compiled output at step {step}")

    for i, model in enumerate(originals):
        for name, value in model.state_dict().items():
            assert_close(batched.state_dict()[name][i], value, msg=f"{case}: model {i}'s {name} after {STEPS} steps")


class _ReadsTheBatchSize(nn.Module):
    """A forward that reads the batch size: as a shape (exact) or as a number (refused in a stacked model:
    it would be every model's samples), with BatchNorm running statistics to show the check has no effects."""

    def __init__(self, as_a_number: bool) -> None:
        super().__init__()
        self.as_a_number = as_a_number
        self.fc, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.norm(self.fc(x).view(x.size(0), -1))
        return h / x.size(0) if self.as_a_number else h * 2


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("as_a_number", [False, True])
def test_a_compiled_stacked_forward_is_checked_eagerly_first(
    as_a_number: bool, fullgraph: bool, execution: str, how: str
) -> None:
    """Under torch.compile batchlayers cannot follow a read batch size: ``h / x.size(0)``, each model's own B
    in an eager call, would divide by every model's samples. The first compiled call with inputs of a kind runs
    the batched forward once eagerly first (on copies, random state and buffers put back), which finds such
    code; so for a model stacked to run model by model, whose compiled calls run batched. Its calls then run
    without compiling (exact), and with ``fullgraph=True`` they raise. With ``fullgraph=True`` the eager run
    cannot happen inside the compiled call: it is refused until ``check_batched`` ran. Models train exactly,
    buffers included. ``model.compile()`` (compiled in place: the eager run calls the module past its compiled
    call) recursed until Python's limit before."""
    models = [seeded(lambda: _ReadsTheBatchSize(as_a_number), i) for i in range(M)]
    stacked = bl.stack(models, execution=execution)
    if how == "model.compile()":
        stacked.compile(backend="aot_eager", fullgraph=fullgraph)
        compiled = stacked
    else:
        compiled = torch.compile(stacked, backend="aot_eager", fullgraph=fullgraph)
    xs = torch.randn(3, M, 5, 4, dtype=torch.float64)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="runs once without compiling first"):
            compiled(xs[0])
        torch._dynamo.reset()
    if fullgraph:
        bl.check_batched(stacked, xs[0])  # changes nothing: the originals are the reference as they are
        if as_a_number:
            with pytest.raises(torch._dynamo.exc.Unsupported):
                compiled(xs[0])
            return
    for x in xs:
        assert_close(compiled(x), torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="compiled output")
    for name, value in stacked.state_dict().items():
        assert_close(value, torch.stack([m.state_dict()[name] for m in models]), msg=f"{name} after the calls")


def test_check_batched_takes_stacked_models_only() -> None:
    with pytest.raises(TypeError, match="check_batched: expected a stacked model .* got Sequential"):
        bl.check_batched(nn.Sequential(bl.BatchedLinear(M, 4, 4)), torch.randn(M, 2, 4))


class _InPlace(nn.Module):
    """Residual code as real models write it: in-place ops on a layer output, then another layer."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        out = self.fc1(x)
        if self.how == "+=":
            out += x
        elif self.how == "*=":
            out *= 2
        elif self.how == "out = out.add_(x)":
            out = out.add_(x)
        elif self.how == "relu(inplace=True)":
            out = nn.functional.relu(out, inplace=True)
        return self.fc2(out)


@pytest.mark.parametrize("how", ["+=", "*=", "out = out.add_(x)", "relu(inplace=True)"])
def test_in_place_ops_keep_the_samples_under_compile(how: str) -> None:
    """torch.compile traces an in-place op's result as another tensor than its input: before this was handled,
    the next layer took the folded samples for a shared constant and the output came back (M, B, M*B, 3)."""
    models = [seeded(lambda: _InPlace(how), i) for i in range(M)]
    x = torch.randn(M, 2, 4, dtype=torch.float64)
    stacked = bl.stack(models)
    bl.check_batched(stacked, x)  # fullgraph=True: checked first
    out = torch.compile(stacked, fullgraph=True, backend="aot_eager")(x)
    assert_close(out, torch.stack([m(x[i]) for i, m in enumerate(models)]), msg=f"compiled output with {how}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_two_class_cross_entropy_compiles_in_one_graph(reduction: str) -> None:
    """The eager two-class path branches on the targets' values (a graph break, an error with fullgraph=True);
    compiled, the loss takes torch's path, which inductor fuses."""
    logits = torch.randn(M, 5, 2, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 2, (M, 5))
    loss = torch.compile(bl.losses.cross_entropy, fullgraph=True, backend="aot_eager")
    compiled = loss(logits, target, reduction=reduction)
    expected = torch.stack([nn.functional.cross_entropy(logits[i], target[i], reduction=reduction) for i in range(M)])
    assert_close(compiled, expected, msg=f"compiled two-class cross entropy, reduction={reduction}")


class _Breaks(nn.Module):
    """A forward with a graph break in the middle: dynamo compiles the part before it and the rest as separate
    graphs, with the stacked call's tracker carried across."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        out = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        out = out + torch.tanh(out)
        out = self.fc2(out) * 2
        return self.fc3(out + x[:, :1])


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_graph_break_inside_a_stacked_forward(backend: str) -> None:
    models = [seeded(_Breaks, i) for i in range(M)]
    x = torch.randn(M, 2, 4, dtype=torch.float64, requires_grad=True)
    out = torch.compile(bl.stack(models), backend=backend)(x)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    assert_close(out, expected, msg=f"output with a graph break ({backend})")
    (grad,) = torch.autograd.grad(out.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert_close(grad, expected_grad, msg=f"input gradient with a graph break ({backend})")


class _OwnPositions(nn.Module):
    """A per-model buffer that the architecture's own code passes to a layer (CLIP's ``position_ids``,
    different in every model here): the stacked call runs eagerly, its hooks included."""

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.emb = nn.Embedding(5, 4)
        self.register_buffer("pos", torch.arange(5).roll(shift).expand(1, -1), persistent=False)

    def forward(self, x):
        return self.fc(x) + self.emb(self.pos)


def test_own_code_using_per_model_tensors_runs_eagerly_under_compile() -> None:
    """torch.compile of such a stacked model crashed (an IndexError: a compiled hook read the per-model
    buffer's stored (M, *) sizes); it runs eagerly and equals the originals."""
    models = [seeded(functools.partial(_OwnPositions, i), i).double() for i in range(M)]
    x = torch.randn(M, 2, 5, 4, dtype=torch.float64)
    out = torch.compile(bl.stack(models))(x)
    assert_close(out, torch.stack([m(x[i]) for i, m in enumerate(models)]), msg="compiled output")


class _PerModelReductions(nn.Module):
    """A loss in forward that reduces over the samples: a masked MSE of picked rows, or a sum over the batch
    divided by the batch size read in forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc, self.how = nn.Linear(4, 3), how

    def forward(self, x, y):
        h = self.fc(x)
        if self.how == "picked rows":
            m = y[:, 0] > 0
            return F.mse_loss(h[m], y[m])
        return (h - y).pow(2).sum() / x.size(0)


@pytest.mark.parametrize("how", ["picked rows", "sum / x.size(0)"])
def test_reductions_over_the_samples_run_eagerly_under_compile(how: str) -> None:
    """Per-model reductions of picked rows and sizes given as values are followed only without compiling:
    compiled, the stacked forward runs eagerly (a ValueError and a wrong result before) and equals the
    originals, call after call."""
    models = [seeded(lambda: _PerModelReductions(how), i).double() for i in range(M)]
    compiled = torch.compile(bl.stack(models), backend="aot_eager")
    for step in range(2):
        x, y = torch.randn(M, 5, 4, dtype=torch.float64), torch.randn(M, 5, 3, dtype=torch.float64)
        y[:, 0, 0] = 1.0  # every model picks a row or more
        out = compiled(x, y)
        expected = torch.stack([m(x[i], y[i]) for i, m in enumerate(models)])
        assert_close(out, expected, msg=f"{how}, call {step}")


@pytest.mark.parametrize("what", ["stack", "concat", "concat one compiled"])
def test_compiled_models_are_taken_as_the_models_they_wrap(what: str) -> None:
    """``stack`` and ``concat`` of ``torch.compile`` wrappers work on the modules they wrap and return a plain
    stacked model (compile that): before, the wrappers' own attributes made the models look configured
    differently, or a wrapper and a plain model two architectures."""
    models = [seeded(MLP, i) for i in range(4)]
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    expected = torch.stack([m(x[i]) for i, m in enumerate(models)])
    if what == "stack":
        result = bl.stack([torch.compile(m, backend="eager") for m in models])
    else:
        parts = [bl.stack(models[:3]), bl.stack(models[3:])]
        compiled = [torch.compile(p, backend="eager") for p in parts]
        result = bl.concat(compiled if what == "concat" else [compiled[0], parts[1]])
    assert type(result) is MLP
    assert_close(result(x), expected, msg=f"{what} of compiled models")
    assert_close(torch.compile(result, backend="aot_eager")(x), expected, msg=f"{what}, compiled again")
