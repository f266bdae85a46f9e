"""Per-model losses against torch.nn.functional run on each model's slice, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from harness import RecordOps, assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from batchlayers import losses as BL
from batchlayers.linear import BatchedLinear

M, B, C = 3, 5, 4


def logits(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def class_target(*shape):
    return torch.randint(0, C, shape)


def probabilities(*shape):
    return torch.softmax(torch.randn(*shape, dtype=torch.float64), dim=2)


def assert_close_or_both_nan(actual: torch.Tensor, expected: torch.Tensor, *, msg: str = "") -> None:
    """:func:`assert_close` where NaN must stand exactly where torch has NaN."""
    assert torch.equal(actual.isnan(), expected.isnan()), f"{msg}: NaN elsewhere than torch's\n{actual}\n{expected}"
    assert_close(actual.nan_to_num(), expected.nan_to_num(), msg=msg)


def check_against_loop(batched_fn, torch_fn, input, target, *, equal_nan=False, **kwargs):
    """``batched_fn`` on (M, B, *) equals ``torch_fn`` per model, and the SUM of the (M,) vector gives each
    model's input exactly the gradient of its own loss (``equal_nan``: NaN where torch has NaN)."""
    compare = assert_close_or_both_nan if equal_nan else assert_close
    x = input.detach().clone().requires_grad_(True)
    losses = batched_fn(x, target, **kwargs)
    refs_x = [input[m].detach().clone().requires_grad_(True) for m in range(input.shape[0])]
    refs = [torch_fn(refs_x[m], target[m], **kwargs) for m in range(input.shape[0])]
    compare(losses, torch.stack(refs), msg="per-model losses")
    if kwargs.get("reduction", "mean") == "none":
        losses = losses.sum()
        refs = [r.sum() for r in refs]
    losses.sum().backward()
    for m, (rx, r) in enumerate(zip(refs_x, refs)):
        r.backward()
        compare(x.grad[m], rx.grad, msg=f"gradient of model {m}")


CLASSIFICATION = [
    ("plain", {}),
    ("weight", {"weight": torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)}),
    ("ignore", {"ignore_index": 7}),
    ("weight-ignore", {"weight": torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64), "ignore_index": 7}),
    ("sum", {"reduction": "sum", "ignore_index": 7}),
    ("none", {"reduction": "none"}),
]


@pytest.mark.parametrize("options", CLASSIFICATION, ids=[c[0] for c in CLASSIFICATION])
@pytest.mark.parametrize("spatial", [(), (2, 3)], ids=["flat", "spatial"])
@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
def test_classification_matches_loop(options, spatial, loss) -> None:
    torch.manual_seed(0)
    _, kwargs = options
    input = logits(M, B, C, *spatial)
    if loss == "nll_loss":
        input = torch.log_softmax(input, dim=2)
    target = class_target(M, B, *spatial)
    if "ignore_index" in kwargs:
        target[0, :2] = 7
        target[1, 0] = 7
    check_against_loop(getattr(BL, loss), getattr(F, loss), input, target, **kwargs)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("soft", [False, True], ids=["indices", "probabilities"])
def test_cross_entropy_label_smoothing_and_soft_targets(label_smoothing, weighted, soft) -> None:
    torch.manual_seed(0)
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64) if weighted else None
    target = probabilities(M, B, C) if soft else class_target(M, B)
    if not soft:
        target[2, 1] = -100
    check_against_loop(
        BL.cross_entropy, F.cross_entropy, logits(M, B, C), target, weight=weight, label_smoothing=label_smoothing
    )


ELEMENTWISE = [
    ("mse_loss", {}),
    ("mse_loss", {"reduction": "sum"}),
    ("l1_loss", {}),
    ("smooth_l1_loss", {"beta": 0.5}),
    ("huber_loss", {"delta": 0.7, "reduction": "none"}),
    ("binary_cross_entropy_with_logits", {"pos_weight": torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)}),
    ("binary_cross_entropy_with_logits", {"weight": torch.rand(B, C, dtype=torch.float64)}),
    ("binary_cross_entropy", {}),
    ("kl_div", {"reduction": "batchmean"}),
    ("kl_div", {"reduction": "sum", "log_target": True}),
]


