"""batchlayers.optim against M independent torch.optim runs, one per model slice."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import tempfile

import pytest
import torch
from harness import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from batchlayers import backends
from batchlayers import losses as BL
from batchlayers import optim as _base_optim
from batchlayers.clip_grad import clip_grad_norm_, nonfinite_models
from batchlayers.linear import BatchedLinear
from batchlayers.optim import SGD, Adam, AdamW, PerModelValue, RMSprop, _base, _native

SHAPES = [(4, 3), (3,), ()]  # one model's parameter shapes: a weight, a bias, a per-model scalar
M = 3


def per_model_value(value, m: int):
    return value[m].item() if isinstance(value, torch.Tensor) else value


def torch_kwargs(kwargs: dict, m: int) -> dict:
    """Model m's scalar hyperparameters for torch.optim."""
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, tuple):
            out[key] = tuple(per_model_value(v, m) for v in value)
        else:
            out[key] = per_model_value(value, m)
    return out


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Bit for bit (``-0.0 == 0.0``); the failure reports how many elements differ and by how much."""
    if not torch.equal(actual, expected):
        differ = actual != expected
        raise AssertionError(
            f"{msg}: {int(differ.sum())} of {actual.numel()} elements differ, largest difference "
            f"{(actual - expected).abs().max().item():.3g}"
        )


class Pair:
    """A batched optimizer over (M, *shape) parameters and M torch optimizers over the slices."""

    def __init__(self, batched_cls, torch_cls, kwargs, *, num_models=M, dtype=torch.float64, shapes=SHAPES, fused=None):
        self.num_models = num_models
        self.params = [torch.nn.Parameter(torch.randn(num_models, *s, dtype=dtype)) for s in shapes]
        self.opt = batched_cls(self.params, **kwargs, fused=fused)
        self.ref_params = [[torch.nn.Parameter(p[m].detach().clone()) for p in self.params] for m in range(num_models)]
        self.ref_opts = [torch_cls(ps, **torch_kwargs(kwargs, m)) for m, ps in enumerate(self.ref_params)]

    def step(self, grads=None, active=None):
        if grads is None:
            grads = [torch.randn_like(p) for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        self.opt.step(active=active)
        for m in range(self.num_models):
            if active is not None and not active[m]:
                continue
            for q, g in zip(self.ref_params[m], grads):
                q.grad = g[m].clone()
            self.ref_opts[m].step()

    def check(self, msg="", exact=True):
        """Each model's slice against its torch optimizer: bit for bit unless ``exact=False``."""
        for i, p in enumerate(self.params):
            expected = torch.stack([self.ref_params[m][i].detach() for m in range(self.num_models)])
            (assert_equal if exact else assert_close)(p.detach(), expected, msg=f"{msg} parameter {i}")


def tensor(*values):
    return torch.tensor(values, dtype=torch.float64)


CONFIGS = [
    (SGD, torch.optim.SGD, {"lr": tensor(0.1, 0.02, 0.3)}),
    (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": tensor(0.9, 0.0, 0.5), "dampening": tensor(0.1, 0.3, 0.0)}),
    (SGD, torch.optim.SGD, {"lr": tensor(0.1, 0.02, 0.3), "momentum": 0.9, "weight_decay": tensor(0.1, 0, 0.01)}),
    (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": tensor(0.9, 0.5, 0.1), "nesterov": True, "maximize": True}),
    (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.1}),
    (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2)}),
    (Adam, torch.optim.Adam, {"lr": 1e-2, "betas": (tensor(0.9, 0.5, 0.0), tensor(0.999, 0.9, 0.5))}),
    (Adam, torch.optim.Adam, {"lr": 1e-2, "eps": tensor(1e-8, 1e-3, 1.0), "weight_decay": tensor(0, 0.1, 0.5)}),
    (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2), "amsgrad": True, "maximize": True}),
    (AdamW, torch.optim.AdamW, {"lr": tensor(1e-2, 1e-3, 3e-2), "weight_decay": tensor(0.1, 0.0, 0.5)}),
    (AdamW, torch.optim.AdamW, {"lr": 1e-2, "betas": (0.8, tensor(0.99, 0.9, 0.5)), "amsgrad": True}),
    (RMSprop, torch.optim.RMSprop, {"lr": tensor(1e-2, 1e-3, 3e-2), "alpha": tensor(0.99, 0.5, 0.9)}),
    (RMSprop, torch.optim.RMSprop, {"lr": 1e-2, "momentum": tensor(0.9, 0.0, 0.5), "weight_decay": 0.1}),
    (RMSprop, torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "eps": tensor(1e-8, 1e-2, 1.0), "maximize": True}),
]


def config_id(config) -> str:
    cls, _, kwargs = config
    return cls.__name__ + "-" + "-".join(k for k in kwargs)


@pytest.mark.parametrize("config", CONFIGS, ids=[config_id(c) for c in CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
# A per-model scale multiplies the whole tensor first, or each model's slice takes it as a float (large
# slices), or both in one step (the (4, 3) weights sliced, the rest whole).
@pytest.mark.parametrize("sliced_from", [1 << 16, 0, 12], ids=["whole", "sliced", "mixed"])
def test_matches_torch_optim(config, dtype, sliced_from, monkeypatch) -> None:
    monkeypatch.setattr(_base, "SLICED_SCALE_MIN_NUMEL", sliced_from)
    torch.manual_seed(0)
    pair = Pair(*config, dtype=dtype)
    for step in range(5):
        pair.step()
        pair.check(f"step {step}")


@pytest.mark.parametrize("config", CONFIGS[1::3], ids=[config_id(c) for c in CONFIGS[1::3]])
def test_active_mask_matches_skipping_models(config) -> None:
    torch.manual_seed(0)
    pair = Pair(*config)
    masks = [[False, True, True], [True, True, False], [True, False, True], [False, False, False], [True] * 3]
    for step, mask in enumerate(masks):
        before = [p.detach().clone() for p in pair.params]
        state_before = copy.deepcopy(pair.opt.state_dict()["state"])
        active = torch.tensor(mask)
        pair.step(active=active)
        pair.check(f"step {step}, active {mask}")
        for m in (~active).nonzero().flatten().tolist():
            for p, old in zip(pair.params, before):
                assert torch.equal(p[m], old[m]), f"inactive model {m} changed"
            for i, state in pair.opt.state_dict()["state"].items():
                for key, value in state.items():
                    old = state_before.get(i, {}).get(key)
                    if old is not None:
                        assert torch.equal(value[m], old[m]), f"inactive model {m}: state {key} changed"


@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[8], CONFIGS[12]], ids=config_id)
def test_nonfinite_gradient_stays_in_its_model(config) -> None:
    torch.manual_seed(0)
    pair = Pair(*config)
    pair.step()
    grads = [torch.randn_like(p) for p in pair.params]
    grads[0][1, 0, 0] = float("nan")
    grads[1][1, 2] = float("inf")
    pair.step(grads)
    pair.step()
    pair.step()
    for i, p in enumerate(pair.params):
        expected = torch.stack([pair.ref_params[m][i].detach() for m in range(M)])
        keep = torch.tensor([0, 2])
        assert_close(p.detach()[keep], expected[keep], msg=f"healthy models, parameter {i}")
    assert not pair.params[0][1].isfinite().all()


@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[8], CONFIGS[10], CONFIGS[13]], ids=config_id)
def test_state_dict_resume_is_exact(config) -> None:
    torch.manual_seed(0)
    batched_cls, _, kwargs = config
    params = [torch.nn.Parameter(torch.randn(M, *s, dtype=torch.float64)) for s in SHAPES]
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = batched_cls(params, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def run(optimizer, sched, ps, steps):
        for gs in steps:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            optimizer.step()
            sched.step()

    run(opt, scheduler, params, grads[:3])
    buffer = io.BytesIO()
    checkpoint = {"params": [p.detach() for p in params], "opt": opt.state_dict(), "sched": scheduler.state_dict()}
    torch.save(checkpoint, buffer)
    run(opt, scheduler, params, grads[3:])

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    with torch.no_grad():
        for p, saved in zip(twin, checkpoint["params"]):
            p.copy_(saved)
    resumed = batched_cls(twin, **kwargs)
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(resumed, step_size=2, gamma=0.5)
    resumed.load_state_dict(checkpoint["opt"])
    resumed_scheduler.load_state_dict(checkpoint["sched"])
    assert isinstance(resumed.param_groups[0]["lr"], type(opt.param_groups[0]["lr"]))
    run(resumed, resumed_scheduler, twin, grads[3:])
    for p, q in zip(params, twin):
        assert torch.equal(p, q), "resumed run differs from the uninterrupted one"
    for key in ("lr", "betas", "momentum"):
        if key in opt.param_groups[0]:
            assert str(opt.param_groups[0][key]) == str(resumed.param_groups[0][key])


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-3),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch)),
    "LinearLR": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3),
    "Sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7),
        ],
        milestones=[2],
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("per_model_lr", [True, False], ids=["tensor_lr", "float_lr"])
def test_lr_scheduler_matches_per_model_torch_schedulers(name, per_model_lr) -> None:
    torch.manual_seed(0)
    lr = tensor(0.1, 0.02, 0.3) if per_model_lr else 0.1
    user_lr = lr.clone() if per_model_lr else lr
    pair = Pair(Adam, torch.optim.Adam, {"lr": lr})
    scheduler = SCHEDULERS[name](pair.opt)
    ref_schedulers = [SCHEDULERS[name](opt) for opt in pair.ref_opts]
    for step in range(7):
        pair.step()
        scheduler.step()
        for s in ref_schedulers:
            s.step()
        expected = [opt.param_groups[0]["lr"] for opt in pair.ref_opts]
        got = pair.opt.param_groups[0]["lr"]
        if per_model_lr:
            assert_close(got.as_subclass(torch.Tensor), tensor(*expected), msg=f"lr after step {step}")
        else:
            assert got == pytest.approx(expected[0], rel=1e-12)
        pair.check(f"step {step}")
    if per_model_lr:
        assert torch.equal(lr, user_lr), "the user's lr tensor was changed"


