"""BatchedSequential: runs of batched linear layers and activations computed as one autograd node, against a
loop of the torch.nn models holding the same slices, and against nn.Sequential wherever it must not fuse."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from harness import RecordOps, assert_close
from torch import nn

import batchlayers.functional._linear as linear_module
import batchlayers.functional._mlp as mlp_module
from batchlayers import _workspace
from batchlayers.container import BatchedSequential, Folded
from batchlayers.convert import select as bl_select
from batchlayers.convert import stack as bl_stack
from batchlayers.convert import unstack as bl_unstack
from batchlayers.linear import BatchedLinear

F64 = torch.float64
M = 3
FUSED = "_LinearChainBackward"

# name -> the layers of one model, written with torch.nn modules ("L" marks where a linear goes)
STRUCTURES = {
    "relu": [(5, 7), nn.ReLU(), (7, 2)],
    "relu-tanh-3": [(5, 7), nn.ReLU(), (7, 4), nn.Tanh(), (4, 3)],
    "nobias": [(5, 7, False), nn.ReLU(inplace=True), (7, 2, False)],
    "gelu-silu-leaky": [
        (5, 7),
        nn.GELU(),
        (7, 6),
        nn.SiLU(),
        (6, 5),
        nn.LeakyReLU(0.1),
        (5, 4),
        nn.GELU(approximate="tanh"),
        (4, 2),
    ],
    "inplace-silu-leaky": [(5, 7), nn.SiLU(inplace=True), (7, 6), nn.LeakyReLU(0.2, inplace=True), (6, 2)],
    "mixed-bias": [(5, 7, False), nn.Tanh(), (7, 6), nn.ReLU(), (6, 2, False)],
    "run-in-middle": [
        Folded(nn.Flatten(-2)),
        (6, 8),
        nn.Tanh(),
        (8, 8),
        nn.ReLU(),
        Folded(nn.Dropout(0.0)),
        (8, 4),
        nn.ReLU(),
        (4, 2),
        nn.ReLU(),
    ],
}
SAMPLE = {name: (5,) for name in STRUCTURES} | {"run-in-middle": (2, 3)}


@pytest.fixture(autouse=True, params=[True, False], ids=["native", "torch-ops"])
def _always_fuse(request, monkeypatch):
    # Runs fuse above a work size only; these tests' tiny layers are forced through the fused path, computed by
    # the C kernels where they serve (ReLU runs: see test_native_kernels_serve) and by torch's ops.
    monkeypatch.setattr(mlp_module, "CHAIN_MIN_MACS", 0)
    monkeypatch.setattr(mlp_module, "native_kernel", request.param)


def _build(structure, dtype=F64) -> tuple[BatchedSequential, list[nn.Sequential]]:
    """The batched model and the M torch.nn models holding its slices."""
    torch.manual_seed(0)
    batched, loops = [], [[] for _ in range(M)]
    for item in structure:
        if isinstance(item, tuple):
            in_f, out_f, *bias = item
            layer = BatchedLinear(M, in_f, out_f, *bias, dtype=dtype)
            batched.append(layer)
            for m in range(M):
                single = nn.Linear(in_f, out_f, *bias, dtype=dtype)
                single.load_state_dict({k: v[m] for k, v in layer.state_dict().items()})
                loops[m].append(single)
        else:
            batched.append(copy.deepcopy(item))
            for m in range(M):
                loops[m].append(copy.deepcopy(item.module if isinstance(item, Folded) else item))
    return BatchedSequential(*batched), [nn.Sequential(*layers) for layers in loops]


def _input(structure_name, leading, dtype=F64):
    return torch.randn(*leading, *SAMPLE[structure_name], dtype=dtype)


def _compare(model, loops, base, shared, input_grad, *, fused=True):
    """Outputs, input gradients and parameter gradients against the loop."""
    xb = base.clone().requires_grad_(input_grad)
    xr = base.clone().requires_grad_(input_grad)
    y = model(xb.expand(M, *xb.shape) if shared else xb)
    expected = torch.stack([loops[m](xr if shared else xr[m]) for m in range(M)])
    assert_close(y, expected, msg="output")
    assert y.is_contiguous(), y.stride()  # as nn.Linear's, whatever layout the products ran in
    names = _graph_names(y)
    assert (FUSED in names) == fused, names
    grad = torch.randn_like(expected)
    y.backward(grad)
    expected.backward(grad)
    if input_grad:
        assert_close(xb.grad, xr.grad, msg="input gradient")
    batched = dict(model.named_parameters())
    for m in range(M):
        for name, p in loops[m].named_parameters():
            if p.grad is None:  # frozen
                assert batched[name].grad is None, name
            else:
                assert_close(batched[name].grad[m], p.grad, msg=f"{name} gradient of model {m}")
    return y


def _graph_names(y):
    return {type(n).__name__ for n in _graph(y.grad_fn)}


def _graph(node, seen=None):
    seen = set() if seen is None else seen
    if node is None or node in seen:
        return seen
    seen.add(node)
    for next_node, _ in node.next_functions:
        _graph(next_node, seen)
    return seen


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["data", "input-grad"])
@pytest.mark.parametrize("extra", [(), (2,)], ids=["MB", "MBT"])
def test_matches_loop(structure, shared, input_grad, extra):
    model, loops = _build(STRUCTURES[structure])
    leading = (4, *extra) if shared else (M, 4, *extra)
    _compare(model, loops, _input(structure, leading), shared, input_grad)


# Sizes of one where the products choose their orientation: one sample a model, a hidden layer and an output
# of one feature (a critic's value head), where a transposed result and a contiguous one share their layout.
@pytest.mark.parametrize("sizes", [[(5, 7), nn.ReLU(), (7, 1)], [(5, 1), nn.ReLU(), (1, 3), nn.Tanh(), (3, 1)]],
                         ids=["output-1", "hidden-1"])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 40], ids=["one-sample", "many-samples"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
def test_sizes_of_one_match_loop(sizes, batch, shared):
    model, loops = _build(sizes)
    leading = (batch,) if shared else (M, batch)
    _compare(model, loops, torch.randn(*leading, 5, dtype=F64), shared, True)


def test_float32_matches_loop():
    model, loops = _build(STRUCTURES["relu-tanh-3"], torch.float32)
    _compare(model, loops, _input("relu-tanh-3", (M, 64), torch.float32), False, True)


@pytest.mark.parametrize("outputs", [1, 2, 3])
@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
def test_float32_few_outputs_after_a_short_hidden_layer_match_loop(outputs, shared):
    # 64 samples through 20 hidden units: the hidden tensor is held transposed, so the output layer's weight
    # gradient multiplies two transposed operands; with 2 outputs the chain copies one of them first
    # (mlp_module._two_rows_transposed).
    model, loops = _build([(10, 20), nn.ReLU(), (20, outputs)], torch.float32)
    leading = (64,) if shared else (M, 64)
    _compare(model, loops, torch.randn(*leading, 10), shared, True)


def test_state_dict_and_children_are_sequentials():
    model, _ = _build(STRUCTURES["run-in-middle"])
    plain = nn.Sequential(*model)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert isinstance(model, nn.Sequential) and model[1] is plain[1] and len(model) == len(plain)
    assert isinstance(model[1:4], BatchedSequential)


def _hooked(kind):
    model, loops = _build(STRUCTURES["relu-tanh-3"])
    calls = []
    target = model[2]
    if kind == "forward":
        target.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    elif kind == "pre":
        target.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape))
    elif kind == "backward":
        target.register_full_backward_hook(lambda mod, gi, go: calls.append(go[0].shape))
    return model, loops, calls


@pytest.mark.parametrize("kind", ["forward", "pre", "backward"])
def test_hooks_run_module_by_module(kind):
    # A hook on a layer of a run sees that layer's call, so the run is not fused.
    model, loops, calls = _hooked(kind)
    _compare(model, loops, _input("relu-tanh-3", (M, 4)), False, True, fused=False)
    assert len(calls) == 1


def test_global_hooks_run_module_by_module():
    model, loops = _build(STRUCTURES["relu"])
    calls = []
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: calls.append(type(mod)))
    try:
        _compare(model, loops, _input("relu", (M, 4)), False, True, fused=False)
    finally:
        handle.remove()
    assert calls.count(BatchedLinear) == 2


def test_subclasses_and_parametrizations_run_module_by_module():
    # A subclass may override forward, and a parametrized layer computes its weight: neither is fused.
    class MyLinear(BatchedLinear):
        pass

    model, loops = _build(STRUCTURES["relu"])
    subclassed = MyLinear(M, 7, 2, dtype=F64)
    subclassed.load_state_dict(model[2].state_dict())
    model[2] = subclassed
    _compare(model, loops, _input("relu", (M, 4)), False, True, fused=False)

    model, loops = _build(STRUCTURES["relu"])
    for module in [model[0], *(loop[0] for loop in loops)]:
        nn.utils.parametrize.register_parametrization(module, "weight", _Double())
    _compare(model, loops, _input("relu", (M, 4)), False, True, fused=False)


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


def test_inplace_leaky_relu_with_negative_slope_runs_module_by_module():
    # torch refuses its backward (the input is gone and the slope's sign hides it): so must the fused run.
    model, _ = _build([(5, 7), nn.LeakyReLU(-0.1, inplace=True), (7, 2)])
    y = model(_input("relu", (M, 4)))
    assert FUSED not in _graph_names(y)
    with pytest.raises(RuntimeError, match="negative slope"):
        y.sum().backward()


@pytest.mark.parametrize("structure", ["relu", "relu-tanh-3", "gelu-silu-leaky"])
def test_gradient_penalty_matches_loop(structure):
    # create_graph=True: the run's backward is recomputed with recorded ops, so it differentiates again.
    model, loops = _build(STRUCTURES[structure])
    base = _input(structure, (M, 4))
    xb = base.clone().requires_grad_()
    y = model(xb)
    assert FUSED in _graph_names(y)
    (grad_x,) = torch.autograd.grad(y.sum(), xb, create_graph=True)
    grad_x.square().sum().backward()
    for m in range(M):
        xr = base[m].clone().requires_grad_()
        (gr,) = torch.autograd.grad(loops[m](xr).sum(), xr, create_graph=True)
        assert_close(grad_x[m], gr, msg=f"input gradient of model {m}")
        gr.square().sum().backward()
        for name, p in loops[m].named_parameters():
            got = dict(model.named_parameters())[name].grad
            if p.grad is None:  # the last bias does not reach the input gradient
                assert got is None, name
            else:
                assert_close(got[m], p.grad, msg=f"{name} of model {m}")


@pytest.mark.parametrize("structure", ["relu", "relu-tanh-3", "gelu-silu-leaky"])
def test_gradgradcheck(structure):
    model, _ = _build(STRUCTURES[structure])
    x = _input(structure, (M, 3)).requires_grad_()
    params = list(model.parameters())

    def fn(x, *ps):
        return torch.func.functional_call(model, dict(zip(dict(model.named_parameters()), ps)), (x,))

    # functional_call swaps in tensors, not Parameters: the run still fuses (checked by the graph) ...
    assert FUSED in _graph_names(fn(x, *params))
    # ... and its first and second derivatives are the numerical ones.
    assert torch.autograd.gradcheck(fn, (x, *params))
    assert torch.autograd.gradgradcheck(fn, (x, *params))


def test_inference_matches_loop():
    model, loops = _build(STRUCTURES["run-in-middle"])
    x = _input("run-in-middle", (M, 4))
    with torch.no_grad():
        y = model(x)
    assert_close(y, torch.stack([loops[m](x[m]) for m in range(M)]), msg="no_grad output")
    with torch.inference_mode():
        assert_close(model(x), y, msg="inference_mode output")


@pytest.mark.parametrize("structure", ["gelu-silu-leaky", "inplace-silu-leaky", "relu-tanh-3"])
def test_inference_runs_the_activations_in_place(structure):
    """Without gradients nothing reads a linear's output again: every activation overwrites it, allocating no
    tensor the size of the hidden layer, with the loop's numbers."""
    model, loops = _build(STRUCTURES[structure])
    x = _input(structure, (M, 4))
    with RecordOps() as ops, torch.no_grad():
        y = model(x)
    assert_close(y, torch.stack([loops[m](x[m]) for m in range(M)]), msg="no_grad output")
    kinds = {"aten.gelu", "aten.silu", "aten.leaky_relu", "aten.relu", "aten.tanh"}
    ran = [op for op in (name.rsplit(".", 1)[0] for name, _, _ in ops.ops) if op.rstrip("_") in kinds]
    assert all(op.endswith("_") for op in ran), ran
    assert len(ran) == sum(not isinstance(m, (BatchedLinear, Folded)) for m in model), ran