@pytest.mark.parametrize("row", ELEMENTWISE, ids=[f"{name}-{'-'.join(kw)}" for name, kw in ELEMENTWISE])
@pytest.mark.parametrize("shared_target", [False, True], ids=["per_model", "shared"])
def test_elementwise_matches_loop(row, shared_target) -> None:
    torch.manual_seed(0)
    name, kwargs = row
    input = torch.randn(M, B, C, dtype=torch.float64)
    target = torch.rand(M, B, C, dtype=torch.float64)
    if name == "binary_cross_entropy":
        input = torch.sigmoid(input)
    if name == "kl_div":
        input = torch.log_softmax(input, -1)
        target = torch.log_softmax(target, -1) if kwargs.get("log_target") else torch.softmax(target, -1)
    if shared_target:
        target = target[0].expand(M, B, C)
    check_against_loop(getattr(BL, name), getattr(F, name), input, target, **kwargs)


def test_sum_trains_like_separate_models_and_mean_does_not() -> None:
    """Gradients of a batched model: losses.sum() gives each model its own mean-loss gradient; mean() / M."""
    torch.manual_seed(0)
    model = BatchedLinear(M, 6, C, dtype=torch.float64)
    x, y = torch.randn(M, B, 6, dtype=torch.float64), class_target(M, B)
    BL.cross_entropy(model(x), y).sum().backward()
    summed = model.weight.grad.clone()
    model.zero_grad()
    BL.cross_entropy(model(x), y).mean().backward()
    for m in range(M):
        ref = torch.nn.Linear(6, C, dtype=torch.float64)
        ref.load_state_dict({"weight": model.weight[m].detach(), "bias": model.bias[m].detach()})
        F.cross_entropy(ref(x[m]), y[m]).backward()
        assert_close(summed[m], ref.weight.grad, msg=f"model {m}, sum")
        assert_close(model.weight.grad[m] * M, ref.weight.grad, msg=f"model {m}, mean is 1/M of it")


def test_nonfinite_loss_does_not_reach_other_models() -> None:
    torch.manual_seed(0)
    model = BatchedLinear(M, 6, C, dtype=torch.float64)
    x, y = torch.randn(M, B, 6, dtype=torch.float64), class_target(M, B)
    x[1, 0, 0] = float("nan")
    losses = BL.cross_entropy(model(x), y)
    assert losses.isnan().tolist() == [False, True, False]
    losses.sum().backward()
    assert model.weight.grad[[0, 2]].isfinite().all() and not model.weight.grad[1].isfinite().all()


BAD = [
    ("ce-input-2d", BL.cross_entropy, lambda: (torch.randn(M, C), class_target(M)), ValueError, r"\(M, B, C, \*d\)"),
    (
        "ce-target-models",
        BL.cross_entropy,
        lambda: (torch.randn(M, B, C), class_target(M + 1, B)),
        ValueError,
        r"expected target class indices of shape \(3, 5\), got \(4, 5\)",
    ),
    (
        "ce-soft-shape",
        BL.cross_entropy,
        lambda: (torch.randn(M, B, C), torch.rand(M, B, C + 1)),
        ValueError,
        r"class probabilities of shape \(3, 5, 4\), got \(3, 5, 5\)",
    ),
    ("nll-float-target", BL.nll_loss, lambda: (torch.randn(M, B, C), torch.rand(M, B)), TypeError, "class indices"),
    (
        "mse-broadcast",
        BL.mse_loss,
        lambda: (torch.randn(M, B, 2), torch.randn(B, 2)),
        ValueError,
        r"mse_loss: expected target with the input's shape \(3, 5, 2\), got \(5, 2\)",
    ),
    ("mse-not-tensor", BL.mse_loss, lambda: ([1.0], torch.randn(M, B)), TypeError, "input to be a Tensor"),
    ("mse-1d", BL.mse_loss, lambda: (torch.randn(M), torch.randn(M)), ValueError, r"\(M, B, \*\)"),
    # no models: a clear error (was torch's reshape error, or a ZeroDivisionError for two classes)
    ("mse-no-models", BL.mse_loss, lambda: (torch.randn(0, B), torch.randn(0, B)), ValueError, r"M >= 1.*\(0, 5\)"),
    ("ce-no-models", BL.cross_entropy, lambda: (torch.randn(0, B, C), class_target(0, B)), ValueError, r"M >= 1"),
    ("ce2-no-models", BL.cross_entropy, lambda: (torch.randn(0, B, 2), class_target(0, B) % 2), ValueError, r"M >= 1"),
    ("nll-no-models", BL.nll_loss, lambda: (torch.randn(0, B, C), class_target(0, B)), ValueError, r"M >= 1"),
]


