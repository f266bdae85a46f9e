"""keep_models_ / copy_model_ / index_models_: training continues exactly like the models' own torch runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, unbatch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchlayers import losses as BL
from batchlayers.amp import GradScaler
from batchlayers.container import Folded
from batchlayers.linear import BatchedLinear
from batchlayers.optim import SGD, Adam, PerModelValue
from batchlayers.optim.lr_scheduler import ReduceLROnPlateau
from batchlayers.population import copy_model_, index_models_, keep_models_

B = 6


class RunningMean(nn.Module):
    """One model's module with a buffer: a running mean of its input, used to check buffers follow."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(features, dtype=torch.float64))

    def forward(self, x):
        if self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


class BatchedRunningMean(nn.Module):
    def __init__(self, num_models: int, features: int) -> None:
        super().__init__()
        self.num_models = num_models
        self.register_buffer("running_mean", torch.zeros(num_models, features, dtype=torch.float64))

    def forward(self, x):
        if self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(1))
        return x


def batched_net(num_models: int) -> nn.Module:
    net = nn.Sequential(
        BatchedLinear(num_models, 4, 8, dtype=torch.float64),
        Folded(nn.Tanh()),
        BatchedRunningMean(num_models, 8),
        BatchedLinear(num_models, 8, 2, dtype=torch.float64),
    )
    net.num_models = num_models  # as the converter sets it on containers; index_models_ updates it too
    return net


def torch_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 8, dtype=torch.float64), nn.Tanh(), RunningMean(8), nn.Linear(8, 2, dtype=torch.float64)
    )


