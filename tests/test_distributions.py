"""``torch.distributions`` inside stacked models, as every PPO/SAC/A2C policy uses them: each stacked model's
log-probabilities, entropies, means, KL divergences and reparameterised samples equal its original model's
(outputs, input gradients, parameter gradients), with parameters from the samples (a linear head), stored per
model (``log_std.exp()``), or constants. Argument validation (``validate_args``, on by default) checks each
model's values. Draws are compared with seeded original models where torch's generator gives the same
numbers for one draw of all models' samples as for each model's in turn (the sizes here); otherwise shapes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from convert_harness import assert_exact_or_refused, compare_training, seeded
from harness import assert_close
from torch import Tensor, nn
from torch.distributions import (
    Bernoulli,
    Beta,
    Categorical,
    Distribution,
    Independent,
    MultivariateNormal,
    Normal,
    TanhTransform,
    TransformedDistribution,
    kl_divergence,
)

from batchlayers.convert import stack

SIZES = [(2, 3), (3, 2), (2, 1)]  # M * B of one is B of another


@pytest.fixture(autouse=True)
def _validating() -> Iterator[None]:
    """Argument validation on, as by default: importing torch.compile's machinery turns it off for the whole
    process (``Distribution._validate_args``), so tests run after a compiled one would not check it."""
    before = Distribution._validate_args
    Distribution.set_default_validate_args(True)
    yield
    Distribution.set_default_validate_args(before)


class SquashedNormal(TransformedDistribution):
    """SAC's tanh-squashed Gaussian (as in pytorch_sac and its descendants)."""

    def __init__(self, loc: Tensor, scale: Tensor) -> None:
        self.loc, self.scale = loc, scale
        self.base_dist = Normal(loc, scale)
        super().__init__(self.base_dist, [TanhTransform(cache_size=1)])

    @property
    def mean(self) -> Tensor:
        mu = self.loc
        for transform in self.transforms:
            mu = transform(mu)
        return mu


