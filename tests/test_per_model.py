"""Per-model values anywhere in the model tree (batchlayers._per_model): parameters and buffers held outside
batched layers, subclasses and look-alikes of torch.nn layers, parametrizations. Each is compared with the
N original models in float64: outputs, parameter gradients and buffers through training steps, then
unstack."""

from __future__ import annotations

import lookalikes as la
import pytest
import torch
from convert_harness import compare_training, seeded
from harness import assert_close
from torch import nn

from batchlayers import replicate, stack, unstack

M = 3


class DataWrites(nn.Module):
    """Writes through ``.data`` in forward: weight clipping (WGAN), a buffer decayed in place, and Glow's
    ActNorm, which initialises its shift and scale from its first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))
        self.loc = nn.Parameter(torch.zeros(4))
        self.log_scale = nn.Parameter(torch.zeros(4))
        self.register_buffer("temperature", torch.full((4,), 2.0))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x):
        h = self.fc(x)
        if not self.initialized:
            self.loc.data.copy_(-h.mean(0))
            self.log_scale.data.copy_(-h.std(0).log())
            self.initialized.fill_(True)
        self.w.data.clamp_(-0.5, 0.5)
        self.temperature.data.mul_(0.9)
        return (h + self.loc) * self.log_scale.exp() * self.w / self.temperature


class PerModelProducts(nn.Module):
    """Matrix products of parameters held outside layers (a low-rank or mixing weight built in forward), one
    of them batched over a dimension as long as the number of models."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.a = nn.Parameter(torch.randn(M, 5))
        self.b = nn.Parameter(torch.randn(M, 5, 2))  # (M as a batch dimension of one model's weight)

    def forward(self, x):
        w = (self.a @ self.b).sum(0) + torch.mm(self.a, self.b[0]) + torch.bmm(self.b, self.b.mT).sum(0)[:M, :2]
        return self.fc(x) @ w.T


CASES = {
    "matrix products of per-model values of different ranks": (PerModelProducts, lambda lead: torch.randn(*lead, 4)),
    "writes through .data: clipping, ActNorm's data init": (DataWrites, lambda lead: torch.randn(*lead, 4)),
    "ViT: cls token, pos embed, gamma, bias table": (la.TinyViT, lambda lead: torch.randn(*lead, 3, 8, 8)),
    "ConvNeXt: std conv, BN+act, LayerNorm2d": (la.ConvNeXtish, lambda lead: torch.randn(*lead, 3, 6, 6)),
    "LM: Conv1D addmm, RMSNorm, scaled/offset embeddings": (la.TinyLM, lambda lead: torch.randint(0, 13, (*lead, 5))),
    "weight_norm, orthogonal, spectral_norm": (la.Parametrized, lambda lead: torch.randn(*lead, 4)),
    "pruned, the old weight_norm": (la.Pruned, lambda lead: torch.randn(*lead, 4)),
    "DeBERTa: relative keys repeated to the batch": (
        la.RelativePositionAttention,
        lambda lead: torch.randn(*lead, 6, 4),
    ),
    "the same, tiled": (
        lambda: la.RelativePositionAttention(tile=True),
        lambda lead: torch.randn(*lead, 6, 4),
    ),
}


def _as_input(x: torch.Tensor) -> torch.Tensor:
    return x if not x.is_floating_point() else x.double()


@pytest.mark.parametrize("shared", [False, True], ids=["own batches", "shared batch"])
@pytest.mark.parametrize("case", list(CASES))
def test_stacks_exactly_against_the_originals(case: str, shared: bool) -> None:
    factory, make_input = CASES[case]
    models = [seeded(factory, i) for i in range(M)]
    references = [seeded(factory, i) for i in range(M)]
    batched = stack(models)
    compare_training(batched, references, lambda lead: _as_input(make_input(lead)), shared=shared)
    for original, back in zip(references, unstack(batched)):
        assert type(back) is type(original)
        for (name, p), (_, q) in zip(original.state_dict().items(), back.state_dict().items()):
            assert_close(q, p, msg=f"unstacked {name}")