class Population:
    """A batched model + optimizer + scheduler, and the per-model torch runs it must equal."""

    def __init__(self, num_models: int, optimizer: str = "adam") -> None:
        torch.manual_seed(0)
        self.model = batched_net(num_models)
        self.refs = unbatch(self.model, torch_net)
        lr = torch.linspace(0.01, 0.05, num_models, dtype=torch.float64)
        momentum = torch.linspace(0.0, 0.9, num_models, dtype=torch.float64)
        if optimizer == "adam":
            self.opt = Adam(self.model.parameters(), lr=lr, betas=(momentum.clamp(max=0.8), 0.99), weight_decay=0.01)
            self.ref_opts = [
                torch.optim.Adam(
                    r.parameters(), lr=lr[m].item(), betas=(min(momentum[m].item(), 0.8), 0.99), weight_decay=0.01
                )
                for m, r in enumerate(self.refs)
            ]
        else:
            self.opt = SGD(self.model.parameters(), lr=lr, momentum=momentum, dampening=0.1)
            self.ref_opts = [
                torch.optim.SGD(r.parameters(), lr=lr[m].item(), momentum=momentum[m].item(), dampening=0.1)
                for m, r in enumerate(self.refs)
            ]
        schedule = lambda epoch: 1.0 / (1 + 0.3 * epoch)  # noqa: E731  (uses base_lrs every step)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.ref_opts]
        self.x = torch.randn(num_models, B, 4, dtype=torch.float64)
        self.y = torch.randn(num_models, B, 2, dtype=torch.float64)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            BL.mse_loss(self.model(self.x), self.y).sum().backward()
            self.opt.step()
            self.sched.step()
            for m, (ref, opt, sched) in enumerate(zip(self.refs, self.ref_opts, self.ref_scheds)):
                opt.zero_grad()
                F.mse_loss(ref(self.x[m]), self.y[m]).backward()
                opt.step()
                sched.step()

    def check(self, msg: str = "") -> None:
        state = self.model.state_dict()
        assert len(self.refs) == self.model[0].num_models == self.model[2].num_models
        for key, value in state.items():
            expected = torch.stack([r.state_dict()[key] for r in self.refs])
            assert_close(value, expected, msg=f"{msg}: {key}")
        expected_lr = torch.tensor([o.param_groups[0]["lr"] for o in self.ref_opts], dtype=torch.float64)
        assert_close(self.opt.param_groups[0]["lr"].as_subclass(torch.Tensor), expected_lr, msg=f"{msg}: lr")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_keep_models_continues_the_kept_runs(optimizer) -> None:
    pop = Population(5, optimizer)
    pop.train(3)
    params = list(pop.model.parameters())
    keep = [3, 1, 4]
    keep_models_(pop.model, pop.opt, keep, schedulers=[pop.sched])
    assert [id(p) for p in pop.model.parameters()] == [id(p) for p in params], "parameters were replaced"
    assert isinstance(pop.opt.param_groups[0]["lr"], PerModelValue)
    pop.refs = [pop.refs[m] for m in keep]
    pop.ref_opts = [pop.ref_opts[m] for m in keep]
    pop.ref_scheds = [pop.ref_scheds[m] for m in keep]
    pop.x, pop.y = pop.x[keep], pop.y[keep]
    pop.check("right after keep_models_")
    pop.train(3)
    pop.check("3 steps after keep_models_")
    keep_models_(pop.model, pop.opt, torch.tensor([2]), schedulers=[pop.sched])
    pop.refs, pop.ref_opts, pop.ref_scheds = pop.refs[2:], pop.ref_opts[2:], pop.ref_scheds[2:]
    pop.x, pop.y = pop.x[2:], pop.y[2:]
    pop.train(2)
    pop.check("down to one model")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_copy_model_is_the_pbt_exploit_step(optimizer) -> None:
    pop = Population(4, optimizer)
    pop.train(3)
    copy_model_(pop.model, pop.opt, src=[2, 0], dst=[0, 3], schedulers=[pop.sched])
    # The reference: dst's torch model, optimizer and scheduler load src's state (all read before writing).
    snapshot = copy.deepcopy(
        [(r.state_dict(), o.state_dict(), s.state_dict()) for r, o, s in zip(pop.refs, pop.ref_opts, pop.ref_scheds)]
    )
    for src, dst in [(2, 0), (0, 3)]:
        ref_state, opt_state, sched_state = snapshot[src]
        pop.refs[dst].load_state_dict(ref_state)
        pop.ref_opts[dst].load_state_dict(opt_state)
        pop.ref_scheds[dst].load_state_dict(sched_state)
        pop.x[dst], pop.y[dst] = pop.x[src].clone(), pop.y[src].clone()
    pop.check("right after copy_model_")
    # Explore: perturb the copies' learning rates in the (M,) tensor (and in their own torch runs).
    pop.opt.param_groups[0]["lr"][0] *= 1.5
    pop.sched.base_lrs[0][0] *= 1.5
    pop.ref_opts[0].param_groups[0]["lr"] *= 1.5
    pop.ref_scheds[0].base_lrs[0] *= 1.5
    pop.train(3)
    pop.check("3 steps after copy_model_ and perturbing")


def test_copy_model_without_hyperparameters_keeps_dst_values() -> None:
    pop = Population(3)
    pop.train(1)
    lr = pop.opt.param_groups[0]["lr"].clone()
    copy_model_(pop.model, pop.opt, 1, 2, copy_hyperparameters=False)
    assert torch.equal(pop.opt.param_groups[0]["lr"], lr)
    assert torch.equal(pop.model[0].weight[2], pop.model[0].weight[1])
    assert torch.equal(
        pop.opt.state[pop.model[0].weight]["exp_avg"][2], pop.opt.state[pop.model[0].weight]["exp_avg"][1]
    )


def test_index_models_keeps_objects_and_updates_num_models() -> None:
    torch.manual_seed(0)
    model = batched_net(4)
    model(torch.randn(4, B, 4, dtype=torch.float64)).sum().backward()
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ids = [id(t) for t in [*model.parameters(), *model.buffers()]]
    assert index_models_(model, [2, -2, 0]) is model  # -2 is model 2 of 4
    assert [id(t) for t in [*model.parameters(), *model.buffers()]] == ids
    assert all(m.num_models == 3 for m in model.modules() if hasattr(m, "num_models"))
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, before[n][[2, 2, 0]]), n
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n][[2, 2, 0]]), n
    assert model(torch.randn(3, B, 4, dtype=torch.float64)).shape == (3, B, 2)