def test_autocast_runs_as_the_layers():
    model, _ = _build(STRUCTURES["relu-tanh-3"], torch.float32)
    plain = nn.Sequential(*model)
    x = _input("relu-tanh-3", (M, 8), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, expected = model(x), plain(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    assert FUSED not in _graph_names(y)


# torch.func.jvp imports torch's jvp decompositions, which call torch.jit.script (deprecated in torch 2.13).
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torch_func_and_forward_ad():
    model, _ = _build(STRUCTURES["relu-tanh-3"])
    plain = nn.Sequential(*model)
    x = _input("relu-tanh-3", (M, 4))
    tangent = torch.randn_like(x)
    params = dict(model.named_parameters())

    def loss(module):
        return lambda p, x: torch.func.functional_call(module, p, (x,)).square().sum()

    for got, want in zip(
        torch.func.grad(loss(model))(params, x).values(), torch.func.grad(loss(plain))(params, x).values()
    ):
        assert_close(got, want, msg="torch.func.grad")
    _, jvp = torch.func.jvp(model, (x,), (tangent,))
    _, expected = torch.func.jvp(plain, (x,), (tangent,))
    assert_close(jvp, expected, msg="torch.func.jvp")
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        out = fwad.unpack_dual(model(fwad.make_dual(x, tangent))).tangent
    assert_close(out, expected, msg="forward-mode AD")


def test_compiled_matches_eager():
    model, loops = _build(STRUCTURES["relu-tanh-3"])
    x = _input("relu-tanh-3", (M, 4))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert_close(y, torch.stack([loops[m](x[m]) for m in range(M)]), msg="compiled output")
    y.sum().backward()
    for m in range(M):
        loops[m](x[m]).sum().backward()
        for name, p in loops[m].named_parameters():
            assert_close(dict(model.named_parameters())[name].grad[m], p.grad, msg=f"compiled {name}, model {m}")


@pytest.mark.parametrize(
    "change, in_features, match",
    [
        (lambda model: None, 6, r"in_features"),
        (lambda model: model.__setitem__(2, BatchedLinear(M, 8, 2, dtype=F64)), 5, r"in_features"),
        (lambda model: model.__setitem__(2, BatchedLinear(M + 1, 7, 2, dtype=F64)), 5, r"4"),
        (lambda model: model[2].to(torch.float32), 5, r"float"),
    ],
    ids=["bad-input", "unchained", "num-models", "dtype"],
)
def test_errors_are_the_layers_own(change, in_features, match):
    # Bad input and layers that do not chain raise what nn.Sequential of the same layers raises.
    model, _ = _build(STRUCTURES["relu"])
    change(model)
    x = torch.randn(M, 4, in_features, dtype=F64)
    with pytest.raises((ValueError, RuntimeError, TypeError)) as fused:
        model(x)
    with pytest.raises(type(fused.value)) as plain:
        nn.Sequential(*model)(x)
    assert str(fused.value) == str(plain.value)
    assert fused.match(match)


def test_weights_changed_in_place_before_backward_raise():
    model, _ = _build(STRUCTURES["relu"])
    y = model(_input("relu", (M, 4)))
    with torch.no_grad():
        model[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_fused_matches_unfused_in_float32_training():
    # A few Adam steps of the fused and the module-by-module model from the same weights stay together.
    model, _ = _build(STRUCTURES["relu-tanh-3"], torch.float32)
    plain = copy.deepcopy(nn.Sequential(*model))
    x = _input("relu-tanh-3", (M, 32), torch.float32)
    target = torch.randint(0, 3, (M, 32))
    for net in (model, plain):
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(5):
            optimizer.zero_grad()
            F.cross_entropy(net(x).reshape(-1, 3), target.reshape(-1)).backward()
            optimizer.step()
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        assert_close(got, want, msg=name)


@pytest.mark.parametrize(
    "num_models, activation, native, fused",
    [(2, nn.Tanh, True, False), (64, nn.Tanh, True, True), (2, nn.ReLU, False, False), (2, nn.ReLU, True, True)],
)
def test_small_runs_are_not_fused(num_models, activation, native, fused, monkeypatch):
    # The measured rule: a 10-20-2 MLP on 64 samples fuses from M=64 on (983k multiply-adds), not at M=2;
    # with ReLU, at any size where the C kernels compute it.
    monkeypatch.undo()
    monkeypatch.setattr(mlp_module, "native_kernel", native)
    model = BatchedSequential(BatchedLinear(num_models, 10, 20), activation(), BatchedLinear(num_models, 20, 2))
    y = model(torch.randn(num_models, 64, 10))
    assert (FUSED in _graph_names(y)) == fused


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
@pytest.mark.parametrize("no_grad", [False, True], ids=["train", "no_grad"])
def test_zero_sizes_give_what_nn_sequential_gives(no_grad):
    model = BatchedSequential(BatchedLinear(M, 0, 3, dtype=F64), nn.ReLU(), BatchedLinear(M, 3, 2, dtype=F64))
    for x in [torch.randn(M, 4, 0, dtype=F64), torch.randn(M, 0, 0, dtype=F64)]:
        with torch.set_grad_enabled(not no_grad):
            assert torch.equal(model(x), nn.Sequential(*model)(x))


def test_deepcopy_and_pickle_keep_fusing(tmp_path):
    model, loops = _build(STRUCTURES["relu-tanh-3"])
    torch.save(model, tmp_path / "model.pt")
    for copied in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert type(copied) is BatchedSequential
        for loop in loops:
            loop.zero_grad(set_to_none=True)
        _compare(copied, loops, _input("relu-tanh-3", (M, 4)), False, True)


@pytest.mark.parametrize("frozen", [(0,), (2,), (0, 2)], ids=["first", "middle", "first-and-middle"])
def test_frozen_layers_match_loop(frozen):
    # Fine-tuning some layers: the frozen ones get no gradient, the others the loop's.
    model, loops = _build(STRUCTURES["relu-tanh-3"])
    for index in frozen:
        model[index].requires_grad_(False)
        for loop in loops:
            loop[index].requires_grad_(False)
    _compare(model, loops, _input("relu-tanh-3", (M, 4)), False, False)
    for index in frozen:
        assert model[index].weight.grad is None and model[index].bias.grad is None


def test_strided_input_matches_loop():
    # An input that is a transposed view (not contiguous) goes through the batched products as it is.
    model, loops = _build(STRUCTURES["relu-tanh-3"])
    base = _input("relu-tanh-3", (M, 4)).transpose(1, 2).contiguous().transpose(1, 2)
    assert not base.is_contiguous()
    xb = base.clone().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    xr = base.detach().clone().requires_grad_()
    y = model(xb)
    expected = torch.stack([loops[m](xr[m]) for m in range(M)])
    assert_close(y, expected, msg="output")
    y.sum().backward()
    expected.sum().backward()
    assert_close(xb.grad, xr.grad, msg="input gradient")


# -- batchlayers' own C kernels (functional/_mlp_native.c) for ReLU runs --------------------------------------


class _Calls:
    """Counts the calls of the C kernels' Python wrappers (which a monkeypatch replaces)."""

    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        forward, backward = mlp_module._native_forward, mlp_module._native_backward

        def counted_forward(*args):
            self.forward += 1
            return forward(*args)

        def counted_backward(*args):
            self.backward += 1
            return backward(*args)

        monkeypatch.setattr(mlp_module, "_native_forward", counted_forward)
        monkeypatch.setattr(mlp_module, "_native_backward", counted_backward)


def _view(leaf, layout):
    """The (M, B, F) input the case passes, a view of ``leaf``."""
    if layout == "shared":
        return leaf.expand(M, *leaf.shape)  # (model stride 0)
    if layout == "rows-apart":
        return leaf[..., :-2]  # rows 2 elements longer than the features
    if layout == "features-apart":
        return leaf.transpose(1, 2)  # (M, F, B) transposed: a feature's samples are adjacent
    if layout == "models-inner":
        return leaf.transpose(0, 1)  # (B, M, F) transposed
    if layout == "negative-view":
        return torch._neg_view(leaf)  # (its memory holds the values' negatives)
    return leaf


def _leaf_shape(layout, batch, features):
    return {
        "shared": (batch, features),
        "rows-apart": (M, batch, features + 2),
        "features-apart": (M, features, batch),
        "models-inner": (batch, M, features),
    }.get(layout, (M, batch, features))


# id -> (layers as in STRUCTURES, dtype, layout, samples, whether the C kernels compute it)
NATIVE_CASES = {
    "float64": ([(5, 7), nn.ReLU(), (7, 2)], F64, "per-model", 4, True),
    "float32": ([(5, 7), nn.ReLU(), (7, 2)], torch.float32, "per-model", 4, True),
    "shared": ([(5, 7), nn.ReLU(), (7, 2)], F64, "shared", 4, True),
    "one-sample": ([(5, 7), nn.ReLU(), (7, 2)], F64, "per-model", 1, True),
    "37-samples-float32": ([(5, 7), nn.ReLU(), (7, 2)], torch.float32, "per-model", 37, True),
    "37-samples-float64": ([(5, 7), nn.ReLU(), (7, 2)], F64, "shared", 37, True),
    "four-layers-mixed-bias": (
        [(5, 9, False), nn.ReLU(inplace=True), (9, 6), nn.ReLU(), (6, 4, False), nn.ReLU(), (4, 3)],
        F64,
        "per-model",
        19,
        True,
    ),
    "one-feature": ([(1, 1), nn.ReLU(), (1, 1)], F64, "per-model", 9, True),
    "400-a-sample": ([(20, 20), nn.ReLU(), (20, 20)], torch.float32, "per-model", 33, True),
    "one-wide-layer": ([(1, 400), nn.ReLU(), (400, 1)], F64, "per-model", 4, True),
    "rows-apart": ([(5, 7), nn.ReLU(), (7, 2)], F64, "rows-apart", 4, True),
    "models-inner": ([(5, 7), nn.ReLU(), (7, 2)], F64, "models-inner", 4, True),
    "features-apart": ([(5, 7), nn.ReLU(), (7, 2)], F64, "features-apart", 4, False),
    # sizes that coincide (models = samples = features = 3): read by strides, never guessed from sizes
    "all-three": ([(3, 3), nn.ReLU(), (3, 3)], F64, "per-model", 3, True),
    "all-three-models-inner": ([(3, 3), nn.ReLU(), (3, 3)], F64, "models-inner", 3, True),
    "all-three-rows-apart": ([(3, 3), nn.ReLU(), (3, 3)], F64, "rows-apart", 3, True),
    "negative-view": ([(5, 7), nn.ReLU(), (7, 2)], F64, "negative-view", 4, False),
    "401-a-sample-first": ([(401, 1), nn.ReLU(), (1, 2)], F64, "per-model", 4, False),
    "401-a-sample-last": ([(5, 7), nn.ReLU(), (7, 1), nn.ReLU(), (1, 401)], F64, "per-model", 4, False),
    "tanh": ([(5, 7), nn.Tanh(), (7, 2)], F64, "per-model", 4, False),
    "relu-then-tanh": ([(5, 7), nn.ReLU(), (7, 4), nn.Tanh(), (4, 2)], F64, "per-model", 4, False),
}


@pytest.mark.parametrize("input_grad", [False, True], ids=["data", "input-grad"])
@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_native_kernels_serve(case, input_grad, monkeypatch, request):
    """Which runs the C kernels compute (ReLU runs of float32 or float64 layers of at most 400 multiply-adds a
    sample, fed rows of contiguous features, any model stride), each against the loop of torch.nn models:
    outputs, the input's gradient through its view, and every parameter's gradient."""
    structure, dtype, layout, batch, native = NATIVE_CASES[case]
    native = native and request.node.callspec.params["_always_fuse"]  # (torch-ops: the kernels are off)
    calls = _Calls(monkeypatch)
    model, loops = _build(structure, dtype)
    base = torch.randn(_leaf_shape(layout, batch, structure[0][0]), dtype=dtype)
    leaf_b, leaf_r = base.clone().requires_grad_(input_grad), base.clone().requires_grad_(input_grad)
    xb, xr = _view(leaf_b, layout), _view(leaf_r, layout)
    y = model(xb)
    expected = torch.stack([loops[m](xr[m]) for m in range(M)])
    assert_close(y, expected, msg="output")
    assert y.is_contiguous()
    grad = torch.randn(*expected.shape[:-1], expected.shape[-1] + 3, dtype=dtype)[..., :-3]  # (rows apart)
    y.backward(grad)
    expected.backward(grad)
    assert (calls.forward, calls.backward) == ((1, 1) if native else (0, 0))
    if input_grad:
        assert_close(leaf_b.grad, leaf_r.grad, msg="input gradient")
    batched = dict(model.named_parameters())
    for m in range(M):
        for name, p in loops[m].named_parameters():
            assert_close(batched[name].grad[m], p.grad, msg=f"{name} gradient of model {m}")
    with torch.no_grad():
        assert_close(model(xb), expected, msg="no_grad output")
    assert calls.forward == (2 if native else 0)


@pytest.mark.parametrize("layout", ["sum", "transposed", "shared-by-models", "negative-view"])
def test_native_backward_takes_any_gradient_layout(layout, monkeypatch):
    """The gradient by the output as autograd hands it over: y.sum()'s (every stride 0), a transposed one
    (a feature's samples adjacent), one shared by the models (model stride 0) and a negative view (its memory
    holds the values' negatives)."""
    calls = _Calls(monkeypatch)
    model, loops = _build([(5, 7), nn.ReLU(), (7, 3)])
    x = torch.randn(M, 6, 5, dtype=F64)
    xb, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = model(xb)
    expected = torch.stack([loops[m](xr[m]) for m in range(M)])
    if layout == "sum":
        y.sum().backward()
        expected.sum().backward()
    else:
        grad = torch.randn(M, 3, 6, dtype=F64).transpose(1, 2)
        if layout == "shared-by-models":
            grad = torch.randn(6, 3, dtype=F64).expand(M, 6, 3)
        if layout == "negative-view":
            grad = torch._neg_view(torch.randn(M, 6, 3, dtype=F64))
        y.backward(grad)
        expected.backward(grad)
    assert calls.backward == (1 if mlp_module.native_kernel else 0)
    assert_close(xb.grad, xr.grad, msg="input gradient")
    batched = dict(model.named_parameters())
    for m in range(M):
        for name, p in loops[m].named_parameters():
            assert_close(batched[name].grad[m], p.grad, msg=f"{name} gradient of model {m}")


@pytest.mark.parametrize("name", ["0.weight", "2.bias"])
def test_native_kernels_decline_negative_views_of_parameters(name, monkeypatch):
    """A weight or bias given as a negative view (its memory holds the values' negatives, through
    torch.func.functional_call) runs in torch's ops, with the loop's results."""
    calls = _Calls(monkeypatch)
    model, loops = _build(STRUCTURES["relu"])
    params = {key: p.detach() for key, p in model.named_parameters()}
    params[name] = torch._neg_view(-params[name])  # (the same values)
    x = _input("relu", (M, 4))
    y = torch.func.functional_call(model, params, (x,))
    assert_close(y, torch.stack([loops[m](x[m]) for m in range(M)]), msg="output")
    assert calls.forward == 0


def test_native_kernels_off_or_unavailable(monkeypatch):
    """``bl.backends.cpu.native_chain = False``, or no C compiler: torch's ops, the same results."""
    import batchlayers as bl
    from batchlayers import _native

    with pytest.raises(TypeError, match="native_chain must be True or False"):
        bl.backends.cpu.native_chain = 1
    calls = _Calls(monkeypatch)
    model, loops = _build(STRUCTURES["relu"])
    bl.backends.cpu.native_chain = False  # (the fixture's monkeypatch restores the module's flag)
    assert mlp_module.native_kernel is False and bl.backends.cpu.native_chain is False
    _compare(model, loops, _input("relu", (M, 4)), False, True)
    bl.backends.cpu.native_chain = True
    assert mlp_module.native_kernel is True
    monkeypatch.setattr(_native, "library", lambda: None)
    monkeypatch.setattr(mlp_module, "_KERNELS", {})  # (the kernels found before)
    _compare(model, loops, _input("relu", (M, 4)), False, True)
    assert (calls.forward, calls.backward) == (0, 0)


def test_native_kernels_keep_torchs_nan(monkeypatch):
    """NaN and infinite inputs: ReLU keeps NaN (torch's relu is clamp_min) and its backward passes no
    gradient where its output is NaN (threshold_backward), so outputs and gradients carry NaN where the loop's
    do."""
    calls = _Calls(monkeypatch)
    model, loops = _build([(3, 4), nn.ReLU(), (4, 2)])
    x = torch.randn(M, 9, 3, dtype=F64)
    x[0, 1, 0], x[1, 2, 2], x[2, 8, 1] = float("nan"), float("inf"), float("-inf")
    xb, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = model(xb)
    expected = torch.stack([loops[m](xr[m]) for m in range(M)])
    grad = torch.randn_like(expected)
    y.backward(grad)
    expected.backward(grad)
    assert calls.backward == (1 if mlp_module.native_kernel else 0)
    torch.testing.assert_close(y, expected, equal_nan=True, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xb.grad, xr.grad, equal_nan=True, rtol=1e-10, atol=1e-10)
    batched = dict(model.named_parameters())
    for m in range(M):
        for name, p in loops[m].named_parameters():
            torch.testing.assert_close(batched[name].grad[m], p.grad, equal_nan=True, rtol=1e-10, atol=1e-10)


def test_native_kernels_match_torchs_ops_closely():
    """float64, against the same run computed by torch's ops: equal up to summation order (1e-13 where the
    loop's tolerance is 1e-10)."""
    model, _ = _build([(10, 20), nn.ReLU(), (20, 16), nn.ReLU(), (16, 2)])
    x = torch.randn(M, 45, 10, dtype=F64, requires_grad=True)
    grad = torch.randn(M, 45, 2, dtype=F64)
    results = []
    for native in (True, False):
        mlp_module.native_kernel = native
        y = model(x)
        results.append([y, *torch.autograd.grad(y, [x, *model.parameters()], grad)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


# -- inside stacked models: bl.stack turns an nn.Sequential holding a run into a BatchedSequential -----------


class _Block(nn.Module):
    """A transformer-style MLP on (B, T, C), optionally applied time-major, plus an MLP of a per-model table
    (no samples: computed once per model, broadcast)."""

    def __init__(self, time_major: bool = False) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
        self.table = nn.Parameter(torch.randn(1, 6))
        self.time_major = time_major

    def forward(self, x):
        if self.time_major:
            return self.mlp(x.transpose(0, 1)).transpose(0, 1) + self.mlp(self.table)
        return self.mlp(x) + self.mlp(self.table)


STACKED = {
    "sequential-root": (
        lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2)),
        (5,),
    ),
    "nested-mlp": (_Block, (3, 6)),
    "nested-time-major": (lambda: _Block(time_major=True), (3, 6)),
}


@pytest.mark.parametrize("name", list(STACKED))
@pytest.mark.parametrize("shared", [False, True], ids=["per-model", "shared"])
# sizes that coincide: B == M == T (3) and M * B == T (batch 1), where a guess from sizes would mix models
@pytest.mark.parametrize("batch", [3, 1], ids=["B=M=T", "MxB=T"])
def test_stacked_runs_fuse_and_match_the_originals(name, shared, batch):
    make, sample = STACKED[name]
    torch.manual_seed(0)
    models = [make().double() for _ in range(M)]
    stacked = bl_stack(models)
    assert isinstance(stacked.get_submodule("mlp" if name != "sequential-root" else ""), BatchedSequential)
    base = torch.randn(*(() if shared else (M,)), batch, *sample, dtype=F64)
    xb = base.clone().requires_grad_()
    xr = base.clone().requires_grad_()
    y = stacked(xb.expand(M, *xb.shape) if shared else xb)
    assert FUSED in _graph_names(y)
    expected = torch.stack([models[m](xr if shared else xr[m]) for m in range(M)])
    assert_close(y, expected, msg="output")
    grad = torch.randn_like(expected)
    y.backward(grad)
    expected.backward(grad)
    assert_close(xb.grad, xr.grad, msg="input gradient")
    params = dict(stacked.named_parameters())
    for m in range(M):
        for pname, p in models[m].named_parameters():
            assert_close(params[pname].grad[m], p.grad, msg=f"{pname} gradient of model {m}")


def test_unstack_gives_back_nn_sequential_and_select_keeps_fusing():
    torch.manual_seed(0)
    models = [STACKED["sequential-root"][0]().double() for _ in range(M)]
    stacked = bl_stack(models)
    assert type(stacked) is BatchedSequential
    back = bl_unstack(stacked)
    assert all(type(b) is nn.Sequential and "_batchlayers_sequential" not in vars(b) for b in back)
    x = torch.randn(2, 4, 5, dtype=F64)
    picked = bl_select(stacked, [2, 0])
    y = picked(x)
    assert FUSED in _graph_names(y)
    assert_close(y, torch.stack([models[2](x[0]), models[0](x[1])]), msg="selected models")


def test_stacked_sequential_without_a_run_stays_nn_sequential():
    models = [nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.0), nn.Linear(7, 2)) for _ in range(M)]
    assert type(bl_stack(models)) is nn.Sequential


@pytest.mark.parametrize("limit", [0, 4 * 4, 1 << 20], ids=["all-baddbmm", "mixed", "all-bmm-add"])
@pytest.mark.parametrize("no_grad", [False, True], ids=["train", "no_grad"])
@pytest.mark.parametrize("structure", ["relu-tanh-3", "mixed-bias"])
def test_bias_after_bmm_matches_loop_on_both_sides_of_its_limit(limit, no_grad, structure, monkeypatch):
    """Layers with at most PRODUCT_THEN_BIAS_MAX_OUTPUTS outputs a model add the bias after ``bmm``, the others
    through ``baddbmm``; either way (and mixed in one run) the loop's numbers."""
    monkeypatch.setattr(mlp_module, "PRODUCT_THEN_BIAS_MAX_OUTPUTS", limit)
    model, loops = _build(STRUCTURES[structure])
    x = _input(structure, (M, 4))
    widths = [layer.out_features for layer in model if isinstance(layer, BatchedLinear) and layer.bias is not None]
    expected_baddbmm = sum(4 * width > limit for width in widths)
    with RecordOps() as ops, torch.set_grad_enabled(not no_grad):
        y = model(x)
    names = [name for name, _, _ in ops.ops]
    assert names.count("aten.baddbmm.default") == expected_baddbmm, names
    # (in place, or into the output's contiguous copy where the product was computed transposed)
    added = names.count("aten.add_.Tensor") + names.count("aten.add.out")
    assert added == len(widths) - expected_baddbmm, names
    if no_grad:
        assert_close(y, torch.stack([loops[m](x[m]) for m in range(M)]), msg="no_grad output")
    else:
        _compare(model, loops, x, False, True)


@pytest.mark.parametrize("fused", [True, False], ids=["chain", "layer-by-layer"])
@pytest.mark.parametrize("structure", ["relu", "relu-tanh-3", "nobias"])
def test_kept_weight_gradients_are_never_written_while_held(monkeypatch, structure, fused):
    """The weight gradients of the chain, and layer by layer those a layer computes itself (out-major, fewer
    outputs than inputs), go into memory kept between backwards (``_workspace.returned``; every size here),
    which autograd keeps as the weights' ``.grad``. A gradient the caller still holds is never written by a
    later backward, gradients accumulate as torch.nn's do, and once dropped the next backward writes into kept
    memory instead of new."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    monkeypatch.setattr(linear_module, "OUT_MAJOR_MIN_MACS", 0)
    if not fused:
        monkeypatch.setattr(mlp_module, "CHAIN_MIN_MACS", 1 << 62)
        monkeypatch.setattr(mlp_module, "native_kernel", False)  # (which fuses a ReLU run at any size)
    _workspace.release()
    model, loops = _build(STRUCTURES[structure])
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    kept_weights = weights if fused else [w for w in weights if w.shape[1] < w.shape[2]]
    assert kept_weights
    every = [*model.parameters(), *(q for loop in loops for q in loop.parameters())]

    def drop_gradients():
        for p in every:
            p.grad = None

    _compare(model, loops, _input(structure, (M, 4)), False, True, fused=fused)
    held = [w.grad for w in weights]
    copies = [g.clone() for g in held]
    drop_gradients()
    _compare(model, loops, _input(structure, (M, 4)), False, True, fused=fused)  # (the first's gradients held)
    assert all(torch.equal(g, c) for g, c in zip(held, copies)), "a held gradient was written"
    assert not {w.grad.data_ptr() for w in weights} & {g.data_ptr() for g in held}
    _compare(model, loops, _input(structure, (M, 4)), False, True, fused=fused)  # (accumulated into .grad)
    del held, copies
    drop_gradients()
    kept = len(_workspace._pool())
    _compare(model, loops, _input(structure, (M, 4)), False, True, fused=fused)
    assert len(_workspace._pool()) == kept, "new buffers where dropped ones were free"
    assert {w.grad.data_ptr() for w in kept_weights} <= {t.data_ptr() for t in _workspace._pool()}
    _workspace.release()


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_kept_buffers_are_written_whole(monkeypatch, structure):
    """The chain's hidden activations and their gradients go into buffers kept between calls
    (batchlayers._workspace; every size here): poisoned with NaN after a training step, the next training step
    and an inference call are still the loop's, and take the kept buffers."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    model, loops = _build(STRUCTURES[structure])
    _compare(model, loops, _input(structure, (M, 4)), False, True)
    kept = [weakref.ref(t) for t in _workspace._pool()]  # (a weak reference does not hold a buffer)
    assert kept
    for buffer in _workspace._pool():
        buffer.fill_(float("nan"))
    del buffer  # (a name holding a buffer keeps it from being reused)
    for p in [*model.parameters(), *(q for loop in loops for q in loop.parameters())]:
        p.grad = None
    _compare(model, loops, _input(structure, (M, 4)), False, True)
    assert sorted(id(t) for t in _workspace._pool()) == sorted(id(r()) for r in kept)  # the same buffers: nothing new
    x = _input(structure, (M, 4))
    with torch.no_grad():
        assert_close(model(x), torch.stack([loops[m](x[m]) for m in range(M)]), msg="inference")
    with torch.inference_mode():  # (its buffers are inference tensors, which no training step may write)
        model(_input(structure, (M, 4)))
    _compare(model, loops, _input(structure, (M, 4)), False, True)
    _workspace.release()