def test_per_model_parameters_are_stored_with_the_model_dimension() -> None:
    batched = stack([seeded(la.TinyViT, i) for i in range(M)])
    assert batched.cls_token.shape == (M, 1, 1, 8) and batched.gamma.shape == (M, 8)
    assert batched.norm1.weight.shape == (M, 8)  # a LayerNorm subclass: its own forward, per-model weights
    assert type(batched.norm1) is la._PlainLayerNorm


def test_sizes_read_from_weights_are_one_models() -> None:
    """``self.lm_head.weight.shape[0]`` inside forward is the vocabulary size, not M."""
    models = [seeded(la.TinyLM, i) for i in range(M)]
    batched = stack(models)
    ids = torch.randint(0, 13, (M, 2, 5))
    assert_close(batched(ids), torch.stack([m(ids[i]) for i, m in enumerate(models)]), msg="logits")


def test_python_control_flow_on_per_model_values() -> None:
    x = torch.randn(M, 2, 4, dtype=torch.float64)
    agreeing = [seeded(la.Gate, i) for i in range(M)]
    assert_close(stack(agreeing)(x), torch.stack([m(x[i]) for i, m in enumerate(agreeing)]), msg="same branch")
    differing = [seeded(la.Gate, i) for i in range(M)]
    with torch.no_grad():
        differing[1].gate.fill_(-1.0)
    with pytest.raises(ValueError, match=r"Tensor.item inside a stacked forward gives different results"):
        stack(differing)(x)