def test_keep_models_with_a_torch_optimizer() -> None:
    """Plain torch.optim over batched parameters: per-element state is indexed, the 0-d step stays."""
    torch.manual_seed(0)
    model = batched_net(3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, B, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    exp_avg = opt.state[model[0].weight]["exp_avg"].clone()
    keep_models_(model, opt, torch.tensor([True, True, False]))
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], exp_avg[[0, 1]])
    assert opt.state[model[0].weight]["step"].dim() == 0
    model(torch.randn(2, B, 4, dtype=torch.float64)).sum().backward()
    opt.step()


BAD = [
    ("out-of-range", lambda m, o: keep_models_(m, o, [0, 3]), ValueError, r"\[0, 3\] out of range for 3 models"),
    ("negative", lambda m, o: keep_models_(m, o, [-4]), ValueError, r"out of range for 3 models \(-3 to 2\)"),
    ("empty", lambda m, o: keep_models_(m, o, []), ValueError, "non-empty 1-D"),
    ("mask-shape", lambda m, o: keep_models_(m, o, torch.tensor([True, False])), ValueError, r"shape \(M,\) = \(3,\)"),
    ("mask-empty", lambda m, o: keep_models_(m, o, torch.zeros(3, dtype=torch.bool)), ValueError, "selects no model"),
    ("bool-src", lambda m, o: copy_model_(m, o, torch.tensor([True, False, True]), [0, 1]), TypeError, "integers"),
    ("floats", lambda m, o: keep_models_(m, o, [0.0, 1.0]), TypeError, "integers"),
    ("2-d", lambda m, o: index_models_(m, torch.tensor([[0, 1]])), ValueError, "1-D"),
    ("dst-repeats", lambda m, o: copy_model_(m, o, [0, 1], [2, 2]), ValueError, "repeats"),
    ("src-dst-length", lambda m, o: copy_model_(m, o, [0, 1], [2]), ValueError, "differ in length"),
]


@pytest.mark.parametrize("row", BAD, ids=[r[0] for r in BAD])
def test_bad_calls_raise_and_change_nothing(row) -> None:
    _, call, exc, pattern = row
    torch.manual_seed(0)
    model = batched_net(3)
    opt = Adam(model.parameters(), lr=torch.tensor([0.1, 0.2, 0.3]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=pattern):
        call(model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_inconsistent_models_raise() -> None:
    model = batched_net(3)
    model.register_buffer("scalar", torch.zeros(()))
    with pytest.raises(ValueError, match="'scalar' is 0-d"):
        index_models_(model, [0])
    model = batched_net(3)
    model[2].num_models = 4
    with pytest.raises(ValueError, match=r"num_models \[3, 4\]"):
        keep_models_(model, None, [0])
    model = batched_net(3)
    other = nn.Parameter(torch.zeros(3, 2))
    opt = SGD([{"params": [*model.parameters(), other]}], lr=0.1)
    with pytest.raises(ValueError, match="mixes the model's parameters with other tensors"):
        keep_models_(model, opt, [0])


@settings(max_examples=20, deadline=None)
@given(
    num_models=st.integers(1, 5),
    data=st.data(),
)
def test_random_keep_indexes_everything(num_models, data) -> None:
    torch.manual_seed(0)
    keep = data.draw(st.lists(st.integers(0, num_models - 1), min_size=1, max_size=num_models + 1))
    model = batched_net(num_models)
    opt = Adam(model.parameters(), lr=torch.rand(num_models, dtype=torch.float64) * 0.1, amsgrad=True)
    BL.mse_loss(
        model(torch.randn(num_models, B, 4, dtype=torch.float64)), torch.zeros(num_models, B, 2)
    ).sum().backward()
    opt.step(active=torch.arange(num_models) % 2 == 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    lr = opt.param_groups[0]["lr"].clone()
    keep_models_(model, opt, keep)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k][keep]), k
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt_state[id(p)][k][keep]), k
    assert torch.equal(opt.param_groups[0]["lr"], lr[keep])