def test_per_model_value_is_plain_tensor_apart_from_fill() -> None:
    params = [torch.nn.Parameter(torch.randn(M, 2))]
    opt = SGD(params, lr=tensor(0.1, 0.2, 0.3))
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, PerModelValue) and lr.dtype == torch.float64
    assert type(lr * 2) is torch.Tensor
    lr.fill_(tensor(1.0, 2.0, 3.0))
    assert lr.tolist() == [1.0, 2.0, 3.0]
    lr.fill_(0.5)
    assert lr.tolist() == [0.5] * 3
    with pytest.raises(ValueError, match="shape"):
        lr.fill_(tensor(1.0, 2.0))
    clone = pickle.loads(pickle.dumps(opt))
    assert isinstance(clone.param_groups[0]["lr"], PerModelValue)
    assert isinstance(copy.deepcopy(opt).param_groups[0]["lr"], PerModelValue)


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v.fill_(tensor(4.0, 5.0, 6.0)),
        lambda v: v.set_(tensor(7.0, 8.0, 9.0)),  # (other memory)
        lambda v: v.set_(v.untyped_storage(), 0, (3,), (0,)),  # (the same memory, other strides)
        lambda v: v.resize_(5).copy_(torch.arange(5.0)),
        lambda v: setattr(v, "data", torch.arange(3, dtype=torch.float32)),
    ],
    ids=["fill", "set-other-memory", "set-other-strides", "resize", "data-other-dtype"],
)
def test_a_per_model_values_plain_alias_follows_every_change(change) -> None:
    """The optimizers read a per-model value through ``PerModelValue.plain()``, an alias kept between steps:
    after any change to the value, in place or of its memory, the alias holds the value's numbers, dtype and
    shape."""
    value = tensor(1.0, 2.0, 3.0).as_subclass(PerModelValue)
    value.plain()
    change(value)
    plain = value.plain()
    assert type(plain) is torch.Tensor and plain.dtype == value.dtype and plain.shape == value.shape
    assert plain.tolist() == value.tolist()


def test_groups_do_not_share_hyperparameter_tensors() -> None:
    a, b = torch.nn.Parameter(torch.randn(M, 2)), torch.nn.Parameter(torch.randn(M, 3))
    lr = tensor(0.1, 0.2, 0.3)
    opt = Adam([{"params": [a]}, {"params": [b]}], lr=lr)
    opt.param_groups[0]["lr"][0] = 5.0
    assert opt.param_groups[1]["lr"][0].item() == 0.1 and lr[0].item() == 0.1


BAD_ARGUMENTS = [
    ("lr-shape", SGD, {"lr": tensor(0.1, 0.2)}, ValueError, r"lr must be a float or a tensor of shape \(M,\) = \(3,\)"),
    ("lr-negative", SGD, {"lr": tensor(0.1, -0.2, 0.1)}, ValueError, r"invalid lr \[-0.2\]"),
    ("lr-nan", Adam, {"lr": float("nan")}, ValueError, "invalid lr"),
    ("beta-one", Adam, {"betas": (0.9, tensor(0.9, 1.0, 0.5))}, ValueError, r"invalid betas\[1\] \[1.0\]"),
    ("betas-triple", Adam, {"betas": (0.9, 0.99, 0.9)}, ValueError, "betas must be a pair"),
    ("nesterov", SGD, {"momentum": tensor(0.9, 0.0, 0.5), "nesterov": True}, ValueError, "Nesterov"),
    ("bool", SGD, {"lr": torch.tensor([True, False, True])}, TypeError, "real tensor"),
    ("fused", Adam, {"fused": "yes"}, ValueError, "fused must be None, False or True, got 'yes'"),
    ("differentiable", RMSprop, {"differentiable": True}, ValueError, "differentiable=True"),
]


@pytest.mark.parametrize("row", BAD_ARGUMENTS, ids=[r[0] for r in BAD_ARGUMENTS])
def test_bad_arguments_raise(row) -> None:
    _, cls, kwargs, exc, pattern = row
    with pytest.raises(exc, match=pattern):
        cls([torch.nn.Parameter(torch.randn(M, 2))], **kwargs)


def test_bad_step_calls_raise() -> None:
    params = [torch.nn.Parameter(torch.randn(M, 2))]
    params[0].grad = torch.ones_like(params[0])
    opt = SGD(params, lr=tensor(0.1, 0.2, 0.3))
    with pytest.raises(ValueError, match=r"active must have shape \(M,\) = \(3,\), got \(2,\)"):
        opt.step(active=torch.tensor([True, False]))
    with pytest.raises(TypeError, match="active must be a bool tensor"):
        opt.step(active=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="same number of models"):
        SGD([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, 2))])
    opt.param_groups[0]["lr"] = tensor(0.1, 0.2)
    with pytest.raises(ValueError, match="keep_models_"):
        opt.step()


@settings(max_examples=25, deadline=None)
@given(
    num_models=st.integers(1, 4),
    which=st.sampled_from(["SGD", "Adam", "AdamW", "RMSprop"]),
    flags=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_random_hyperparameters_match_torch(num_models, which, flags, seed) -> None:
    gen = torch.Generator().manual_seed(seed)

    def rand(low, high):
        return (torch.rand(num_models, generator=gen, dtype=torch.float64) * (high - low) + low).clone()

    first, second = bool(flags & 1), bool(flags & 2)
    if which == "SGD":
        kwargs = {"lr": rand(0, 0.3), "momentum": rand(0, 0.95), "weight_decay": rand(0, 0.1), "maximize": first}
        kwargs |= {"nesterov": True} if second else {"dampening": rand(0, 0.5)}
    elif which == "RMSprop":
        kwargs = {"lr": rand(0, 0.03), "alpha": rand(0.5, 0.99), "eps": rand(1e-8, 1e-2), "momentum": rand(0, 0.9)}
        kwargs |= {"centered": first, "weight_decay": rand(0, 0.1), "maximize": second}
    else:
        kwargs = {"lr": rand(0, 0.03), "betas": (rand(0, 0.95), rand(0.5, 0.999)), "eps": rand(1e-8, 1e-2)}
        kwargs |= {"weight_decay": rand(0, 0.2), "amsgrad": first, "maximize": second}
    batched_cls = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW, "RMSprop": RMSprop}[which]
    torch.manual_seed(seed)
    pair = Pair(batched_cls, getattr(torch.optim, which), kwargs, num_models=num_models, shapes=[(2, 3), ()])
    for step in range(3):
        active = torch.rand(num_models, generator=gen) > 0.3 if step == 1 else None
        pair.step(active=active)
        pair.check(f"step {step}")


def test_nonfinite_model_never_changes_the_others_end_to_end() -> None:
    """Per-model loss -> per-model clipping -> step(active=~nonfinite): the diverged model is frozen, the
    others train exactly like their own torch runs, and the frozen one resumes like a fresh torch run."""
    torch.manual_seed(0)
    model = BatchedLinear(M, 4, 2, dtype=torch.float64)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    refs = [torch.nn.Linear(4, 2, dtype=torch.float64) for _ in range(M)]
    for m, ref in enumerate(refs):
        ref.load_state_dict({k: v[m] for k, v in initial.items()})
    lr = tensor(0.1, 0.2, 0.05)
    opt = Adam(model.parameters(), lr=lr, weight_decay=0.1)
    ref_opts = [torch.optim.Adam(r.parameters(), lr=lr[m].item(), weight_decay=0.1) for m, r in enumerate(refs)]
    for step in range(5):
        x, y = torch.randn(M, 6, 4, dtype=torch.float64), torch.randn(M, 6, 2, dtype=torch.float64)
        diverged = step < 3
        if diverged:
            x[1, 0, 0] = float("inf")
        opt.zero_grad()
        losses = BL.mse_loss(model(x), y)
        losses.sum().backward()
        bad = nonfinite_models(losses, model)
        assert bad.tolist() == [False, diverged, False]
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step(active=~bad)
        for m, (ref, ref_opt) in enumerate(zip(refs, ref_opts)):
            if bad[m]:
                continue
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x[m]), y[m]).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
        for key, value in model.state_dict().items():
            assert_close(value, torch.stack([r.state_dict()[key] for r in refs]), msg=f"step {step}: {key}")
        if diverged:
            assert torch.equal(model.weight[1], initial["weight"][1]), "the diverged model changed"


