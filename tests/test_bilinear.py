"""BatchedBilinear against a loop over torch.nn.Bilinear (two inputs, which LayerCase does not take)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from harness import LayerCase, assert_close, check_init_matches_torch, check_state_dict_layout
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from batchlayers.linear import BatchedBilinear

# (id, in1_features, in2_features, out_features, bias, extra batch dims): in1 > in2 and in1 <= in2 take
# different contraction orders.
CONFIGS = [
    ("in1-longer", 7, 4, 5, True, ()),
    ("in2-longer", 3, 6, 4, True, ()),
    ("square-nobias", 5, 5, 3, False, ()),
    ("seq", 6, 4, 3, True, (3,)),
    ("seq-in2-longer", 2, 5, 3, True, (2, 3)),
    ("no-batch-dim", 4, 3, 2, True, None),
]
SHARING = ["per_model", "shared1", "shared2", "shared_both"]


def _build(num_models, config, dtype):
    _, in1, in2, out, bias, _ = config
    layer = BatchedBilinear(num_models, in1, in2, out, bias, dtype=dtype)
    modules = []
    for i in range(num_models):
        module = nn.Bilinear(in1, in2, out, bias, dtype=dtype)
        module.load_state_dict({k: v[i].clone() for k, v in layer.state_dict().items()})
        modules.append(module)
    return layer, modules


def _inputs(num_models, config, dtype, sharing, batch=5):
    _, in1, in2, _, _, extra = config
    lead = () if extra is None else (batch, *extra)
    made = []
    for k, features in ((1, in1), (2, in2)):
        shared = sharing in (f"shared{k}", "shared_both")
        made.append((torch.randn(*lead, features, dtype=dtype), shared))
    return made


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("sharing", SHARING)
def test_matches_loop(config, num_models, dtype, sharing) -> None:
    torch.manual_seed(0)
    layer, modules = _build(num_models, config, dtype)
    raw = _inputs(num_models, config, dtype, sharing)
    batched_in, loop_in = [], []
    for x, shared in raw:
        xb = (x if shared else torch.randn(num_models, *x.shape, dtype=dtype)).requires_grad_()
        xr = xb.detach().clone().requires_grad_()
        batched_in.append((xb, shared))
        loop_in.append(xr)
    call = [xb.expand(num_models, *xb.shape) if shared else xb for xb, shared in batched_in]
    y = layer(*call)
    ys = torch.stack(
        [m(*(xr if shared else xr[i] for xr, (_, shared) in zip(loop_in, batched_in))) for i, m in enumerate(modules)]
    )
    assert_close(y, ys, msg="output")
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ys.backward(grad_out)
    for k, ((xb, _), xr) in enumerate(zip(batched_in, loop_in), start=1):
        assert_close(xb.grad, xr.grad, msg=f"gradient of input{k}")
    for name, p in layer.named_parameters():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        assert_close(p.grad, ref, msg=f"gradient of {name}")


class _Materialized(TorchDispatchMode):
    """Records every op output of one of the sizes ``numels`` that is not a stride-0 view: a copy of a shared
    input (in any shape: e.g. ``einsum`` copies one into ``(M*B, in, 1)``)."""

    def __init__(self, numels):
        super().__init__()
        self.numels, self.copies = numels, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() in self.numels and 0 not in t.stride():
                self.copies.append(str(func))
        return out


@pytest.mark.parametrize("config", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_shared_inputs_not_copied(config) -> None:
    num_models, batch = 4, 6
    layer, _ = _build(num_models, config, torch.float32)
    x1, x2 = torch.randn(batch, config[1]), torch.randn(batch, config[2])
    # no other tensor of the forward has one of these sizes (outputs 5 and 4 features, partial products 20, 12)
    with _Materialized({num_models * batch * config[1], num_models * batch * config[2]}) as mode:
        layer(x1.expand(num_models, *x1.shape), x2.expand(num_models, *x2.shape))
    assert not mode.copies, f"a shared input was copied by {mode.copies}"


_CASE = LayerCase(
    id="Bilinear",
    batched=lambda m, dt: BatchedBilinear(m, 6, 4, 5, dtype=dt),
    torch=lambda dt: nn.Bilinear(6, 4, 5, dtype=dt),
    input=None,
)


def test_init_matches_torch() -> None:
    check_init_matches_torch(_CASE)
    layer = BatchedBilinear(8, 6, 40, 5)
    bound = 1 / math.sqrt(6)  # torch's: 1/sqrt(in1_features), for the weight and the bias
    for name, p in layer.named_parameters():
        assert p.abs().max() <= bound, f"{name} outside the init bound"
        assert p.abs().max() > 0.9 * bound, f"{name} does not reach the init bound"


def test_state_dict_layout() -> None:
    check_state_dict_layout(_CASE)
    state = BatchedBilinear(3, 6, 4, 5, bias=False).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {"weight": (3, 5, 6, 4)}


def test_compile_fullgraph() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = BatchedBilinear(3, 4, 6, 2, dtype=torch.float64)
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
    x1, x2 = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    y, yc = eager(x1, x2), compiled(x1, x2)
    assert_close(yc, y, msg="compiled output")
    g = torch.randn_like(y)
    y.backward(g)
    yc.backward(g)
    for (name, p), q in zip(eager.named_parameters(), compiled_copy.parameters()):
        assert_close(q.grad, p.grad, msg=f"compiled gradient of {name}")


def test_extra_repr() -> None:
    assert BatchedBilinear(3, 4, 6, 2, bias=False).extra_repr() == (
        "num_models=3, in1_features=4, in2_features=6, out_features=2, bias=False"
    )


def test_bad_in1_features() -> None:
    with pytest.raises(ValueError, match=r"BatchedBilinear: in1_features must be > 0, got 0"):
        BatchedBilinear(2, 0, 3, 4)


NAME = "BatchedBilinear"
BAD_INPUTS = [
    ("models1", (4, 2, 5), (3, 2, 6), ValueError, rf"{NAME}.*input1.*dimension 0 \(models\) is 4, not 3"),
    ("models2", (3, 2, 5), (2, 2, 6), ValueError, rf"{NAME}.*input2.*dimension 0 \(models\) is 2, not 3"),
    ("in1", (3, 2, 4), (3, 2, 6), ValueError, rf"{NAME}.*input1.*in1_features=5.*dimension 2 \(in1_features\) is 4"),
    ("in2", (3, 2, 5), (3, 2, 7), ValueError, rf"{NAME}.*input2.*in2_features=6.*dimension 2 \(in2_features\) is 7"),
    ("batch", (3, 2, 5), (3, 4, 6), ValueError, rf"{NAME}.*same \(M, \*\).*\(3, 2, 5\) and \(3, 4, 6\)"),
    ("extra-dims", (3, 2, 2, 5), (3, 2, 6), ValueError, rf"{NAME}.*same \(M, \*\)"),
    ("ndim", (5,), (3, 2, 6), ValueError, rf"{NAME}.*input1.*too few"),
    ("type", (3, 2, 5), None, TypeError, rf"{NAME}: expected the input2 to be a Tensor, got list"),
]


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[r[0] for r in BAD_INPUTS])
def test_bad_input_raises(row) -> None:
    _, shape1, shape2, exc, pattern = row
    layer = BatchedBilinear(3, 5, 6, 4)
    x2 = [[0.0] * 6] * 3 if shape2 is None else torch.randn(shape2)
    with pytest.raises(exc, match=pattern):
        layer(torch.randn(shape1), x2)