def test_training_continues_while_an_old_graph_is_still_referenced() -> None:
    """A graph from before keep_models_ (a loss the caller still holds) must not break the next backward,
    and the kept models must then get exactly the gradients of a fresh copy of themselves."""
    torch.manual_seed(0)
    model = batched_net(4)
    opt = SGD(model.parameters(), lr=0.1)
    old_loss = model(torch.randn(4, B, 4, dtype=torch.float64)).sum()
    old_loss.backward()
    opt.step()
    keep_models_(model, opt, [3, 1])
    reference = copy.deepcopy(model)
    x = torch.randn(2, B, 4, dtype=torch.float64)
    model.zero_grad()
    model(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, msg=name)
    assert old_loss.requires_grad  # still alive: the case that used to fail


def test_keep_models_on_a_stacked_gpt_leaves_its_shared_mask_alone() -> None:
    """A converted model keeps buffers equal in every model (the causal mask) as one copy: keeping models
    must index everything else and then behave like the stack of just those original models."""
    import models as zoo

    from batchlayers.convert import shared_buffers, stack

    torch.manual_seed(0)
    originals = [zoo.GPT().double() for _ in range(3)]
    stacked = stack(originals)
    assert shared_buffers(stacked), "the GPT's causal mask should be kept as one shared buffer"
    opt = Adam(stacked.parameters(), lr=1e-3)
    keep_models_(stacked, opt, [2, 0])
    expected = stack([originals[2], originals[0]])
    idx = torch.randint(0, zoo.GPTConfig().vocab_size, (2, B, 8))
    assert_close(stacked(idx).logits, expected(idx).logits, msg="logits after keep_models_")


# -- per-model ReduceLROnPlateau and the schedulers that must follow keep_models_ / copy_model_ ----------------


class PlateauRuns:
    """A batched optimizer and per-model ReduceLROnPlateau, and per model a torch.optim.SGD with torch's own
    ReduceLROnPlateau: the reference the batched scheduler must equal exactly."""

    def __init__(self, lr, kwargs: dict, per_model_min_lr: torch.Tensor | None = None) -> None:
        num_models = 4
        self.param = nn.Parameter(torch.zeros(num_models, 2, dtype=torch.float64))
        self.opt = SGD([self.param], lr=lr)
        min_lr = {} if per_model_min_lr is None else {"min_lr": per_model_min_lr}
        self.sched = ReduceLROnPlateau(self.opt, **kwargs, **min_lr)
        lrs = lr.tolist() if isinstance(lr, torch.Tensor) else [lr] * num_models
        self.refs = []
        for m in range(num_models):
            opt = torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=lrs[m])
            own_min = {} if per_model_min_lr is None else {"min_lr": per_model_min_lr[m].item()}
            self.refs.append((opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kwargs, **own_min)))

    def step(self, metrics: torch.Tensor) -> None:
        self.sched.step(metrics)
        for (_, ref), metric in zip(self.refs, metrics.tolist()):
            ref.step(metric)

    def check(self, msg: str) -> None:
        expected = torch.tensor([opt.param_groups[0]["lr"] for opt, _ in self.refs], dtype=torch.float64)
        got = torch.as_tensor(self.opt.param_groups[0]["lr"], dtype=torch.float64)
        assert torch.equal(got.as_subclass(torch.Tensor).reshape(-1).expand(len(self.refs)), expected), msg
        for m, (_, ref) in enumerate(self.refs):
            assert self.sched.num_bad_epochs[m].item() == ref.num_bad_epochs, f"{msg}: num_bad_epochs[{m}]"
            assert self.sched.cooldown_counter[m].item() == ref.cooldown_counter, f"{msg}: cooldown[{m}]"
            assert self.sched.best[m].item() == ref.best, f"{msg}: best[{m}]"