def test_lambda_lr_with_per_model_factors_gives_per_model_schedules() -> None:
    """A LambdaLR returning an (M,) factor gives each model its own schedule shape (here its own warm-up
    length), starting from a float lr; equal to per-model torch schedulers with scalar warm-ups."""
    torch.manual_seed(0)
    warmup = tensor(1.0, 3.0, 5.0)
    pair = Pair(SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    scheduler = torch.optim.lr_scheduler.LambdaLR(pair.opt, lambda epoch: torch.clamp((epoch + 1) / warmup, max=1.0))
    ref_schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch, w=w: min((epoch + 1) / w, 1.0))
        for opt, w in zip(pair.ref_opts, warmup.tolist())
    ]
    for step in range(6):
        pair.step()
        scheduler.step()
        for s in ref_schedulers:
            s.step()
        pair.check(f"step {step}", exact=False)  # the schedule's (epoch + 1) / warmup rounds differently
    assert isinstance(pair.opt.param_groups[0]["lr"], PerModelValue)
    expected = tensor(*[opt.param_groups[0]["lr"] for opt in pair.ref_opts])
    assert_close(pair.opt.param_groups[0]["lr"].as_subclass(torch.Tensor), expected, msg="lr")


def test_sgd_momentum_switched_on_later_starts_from_the_gradient() -> None:
    torch.manual_seed(0)
    pair = Pair(SGD, torch.optim.SGD, {"lr": tensor(0.1, 0.2, 0.05)})
    pair.step()
    pair.opt.param_groups[0]["momentum"] = tensor(0.9, 0.0, 0.5)
    for m, opt in enumerate(pair.ref_opts):
        opt.param_groups[0]["momentum"] = [0.9, 0.0, 0.5][m]
    for step, active in enumerate([[True, False, True], [False, True, True], None]):
        pair.step(active=None if active is None else torch.tensor(active))
        pair.check(f"step {step} with momentum, active {active}")


# -- the compiled path (fused=True) ------------------------------------------------------------------------

FUSED_CONFIGS = [
    (SGD, torch.optim.SGD, {"lr": tensor(0.1, 0.02, 0.3), "weight_decay": tensor(0.1, 0, 0.01)}),
    (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": tensor(0.9, 0.0, 0.5), "dampening": tensor(0.1, 0.3, 0.0)}),
    (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True, "weight_decay": 0.1}),
    (
        Adam,
        torch.optim.Adam,
        {"lr": tensor(1e-2, 1e-3, 3e-2), "betas": (tensor(0.9, 0.5, 0.0), 0.99), "eps": tensor(1e-8, 1e-3, 1.0)},
    ),
    (Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": tensor(0, 0.1, 0.5), "amsgrad": True, "maximize": True}),
    (AdamW, torch.optim.AdamW, {"lr": tensor(1e-2, 1e-3, 3e-2), "weight_decay": tensor(0.1, 0.0, 0.5)}),
    (AdamW, torch.optim.AdamW, {"lr": 1e-2, "betas": (0.8, tensor(0.99, 0.9, 0.5)), "amsgrad": True}),
    (
        RMSprop,
        torch.optim.RMSprop,
        {"lr": tensor(1e-2, 1e-3, 3e-2), "momentum": tensor(0.9, 0.0, 0.5), "weight_decay": 0.1},
    ),
    (RMSprop, torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "alpha": tensor(0.99, 0.5, 0.9), "maximize": True}),
    # Float averaging weights (1 - beta1, 1 - alpha) of 0.5 and more: the kernel's lerp takes its second formula.
    (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2), "betas": (0.3, 0.99), "weight_decay": 0.1}),
    (RMSprop, torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "alpha": 0.2}),
]
MASKS = [None, [False, True, True], None, [True, False, True], [False] * 3, None]


@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=[config_id(c) for c in FUSED_CONFIGS])
def test_fused_equals_foreach_and_torch_in_float64(config) -> None:
    """The compiled kernel computes the foreach path's numbers bit for bit, and so each model's torch.optim
    step, also with models frozen by active masks (which leave the models at different steps)."""
    torch.manual_seed(0)
    foreach = Pair(*config)
    torch.manual_seed(0)
    fused = Pair(*config, fused=True)
    for step, mask in enumerate(MASKS):
        grads = [torch.randn_like(p) for p in foreach.params]
        active = None if mask is None else torch.tensor(mask)
        foreach.step(grads, active=active)
        fused.step(grads, active=active)
        fused.check(f"step {step}, active {mask}")
        for i, (a, b) in enumerate(zip(fused.params, foreach.params)):
            assert_equal(a.detach(), b.detach(), f"step {step}: fused vs foreach, parameter {i}")
        for i, (a, b) in enumerate(zip(fused.opt.state.values(), foreach.opt.state.values())):
            for key in b:
                assert_equal(a[key], b[key], f"step {step}: state {key} of parameter {i}")


def ulps_of_parameter(actual: torch.Tensor, expected: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The difference in ulps of the largest magnitude the step involves: the parameter's before or after the
    step, or the update's (larger where an element is near 0: Adam moves every element by about lr)."""
    scale = torch.maximum(torch.maximum(before.abs(), expected.abs()), (expected - before).abs())
    return (actual - expected).abs() / (torch.nextafter(scale, torch.tensor(float("inf"))) - scale)


@pytest.mark.parametrize("exact_sqrt", [False, True], ids=["kernel_sqrt", "torch_sqrt"])
@pytest.mark.parametrize("config", [FUSED_CONFIGS[2], FUSED_CONFIGS[4], FUSED_CONFIGS[7]], ids=config_id)
def test_fused_float32_differs_from_foreach_only_by_the_square_root(config, exact_sqrt, monkeypatch) -> None:
    """In float32 the kernel's square root is correctly rounded and torch's CPU sqrt (MKL) is not always:
    with torch's sqrt the kernel equals the foreach path bit for bit, with its own a few elements per step
    differ by a few ulps (from the same state). SGD takes no square root: bit for bit either way."""
    monkeypatch.setattr(_base, "TORCH_FUSED_DTYPES", frozenset())  # the compiled kernel also with float values
    monkeypatch.setattr(_native, "enabled", False)
    if exact_sqrt:
        monkeypatch.setattr(_base, "EXACT_SQRT_DTYPES", frozenset({torch.float64, torch.float32}))
    torch.manual_seed(0)
    shapes = [(64, 33), (5,)]  # enough elements for the two square roots to differ somewhere
    foreach = Pair(*config, dtype=torch.float32, shapes=shapes)
    fused = Pair(*config, dtype=torch.float32, shapes=shapes, fused=True)
    for step in range(4):
        with torch.no_grad():
            for p, q in zip(fused.params, foreach.params):
                p.copy_(q)
        fused.opt.load_state_dict(copy.deepcopy(foreach.opt.state_dict()))  # torch's load keeps the tensors
        before = [p.detach().clone() for p in foreach.params]
        grads = [torch.randn_like(p) for p in foreach.params]
        foreach.step(grads)
        fused.step(grads)
        foreach.check(f"foreach, step {step}")
        for i, (a, b, old) in enumerate(zip(fused.params, foreach.params, before)):
            if exact_sqrt or config[0] is SGD:
                assert_equal(a.detach(), b.detach(), f"step {step}, parameter {i}")
            else:
                ulps = ulps_of_parameter(a.detach(), b.detach(), old)
                # How many elements differ, and by how much, depends on the CPU's sqrt: at most 0.15% and 11 ulps on
                # an AVX-512 Xeon; 4.4% and 31 ulps for RMSprop with momentum on an AVX2-only EPYC. A wrong formula
                # moves nearly every element by far more.
                assert ulps.max() <= 64 and (ulps > 0).float().mean() < 0.1, f"step {step}, parameter {i}"


TORCH_FUSED_CONFIGS = [
    (Adam, torch.optim.Adam, {"lr": 1e-2}),
    (Adam, torch.optim.Adam, {"lr": 1e-2, "betas": (0.5, 0.9), "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    (AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}),
    (SGD, torch.optim.SGD, {"lr": 0.1}),
    (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.1}),
    (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}),
]


@pytest.mark.parametrize("config", TORCH_FUSED_CONFIGS, ids=config_id)
def test_fused_with_float_values_is_torchs_fused_step(config, monkeypatch) -> None:
    """In float32 with float hyperparameters and every model at one step, ``fused=True`` is torch's own fused
    kernel over the stacked tensors, bit for bit, and nothing is compiled. Each model's slice is then within
    a few ulps of its own ``torch.optim`` step with ``fused=True``: torch's kernel rounds some elements
    differently in its vectorised loop and in its tail, and which elements fall in the tail depends on where
    the slice starts. Once ``active`` leaves the models at different steps the native kernel takes over,
    also within a few ulps (measured over these configurations and five steps: at most 5.5 ulps of the
    parameter; a wrong formula moves parameters by far more)."""
    batched_cls, torch_cls, kwargs = config
    native_calls = count_native_calls(monkeypatch)
    torch.manual_seed(0)
    shapes = [(13, 7), (13,), ()]
    pair = Pair(
        batched_cls,
        functools.partial(torch_cls, fused=True),
        kwargs,
        num_models=5,
        dtype=torch.float32,
        shapes=shapes,
        fused=True,
    )
    whole = [torch.nn.Parameter(p.detach().clone()) for p in pair.params]
    whole_opt = torch_cls(whole, fused=True, **kwargs)
    for step, mask in enumerate([None, None, None, [True, False, True, True, False], None]):
        befores = [p.detach().clone() for p in pair.params]
        grads = [torch.randn_like(p) for p in pair.params]
        pair.step(grads, active=None if mask is None else torch.tensor(mask))
        counted = any("step" in state for state in pair.opt.state.values())  # (not SGD without momentum)
        assert "_compiled_kernels" not in pair.opt.__dict__, f"step {step}: the compiled kernel ran"
        assert len(native_calls) == (counted and step >= 4), f"step {step}: the native kernel ran, or did not"
        if step < 3:
            for p, g in zip(whole, grads):
                p.grad = g.clone()
            whole_opt.step()
            for i, (p, q) in enumerate(zip(pair.params, whole)):
                assert_equal(p.detach(), q.detach(), f"step {step}, parameter {i}: against torch's fused step")
        for i, (p, before) in enumerate(zip(pair.params, befores)):
            expected = torch.stack([pair.ref_params[m][i].detach() for m in range(pair.num_models)])
            ulps = ulps_of_parameter(p.detach(), expected, before)
            assert ulps.max() <= 8, f"step {step}, parameter {i}: {ulps.max()} ulps from each model's fused step"


UNIT_RATE_CONFIGS = [
    (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3)}),
    (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "amsgrad": True, "eps": 1e-3}),
    # torch negates the gradient, then adds the decay: the decay is added before the kernel, negated first
    (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "weight_decay": 0.1, "maximize": True}),
    (Adam, torch.optim.Adam, {"lr": 1e-2, "betas": (0.5, 0.9), "weight_decay": tensor(0.0, 0.1, 0.5, 1.0, 2.0)}),
    (AdamW, torch.optim.AdamW, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "weight_decay": 0.1, "maximize": True}),
    (AdamW, torch.optim.AdamW, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "weight_decay": tensor(0, 0.1, 0.5, 1, 2)}),
    (AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": tensor(0.0, 0.1, 0.5, 1.0, 2.0), "amsgrad": True}),
    (SGD, torch.optim.SGD, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "momentum": 0.9}),
    (SGD, torch.optim.SGD, {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "momentum": 0.9, "dampening": 0.2}),
    (
        SGD,
        torch.optim.SGD,
        {
            "lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3),
            "momentum": 0.9,
            "nesterov": True,
            "weight_decay": 0.1,
            "maximize": True,
        },
    ),
    (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "weight_decay": tensor(0.0, 0.1, 0.5, 1.0, 2.0)}),
]