class _BatchMean(nn.Module):
    """Mixes a batch's samples outside any batched layer: per-model running mean from x.mean(0)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x * self.scale


def test_a_batch_statistic_into_a_per_model_buffer_is_each_models_own() -> None:
    """``x.mean(0)`` reduces each model's own samples: the running mean is every model's own."""
    compare_training(
        stack([seeded(_BatchMean, i) for i in range(M)]),
        [seeded(_BatchMean, i) for i in range(M)],
        lambda lead: torch.randn(*lead, 4, dtype=torch.float64),
    )


class _SharedWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        out = torch.zeros(4)
        out += self.scale  # a tensor made in forward, shared by all models, given per-model values
        return x * out


def test_writing_per_model_values_into_a_shared_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="writes per-model values into a tensor that all models share"):
        stack([_SharedWrite(), _SharedWrite()])(torch.randn(2, 3, 4))


# dynamo warns about reading .grad of non-leaf tensors while it wraps the tracker's arguments (its own check)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_torch_compile_runs_a_model_with_per_model_code_eagerly() -> None:
    """torch.compile does not pass size reads to the tracker, so the model's own code would read (M, *)
    sizes (TinyLM divides by ``lm_head.weight.shape[0]``): such frames fall back to eager, exact."""
    models = [seeded(la.TinyLM, i) for i in range(2)]
    compiled = torch.compile(stack(models), backend="aot_eager")
    ids = torch.randint(0, 13, (2, 3, 5))
    try:
        assert_close(compiled(ids), torch.stack([m(ids[i]) for i, m in enumerate(models)]), msg="compiled logits")
    finally:
        torch._dynamo.reset()  # the frames it marked to run eagerly must not affect other tests' compiles


@pytest.mark.parametrize(
    "case", ["ViT: cls token, pos embed, gamma, bias table", "LM: Conv1D addmm, RMSNorm, scaled/offset embeddings"]
)
def test_sizes_that_coincide(case: str) -> None:
    """M * B equal to the number of tokens (5), with B = 1: the per-model paths never go by sizes."""
    factory, make_input = CASES[case]
    models = [seeded(factory, i) for i in range(5)]
    references = [seeded(factory, i) for i in range(5)]
    compare_training(stack(models), references, lambda lead: _as_input(make_input(lead)), batch=1)


def test_per_model_buffers_replaced_by_to_are_still_per_model() -> None:
    """``.to()`` replaces buffers (BatchNormAct2d's running statistics, held outside batched layers); the
    next call knows them as per-model again."""
    models = [seeded(la.ConvNeXtish, i).eval() for i in range(M)]
    batched = stack(models).float()
    assert batched.bn.running_mean.dtype == torch.float32
    x = torch.randn(M, 2, 3, 6, 6)
    expected = torch.stack([m.float()(x[i]) for i, m in enumerate(models)])
    torch.testing.assert_close(batched(x), expected)


class _Attributes(nn.Module):
    """Plain (unregistered) attributes read in forward: a temperature, a list of scales, a tensor."""

    def __init__(self, temperature: float = 2.0) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.temperature = temperature
        self.scales = [1.0, 0.5]
        self.offset = torch.randn(3, dtype=torch.float64)  # a plain tensor attribute, different per model

    def forward(self, x):
        return self.fc(x) / self.temperature * self.scales[0] + self.offset


def test_plain_tensor_attributes_that_differ_are_per_model() -> None:
    from batchlayers import concat, select

    models, references = [seeded(_Attributes, i) for i in range(M)], [seeded(_Attributes, i) for i in range(M)]
    batched = stack(models)
    assert batched.offset.shape == (M, 3)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 4, dtype=torch.float64))
    for original, back in zip(references, unstack(batched)):
        assert torch.equal(back.offset, original.offset)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    picked = select(batched, [2, 0])
    assert_close(picked(x), torch.stack([references[2](x[0]), references[0](x[1])]), msg="select")
    joined = concat([select(batched, [0]), select(batched, [1, 2])])
    xs = torch.randn(M, 5, 4, dtype=torch.float64)
    assert_close(joined(xs), torch.stack([r(xs[i]) for i, r in enumerate(references)]), msg="concat")


def _with(name: str, value: object) -> nn.Module:
    model = _Attributes()
    setattr(model, name, value)
    return model


@pytest.mark.parametrize(
    "name, value, shown",
    [
        ("temperature", 3.0, r"'temperature' is 3.0 instead of 2.0"),
        ("scales", [1.0, 0.25], r"'scales' is \[1.0, 0.25\] instead of \[1.0, 0.5\]"),
        ("_private", 1, r"'_private' is 1 instead of 0"),
        ("table", {"a": torch.ones(2)}, r"'table' is \{'a': tensor"),
    ],
)
def test_plain_attributes_that_differ_are_refused_with_their_path(name: str, value: object, shown: str) -> None:
    """Numbers, lists, dicts (tensors inside compared by value), private ones too: never model 0's for all."""
    first = _with(
        name, 0 if name == "_private" else {"a": torch.zeros(2)} if name == "table" else _Attributes().__dict__[name]
    )
    with pytest.raises(ValueError, match=rf"the model itself is configured differently in model 1.*{shown}.*buffer"):
        stack([first, _with(name, value)])


def test_plain_tensor_attributes_of_another_shape_are_refused() -> None:
    other = _Attributes()
    other.offset = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"tensor attribute 'offset' is \(4,\) torch.float64 in model 1 but \(3,\)"):
        stack([_Attributes(), other])


def test_replicate_refuses_plain_tensor_attributes_that_differ() -> None:
    with pytest.raises(ValueError, match=r"replicate: the tensor attribute 'offset' differs.*stack\(models\)"):
        replicate(_Attributes, 2)


def test_replicate_keeps_each_models_pruned_weights() -> None:
    """Pruned weights are plain attributes that differ between models, recomputed before every call: replicate
    keeps each model's (it refuses other differing attributes, above)."""
    made: list[nn.Module] = []

    def factory() -> nn.Module:
        made.append(seeded(la.Pruned, len(made)))
        return made[-1]

    batched = replicate(factory, M)
    for name in ("a.weight", "b.weight", "b.bias", "c.weight"):
        path, _, attr = name.rpartition(".")
        expected = torch.stack([getattr(m.get_submodule(path), attr) for m in made]).detach()
        assert_close(getattr(batched.get_submodule(path), attr), expected, msg=name)
    x = torch.randn(M, 3, 4, dtype=torch.float64)
    assert_close(batched(x), torch.stack([m(x[i]) for i, m in enumerate(made)]), msg="output")