PLATEAU_CONFIGS = [
    {"mode": "min", "factor": 0.5, "patience": 1},
    {"mode": "max", "factor": 0.3, "patience": 2, "threshold_mode": "abs", "threshold": 0.05},
    {"mode": "min", "factor": 0.1, "patience": 0, "cooldown": 2, "eps": 1e-3},
    {"mode": "max", "factor": 0.7, "patience": 1, "threshold": 0.2, "cooldown": 1},
]


@pytest.mark.parametrize("kwargs", PLATEAU_CONFIGS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("lr", ["per-model", "float"])
@pytest.mark.parametrize("min_lr", ["float", "per-model"])
def test_reduce_lr_on_plateau_equals_torch_per_model(kwargs, lr, min_lr) -> None:
    torch.manual_seed(0)
    start = torch.tensor([0.1, 0.05, 0.2, 0.01], dtype=torch.float64) if lr == "per-model" else 0.1
    floor = torch.tensor([1e-3, 2e-2, 0.0, 5e-3], dtype=torch.float64) if min_lr == "per-model" else None
    runs = PlateauRuns(start, {**kwargs, **({} if floor is not None else {"min_lr": 4e-3})}, floor)
    metrics = torch.rand(25, 4, dtype=torch.float64)
    metrics[:, 1] = torch.linspace(1, 0, 25) * (-1 if kwargs["mode"] == "max" else 1)  # model 1 always improves
    metrics[5:9, 2] = float("nan")  # a NaN metric is a bad epoch, as in torch
    for t, row in enumerate(metrics):
        runs.step(row)
        runs.check(f"epoch {t}")
    lrs = runs.opt.param_groups[0]["lr"]
    assert isinstance(lrs, torch.Tensor) and len(set(lrs.tolist())) > 1, "the models' learning rates should differ"
    stepped_lrs = runs.sched.get_last_lr()[0]
    assert torch.equal(torch.as_tensor(stepped_lrs), torch.as_tensor(lrs).as_subclass(torch.Tensor))


def test_reduce_lr_on_plateau_state_dict_resumes_exactly() -> None:
    runs = PlateauRuns(torch.tensor([0.1, 0.05, 0.2, 0.01], dtype=torch.float64), {"patience": 1, "cooldown": 1})
    metrics = torch.rand(12, 4, dtype=torch.float64)
    for row in metrics[:5]:
        runs.step(row)
    saved_opt, saved_sched = copy.deepcopy(runs.opt.state_dict()), runs.sched.state_dict()
    runs.step(metrics[5])  # a saved state does not change afterwards
    param = nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))
    resumed_opt = SGD([param], lr=0.5)
    resumed = ReduceLROnPlateau(resumed_opt)
    resumed_opt.load_state_dict(saved_opt)
    resumed.load_state_dict(saved_sched)
    for row in metrics[5:]:
        resumed.step(row)
    for row in metrics[6:]:
        runs.step(row)
    assert torch.equal(resumed_opt.param_groups[0]["lr"], runs.opt.param_groups[0]["lr"])
    for name in ("best", "num_bad_epochs", "cooldown_counter"):
        assert torch.equal(getattr(resumed, name), getattr(runs.sched, name)), name


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "found-by-itself"])
def test_plateau_follows_keep_and_copy(passed) -> None:
    """keep_models_ / copy_model_ index and copy the scheduler's per-model state, passed or not; model i then
    continues exactly like its own torch run."""
    runs = PlateauRuns(torch.tensor([0.1, 0.05, 0.2, 0.01], dtype=torch.float64), {"patience": 1, "cooldown": 1})
    model = nn.ParameterList([runs.param])  # the optimizer's parameter
    metrics = torch.rand(20, 4, dtype=torch.float64)
    for row in metrics[:6]:
        runs.step(row)
    schedulers = {"schedulers": [runs.sched]} if passed else {}
    keep_models_(model, runs.opt, [3, 0, 2], **schedulers)
    runs.refs = [runs.refs[m] for m in (3, 0, 2)]
    runs.check("after keep_models_")
    copy_model_(model, runs.opt, src=2, dst=0, **schedulers)
    ref_opt, ref_sched = runs.refs[0]
    ref_opt.load_state_dict(runs.refs[2][0].state_dict())
    ref_sched.load_state_dict(runs.refs[2][1].state_dict())
    runs.check("after copy_model_")
    for row in metrics[6:, :3]:
        runs.step(row)
        runs.check("training on")