def count_native_calls(monkeypatch) -> list[str]:
    """A list that grows by the kernel's name at every call of a native kernel."""
    calls: list[str] = []
    for name in ("adam_f32", "sgd_f32", "rmsprop_f32"):
        kernel = getattr(_native, name)

        def counted(*args, kernel=kernel, name=name, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(_native, name, counted)
    return calls


PER_MODEL_RATE_KERNELS = [
    (config, kernel) for config in UNIT_RATE_CONFIGS for kernel in ["native", "unit_rate", "compiled"]
]


@pytest.mark.parametrize(
    ("config", "kernel"), PER_MODEL_RATE_KERNELS, ids=lambda v: v if isinstance(v, str) else config_id(v)
)
def test_fused_with_per_model_rates(config, kernel, monkeypatch) -> None:
    """In float32, a per-model learning rate or weight decay (the other values floats, every model at one
    step) runs the native kernel (``batchlayers.optim._native``), or without it torch's fused kernel
    at a unit rate on scratch tensors, added to the parameters scaled by each model's rate, on parameter
    lists up to ``UNIT_RATE_MAX_NUMEL`` elements (beyond: the compiled kernel). From the same values, each
    model's step is within a few ulps of its own torch.optim step (of the larger of the parameter and the
    update), also when one model's gradient is NaN, when a scheduler changes the rates in place or new
    rates replace them, and once ``active`` leaves the models at different steps (the native kernel goes
    on; the unit rate gives way to the compiled kernel); nothing is compiled before that."""
    unit_rate = kernel == "unit_rate"
    if kernel != "native":
        monkeypatch.setattr(_native, "enabled", False)
    if kernel == "compiled":
        monkeypatch.setattr(_base, "UNIT_RATE_MAX_NUMEL", 0)
    native_calls = count_native_calls(monkeypatch)
    batched_cls, torch_cls, kwargs = config
    torch.manual_seed(0)
    shapes = [(13, 7), (13,), ()]
    pair = Pair(batched_cls, torch_cls, kwargs, num_models=5, dtype=torch.float32, shapes=shapes, fused=True)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in [pair.opt, *pair.ref_opts]]
    for step, mask in enumerate([None, None, None, None, [True, False, True, True, False], None]):
        befores = [p.detach().clone() for p in pair.params]
        grads = [torch.randn_like(p) for p in pair.params]
        if step == 2:
            grads[1][3, 5] = float("nan")  # that element of model 3 becomes NaN, as in torch, and only that one
        if step == 3:
            new_lrs = torch.tensor([2e-2, 5e-3, 1e-3, 4e-2, 1e-2], dtype=torch.float64)
            pair.opt.param_groups[0]["lr"] = new_lrs
            for opt, lr in zip(pair.ref_opts, new_lrs.tolist()):
                opt.param_groups[0]["lr"] = lr
        pair.step(grads, active=None if mask is None else torch.tensor(mask))
        for scheduler in schedulers:
            scheduler.step()
        compiled = "_compiled_kernels" in pair.opt.__dict__
        expect_compiled = kernel == "compiled" or (unit_rate and step >= 5)
        assert compiled == expect_compiled, f"step {step}: the compiled kernel ran: {compiled}"
        assert ("_unit_rate_scratch" in pair.opt.__dict__) == unit_rate, f"step {step}"
        assert len(native_calls) == (step + 1 if kernel == "native" else 0), f"step {step}: native kernel calls"
        for i, (p, before) in enumerate(zip(pair.params, befores)):
            expected = torch.stack([pair.ref_params[m][i].detach() for m in range(pair.num_models)])
            nan = expected.isnan()
            assert torch.equal(p.detach().isnan(), nan), f"step {step}, parameter {i}: NaN where torch has none"
            ulps = ulps_of_parameter(p.detach()[~nan], expected[~nan], before[~nan])
            assert ulps.max() <= 4, f"step {step}, parameter {i}: {ulps.max()} ulps from each model's step"
        sync_references(pair)  # the next step from the same values: differences do not add up


def sync_references(pair: Pair) -> None:
    """Each model's torch parameters and optimizer state set to its slice of the batched ones."""
    with torch.no_grad():
        for m, (ref_params, ref_opt) in enumerate(zip(pair.ref_params, pair.ref_opts)):
            for p, q in zip(pair.params, ref_params):
                q.copy_(p[m])
                for key, value in ref_opt.state[q].items():
                    value.copy_(pair.opt.state[p][key][m])


# -- the native kernel (batchlayers.optim._native) -------------------------------------------------------------

NATIVE_CONFIGS = [c for c in FUSED_CONFIGS + UNIT_RATE_CONFIGS + TORCH_FUSED_CONFIGS if c[0] in (Adam, AdamW)]


def config_num_models(kwargs: dict) -> int:
    for value in kwargs.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, torch.Tensor):
                return len(v)
    return M


def native_against_foreach(config, monkeypatch):
    """Steps of the native kernel (``fused=True``) and of the foreach path, in float32, each from the foreach
    path's values (so that a difference cannot grow), with models at different steps after ``active``:
    yields the step, both pairs, the parameters before the step and the native kernels called so far."""
    monkeypatch.setattr(_base, "TORCH_FUSED_DTYPES", frozenset())  # the native kernel also with float values
    native_calls = count_native_calls(monkeypatch)
    batched_cls, torch_cls, kwargs = config
    num_models = config_num_models(kwargs)
    torch.manual_seed(0)
    shapes = [(64, 33), (5,), ()]
    foreach = Pair(batched_cls, torch_cls, kwargs, num_models=num_models, dtype=torch.float32, shapes=shapes)
    native = Pair(batched_cls, torch_cls, kwargs, num_models=num_models, dtype=torch.float32, shapes=shapes, fused=True)
    masks = [None, [m > 0 for m in range(num_models)], None, [m % 2 == 0 for m in range(num_models)], None]
    for step, mask in enumerate(masks):
        with torch.no_grad():
            for p, q in zip(native.params, foreach.params):
                p.copy_(q)
        native.opt.load_state_dict(copy.deepcopy(foreach.opt.state_dict()))
        before = [p.detach().clone() for p in foreach.params]
        grads = [torch.randn_like(p) for p in foreach.params]
        active = None if mask is None else torch.tensor(mask)
        foreach.step(grads, active=active)
        native.step(grads, active=active)
        foreach.check(f"foreach, step {step}")  # (the reference: each model's torch.optim step, bit for bit)
        yield step, native, foreach, before, native_calls


@pytest.mark.parametrize("config", NATIVE_CONFIGS, ids=config_id)
def test_native_adam_equals_foreach_where_torchs_sqrt_is_correctly_rounded(config, monkeypatch) -> None:
    """The native kernel computes the foreach path's numbers op for op: its moments equal the foreach path's
    bit for bit, and so does every parameter element whose square root torch's CPU ``sqrt`` rounds correctly
    (the kernel's ``sqrtf`` always does; torch's is 1 ulp off for under 1% of inputs), also with per-model
    betas and eps, float or per-model values, and models at different steps after ``active`` masks. Each
    step starts from the foreach path's values, so that a difference cannot grow."""
    differing = numel = 0
    for step, native, foreach, before, native_calls in native_against_foreach(config, monkeypatch):
        assert native_calls == ["adam_f32"] * (step + 1), f"step {step}: {native_calls}"
        for i, (a, b, old) in enumerate(zip(native.params, foreach.params, before)):
            state, expected_state = native.opt.state[a], foreach.opt.state[b]
            for key in expected_state:
                assert_equal(state[key], expected_state[key], f"step {step}: state {key} of parameter {i}")
            second = expected_state["max_exp_avg_sq" if config[2].get("amsgrad") else "exp_avg_sq"]
            torch_root_exact = torch.sqrt(second) == second.double().sqrt().float()  # (float64: correctly rounded)
            assert_equal(a.detach()[torch_root_exact], b.detach()[torch_root_exact], f"step {step}, parameter {i}")
            ulps = ulps_of_parameter(a.detach(), b.detach(), old)
            assert ulps.max() <= 64, f"step {step}, parameter {i}: {ulps.max()} ulps"
            differing += int((a.detach() != b.detach()).sum())
            numel += a.numel()
    assert differing < 0.01 * numel