@pytest.mark.parametrize("row", BAD, ids=[r[0] for r in BAD])
def test_bad_inputs_raise(row) -> None:
    _, fn, make, exc, pattern = row
    with pytest.raises(exc, match=pattern):
        fn(*make())


def test_bad_reduction_raises() -> None:
    with pytest.raises(ValueError, match="reduction must be one of"):
        BL.mse_loss(torch.randn(M, B), torch.randn(M, B), reduction="batchmean")


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(1, 4),
    batch=st.integers(1, 4),
    classes=st.integers(2, 5),
    spatial=st.lists(st.integers(1, 3), max_size=2),
    weighted=st.booleans(),
    label_smoothing=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_random_cross_entropy_matches_loop(num_models, batch, classes, spatial, weighted, label_smoothing, seed):
    gen = torch.Generator().manual_seed(seed)
    input = torch.randn(num_models, batch, classes, *spatial, generator=gen, dtype=torch.float64)
    target = torch.randint(0, classes, (num_models, batch, *spatial), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.2] = -100
    target.view(num_models, -1)[:, 0] = 0  # every model keeps a counted target (else 0/0 in both)
    weight = torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1 if weighted else None
    losses = BL.cross_entropy(input, target, weight=weight, label_smoothing=label_smoothing)
    expected = torch.stack(
        [
            F.cross_entropy(input[m], target[m], weight=weight, label_smoothing=label_smoothing)
            for m in range(num_models)
        ]
    )
    assert_close(losses, expected, msg="cross_entropy")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True], ids=["all-counted", "ignore_index"])
@pytest.mark.parametrize(
    "spatial,dtype",
    [((), torch.long), ((3,), torch.long), ((), torch.uint8)],  # torch takes uint8 targets without spatial dims
    ids=["flat", "spatial", "flat-uint8"],
)
def test_two_class_cross_entropy_formula_matches_loop(reduction, ignore, spatial, dtype) -> None:
    """Two classes take a direct formula on CPU (logaddexp - picked logit): same values and gradients."""
    torch.manual_seed(0)
    input = logits(M, B, 2, *spatial)
    target = torch.randint(0, 2, (M, B, *spatial)).to(dtype)
    ignore_index = -100 if dtype == torch.long else 255
    if ignore:
        target[0, :2] = ignore_index
    check_against_loop(BL.cross_entropy, F.cross_entropy, input, target, reduction=reduction, ignore_index=ignore_index)


# (forward-mode AD's first use in a process registers torch's jit decompositions, which warn)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["vmap-grad", "forward-ad"])
def test_two_class_cross_entropy_under_torch_func_transforms(transform) -> None:
    """Under a torch.func transform or forward-mode AD two classes take torch's path (the formula's Functions
    have no vmap or jvp rule, and raised there): per-sample gradients and a forward-mode derivative equal
    torch's cross entropy model by model."""
    torch.manual_seed(0)
    input = logits(M, B, 2)
    target = torch.randint(0, 2, (M, B))
    if transform == "vmap-grad":

        def loss(x, t):  # one sample per model: (M, 2), (M,)
            return BL.cross_entropy(x.unsqueeze(1), t.unsqueeze(1)).sum()

        got = torch.func.vmap(torch.func.grad(loss), in_dims=(1, 1))(input, target)  # (B, M, 2)
        for m in range(M):
            expected = torch.stack(
                [torch.func.grad(lambda x, m=m, i=i: F.cross_entropy(x, target[m, i : i + 1]))(input[m, i : i + 1])
                 for i in range(B)]
            )  # fmt: skip
            assert_close(got[:, m], expected.squeeze(1), msg=f"per-sample gradients of model {m}")
    else:
        tangent = torch.randn_like(input)
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(input.clone().requires_grad_(), tangent)  # (recorded for backward too)
            got = forward_ad.unpack_dual(BL.cross_entropy(dual, target)).tangent
            for m in range(M):
                own = F.cross_entropy(forward_ad.make_dual(input[m].clone(), tangent[m]), target[m])
                assert_close(got[m], forward_ad.unpack_dual(own).tangent, msg=f"tangent of model {m}")


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_two_class_cross_entropy_reduces_in_one_node_exactly_when_every_target_counts(dtype, reduction) -> None:
    """All targets 0 or 1: one node computes and reduces the loss. An ignored target takes the general path,
    which masks it (a target out of range: see the test below)."""
    torch.manual_seed(0)
    input = logits(M, B, 2).requires_grad_(True)
    target = torch.randint(0, 2, (M, B)).to(dtype)
    counted = BL.cross_entropy(input, target, reduction=reduction)
    assert type(counted.grad_fn).__name__ == "_TwoClassCrossEntropyReducedBackward"
    target[1, 0] = 7
    ignored = BL.cross_entropy(input, target, reduction=reduction, ignore_index=7)
    assert type(ignored.grad_fn).__name__ != "_TwoClassCrossEntropyReducedBackward"
    expected = F.cross_entropy(input[1], target[1].long(), reduction=reduction, ignore_index=7)
    assert_close(ignored[1], expected, msg="model 1, one target ignored")