def test_keep_models_without_a_torch_scheduler_it_cannot_find() -> None:
    """A torch scheduler with per-model learning rates is not found from its optimizer: keep_models_ refuses a
    call that keeps M (its base_lrs would silently belong to other models), and lets one that changes M through
    (the scheduler's lists keep the old length: its next use raises rather than mixing models)."""
    model = BatchedLinear(3, 4, 2, dtype=torch.float64)
    opt = Adam(model.parameters(), lr=torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    weight = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"keep_models_: param_groups\[0\] .* 'initial_lr'.*schedulers=\[scheduler\]"):
        keep_models_(model, opt, [2, 1, 0])
    assert torch.equal(model.weight, weight) and opt.param_groups[0]["lr"].tolist() == [0.1, 0.2, 0.3]
    keep_models_(model, opt, [2, 1, 0], schedulers=[sched])
    assert [t.tolist() for t in sched.base_lrs] == [[0.3, 0.2, 0.1]]
    keep_models_(model, opt, [0, 1])  # changes M: allowed, and the stale scheduler would raise at its next step
    assert model.weight.shape[0] == 2
    model(torch.randn(2, B, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"shape \(2,\) to a value of shape \(3,\)"):
        sched.step()


def test_plateau_refuses_an_optimizer_whose_models_changed_behind_it() -> None:
    runs = PlateauRuns(torch.tensor([0.1, 0.05, 0.2, 0.01], dtype=torch.float64), {"patience": 1})
    index_models_(nn.ParameterList([runs.param]), [0, 1])  # the parameters only: not keep_models_
    with pytest.raises(ValueError, match=r"param group 0 holds 2 models, this scheduler's state 4; .*keep_models_"):
        runs.sched.step(torch.ones(2))


# -- batchlayers.amp.GradScaler: its (M,) scale and growth tracker follow the models (the reference test against
# torch.amp.GradScaler per model is tests/test_amp.py::test_scaler_follows_keep_and_copy_models) ------------------


def scaled_step(model: nn.Module, optimizer, scaler: GradScaler, num_models: int) -> None:
    """One mixed-precision step; model 0's gradient overflows, so that the models' scales differ."""
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(num_models, B, 4, dtype=torch.float64)).square().mean((1, 2))).sum().backward()
    model[0].weight.grad[0, 0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


def scaled_population(num_models: int = 3) -> tuple[nn.Module, Adam, GradScaler]:
    torch.manual_seed(0)
    model = batched_net(num_models)
    optimizer = Adam(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    scaled_step(model, optimizer, scaler, num_models)
    return model, optimizer, scaler


LEFT_BEHIND = [
    ("keep-reorder", lambda m, o, **kw: keep_models_(m, o, [2, 0, 1], **kw)),
    ("keep-duplicate", lambda m, o, **kw: keep_models_(m, o, [0, 0, 1], **kw)),
    ("keep-fewer", lambda m, o, **kw: keep_models_(m, o, [1, 2], **kw)),
    ("copy", lambda m, o, **kw: copy_model_(m, o, 0, 2, **kw)),
    ("copy-no-hyperparameters", lambda m, o, **kw: copy_model_(m, o, 0, 2, copy_hyperparameters=False, **kw)),
]


@pytest.mark.parametrize("row", LEFT_BEHIND, ids=[r[0] for r in LEFT_BEHIND])
def test_a_scaler_left_behind_is_refused(row) -> None:
    """A GradScaler that steps the optimizer but is not passed would keep each position's old model's scale: the
    call is refused (whether or not M changes) and changes nothing; scalers=[] says no scaler follows."""
    _, call = row
    model, optimizer, scaler = scaled_population()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    scale = scaler.get_scale()
    assert scale.unique().numel() == 2
    with pytest.raises(ValueError, match=r"stepped by a batchlayers\.amp\.GradScaler .*scalers=\[scaler\]"):
        call(model, optimizer)
    assert torch.equal(scaler.get_scale(), scale)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    call(model, optimizer, scalers=[])  # told that no scaler follows: allowed, the scaler keeps its state
    assert torch.equal(scaler.get_scale(), scale)


def test_one_scaler_over_two_optimizers_is_carried_once() -> None:
    """One scaler stepping the optimizers of two models: it is passed to one of the two keep_models_ calls (after
    which the other optimizer no longer needs it); passing it again would index it twice and is refused."""
    torch.manual_seed(0)
    first, second = batched_net(3), batched_net(3)
    first_opt, second_opt = Adam(first.parameters(), lr=0.01), SGD(second.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=torch.tensor([1.0, 2.0, 4.0]))
    for model, optimizer in ((first, first_opt), (second, second_opt)):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(3, B, 4, dtype=torch.float64)).sum((1, 2))).sum().backward()
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(ValueError, match="stepped by a batchlayers.amp.GradScaler"):
        keep_models_(second, second_opt, [2, 0, 1])
    keep_models_(first, first_opt, [2, 0, 1], scalers=[scaler])
    assert scaler.get_scale().tolist() == [4.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"scalers\[0\] does not step this optimizer.*carried"):
        keep_models_(second, second_opt, [2, 0, 1], scalers=[scaler])
    keep_models_(second, second_opt, [2, 0, 1])  # the scaler has followed already
    assert scaler.get_scale().tolist() == [4.0, 1.0, 2.0]
    for model, optimizer in ((first, first_opt), (second, second_opt)):  # both steps follow the scaler again
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(3, B, 4, dtype=torch.float64)).sum((1, 2))).sum().backward()
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(ValueError, match="stepped by a batchlayers.amp.GradScaler"):
        keep_models_(second, second_opt, [0, 1])