NATIVE_RMSPROP_CONFIGS = [c for c in CONFIGS + FUSED_CONFIGS if c[0] is RMSprop] + [
    (RMSprop, torch.optim.RMSprop, {"lr": tensor(1e-2, 1e-3, 3e-2), "momentum": 0.5, "centered": True}),
]


@pytest.mark.parametrize("config", NATIVE_RMSPROP_CONFIGS, ids=config_id)
def test_native_rmsprop_equals_foreach_where_torchs_sqrt_is_correctly_rounded(config, monkeypatch) -> None:
    """As for Adam: the native RMSprop's averages are the foreach path's bit for bit, and so are the parameter
    and momentum buffer elements whose square root torch's CPU ``sqrt`` rounds correctly, with per-model
    alpha, eps and momentum (0 for some models: the plain step, the buffer kept), centered or not, and models
    at different steps after ``active``."""
    for step, native, foreach, before, native_calls in native_against_foreach(config, monkeypatch):
        assert native_calls == ["rmsprop_f32"] * (step + 1), f"step {step}: {native_calls}"
        for i, (a, b, old) in enumerate(zip(native.params, foreach.params, before)):
            state, expected_state = native.opt.state[a], foreach.opt.state[b]
            for key in ("step", "square_avg", "grad_avg"):
                if key in expected_state:
                    assert_equal(state[key], expected_state[key], f"step {step}: state {key} of parameter {i}")
            root = expected_state["square_avg"]
            if "grad_avg" in expected_state:
                root = torch.addcmul(root, expected_state["grad_avg"], expected_state["grad_avg"], value=-1)
            exact = torch.sqrt(root) == root.double().sqrt().float()
            assert_equal(a.detach()[exact], b.detach()[exact], f"step {step}, parameter {i}")
            if "momentum_buffer" in expected_state:
                buf, expected_buf = state["momentum_buffer"], expected_state["momentum_buffer"]
                assert_equal(buf[exact], expected_buf[exact], f"step {step}: momentum_buffer of parameter {i}")
            ulps = ulps_of_parameter(a.detach(), b.detach(), old)
            assert ulps.max() <= 64, f"step {step}, parameter {i}: {ulps.max()} ulps"


NATIVE_SGD_CONFIGS = [c for c in CONFIGS + FUSED_CONFIGS + UNIT_RATE_CONFIGS + TORCH_FUSED_CONFIGS if c[0] is SGD]


@pytest.mark.parametrize("config", NATIVE_SGD_CONFIGS, ids=config_id)
def test_native_sgd_is_each_models_torch_step_bit_for_bit(config, monkeypatch) -> None:
    """SGD takes no square root: the native kernel is each model's torch.optim step bit for bit in float32,
    with per-model momentum (0 for some models: their buffers kept, Nesterov taking their plain gradient),
    dampening, weight decay, maximize, a NaN gradient, and models at different steps after ``active``."""
    monkeypatch.setattr(_base, "TORCH_FUSED_DTYPES", frozenset())  # the native kernel also with float values
    native_calls = count_native_calls(monkeypatch)
    batched_cls, torch_cls, kwargs = config
    num_models = config_num_models(kwargs)
    torch.manual_seed(0)
    pair = Pair(
        batched_cls,
        torch_cls,
        kwargs,
        num_models=num_models,
        dtype=torch.float32,
        shapes=[(64, 33), (5,), ()],
        fused=True,
    )
    masks = [None, [m > 0 for m in range(num_models)], None, [m % 2 == 0 for m in range(num_models)], None]
    for step, mask in enumerate(masks):
        grads = [torch.randn_like(p) for p in pair.params]
        if step == 2:
            grads[0][1, 3, 5] = float("nan")
        pair.step(grads, active=None if mask is None else torch.tensor(mask))
        for i, p in enumerate(pair.params):
            for m in range(num_models):
                expected = {"param": pair.ref_params[m][i].detach()}
                buf = pair.ref_opts[m].state[pair.ref_params[m][i]].get("momentum_buffer")
                if buf is not None:
                    expected["momentum_buffer"] = buf
                for key, value in expected.items():
                    actual = p.detach()[m] if key == "param" else pair.opt.state[p][key][m]
                    nan = value.isnan()
                    assert torch.equal(actual.isnan(), nan), f"step {step}: NaN in {key} {i} of model {m}"
                    assert_equal(actual[~nan], value[~nan], f"step {step}: {key} {i} of model {m}")
        assert native_calls == ["sgd_f32"] * (step + 1), f"step {step}: {native_calls}"


@pytest.mark.parametrize(
    "config",
    [
        (Adam, torch.optim.Adam, {"lr": tensor(1e-2, 1e-3, 3e-2), "betas": (tensor(0.9, 0.5, 0.8), 0.99)}),
        (SGD, torch.optim.SGD, {"lr": tensor(0.1, 0.02, 0.3), "momentum": 0.9, "dampening": 0.2}),
    ],
    ids=config_id,
)
def test_native_kernel_with_step_counts_per_parameter_and_model(config, monkeypatch) -> None:
    """Parameters that missed a step (no gradient) and models frozen by ``active`` leave every parameter's
    models at their own step counts, so the native kernel reads ``(parameters, M)`` bias corrections or
    momentum factors, here with as many parameters as models (3): a table read transposed would pass
    unnoticed where it is square but for these numbers, each model's against its own torch.optim step."""
    native_calls = count_native_calls(monkeypatch)
    batched_cls, torch_cls, kwargs = config
    torch.manual_seed(0)
    pair = Pair(batched_cls, torch_cls, kwargs, dtype=torch.float32, shapes=[(4, 3), (7,), (2, 5)], fused=True)
    skipped = [None, {0}, {2}, None, {0}]  # (which parameters have no gradient at each step)
    masks = [None, None, [True, False, True], [False, True, True], None]
    for step, (skip, mask) in enumerate(zip(skipped, masks)):
        befores = [p.detach().clone() for p in pair.params]
        grads = [torch.randn_like(p) for p in pair.params]
        for i, (p, g) in enumerate(zip(pair.params, grads)):
            p.grad = None if skip and i in skip else g.clone()
        pair.opt.step(active=None if mask is None else torch.tensor(mask))
        for m in range(pair.num_models):
            if mask is None or mask[m]:
                for i, (q, g) in enumerate(zip(pair.ref_params[m], grads)):
                    q.grad = None if skip and i in skip else g[m].clone()
                pair.ref_opts[m].step()
        for i, (p, before) in enumerate(zip(pair.params, befores)):
            expected = torch.stack([pair.ref_params[m][i].detach() for m in range(pair.num_models)])
            if batched_cls is SGD:  # (no square root: bit for bit)
                assert_equal(p.detach(), expected, f"step {step}, parameter {i}")
            else:
                ulps = ulps_of_parameter(p.detach(), expected, before)
                assert ulps.max() <= 4, f"step {step}, parameter {i}: {ulps.max()} ulps from each model's step"
    assert len(native_calls) == len(skipped)
    counts = torch.stack([pair.opt.state[p]["step"] for p in pair.params])
    assert len({tuple(row.tolist()) for row in counts}) == 3  # (every parameter at its own counts)


def test_native_kernel_splits_elements_between_threads_exactly(monkeypatch) -> None:
    """Above ``THREADS_MIN_NUMEL`` elements the native kernel splits them between threads at any element,
    mid-slice included: the same numbers as one thread, bit for bit."""
    torch.manual_seed(0)
    shapes = [(7, 11), (13,), ()]
    kwargs = {"lr": tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), "weight_decay": 0.1, "amsgrad": True}
    pairs = [Pair(AdamW, torch.optim.AdamW, kwargs, num_models=5, dtype=torch.float32, shapes=shapes, fused=True)]
    pairs.append(copy.deepcopy(pairs[0]))
    threads = torch.get_num_threads()
    try:
        for step in range(3):
            grads = [torch.randn_like(p) for p in pairs[0].params]
            for pair, (min_numel, num_threads) in zip(pairs, [(1 << 30, 1), (0, 3)]):
                monkeypatch.setattr(_native, "THREADS_MIN_NUMEL", min_numel)
                torch.set_num_threads(num_threads)
                pair.step(grads)
            for i, (a, b) in enumerate(zip(*(pair.params for pair in pairs))):
                assert_equal(b.detach(), a.detach(), f"step {step}, parameter {i}")
    finally:
        torch.set_num_threads(threads)
    pairs[1].check("three threads", exact=False)