@pytest.mark.parametrize("spatial", [(), (3,)], ids=["flat", "spatial"])
def test_two_class_cross_entropy_reads_a_shared_target_once(spatial) -> None:
    """Targets shared by every model (a stride-0 expand) are looked up once, never copied M times; the
    losses and gradients equal those of M copies."""
    torch.manual_seed(0)
    input = logits(M, B, 2, *spatial)
    shared = torch.randint(0, 2, (B, *spatial)).expand(M, B, *spatial)
    results = []
    for target in (shared, shared.contiguous()):
        x = input.clone().requires_grad_(True)
        with RecordOps() as ops:
            loss = BL.cross_entropy(x, target)
        loss.sum().backward()
        results.append((loss, x.grad, ops.ops))
    assert_close(results[0][0], results[1][0], msg="losses")
    assert_close(results[0][1], results[1][1], msg="gradients")
    copies = [(name, numel) for name, _, numel in results[0][2] if name in ("aten.clone.default", "aten.copy_.default")]
    assert not copies, copies
    check_against_loop(BL.cross_entropy, F.cross_entropy, input, shared)


@pytest.mark.parametrize("bad", [2, -1])
def test_two_class_cross_entropy_refuses_targets_out_of_range(bad) -> None:
    input, target = logits(M, B, 2), torch.zeros(M, B, dtype=torch.long)
    target[1, 2] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(input[1], target[1])  # what torch says
    with pytest.raises(IndexError, match=rf"target {bad} of model 1 at position \(2,\) is out of range for C=2"):
        BL.cross_entropy(input, target)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "spatial,dtype",
    [((), torch.long), ((3,), torch.long), ((), torch.uint8)],  # torch takes uint8 targets without spatial dims
    ids=["flat", "spatial", "flat-uint8"],
)
@pytest.mark.parametrize("ignore_index", [0, 1])
def test_two_class_cross_entropy_ignores_a_class_given_as_ignore_index(ignore_index, spatial, dtype, reduction) -> None:
    """``ignore_index`` 0 or 1 is a real class: torch skips every target of that class, so must we (also
    when every target is 0 or 1, the case that otherwise counts every target in one node)."""
    torch.manual_seed(0)
    target = torch.randint(0, 2, (M, B, *spatial)).to(dtype)
    target[:, 0] = 1 - ignore_index  # every model keeps a counted target (else 0/0 in both)
    check_against_loop(
        BL.cross_entropy,
        F.cross_entropy,
        logits(M, B, 2, *spatial),
        target,
        reduction=reduction,
        ignore_index=ignore_index,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True], ids=["all-counted", "ignore_index"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_class_cross_entropy_under_autocast_follows_torch(dtype, ignore, reduction) -> None:
    """CPU autocast runs torch's cross_entropy in float32 (it is on autocast's float32 list): the two-class
    formula must too, returning float32 losses and gradients of the low-precision logits' dtype."""
    torch.manual_seed(0)
    target = torch.randint(0, 2, (M, B))
    if ignore:
        target[0, :2] = -100
    with torch.autocast("cpu", dtype=dtype):
        check_against_loop(BL.cross_entropy, F.cross_entropy, logits(M, B, 2, dtype=dtype), target, reduction=reduction)


def _gradient_penalty_grad(loss_fn, weight, features, target, **kwargs):
    """d(loss + ||d loss / d features||^2) / d weight: the loss's input gradient differentiated again."""
    loss = loss_fn(features @ weight, target, **kwargs).sum()
    (by_features,) = torch.autograd.grad(loss, features, create_graph=True)
    (by_weight,) = torch.autograd.grad(loss + by_features.pow(2).sum(), weight)
    return by_weight


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, -100, 1], ids=["all-counted", "some-ignored", "ignore-class-1"])
def test_two_class_cross_entropy_double_backward_matches_loop(ignore_index, reduction) -> None:
    """A gradient penalty differentiates the two-class formula's hand-written backward: with
    ``create_graph=True`` it must be exactly torch's second derivative, never a silently constant gradient."""
    torch.manual_seed(0)
    features = torch.randn(M, B, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(M, 4, 2, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 2, (M, B))
    target[:, 0] = 0  # every model keeps a counted target
    kwargs = {"reduction": reduction}
    if ignore_index is not None:
        kwargs["ignore_index"] = ignore_index
        target[0, 1:3] = ignore_index
    batched = _gradient_penalty_grad(BL.cross_entropy, weight, features, target, **kwargs)
    for m in range(M):
        expected = _gradient_penalty_grad(
            F.cross_entropy,
            weight[m].detach().requires_grad_(True),
            features[m].detach().requires_grad_(True),
            target[m],
            **kwargs,
        )
        assert_close(batched[m], expected, msg=f"penalised gradient of model {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_two_class_cross_entropy_model_with_every_target_ignored(ignore_index, reduction) -> None:
    """A model whose targets are all ignored: torch's 'mean' is 0/0 = NaN, but its gradient is 0, and the
    other models are untouched."""
    torch.manual_seed(0)
    target = torch.randint(0, 2, (M, B))
    target[:, 0] = 1
    target[1] = ignore_index
    check_against_loop(
        BL.cross_entropy,
        F.cross_entropy,
        logits(M, B, 2),
        target,
        equal_nan=True,
        reduction=reduction,
        ignore_index=ignore_index,
    )


INF = float("inf")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_two_class_cross_entropy_infinite_logits_follow_torch(ignore_index, reduction) -> None:
    """A +inf logit makes torch's loss and gradient NaN (a diverged model must not look finite); a -inf
    logit alone does not. Every row ``(x_0, x_1, target)`` below, and the models without one, as torch."""
    rows = [
        (INF, 0.0, 0),
        (INF, 0.0, 1),
        (0.0, INF, 0),
        (INF, -INF, 1),
        (-INF, 0.0, 0),
        (-INF, 0.0, 1),
        (0.0, -INF, 0),
        (-INF, -INF, 1),
        (INF, 1.0, -100),  # ignored (when ignore_index is -100): torch's gradient is NaN even so
    ]
    torch.manual_seed(0)
    input = logits(len(rows) + 1, B, 2)
    target = torch.randint(0, 2, (len(rows) + 1, B))
    target[:, 0] = 0
    for m, (x0, x1, t) in enumerate(rows):
        input[m, 1, 0], input[m, 1, 1], target[m, 1] = x0, x1, t if t != -100 else ignore_index
    check_against_loop(
        BL.cross_entropy, F.cross_entropy, input, target, equal_nan=True, reduction=reduction, ignore_index=ignore_index
    )


# batchlayers' C kernels for two classes (``_losses_native.c``, ``bl.backends.cpu.native_losses``).


def count_native_kernel_calls(monkeypatch) -> list[str]:
    """The directions (``forward``, ``backward``) whose C kernel the two-class path called, in order; a forward
    that declined (a target not 0 or 1, a difference of logits not finite) as ``forward declined``."""
    calls: list[str] = []
    found = BL._native_kernel

    def counting(direction, dtype):
        kernel = found(direction, dtype)
        if kernel is None:
            return None

        def call(*args):
            declined = kernel(*args)
            calls.append(f"{direction} declined" if declined else direction)
            return declined

        return call

    monkeypatch.setattr(BL, "_native_kernel", counting)
    return calls


def transposed_logits(m, b):
    return logits(m, 2, b).transpose(1, 2)  # (M, B, 2) whose rows are not contiguous


BOTH, BACKWARD, DECLINED = ["forward", "backward"], ["backward"], ["forward declined"]
NATIVE_CASES = [
    # (id, logits, target, reduction, the kernels that run: the backward's also after the formula's forward)
    ("mean", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (M, B)), "mean", BOTH),
    ("sum", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (M, B)), "sum", BOTH),
    ("shared-target", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (B,)).expand(M, B), "mean", BOTH),
    ("float32", lambda: logits(M, B, 2, dtype=torch.float32), lambda: torch.randint(0, 2, (M, B)), "mean", BOTH),
    ("one-sample", lambda: logits(M, 1, 2), lambda: torch.randint(0, 2, (M, 1)), "mean", BOTH),
    ("uint8-target", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (M, B), dtype=torch.uint8), "mean", BACKWARD),
    ("strided-rows", lambda: transposed_logits(M, B), lambda: torch.randint(0, 2, (M, B)), "mean", BACKWARD),
    ("strided-target", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (B, M)).t(), "sum", BACKWARD),
    # (the formula's probabilities then follow the logits' layout, not contiguous: torch's ops backward too)
    ("models-inner", lambda: logits(B, M, 2).transpose(0, 1), lambda: torch.randint(0, 2, (M, B)), "mean", []),
    # sizes that coincide (models = samples = classes = 2): read by strides, never guessed from sizes
    ("all-two", lambda: logits(2, 2, 2), lambda: torch.randint(0, 2, (2, 2)), "mean", BOTH),
    ("all-two-transposed", lambda: logits(2, 2, 2).transpose(0, 1), lambda: torch.randint(0, 2, (2, 2)), "sum", []),
    ("all-two-target-transposed", lambda: logits(2, 2, 2), lambda: torch.randint(0, 2, (2, 2)).t(), "mean", BACKWARD),
    ("none", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (M, B)), "none", []),
    ("spatial", lambda: logits(M, B, 2, 3), lambda: torch.randint(0, 2, (M, B, 3)), "mean", []),
    ("target-ignored", lambda: logits(M, B, 2), lambda: torch.tensor([[0, 1, -100, 1, 0]] * M), "mean", DECLINED),
]  # fmt: skip