def test_bad_scalers_raise_and_change_nothing() -> None:
    model, optimizer, scaler = scaled_population()
    scale = scaler.get_scale()
    other = GradScaler("cpu", num_models=4)
    rows = [
        (lambda: keep_models_(model, optimizer, [1, 0, 2], scalers=scaler), TypeError, "list of batchlayers.amp"),
        (lambda: keep_models_(model, optimizer, [1, 0, 2], scalers=[torch.amp.GradScaler("cpu")]), TypeError,
         r"scalers\[0\] is a GradScaler from torch\.amp.*batchlayers\.amp\.GradScaler"),
        (lambda: keep_models_(model, optimizer, [1, 0, 2], scalers=[scaler, other]), ValueError,
         r"scalers\[1\] holds 4 models, the model 3"),
        (lambda: copy_model_(model, optimizer, 0, 1, scalers=[scaler, scaler]), ValueError,
         r"scalers\[1\] is scalers\[0\] again"),
        (lambda: keep_models_(model, None, [1, 0, 2], scalers=[scaler]), ValueError, "without their optimizer"),
    ]  # fmt: skip
    for call, exc, pattern in rows:
        with pytest.raises(exc, match=pattern):
            call()
        assert torch.equal(scaler.get_scale(), scale) and model[0].num_models == 3
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(3, B, 4, dtype=torch.float64)).square().mean((1, 2))).sum().backward()
    scaler.unscale_(optimizer)  # between unscale_ and update: the found infs are the old models'
    with pytest.raises(ValueError, match=r"scalers\[0\] is in the middle of an iteration.*after scaler\.update\(\)"):
        keep_models_(model, optimizer, [1, 0, 2], scalers=[scaler])
    assert torch.equal(scaler.get_scale(), scale)
