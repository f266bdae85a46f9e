"""Checks every batched layer passes, run over every ``LayerCase`` in ``tests/cases_*.py``."""

from __future__ import annotations

import copy
import importlib
import pathlib
import pickle

import pytest
import torch
from harness import (
    LayerCase,
    assert_close,
    check_init_matches_torch,
    check_state_dict_layout,
    compare_with_loop,
    outputs_equal,
    unbatch,
)

_HERE = pathlib.Path(__file__).parent
CASES: list[LayerCase] = [
    case for path in sorted(_HERE.glob("cases_*.py")) for case in importlib.import_module(path.stem).CASES
]
BAD_INPUTS = [(case, row) for case in CASES for row in case.bad_inputs]

case_param = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)


@case_param
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_matches_loop(case: LayerCase, num_models: int, dtype: torch.dtype, shared: bool) -> None:
    torch.manual_seed(0)
    batched = case.build(num_models, dtype)
    modules = unbatch(batched, lambda: case.torch(dtype))
    compare_with_loop(
        batched,
        modules,
        lambda lead: case.input(lead, dtype),
        shared=shared,
        steps=case.steps,
        input_requires_grad=case.input_requires_grad,
    )


@case_param
def test_init_matches_torch(case: LayerCase) -> None:
    check_init_matches_torch(case)


@case_param
def test_state_dict_layout(case: LayerCase) -> None:
    check_state_dict_layout(case)


@case_param
def test_deepcopy_and_pickle(case: LayerCase) -> None:
    batched = case.build(3, torch.float64)
    # Each clone is made just before its comparison: a forward may change weights (embedding max_norm), so a
    # clone made before the previous comparison ran would no longer match.
    for make_clone in (copy.deepcopy, lambda module: pickle.loads(pickle.dumps(module))):
        clone = make_clone(batched)
        for (name, p), q in zip(batched.named_parameters(), clone.parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), f"{name} not copied"
        outputs_equal(batched, clone, case, 3)


@case_param
def test_to_dtype(case: LayerCase) -> None:
    torch.manual_seed(0)
    batched = case.build(3, torch.float32).to(torch.float64)
    for name, t in [*batched.named_parameters(), *batched.named_buffers()]:
        if t.is_floating_point():
            assert t.dtype == torch.float64, f"{name} stayed {t.dtype}"
    modules = unbatch(batched, lambda: case.torch(torch.float64))
    compare_with_loop(
        batched,
        modules,
        lambda lead: case.input(lead, torch.float64),
        shared=False,
        steps=1,
        input_requires_grad=case.input_requires_grad,
    )


@case_param
def test_compile_fullgraph(case: LayerCase) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = case.build(3, torch.float64)
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
    x = case.input((3, 4), torch.float64)
    y_eager, y_compiled = eager(x.clone()), compiled(x.clone())
    assert_close(y_compiled, y_eager, msg="compiled output")
    if y_eager.requires_grad:
        g = torch.randn_like(y_eager)
        y_eager.backward(g)
        y_compiled.backward(g)
        for (name, p), q in zip(eager.named_parameters(), compiled_copy.parameters()):
            if p.grad is not None:
                assert_close(q.grad, p.grad, msg=f"compiled gradient of {name}")
    for (name, b), c in zip(eager.named_buffers(), compiled_copy.buffers()):
        assert_close(c, b, msg=f"compiled buffer {name}")


@case_param
def test_extra_repr_starts_with_num_models(case: LayerCase) -> None:
    assert case.batched(3, torch.float32).extra_repr().startswith("num_models=3")


@pytest.mark.parametrize("case,row", BAD_INPUTS, ids=[f"{c.id}-{r[0]}" for c, r in BAD_INPUTS])
def test_bad_input_raises(case: LayerCase, row) -> None:
    _, make_bad, exc, pattern = row
    batched = case.batched(3, torch.float32)
    with pytest.raises(exc, match=pattern):
        batched(make_bad(3, torch.float32))