@pytest.mark.parametrize("case", NATIVE_CASES, ids=[c[0] for c in NATIVE_CASES])
def test_two_class_native_kernels_run_where_they_apply(case, monkeypatch) -> None:
    """int64 targets 0 or 1, ``(B, 2)`` rows contiguous, reduced per model: the C kernels compute the loss and
    its gradient (the backward's also the formula's gradient); elsewhere torch's ops. All equal torch's cross
    entropy model by model."""
    _, make_logits, make_target, reduction, kernels = case
    torch.manual_seed(0)
    input, target = make_logits(), make_target()
    calls = count_native_kernel_calls(monkeypatch)
    check_against_loop(BL.cross_entropy, F.cross_entropy, input, target, reduction=reduction)
    assert calls == kernels, calls


UNREADABLE = [
    ("meta-target", lambda: logits(M, B, 2), lambda: torch.zeros(M, B, dtype=torch.long, device="meta")),
    ("sparse-target", lambda: logits(M, B, 2), lambda: torch.randint(0, 2, (M, B)).to_sparse()),
    ("sparse-target-one-sample", lambda: logits(M, 1, 2), lambda: torch.randint(0, 2, (M, 1)).to_sparse()),
    ("sparse-logits", lambda: logits(M, B, 2).to_sparse(), lambda: torch.randint(0, 2, (M, B))),
    # negative views: their memory holds the values' negatives (targets 0 and -1 here, which torch refuses)
    ("negative-target", lambda: logits(M, B, 2), lambda: torch._neg_view(torch.randint(0, 2, (M, B)))),
    ("negative-logits", lambda: torch._neg_view(logits(M, B, 2)), lambda: torch.randint(0, 2, (M, B))),
]