def test_without_a_compiler_fused_adam_takes_its_other_kernels(monkeypatch, tmp_path) -> None:
    """Where the native kernel cannot be compiled, ``fused=True`` steps as before (the unit rate), the
    reason is kept, and nothing is left in the cache directory or the temporary one (a missing compiler is
    not taken for an unwritable cache directory)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("BATCHLAYERS_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    _native._load.cache_clear()
    try:
        assert _native.library() is None
        assert "no-such-compiler" in _native.unavailable_reason()
        with pytest.raises(RuntimeError, match="native optimizer kernel is unavailable.*no-such-compiler"):
            backends.cpu.check_native_optimizers()
        native_calls = count_native_calls(monkeypatch)
        pair = Pair(*UNIT_RATE_CONFIGS[0], num_models=5, dtype=torch.float32, fused=True)
        for step in range(2):
            pair.step()
            pair.check(f"step {step}", exact=False)
        assert not native_calls and "_unit_rate_scratch" in pair.opt.__dict__
        assert not list((tmp_path / "cache").glob("*")) and not list((tmp_path / "tmp").glob("*"))
    finally:
        _native._load.cache_clear()  # (the next use loads the real library again)


def test_a_cache_directory_that_cannot_be_made_gives_a_temporary_one(monkeypatch, tmp_path) -> None:
    """Where ``$BATCHLAYERS_CACHE_DIR`` cannot be made (here a path through a file), the kernel is compiled
    into a temporary directory of its own for this process, and the steps run it."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("BATCHLAYERS_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    _native._load.cache_clear()
    try:
        assert _native.library() is not None, _native.unavailable_reason()
        assert [p.name for p in (tmp_path / "tmp").glob("batchlayers-*/native-*.so")], "not in a temporary directory"
        native_calls = count_native_calls(monkeypatch)
        pair = Pair(*UNIT_RATE_CONFIGS[0], num_models=5, dtype=torch.float32, fused=True)
        pair.step()
        pair.check("step", exact=False)
        assert native_calls == ["adam_f32"]
    finally:
        _native._load.cache_clear()


@pytest.mark.parametrize("negative", ["gradient", "parameter"])
def test_negative_views_leave_the_native_kernel_out(negative, monkeypatch) -> None:
    """A gradient or parameter given as a negative view (its memory holds the values' negatives): the native
    kernel, which reads and writes memory (and stepped by the negated values), leaves it to torch's kernels,
    which refuse it with their own error."""
    torch.manual_seed(0)
    native_calls = count_native_calls(monkeypatch)
    value, grad = torch.randn(4, 3), torch.randn(4, 3)
    p = torch.nn.Parameter(torch._neg_view(value) if negative == "parameter" else value)
    p.grad = torch._neg_view(grad) if negative == "gradient" else grad
    with pytest.raises(RuntimeError, match="negation"):
        Adam([p], lr=torch.full((4,), 0.1, dtype=torch.float64), fused=True).step()  # (a rate per model)
    assert native_calls == [], native_calls


def test_no_models_leave_the_native_kernel_out() -> None:
    """An optimizer over parameters of zero models steps (nothing) without the kernel dividing by zero."""
    param = torch.nn.Parameter(torch.randn(0, 3))
    param.grad = torch.randn(0, 3)
    assert _native.operands([[param], [param.grad]]) is None
    SGD([param], lr=torch.zeros(0, dtype=torch.float64), momentum=0.9, fused=True).step()
    assert param.shape == (0, 3)


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "native"])
def test_a_step_before_backward_is_caught_as_torch_catches_it(fused, monkeypatch) -> None:
    """The native kernel writes through raw pointers, and counts its writes as torch's in-place ops do: a
    step between a forward and its backward makes the backward raise, as with torch.optim, instead of giving
    gradients of parameters that have changed."""
    native_calls = count_native_calls(monkeypatch)
    weight, bias = torch.nn.Parameter(torch.randn(5, 3, 4)), torch.nn.Parameter(torch.randn(5, 3))
    weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
    opt = Adam([weight, bias], lr=tensor(1e-2, 1e-3, 3e-2, 0.1, 3e-3), fused=fused)
    loss = (weight * weight).sum()
    opt.step()
    assert len(native_calls) == bool(fused)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    state = opt.state[weight]
    # (The step counts too: the kernel counts the step in them, as torch adds 1.)
    versions = {key: state[key]._version for key in ("exp_avg", "exp_avg_sq", "step")}
    weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
    opt.step()
    assert all(state[key]._version > version for key, version in versions.items())


def test_native_optimizers_setting(monkeypatch) -> None:
    """``backends.cpu.native_optimizers`` turns the native kernel off and on (a bool only), and
    ``check_native_optimizers`` passes where it is built."""
    monkeypatch.setattr(_native, "enabled", _native.enabled)  # (restored afterwards)
    native_calls = count_native_calls(monkeypatch)
    backends.cpu.check_native_optimizers()
    for setting in (False, True):
        backends.cpu.native_optimizers = setting
        assert backends.cpu.native_optimizers is setting
        pair = Pair(*UNIT_RATE_CONFIGS[0], num_models=5, dtype=torch.float32, fused=True)
        pair.step()
        pair.check(f"native_optimizers={setting}", exact=False)
        assert len(native_calls) == setting
        native_calls.clear()
    with pytest.raises(TypeError, match="native_optimizers must be True or False"):
        backends.cpu.native_optimizers = 1