class Policy(nn.Module):
    """Heads on a ``(B, 4)`` observation; ``x[:, 4:]`` is a given ``(B, 2)`` action. ``log_std`` and
    ``prior`` are per-model parameters that no sample touches."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mu = nn.Linear(4, 2)
        self.sd = nn.Linear(4, 2)
        self.mu2 = nn.Linear(4, 2)
        self.logits = nn.Linear(4, 3)
        self.log_std = nn.Parameter(torch.randn(2) * 0.3)
        self.prior = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return KINDS[self.kind](self, x[:, :4], x[:, 4:])

    def std(self, obs: Tensor) -> Tensor:
        return F.softplus(self.sd(obs)) + 0.1


def _index(act: Tensor) -> Tensor:
    """A class index in {0, 1, 2} per sample, from the given action."""
    return (act[:, 0] > 0).long() + (act[:, 1] > 0).long()


def _columns(*values: Tensor) -> Tensor:
    """``(B,)`` and ``(B, k)`` values side by side, ``(B, *)``."""
    return torch.cat([v.unsqueeze(-1) if v.dim() == 1 else v for v in values], -1)


def _stats(d, value: Tensor, *names: str) -> Tensor:
    """``d.log_prob(value)`` and ``d``'s statistics ``names`` side by side (``entropy``, ``cdf`` of ``value``,
    properties); one for the whole distribution (a per-model one's entropy) is added to each row."""
    lp = d.log_prob(value)
    values = [lp]
    for n in names:
        v = d.entropy() if n == "entropy" else d.cdf(value) if n == "cdf" else getattr(d, n)
        values.append(v + 0 * lp if v.dim() < lp.dim() else v)
    return _columns(*values)


def _categorical_stats(c: Categorical, index: Tensor) -> Tensor:
    lp = c.log_prob(index)
    return _columns(lp, c.entropy() + 0 * lp, c.probs.expand(*lp.shape, 3), c.logits.expand(*lp.shape, 3),
                    c.mode.double() + 0 * lp)  # fmt: skip


def _drawn(d, reparameterised: bool = True) -> Tensor:
    """One draw from ``d`` (the only one in the forward) and its log-probability."""
    a = d.rsample() if reparameterised else d.sample()
    return _columns(a.double(), d.log_prob(a))


def _mvn(loc: Tensor, scale: Tensor) -> MultivariateNormal:
    return MultivariateNormal(loc, scale_tril=torch.diag_embed(scale))


_NORMAL = ("entropy", "mean", "stddev", "variance", "mode", "cdf")
KINDS = {
    # Normal: loc from the samples, scale a per-model parameter, from the samples, or a number
    "normal_param_scale": lambda m, obs, act: _stats(Normal(m.mu(obs), m.log_std.exp()), act, *_NORMAL),
    "normal_sample_scale": lambda m, obs, act: _stats(Normal(m.mu(obs), m.std(obs)), act, *_NORMAL),
    "normal_number_scale": lambda m, obs, act: _stats(Normal(m.mu(obs), 0.5), act, *_NORMAL),
    "normal_param_loc": lambda m, obs, act: _stats(Normal(m.log_std, m.std(obs)), act, *_NORMAL),
    "normal_params_only": lambda m, obs, act: _stats(Normal(m.log_std, m.log_std.exp()), act, "entropy", "stddev"),
    "independent": lambda m, obs, act: _stats(
        Independent(Normal(m.mu(obs), m.log_std.exp()), 1), act, "entropy", "mean", "mode", "stddev"
    ),
    "squashed": lambda m, obs, act: _stats(SquashedNormal(m.mu(obs), m.log_std.exp()), act.tanh() * 0.99, "mean"),
    "squashed_independent": lambda m, obs, act: _stats(
        Independent(TransformedDistribution(Normal(m.mu(obs), m.std(obs)), [TanhTransform(cache_size=1)]), 1),
        act.tanh() * 0.99,
    ),
    "categorical_logits": lambda m, obs, act: _categorical_stats(Categorical(logits=m.logits(obs)), _index(act)),
    "categorical_probs": lambda m, obs, act: _categorical_stats(
        Categorical(probs=m.logits(obs).softmax(-1)), _index(act)
    ),
    "categorical_param": lambda m, obs, act: _categorical_stats(Categorical(logits=m.prior), _index(act)),
    "bernoulli": lambda m, obs, act: _stats(
        Bernoulli(logits=m.mu(obs)), (act > 0).double(), "entropy", "mean", "variance", "probs"
    ),
    "bernoulli_param": lambda m, obs, act: _stats(Bernoulli(probs=m.log_std.sigmoid()), (act > 0).double(), "entropy"),
    "beta": lambda m, obs, act: _stats(
        Beta(m.std(obs) + 1, F.softplus(m.mu(obs)) + 1), act.sigmoid(), "entropy", "mean", "variance"
    ),
    "beta_param": lambda m, obs, act: _stats(Beta(m.log_std.exp(), m.std(obs)), act.sigmoid(), "entropy", "mean"),
    "mvn_diag_param": lambda m, obs, act: _stats(_mvn(m.mu(obs), m.log_std.exp()), act, "entropy", "mean", "variance"),
    "mvn_diag_samples": lambda m, obs, act: _stats(_mvn(m.mu(obs), m.std(obs)), act, "entropy", "mean", "stddev"),
    "mvn_cov_param": lambda m, obs, act: _stats(
        MultivariateNormal(m.mu(obs), covariance_matrix=torch.diag(m.log_std.exp())), act, "entropy", "stddev"
    ),
    "mvn_cov_samples": lambda m, obs, act: _stats(
        MultivariateNormal(m.mu(obs), covariance_matrix=torch.diag_embed(m.std(obs) ** 2)), act, "entropy", "mean"
    ),
    "kl_normal": lambda m, obs, act: kl_divergence(Normal(m.mu(obs), m.log_std.exp()), Normal(m.mu2(obs), m.std(obs))),
    "kl_normal_param": lambda m, obs, act: kl_divergence(
        Normal(m.mu(obs), m.std(obs)), Normal(m.log_std, m.log_std.exp())
    ),
    "kl_independent": lambda m, obs, act: kl_divergence(
        Independent(Normal(m.mu(obs), m.log_std.exp()), 1), Independent(Normal(m.mu2(obs), m.std(obs)), 1)
    ),
    "kl_categorical": lambda m, obs, act: kl_divergence(Categorical(logits=m.logits(obs)), Categorical(logits=m.prior)),
    "kl_mvn": lambda m, obs, act: kl_divergence(_mvn(m.mu(obs), m.std(obs)), _mvn(m.mu2(obs), m.log_std.exp())),
    # Draws: one per forward (a second would take the generator's numbers in another order than the
    # original models run one by one)
    "rsample_normal": lambda m, obs, act: Normal(m.mu(obs), m.log_std.exp()).rsample(),
    "rsample_normal_sample_scale": lambda m, obs, act: Normal(m.mu(obs), m.std(obs)).rsample(),
    "rsample_independent": lambda m, obs, act: _drawn(Independent(Normal(m.mu(obs), m.log_std.exp()), 1)),
    "rsample_squashed": lambda m, obs, act: _drawn(SquashedNormal(m.mu(obs), m.log_std.exp())),  # SAC's actor
    "sample_categorical": lambda m, obs, act: _drawn(Categorical(logits=m.logits(obs)), reparameterised=False),
    "sample_bernoulli": lambda m, obs, act: _drawn(Bernoulli(logits=m.mu(obs)), reparameterised=False),
    "rsample_beta": lambda m, obs, act: Beta(m.std(obs) + 1, m.log_std.exp()).rsample(),
    "rsample_mvn": lambda m, obs, act: _drawn(_mvn(m.mu(obs), m.log_std.exp())),
}
_DRAWS = [k for k in KINDS if "sample" in k.split("_")[0]]
_GIVEN = [k for k in KINDS if k not in _DRAWS]


class Repro(nn.Module):
    """The policy of the bug report: a Gaussian with a per-model log-std and a categorical head."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(4, 2)
        self.log_std = nn.Parameter(torch.randn(2) * 0.3)
        self.logits = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        d = Normal(self.mu(x), self.log_std.exp())
        a = d.rsample()
        c = Categorical(logits=self.logits(x))
        return d.log_prob(a).sum(-1) + c.entropy() + c.log_prob(torch.zeros(x.shape[0], dtype=torch.long))


def _compare(factory, num_models: int, batch: int, features: int, seed: int | None = None) -> None:
    """Output, input gradient and parameter gradients of a stacked model against the original models run
    one by one (with the generator seeded alike before each side, where ``seed`` is given)."""
    originals = [seeded(factory, i) for i in range(num_models)]
    stacked = stack([seeded(factory, i) for i in range(num_models)])
    torch.manual_seed(100)
    x = torch.randn(num_models, batch, features, dtype=torch.float64)
    x_stacked = x.clone().requires_grad_()
    x_own = [x[i].clone().requires_grad_() for i in range(num_models)]
    if seed is not None:
        torch.manual_seed(seed)
    out = stacked(x_stacked)
    if seed is not None:
        torch.manual_seed(seed)
    expected = torch.stack([m(xi) for m, xi in zip(originals, x_own)])
    assert_close(out, expected, msg="output")
    cotangent = torch.randn_like(expected)
    (out * cotangent).sum().backward()
    (expected * cotangent).sum().backward()
    if x_stacked.grad is None:  # (discrete values only: no gradient reaches the input)
        assert all(xi.grad is None for xi in x_own)
    else:
        assert_close(x_stacked.grad, torch.stack([xi.grad for xi in x_own]), msg="input gradient")
    for name, p in stacked.named_parameters():
        own = [dict(m.named_parameters())[name].grad for m in originals]
        expected_grad = torch.stack([g if g is not None else torch.zeros_like(p[0]) for g in own])
        assert_close(p.grad if p.grad is not None else torch.zeros_like(p), expected_grad, msg=f"gradient of {name}")


@pytest.mark.parametrize(("num_models", "batch"), SIZES)
@pytest.mark.parametrize("kind", _GIVEN)
def test_given_values_match_the_original_models(kind, num_models, batch):
    _compare(lambda: Policy(kind), num_models, batch, 6)


@pytest.mark.parametrize(("num_models", "batch"), SIZES)
@pytest.mark.parametrize("kind", _DRAWS)
def test_draws_match_seeded_original_models(kind, num_models, batch):
    _compare(lambda: Policy(kind), num_models, batch, 6, seed=7)


@pytest.mark.parametrize(("num_models", "batch"), SIZES)
def test_bug_report_policy(num_models, batch):
    _compare(Repro, num_models, batch, 4, seed=3)


class _EveryParameter(Policy):
    """A policy whose every parameter gets a gradient (as ``compare_training`` needs)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + 0 * sum(p.sum() for p in self.parameters())


@pytest.mark.parametrize("kind", ["normal_param_scale", "categorical_logits", "kl_normal", "squashed"])
def test_training_steps(kind):
    """Parameters updated from the stacked gradients stay each original model's."""
    num_models = 3
    stacked = stack([seeded(lambda: _EveryParameter(kind), i) for i in range(num_models)])
    originals = [seeded(lambda: _EveryParameter(kind), i) for i in range(num_models)]
    compare_training(stacked, originals, lambda shape: torch.randn(*shape, 6, dtype=torch.float64), batch=2)


@pytest.mark.parametrize(("num_models", "batch"), SIZES)
def test_sample_shapes(num_models, batch):
    """Draws of several samples per row (not comparable with the original models' draws: torch draws normals
    in blocks of 16) hold each model's ``(n, B, *)`` samples, and reparameterised gradients reach the
    right model's parameters: the loc head's bias gradient of a sum of ``rsample`` is the number of draws."""

    class Draws(Policy):
        def forward(self, x):
            d = Normal(self.mu(x[:, :4]), self.log_std.exp())
            c = Categorical(logits=self.logits(x[:, :4]))
            return d.rsample((5,)), c.sample((5,)), Independent(d, 1).sample((5,)).shape

    stacked = stack([seeded(lambda: Draws("normal_param_scale"), i) for i in range(num_models)])
    a, k, shape = stacked(torch.randn(num_models, batch, 6, dtype=torch.float64))
    assert a.shape == (num_models, 5, batch, 2) and k.shape == (num_models, 5, batch)
    assert tuple(shape) == (5, batch, 2)
    assert ((k >= 0) & (k < 3)).all()
    a.sum().backward()
    assert_close(stacked.mu.bias.grad, torch.full((num_models, 2), 5.0 * batch, dtype=torch.float64), msg="bias")


class _BatchSizedScale(nn.Module):
    """A scale or value built from the folded batch size, ``M * B`` there where each model's is ``B``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.mu = nn.Linear(4, 2)
        self.log_std = nn.Parameter(torch.randn(2) * 0.3)

    def forward(self, x):
        h, n = self.mu(x), x.shape[0]
        if self.pattern == "linspace_scale":
            return Normal(h, torch.linspace(0.5, 1.0, n, dtype=h.dtype)[:, None]).log_prob(h * 0.5)
        if self.pattern == "arange_broadcast":
            return torch.broadcast_tensors(h, torch.arange(n, dtype=h.dtype)[:, None])[1] + h
        if self.pattern == "arange_per_model":
            return torch.broadcast_tensors(self.log_std, torch.arange(n, dtype=h.dtype)[:, None])[1] + h
        if self.pattern == "ones_per_model":
            a, b = torch.broadcast_tensors(self.log_std, torch.ones(n, 2, dtype=h.dtype))
            return a * b + h
        if self.pattern == "wide":
            return torch.broadcast_tensors(h[:, None], torch.ones(n, n, 2, dtype=h.dtype))[0].sum(1)
        if self.pattern == "two_dims":
            a, b = torch.broadcast_tensors(h[:, None, :1], h[None, :, :1])
            return (a - b).sum(1)
        raise AssertionError(self.pattern)


@pytest.mark.parametrize(("num_models", "batch"), SIZES)
@pytest.mark.parametrize(
    "pattern", ["linspace_scale", "arange_broadcast", "arange_per_model", "ones_per_model", "wide", "two_dims"]
)
def test_batch_sized_values_are_exact_or_refused(pattern, num_models, batch):
    """``broadcast_tensors`` (through ``broadcast_all``) of the samples or a per-model value with a tensor
    sized by the folded batch: exact where every model's rows get their own values, else refused."""
    assert_exact_or_refused(
        lambda: _BatchSizedScale(pattern),
        num_models,
        lambda shape: torch.randn(*shape, 4, dtype=torch.float64),
        batch,
    )


def test_batch_sized_ones_are_exact():
    assert (
        assert_exact_or_refused(
            lambda: _BatchSizedScale("ones_per_model"), 2, lambda s: torch.randn(*s, 4, dtype=torch.float64), 3
        )
        == "exact"
    )


class _Invalid(nn.Module):
    """A scale that is negative for some models only: their original models raise, so the stacked one must."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.mu = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x):
        h = self.mu(x)
        if self.where == "param":
            return Normal(h, self.scale).log_prob(h * 0.5)
        return Normal(h, self.scale * (x[:, :2] ** 2 + 0.1)).log_prob(h * 0.5)


@pytest.mark.parametrize("where", ["param", "samples"])
def test_invalid_arguments_of_one_model_raise(where):
    models = [seeded(lambda: _Invalid(where), i) for i in range(3)]
    with torch.no_grad():
        models[1].scale.neg_()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError):
        models[1](x[1])
    models[0](x[0])  # the others are valid
    with pytest.raises(ValueError):
        stack(models)(x)
    assert torch.overrides._get_current_function_mode_stack() == []


class _Diagonals(nn.Module):
    """``diagonal``/``diag_embed`` (MultivariateNormal's), by position and keyword, and over the samples."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        m = h.view(-1, 2, 2)
        return {
            "linalg": lambda: torch.linalg.diagonal(A=m) + torch.linalg.diagonal(m, offset=1).sum(-1, keepdim=True),
            "method": lambda: m.diagonal(dim1=-2, dim2=-1) * 2,
            "embed": lambda: torch.diag_embed(input=h[:, :2]).flatten(1) + torch.diag_embed(h, dim1=0, dim2=2).sum(0),
            "over_samples": lambda: h[:, :, None].expand(-1, 4, 4).diagonal(dim1=0, dim2=1).sum(0),
            "embed_samples": lambda: torch.diag_embed(h.T).sum(0),
        }[self.pattern]()


@pytest.mark.parametrize(("num_models", "batch"), SIZES)
@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("linalg", "exact"),
        ("method", "exact"),
        ("embed", "exact"),
        ("over_samples", "refused"),
        ("embed_samples", "refused"),
    ],  # fmt: skip
)
def test_diagonals(pattern, expected, num_models, batch):
    result = assert_exact_or_refused(
        lambda: _Diagonals(pattern), num_models, lambda shape: torch.randn(*shape, 4, dtype=torch.float64), batch
    )
    assert result == expected