def _outcome(fn):
    try:
        return "result", fn()
    except Exception as error:  # (what torch's ops raise, compared below)
        return "error", f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("case", UNREADABLE, ids=[c[0] for c in UNREADABLE])
def test_two_class_native_kernel_never_reads_what_it_cannot(case, monkeypatch) -> None:
    """The kernel reads memory by address: a meta target (address 0: a crash once), a sparse one or sparse
    logits, and negative views never reach it, and the call does what it does without the kernel."""
    _, make_logits, make_target = case
    torch.manual_seed(0)
    input, target = make_logits(), make_target()
    calls = count_native_kernel_calls(monkeypatch)
    with_kernel = _outcome(lambda: BL.cross_entropy(input, target))
    monkeypatch.setattr(BL, "native_kernel", False)
    without = _outcome(lambda: BL.cross_entropy(input, target))
    assert calls == [], calls
    assert with_kernel[0] == without[0], (with_kernel, without)
    if with_kernel[0] == "error":
        assert with_kernel[1] == without[1]
    else:
        torch.testing.assert_close(with_kernel[1], without[1], rtol=0, atol=0)


def test_two_class_native_backward_declines_a_negative_gradient(monkeypatch) -> None:
    """An output gradient given as a negative view (its memory holds the values' negatives) goes to torch's
    ops, with torch's cross entropy's input gradient."""
    torch.manual_seed(0)
    input, target = logits(M, B, 2), torch.randint(0, 2, (M, B))
    grad = torch.randn(M, dtype=input.dtype)
    calls = count_native_kernel_calls(monkeypatch)
    x = input.clone().requires_grad_()
    BL.cross_entropy(x, target).backward(torch._neg_view(-grad))  # (the values of grad)
    assert calls == ["forward"], calls
    for m in range(M):
        xm = input[m].clone().requires_grad_()
        (F.cross_entropy(xm, target[m]) * grad[m]).backward()
        torch.testing.assert_close(x.grad[m], xm.grad, rtol=1e-10, atol=1e-10)