def test_native_kernel_is_compiled_once_into_the_cache_directory(monkeypatch, tmp_path) -> None:
    """The library is compiled into ``$BATCHLAYERS_CACHE_DIR`` and loaded from there by the next process."""
    monkeypatch.setenv("BATCHLAYERS_CACHE_DIR", str(tmp_path))
    _native._load.cache_clear()
    try:
        assert _native.library() is not None, _native.unavailable_reason()
        assert _native.unavailable_reason() == ""  # (none left from an earlier failure)
        built = list(tmp_path.glob("native-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        _native._load.cache_clear()
        assert _native.library() is not None
        assert list(tmp_path.glob("*")) == built and built[0].stat().st_mtime_ns == stamp
    finally:
        _native._load.cache_clear()


def test_fused_compiles_for_noncontiguous_parameters() -> None:
    """torch 2.13's CPU fused Adam steps a transposed parameter with a contiguous gradient wrongly: such
    parameters take the compiled kernel, which equals the foreach path but for the square root's last bits."""
    torch.manual_seed(0)
    start = torch.randn(M, 4, 6).transpose(1, 2)
    grads = [torch.randn(M, 6, 4) for _ in range(3)]
    params = {fused: torch.nn.Parameter(start.clone()) for fused in (None, True)}
    assert not params[True].is_contiguous()
    for fused, param in params.items():
        opt = Adam([param], lr=0.1, fused=fused)
        for grad in grads:
            param.grad = grad.clone()
            opt.step()
    assert "_compiled_kernels" in opt.__dict__
    ulps = ulps_of_parameter(params[True].detach(), params[None].detach(), start)
    assert ulps.max() <= 64 and (ulps > 0).float().mean() < 0.1


@pytest.mark.parametrize("config", [FUSED_CONFIGS[1], FUSED_CONFIGS[4], FUSED_CONFIGS[8]], ids=config_id)
@pytest.mark.parametrize("saved_fused", [False, True], ids=["foreach_to_fused", "fused_to_foreach"])
def test_state_dict_moves_between_paths(config, saved_fused) -> None:
    """A checkpoint of one path resumes on the other, bit for bit; the loading optimizer keeps its path."""
    torch.manual_seed(0)
    batched_cls, _, kwargs = config
    params = [torch.nn.Parameter(torch.randn(M, *s, dtype=torch.float64)) for s in SHAPES]
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    masks = [None, torch.tensor([True, False, True]), None, None, torch.tensor([False, True, True]), None]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = batched_cls(params, **kwargs, fused=saved_fused)

    def run(optimizer, ps, steps):
        for gs, active in steps:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            optimizer.step(active=active)

    run(opt, params, list(zip(grads, masks))[:3])
    checkpoint = copy.deepcopy(opt.state_dict())  # torch's load_state_dict would share the tensors
    with torch.no_grad():
        for p, q in zip(twin, params):
            p.copy_(q)
    resumed = batched_cls(twin, **kwargs, fused=not saved_fused)
    resumed.load_state_dict(checkpoint)
    assert resumed.param_groups[0]["fused"] is (not saved_fused)
    run(opt, params, list(zip(grads, masks))[3:])
    run(resumed, twin, list(zip(grads, masks))[3:])
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal(q.detach(), p.detach(), f"parameter {i}")
    for i, (a, b) in enumerate(zip(resumed.state.values(), opt.state.values())):
        for key in b:
            assert_equal(a[key], b[key], f"state {key} of parameter {i}")


@pytest.mark.parametrize("per_model_lr", [True, False], ids=["tensor_lr", "float_lr"])
def test_fused_kernel_is_not_recompiled_by_schedules_or_masks(per_model_lr) -> None:
    """New learning rates, bias corrections and models at different steps reuse the compiled kernel, and a
    pickled copy leaves it behind."""
    counters = torch._dynamo.utils.counters
    torch.manual_seed(0)
    lr = tensor(0.1, 0.02, 0.3) if per_model_lr else 0.1
    pair = Pair(Adam, torch.optim.Adam, {"lr": lr, "weight_decay": 0.1}, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(pair.opt, step_size=1, gamma=0.5)
    ref_schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in pair.ref_opts]
    pair.step()
    graphs = counters["stats"]["unique_graphs"]
    for step, mask in enumerate([[True, False, True], None, [False, True, True], None]):
        scheduler.step()
        for s in ref_schedulers:
            s.step()
        pair.step(active=None if mask is None else torch.tensor(mask))
        pair.check(f"step {step}")
    assert counters["stats"]["unique_graphs"] == graphs, "the kernel was compiled again"
    assert "_compiled_kernels" in pair.opt.__dict__
    assert "_compiled_kernels" not in pickle.loads(pickle.dumps(pair.opt)).__dict__


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[8], CONFIGS[12]], ids=config_id)
def test_steps_under_inference_mode_match_torch(config, fused) -> None:
    """Steps taken under ``torch.inference_mode()`` (the state then made of inference tensors, which have no
    version counter) give each model's torch.optim step, as torch.optim steps there."""
    torch.manual_seed(0)
    dtype = torch.float32 if fused else torch.float64  # (fused float32: the native kernel)
    pair = Pair(*config, dtype=dtype, fused=fused)
    for step in range(3):
        grads = [torch.randn_like(p) for p in pair.params]
        with torch.inference_mode():
            pair.step(grads)
        pair.check(f"step {step}", exact=not fused)


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
def test_step_counts_changed_in_place_are_read_again(fused) -> None:
    """The optimizer remembers that all models are at one step only until the step tensors change."""
    torch.manual_seed(0)
    pair = Pair(*FUSED_CONFIGS[3], fused=fused)
    for step in range(4):
        if step == 2:
            for opt in [pair.opt, *pair.ref_opts]:
                for state in opt.state.values():
                    state["step"].fill_(7)
        pair.step()
        pair.check(f"step {step}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("name", ["Adam", "SGD", "RMSprop"])
def test_step_counts_held_as_rows_of_one_tensor(name, fused, dtype) -> None:
    """A new optimizer holds its parameters' ``(M,)`` step counts as the rows of one tensor and counts them
    with one add. A parameter without a gradient (step 2), and counts loaded from a copied state dict (step
    4), are counted one by one: every count and every step stays each model's own (against torch.optim)."""
    torch.manual_seed(0)
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    params = [torch.nn.Parameter(torch.randn(M, *s, dtype=dtype)) for s in SHAPES]
    opt = getattr(_base_optim, name)(params, **kwargs, fused=fused)
    refs = [[torch.nn.Parameter(p[m].detach().clone()) for p in params] for m in range(M)]
    ref_opts = [getattr(torch.optim, name)(ps, **kwargs) for ps in refs]
    for step in range(6):
        if step == 4:
            resumed = getattr(_base_optim, name)(params, **kwargs, fused=fused)
            resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
            opt = resumed
        grads = [None if (step == 2 and i == 1) else torch.randn_like(p) for i, p in enumerate(params)]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for m in range(M):
            for q, g in zip(refs[m], grads):
                q.grad = None if g is None else g[m].clone()
            ref_opts[m].step()
        steps = [opt.state[p]["step"] for p in params]
        if step == 0:
            assert all(s._base is steps[0]._base is not None for s in steps), "not rows of one tensor"
        for i, (p, count) in enumerate(zip(params, steps)):
            expected = step + 1 - (i == 1 and step >= 2)
            assert_equal(count, torch.full((M,), float(expected)), f"step {step}: parameter {i}'s counts")
            expected_param = torch.stack([refs[m][i].detach() for m in range(M)])
            if dtype == torch.float64 or not fused:
                assert_equal(p.detach(), expected_param, f"step {step}, parameter {i}")
            else:  # torch's fused kernel or the compiled one's square root: the last bits (see above)
                assert_close(p.detach(), expected_param, msg=f"step {step}, parameter {i}")


def test_bias_corrections_are_pythons_float_powers() -> None:
    """``beta ** step`` and ``x ** 0.5`` per model as Python (the C library's pow) computes torch.optim's:
    torch's vectorised pow and sqrt differ from it in the last bit for some inputs."""
    gen = torch.Generator().manual_seed(0)
    betas = torch.rand(1000, generator=gen, dtype=torch.float64)
    steps = torch.randint(1, 100_000, (1000,), generator=gen).double()
    got = _base.power(betas, steps, betas.device)
    assert_equal(got, torch.tensor([b**s for b, s in zip(betas.tolist(), steps.tolist())], dtype=torch.float64))
    roots = _base.power(1 - got, 0.5, betas.device)
    assert_equal(roots, torch.tensor([(1 - v) ** 0.5 for v in got.tolist()], dtype=torch.float64))
    assert _base.power(0.9, 3.0, betas.device) == 0.9**3.0


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("kind", ["sparse", "complex"])
def test_unsupported_parameters_are_refused_before_anything_changes(kind, fused) -> None:
    """A sparse gradient or a complex parameter after a valid one: refused before any state is created or any
    parameter is updated."""
    dense = torch.nn.Parameter(torch.randn(3, 4))
    dense.grad = torch.randn(3, 4)
    other = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.complex64 if kind == "complex" else torch.float32))
    other.grad = torch.randn_like(other).to_sparse() if kind == "sparse" else torch.randn_like(other)
    opt = Adam([dense, other], lr=0.1, fused=fused)
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match=f"Adam does not support {kind}"):
        opt.step()
    assert torch.equal(dense.detach(), before) and len(opt.state) == 0


# -- momentum switched to 0 and back, per model ------------------------------------------------------------
#
# While a model's momentum is 0, torch.optim keeps no momentum buffer for it (SGD: none yet, started as the
# gradient at its first step with momentum) or leaves the one it has untouched (SGD and RMSprop), and takes
# the plain gradient step.


def set_momentum(pair: Pair, value, in_place: bool = False) -> None:
    """``param_groups[0]["momentum"] = value`` in the batched optimizer (or a ``fill_`` of its per-model tensor, as
    a scheduler writes it) and model m's value in its torch optimizer."""
    if in_place:
        pair.opt.param_groups[0]["momentum"].fill_(value)
    else:
        pair.opt.param_groups[0]["momentum"] = value.clone() if isinstance(value, torch.Tensor) else value
    for m, opt in enumerate(pair.ref_opts):
        opt.param_groups[0]["momentum"] = per_model_value(value, m)


def check_nan_aware(pair: Pair, msg: str) -> None:
    """:meth:`Pair.check` where a NaN must meet a NaN (an inf an inf of the same sign)."""
    for i, p in enumerate(pair.params):
        expected = torch.stack([pair.ref_params[m][i].detach() for m in range(pair.num_models)])
        actual = p.detach()
        if not torch.equal(actual.isnan(), expected.isnan()):
            raise AssertionError(
                f"{msg} parameter {i}: NaN in {actual.isnan().nonzero().tolist()}, torch's in "
                f"{expected.isnan().nonzero().tolist()}"
            )
        assert_equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0), f"{msg} parameter {i}")


MOMENTUM_SCHEDULES = {
    # model 1 without momentum for 3 steps, then with (its first momentum step: buf = grad, no dampening)
    "SGD-off-then-on": (
        SGD,
        {"lr": tensor(0.1, 0.2, 0.05), "momentum": tensor(0.9, 0.0, 0.5), "dampening": tensor(0.1, 0.3, 0.2)},
        {3: tensor(0.9, 0.7, 0.5)},
    ),
    # model 1 with momentum, 0 for two steps (buffer kept), then with it again; a float at the end
    "SGD-on-off-on": (
        SGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.25, "weight_decay": 0.1, "maximize": True},
        {2: tensor(0.9, 0.0, 0.9), 4: 0.9},
    ),
    # every model at a different point: off, on, off, on (models at different momentum steps)
    "SGD-staggered": (
        SGD,
        {"lr": tensor(0.1, 0.2, 0.05), "momentum": tensor(0.0, 0.5, 0.9)},
        {1: tensor(0.8, 0.0, 0.9), 2: tensor(0.0, 0.0, 0.6), 3: 0.0, 4: tensor(0.7, 0.6, 0.0), 5: 0.9},
    ),
    "RMSprop-on-off-on": (
        RMSprop,
        {"lr": tensor(1e-2, 3e-2, 2e-2), "momentum": 0.9},
        {2: tensor(0.9, 0.0, 0.9), 4: 0.9},
    ),
    "RMSprop-centered-on-off-on": (
        RMSprop,
        {"lr": 1e-2, "momentum": tensor(0.9, 0.5, 0.7), "centered": True, "weight_decay": 0.1, "maximize": True},
        {2: tensor(0.0, 0.0, 0.7), 3: tensor(0.9, 0.0, 0.0), 5: tensor(0.9, 0.5, 0.7)},
    ),
}