def test_two_class_native_kernel_declines_rows_apart(monkeypatch) -> None:
    """Logits ``(M, B, 2)`` sliced from wider rows (each pair contiguous, pairs 3 apart): the forward kernel
    declines (it reads pairs 2 apart); the formula's gradient is contiguous, so the backward kernel writes
    it. The gradient reaches the wider tensor's first two columns, as torch's."""
    torch.manual_seed(0)
    wide, target = logits(M, B, 3).requires_grad_(True), torch.randint(0, 2, (M, B))
    calls = count_native_kernel_calls(monkeypatch)
    BL.cross_entropy(wide[..., :2], target).sum().backward()
    assert calls == ["backward"], calls
    for m in range(M):
        own = wide[m].detach().requires_grad_(True)
        expected = F.cross_entropy(own[:, :2], target[m])
        expected.backward()
        assert_close(wide.grad[m], own.grad, msg=f"gradient of model {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_two_class_native_kernels_equal_the_formula(reduction, monkeypatch) -> None:
    """float64: the kernels give the formula's values and gradients to rounding, also for a gradient that
    differs by model (a weighted sum of the losses) and for logits shared by every model (a stride-0 expand,
    whose gradient sums the models')."""
    torch.manual_seed(0)
    base = logits(1, 64, 2).requires_grad_(True)
    input = logits(M, 64, 2).requires_grad_(True)
    target = torch.randint(0, 2, (M, 64))
    weights = torch.rand(M, dtype=torch.float64) + 0.5
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(BL, "native_kernel", enabled)
        calls = count_native_kernel_calls(monkeypatch)
        losses = BL.cross_entropy(input, target, reduction=reduction)
        shared = BL.cross_entropy(base.expand(M, 64, 2), target, reduction=reduction)
        (by_input,) = torch.autograd.grad((losses * weights).sum(), input)
        (by_base,) = torch.autograd.grad((shared * weights).sum(), base)
        assert calls == (["forward", "forward", "backward", "backward"] if enabled else []), calls
        results.append((losses, by_input, shared, by_base))
    for name, got, expected in zip(["losses", "gradient", "shared losses", "shared gradient"], *results):
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=0, msg=name)
    for m in range(M):
        x, xs = input[m].detach().requires_grad_(True), base[0].detach().requires_grad_(True)
        own, own_shared = (F.cross_entropy(t, target[m], reduction=reduction) for t in (x, xs))
        (own * weights[m]).backward()
        assert_close(results[0][0][m], own, msg=f"loss of model {m}")
        assert_close(results[0][1][m], x.grad, msg=f"gradient of model {m}")
        assert_close(results[0][2][m], own_shared, msg=f"shared logits: loss of model {m}")
    expected_base = sum(
        torch.autograd.grad(F.cross_entropy(base[0], target[m], reduction=reduction) * weights[m], base)[0]
        for m in range(M)
    )
    assert_close(results[0][3], expected_base, msg="shared logits: gradient summed over the models")


def test_two_class_native_float32_is_accurate_over_the_whole_logit_range(monkeypatch) -> None:
    """float32 computes exp and log1p with polynomials of its own: over differences of the logits from -110 to
    110 (sigmoid subnormal at one end, softplus past its linear threshold at the other) the losses and
    gradients are within a few float32 ulp of the exact values: the formula in float64 on the same logits,
    ``softplus(z)`` and ``sign * sigmoid(z)`` (torch's float64 cross entropy rounds ``p - 1`` where p is near
    1, so it is no reference for the smallest gradients)."""
    torch.manual_seed(0)
    difference = torch.cat([torch.linspace(-110, 110, 20000), torch.randn(4000) * 8])
    input = torch.stack([torch.randn_like(difference), torch.empty_like(difference)], dim=-1)
    input[:, 1] = input[:, 0] + difference
    calls = count_native_kernel_calls(monkeypatch)
    # one sample a model (every loss seen alone), and 6000 (a model's sum, accumulated in float64)
    for batch, reduction in ((1, "sum"), (6000, "sum"), (6000, "mean")):
        x = input.detach().view(-1, batch, 2).requires_grad_(True)
        target = torch.randint(0, 2, x.shape[:2])
        sign = 1.0 - 2.0 * target.double()
        z = (x[..., 1] - x[..., 0]).detach().double() * sign  # (the difference rounded to float32, as torch's)
        scale = 1.0 / batch if reduction == "mean" else 1.0
        loss = BL.cross_entropy(x, target, reduction=reduction)
        (grad,) = torch.autograd.grad(loss.sum(), x)
        expected = F.softplus(z, threshold=1000.0).sum(dim=1) * scale
        by_second = sign * torch.sigmoid(z) * scale
        # each to 3 ulp (subnormal floats to a few of their spacings, 1.4e-45)
        torch.testing.assert_close(loss.double(), expected, rtol=4e-7, atol=1e-44, msg=f"{batch}: losses")
        for got, exact in ((grad[..., 1], by_second), (grad[..., 0], -by_second)):
            torch.testing.assert_close(got.double(), exact, rtol=4e-7, atol=1e-44, msg=f"{batch}: gradient")
    assert calls == ["forward", "backward"] * 3, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [INF, -INF, float("nan")])
def test_two_class_native_kernel_declines_logits_that_are_not_finite(bad, dtype, monkeypatch) -> None:
    """An infinite or NaN logit anywhere: the forward kernel declines and torch's ops decide (a +inf logit
    makes torch's loss and gradient NaN, a -inf one alone does not), every model as torch."""
    torch.manual_seed(0)
    input, target = logits(M, B, 2, dtype=dtype), torch.randint(0, 2, (M, B))
    input[1, 2, int(target[1, 2])] = bad
    calls = count_native_kernel_calls(monkeypatch)
    check_against_loop(BL.cross_entropy, F.cross_entropy, input, target, equal_nan=True)
    assert calls[0] == "forward declined", calls


def test_two_class_native_kernels_off_or_unavailable(monkeypatch) -> None:
    """``bl.backends.cpu.native_losses = False``, or no C compiler: torch's ops, the same results."""
    import batchlayers as bl
    from batchlayers import _native

    with pytest.raises(TypeError, match="native_losses must be True or False"):
        bl.backends.cpu.native_losses = 1
    torch.manual_seed(0)
    input, target = logits(M, B, 2), torch.randint(0, 2, (M, B))
    calls = count_native_kernel_calls(monkeypatch)
    try:
        bl.backends.cpu.native_losses = False
        assert BL.native_kernel is False and bl.backends.cpu.native_losses is False
        check_against_loop(BL.cross_entropy, F.cross_entropy, input, target)
    finally:
        bl.backends.cpu.native_losses = True
    monkeypatch.setattr(_native, "library", lambda: None)
    check_against_loop(BL.cross_entropy, F.cross_entropy, input, target)
    assert calls == [], calls