@pytest.mark.parametrize("masks", [False, True], ids=["all_active", "masks"])
@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("name", list(MOMENTUM_SCHEDULES))
def test_momentum_switched_to_zero_and_back_matches_torch(name, fused, masks) -> None:
    """A model whose momentum is 0 leaves its momentum buffer (and momentum step count) as they are, as
    torch.optim does; when its momentum comes back it resumes from that buffer, or starts one."""
    batched_cls, kwargs, schedule = MOMENTUM_SCHEDULES[name]
    torch.manual_seed(0)
    pair = Pair(batched_cls, getattr(torch.optim, batched_cls.__name__), kwargs, fused=fused)
    for step in range(7):
        if step in schedule:
            set_momentum(pair, schedule[step])
        active = torch.tensor([True, step % 3 != 1, step != 4]) if masks else None
        pair.step(active=active)
        pair.check(f"step {step}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
def test_sgd_nesterov_with_a_zero_momentum_written_in_place_matches_torch(fused, dtype, monkeypatch) -> None:
    """A scheduler's ``fill_`` can put a 0 into a Nesterov group's per-model momentum (not checked); torch then
    takes the plain step for that model, also for a non-finite gradient (float32, fused: the native kernel)."""
    native_calls = count_native_calls(monkeypatch)
    torch.manual_seed(0)
    kwargs = {"lr": 0.1, "momentum": tensor(0.9, 0.8, 0.5), "nesterov": True}
    pair = Pair(SGD, torch.optim.SGD, kwargs, fused=fused, dtype=dtype)
    pair.step()
    set_momentum(pair, tensor(0.9, 0.0, 0.5), in_place=True)
    grads = [torch.randn_like(p) for p in pair.params]
    grads[0][1, 0, 0] = float("inf")
    pair.step(grads)
    check_nan_aware(pair, "inf gradient without momentum")
    set_momentum(pair, tensor(0.9, 0.8, 0.5), in_place=True)
    pair.step()
    check_nan_aware(pair, "momentum back")
    assert len(native_calls) == (3 if fused and dtype == torch.float32 else 0)


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
def test_sgd_nonfinite_gradient_without_momentum_is_not_kept(fused) -> None:
    """An inf gradient of a model without momentum is not stored in a buffer (torch keeps none) to come back as
    ``0 * inf = NaN``; nor does an inf already in a model's buffer while its momentum is 0."""
    torch.manual_seed(0)
    pair = Pair(SGD, torch.optim.SGD, {"lr": 0.1, "momentum": tensor(0.9, 0.0, 0.5)}, fused=fused)
    for step in range(6):
        grads = [torch.randn_like(p) for p in pair.params]
        if step == 1:
            grads[0][1, 0, 0] = float("inf")  # model 1, momentum 0
            grads[1][2, 1] = -float("inf")  # model 2, into its buffer
        if step == 2:
            set_momentum(pair, tensor(0.9, 0.0, 0.0))
        if step == 4:
            set_momentum(pair, tensor(0.9, 0.7, 0.0))
        pair.step(grads)
        check_nan_aware(pair, f"step {step}")
    assert pair.params[0][1, 0, 0] == -float("inf") and pair.params[1][2, 1] == float("inf")


def snapshot(pair: Pair) -> list[torch.Tensor]:
    """The batched parameters and every optimizer state tensor, copied."""
    tensors = [p.detach() for p in pair.params]
    tensors += [t for state in pair.opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return [t.clone() for t in tensors]


def torch_step_raises(pair: Pair, m: int, momentum: float) -> bool:
    """Whether model m's torch optimizer raises ``KeyError('momentum_buffer')`` at a step with ``momentum``
    (on copies: the reference run itself does not step)."""
    params, opt = copy.deepcopy((pair.ref_params[m], pair.ref_opts[m]))
    opt.param_groups[0]["momentum"] = momentum
    for q in params:
        q.grad = torch.ones_like(q)
    try:
        opt.step()
    except KeyError as error:
        assert error.args == ("momentum_buffer",)
        return True
    return False


@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("start", ["float_zero", "per_model_zero"])
def test_rmsprop_momentum_without_a_buffer_raises_like_torch(start, fused) -> None:
    """torch's RMSprop creates a parameter's momentum buffer at its first step only if momentum > 0 then, and
    at a later step with momentum > 0 and no buffer raises ``KeyError('momentum_buffer')``, changing nothing.
    Per model: the step raises if a model that started without momentum is given some, unless it is frozen by
    ``active``; models with a buffer keep it through steps with momentum 0."""
    torch.manual_seed(0)
    momentum = 0.0 if start == "float_zero" else tensor(0.9, 0.0, 0.5)
    pair = Pair(RMSprop, torch.optim.RMSprop, {"lr": 1e-2, "momentum": momentum}, fused=fused)
    pair.step()
    without = [0, 1, 2] if start == "float_zero" else [1]
    for value in (tensor(0.9, 0.3, 0.5), 0.4):
        assert [m for m in range(M) if torch_step_raises(pair, m, per_model_value(value, m))] == without
        before = snapshot(pair)
        pair.opt.param_groups[0]["momentum"] = value
        for p in pair.params:
            p.grad = torch.ones_like(p)
        with pytest.raises(KeyError, match="momentum_buffer"):
            pair.opt.step()
        for a, b in zip(snapshot(pair), before):
            assert torch.equal(a, b), "a refused step changed a parameter or the optimizer state"
    # Momentum only where a buffer exists, or for models that do not step: no error, torch's numbers.
    with_buffer = torch.tensor([m not in without for m in range(M)])
    on = torch.where(with_buffer, 0.6, 0.0).double()
    set_momentum(pair, on)
    pair.step()
    pair.check("momentum where a buffer exists")
    set_momentum(pair, tensor(0.6, 0.8, 0.7))
    pair.step(active=with_buffer)
    pair.check("momentum for every model, the models without a buffer frozen")
    set_momentum(pair, 0.0)
    pair.step()
    set_momentum(pair, on)
    pair.step()
    pair.check("momentum off and on again")


def test_rmsprop_models_without_a_momentum_buffer_follow_state_dict_and_keep_models() -> None:
    """Which models have a momentum buffer survives a checkpoint (``weights_only``) and follows the models
    through ``keep_models_`` and ``copy_model_``."""
    from batchlayers.population import copy_model_, keep_models_

    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(M, *s, dtype=torch.float64)) for s in SHAPES])
    opt = RMSprop(model.parameters(), lr=1e-2, momentum=tensor(0.9, 0.0, 0.5))
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = RMSprop(model.parameters(), lr=1e-2, momentum=tensor(0.9, 0.0, 0.5))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for optimizer in (opt, resumed):
        optimizer.param_groups[0]["momentum"] = tensor(0.9, 0.2, 0.5)
        with pytest.raises(KeyError, match="momentum_buffer"):
            optimizer.step()
    keep_models_(model, resumed, [2, 1, 0])
    resumed.param_groups[0]["momentum"] = tensor(0.5, 0.2, 0.9)
    with pytest.raises(KeyError, match=r"momentum_buffer"):
        resumed.step()
    resumed.step(active=torch.tensor([True, False, True]))
    copy_model_(model, resumed, src=0, dst=1)
    resumed.step()  # model 1 now has model 0's buffer
    keep_models_(model, resumed, [1, 2])
    resumed.step()


@pytest.mark.parametrize("where", ["instance", "global"])
@pytest.mark.parametrize("fused", [None, True], ids=["foreach", "fused"])
def test_step_hooks_and_profiler_label_work_as_in_torch_optim(where, fused) -> None:
    """step() skips torch's profiling wrapper only while nothing would see it: step hooks still run (and
    a pre-hook's new arguments are used), and a profiler still records ``Optimizer.step#<class>.step``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    lr = tensor(1e-2, 1e-3, 3e-2)
    pair = Pair(Adam, torch.optim.Adam, {"lr": lr}, fused=fused, dtype=torch.float32)
    seen = []

    def pre_hook(optimizer, args, kwargs):
        seen.append(("pre", torch.is_grad_enabled()))
        return args, {**kwargs, "active": torch.tensor([True, False, True])}  # skip model 1, as torch would let it

    def post_hook(optimizer, args, kwargs):
        seen.append(("post", kwargs["active"].tolist()))

    if where == "instance":
        handles = [pair.opt.register_step_pre_hook(pre_hook), pair.opt.register_step_post_hook(post_hook)]
    else:
        handles = [register_optimizer_step_pre_hook(pre_hook), register_optimizer_step_post_hook(post_hook)]
    grads = [torch.randn_like(p) for p in pair.params]
    try:
        for p, g in zip(pair.params, grads):
            p.grad = g.clone()
        pair.opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("pre", True), ("post", [True, False, True])]
    for m in (0, 2):  # the references step without hooks: model 1 was skipped
        for q, g in zip(pair.ref_params[m], grads):
            q.grad = g[m].clone()
        pair.ref_opts[m].step()
    exact = fused is None  # the fused path rounds its own way in float32 (test_fused_*)
    pair.check("hooked step", exact=exact)
    pair.step()  # no hooks: the fast path
    pair.check("plain step", exact=exact)
    assert len(seen) == 2

    for p in pair.params:
        p.grad = torch.randn_like(p)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pair.opt.step()
    names = [event.name for event in prof.events()]
    assert names.count("Optimizer.step#Adam.step") == 1


@pytest.mark.parametrize("profiled", [False, True], ids=["plain", "profiled"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["to_none", "to_zero"])
def test_zero_grad_as_torch_optim(set_to_none, profiled) -> None:
    """zero_grad leaves every gradient as torch.optim's does, and a profiler still records its label."""
    params = [torch.nn.Parameter(torch.randn(M, *s)) for s in SHAPES]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = Adam(params, lr=1e-3), torch.optim.Adam(twins, lr=1e-3)
    for p, q in zip(params, twins):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    params[1].grad = twins[1].grad = None  # a parameter without a gradient stays so
    if profiled:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ours.zero_grad(set_to_none=set_to_none)
        assert [e.name for e in prof.events()].count("Optimizer.zero_grad#Adam.zero_grad") == 1
    else:
        ours.zero_grad(set_to_none=set_to_none)
    theirs.zero_grad(set_to_none=set_to_none)
    for p, q in zip(params, twins):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert_equal(p.grad, q.grad, "gradient")
