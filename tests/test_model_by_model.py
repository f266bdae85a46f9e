"""stack(models, execution="model_by_model"): the architecture's forward once per model, against the N
original models."""

from __future__ import annotations

import collections
import copy
import pickle
import weakref

import models as zoo
import pytest
import torch
import torch.nn.functional as F
from convert_harness import assert_threads_get_their_own, assert_unchanged, compare_training, seeded, snapshot
from harness import assert_close
from torch import Tensor, nn

import batchlayers as bl
from batchlayers import backends
from batchlayers._model_by_model import CLONED_SHARED_MAX_NUMEL, ModelByModel
from batchlayers.convert import shared_buffers


def _images(lead, size: int = 8):
    return torch.randn(*lead, 3, size, size, dtype=torch.float64)


def _tokens(lead):
    return torch.randint(0, 11, (*lead, 8))


# name: (factory, make_input, logits)
ARCHITECTURES = {
    "MLP": (zoo.MLP, lambda lead: torch.randn(*lead, 6, dtype=torch.float64), None),
    "CNN-BN-residual": (zoo.CNN, _images, None),
    "SE": (zoo.SENet, _images, None),
    "depthwise-grouped": (zoo.DepthwiseNet, _images, None),
    "GroupNorm": (zoo.GroupNormNet, _images, None),
    "U-Net": (zoo.TinyUNet, lambda lead: _images(lead, 10), None),
    "GPT": (zoo.GPT, _tokens, lambda out: out.logits),
    "GPT-positions-T": (lambda: zoo.GPT(zoo.GPTConfig(position_indices="T")), _tokens, lambda out: out.logits),
    "LSTM-LM": (zoo.LSTMLanguageModel, _tokens, None),
}


def _stacked(factory, num_models: int, **kwargs) -> tuple[nn.Module, list[nn.Module]]:
    batched = bl.stack([seeded(factory, i) for i in range(num_models)], execution="model_by_model", **kwargs)
    return batched, [seeded(factory, i) for i in range(num_models)]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("num_models", [1, 3])
def test_matches_original_models(arch: str, num_models: int) -> None:
    factory, make_input, logits = ARCHITECTURES[arch]
    models = [seeded(factory, i) for i in range(num_models)]
    before = [snapshot(m) for m in models]
    batched = bl.stack(models, execution="model_by_model")
    assert type(batched) is type(models[0]) and isinstance(vars(batched)["forward"], ModelByModel)
    references = [seeded(factory, i) for i in range(num_models)]
    compare_training(batched, references, make_input, logits=logits or (lambda out: out))
    for m, b in zip(models, before):
        assert_unchanged(m, b)


@pytest.mark.parametrize("arch", ["GPT-positions-T", "CNN-BN-residual"])
@pytest.mark.parametrize("num_models, batch", [(2, 4), (3, 3), (3, 1)], ids=["M*B == T", "B == M", "B == 1"])
def test_sizes_that_coincide(arch: str, num_models: int, batch: int) -> None:
    """GPT's arange(T) positions with M*B == T (8) are refused by the batched forward as ambiguous."""
    factory, make_input, logits = ARCHITECTURES[arch]
    batched, references = _stacked(factory, num_models)
    compare_training(batched, references, make_input, logits=logits or (lambda out: out), batch=batch)


@pytest.mark.parametrize("arch", ["MLP", "CNN-BN-residual"])
def test_shared_input(arch: str) -> None:
    factory, make_input, _ = ARCHITECTURES[arch]
    batched, references = _stacked(factory, 3)
    compare_training(batched, references, make_input, shared=True)


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_convolutions_run_channels_last_on_the_cpu_by_default(strategy: str) -> None:
    """The conv strategy setting decides the layout: channels-last for "auto" (and the *_channels_last
    strategies), torch.nn's own for the plain ones. Either way the results are the originals'."""
    batched, references = _stacked(zoo.CNN, 2)
    seen = []
    batched.layer1[0].register_forward_hook(lambda module, args, out: seen.append(out))  # a non-leaf block
    old = backends.conv.strategy
    backends.conv.strategy = strategy
    try:
        compare_training(batched, references, _images, steps=1)
    finally:
        backends.conv.strategy = old
    assert len(seen) == 2 * 2  # one train and one eval pass, once per model
    channels_last = seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    assert channels_last == (strategy == "auto")


@pytest.mark.parametrize("inference_mode", [False, True], ids=["no_grad", "inference_mode"])
def test_a_models_channels_last_inputs_are_freed_before_the_next_model_runs(inference_mode: bool) -> None:
    """Each convolution's channels-last copy of its input is batchlayers' own, made for the convolution alone:
    without gradients nothing holds it after the call, so one model's inputs are gone before the next model
    runs (holding every model's until the pass ends costs memory and the cache locality model by model is for:
    the U-Net's inference ran at 0.68x the loop with them held, 0.82x without, in three quick benchmark runs)."""
    batched, references = _stacked(zoo.CNN, 3)
    per_model = sum(isinstance(m, nn.Conv2d) for m in references[0].modules())
    copies: list = []

    def convolution_input(module: nn.Module, args: tuple, out: Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            assert args[0].is_contiguous(memory_format=torch.channels_last)
            earlier_models = copies[: len(copies) // per_model * per_model]
            assert all(ref() is None for ref in earlier_models), "an earlier model's convolution input is still held"
            copies.append(weakref.ref(args[0]))

    x = _images((3, 2))
    handle = nn.modules.module.register_module_forward_hook(convolution_input)
    try:
        with torch.inference_mode() if inference_mode else torch.no_grad():
            out = batched(x)
    finally:
        handle.remove()
    assert len(copies) == 3 * per_model
    with torch.no_grad():
        for i, reference in enumerate(references):
            assert_close(out[i], reference(x[i]))


def test_a_layer_changed_after_a_call_is_used_as_changed() -> None:
    """Each batched layer's torch.nn layer is kept between calls: a changed momentum or padding mode builds it
    again."""
    batched, references = _stacked(zoo.CNN, 2)
    x = _images((2, 3))
    batched(x)
    for i, r in enumerate(references):
        r(x[i])
    for model in (batched, *references):
        model.bn1.momentum = 0.5
        model.layer2.conv1.padding_mode = "circular"
    compare_training(batched, references, _images)


# ------------------------------------------------------------------------------------------------------
# What the batched forward must refuse is exact here: every model runs on its own samples.


class _MixesSamples(nn.Module):
    """Code that mixes a model's samples (or reads sizes that hold all models' in the batched forward)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # (B, 4)
        if self.pattern == "roll over the batch":
            return self.fc(torch.roll(x, 1, 0))
        if self.pattern == "per-sample arange":
            return self.fc(x + torch.arange(x.size(0), dtype=x.dtype)[:, None])
        if self.pattern == "row of the batch max":
            return self.fc(x - x[x[:, 0].argmax()])
        if self.pattern == "unknown op":
            return self.fc(torch.special.bessel_j0(x))
        raise AssertionError(self.pattern)


@pytest.mark.parametrize("pattern", ["roll over the batch", "per-sample arange", "row of the batch max", "unknown op"])
def test_patterns_the_batched_forward_refuses_are_exact(pattern: str) -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError):
        bl.stack([seeded(lambda: _MixesSamples(pattern), i) for i in range(2)])(x)
    batched, references = _stacked(lambda: _MixesSamples(pattern), 2)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 4, dtype=torch.float64), batch=3)


class _FlatTokens(nn.Module):
    """Tokens flattened to rows, positions repeated by a batch size read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.pos = nn.Linear(4, 4), nn.Embedding(6, 4)

    def forward(self, x):  # (B, T, 4)
        h = self.proj(x)
        positions = self.pos(torch.arange(h.size(1)).repeat(h.size(0)))  # (B * T, 4)
        return self.proj(h.reshape(-1, 4) + positions).view_as(h)


def test_positions_repeated_by_a_size_read_in_forward() -> None:
    """The batched forward reads N * B there and refuses, pointing here; model by model it is exact."""
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"computed from a size read from the models' samples alone.*model_by_model'"):
        bl.stack([seeded(_FlatTokens, i) for i in range(2)])(x)
    batched, references = _stacked(_FlatTokens, 2)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 5, 4, dtype=torch.float64), batch=3)


class _PerModelOwnCode(nn.Module):
    """A parameter and a buffer outside any layer (a ViT's cls token, a cache the forward fills)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 4))
        self.proj = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(4))

    def forward(self, x):  # (B, T, 4)
        h = torch.cat([self.token.expand(x.size(0), -1, -1), self.proj(x)], dim=1)
        self.cache = self.proj.weight.detach().sum(0)  # assigned anew: each model's own
        return h * self.cache


def test_per_model_tensors_of_the_architectures_own_code() -> None:
    batched, references = _stacked(_PerModelOwnCode, 3)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 5, 4, dtype=torch.float64))
    assert batched.cache.shape == (3, 4)
    assert_close(batched.cache, torch.stack([r.cache for r in references]), msg="cache")


class _LeNet(nn.Module):
    def __init__(self, write: bool = False) -> None:
        super().__init__()
        self.write = write
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv(x)), 2)
        flat = h.view(h.size(0), -1)  # needs torch.nn's layout; the pass keeps it channels-last
        if self.write:
            h.mul_(2)
        return self.fc(flat)


def test_view_of_a_channels_last_activation() -> None:
    batched, references = _stacked(_LeNet, 2)
    compare_training(batched, references, _images)
    written = bl.stack([seeded(lambda: _LeNet(write=True), i) for i in range(2)], execution="model_by_model")
    with pytest.raises(RuntimeError, match=r"written in place after \.view\(\)"):
        written(_images((2, 3)))


def test_structured_outputs_and_a_loss_in_forward() -> None:
    batched, references = _stacked(zoo.LSTMLanguageModel, 3)
    idx, targets = _tokens((3, 2)), _tokens((3, 2))
    logits, loss = batched(idx, targets=targets)
    refs = [r(idx[i], targets=targets[i]) for i, r in enumerate(references)]
    assert_close(logits, torch.stack([r[0] for r in refs]), msg="logits")
    assert loss.shape == (3,)
    assert_close(loss, torch.stack([r[1] for r in refs]), msg="loss")


# ------------------------------------------------------------------------------------------------------
# The stacked model is left as it was, copies keep the execution, errors are clear


def _state(model: nn.Module) -> list[tuple[str, int]]:
    named = [*model.named_parameters(), *model.named_buffers(), *model.named_modules()]
    return [(n, id(t)) for n, t in named]


class _FailsForModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("cache", torch.randn(3))  # differs between the models: stored (M, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.cache = x.detach().mean(0)
        if torch.isnan(x).any():
            raise KeyError("a model fails")
        return self.fc(x)


def test_an_error_in_forward_leaves_the_model_as_it_was() -> None:
    batched, _ = _stacked(_FailsForModel, 3)
    before, cache = _state(batched), batched.cache
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    bad = x.clone()
    bad[1, 0, 0] = float("nan")  # model 1 fails, after model 0's pass changed the cache and the count
    with pytest.raises(KeyError, match="a model fails"):
        batched(bad)
    assert _state(batched) == before and batched.cache is cache and batched.calls == 0
    out = batched(x)
    assert out.shape == (3, 2, 3) and batched.cache is not cache  # the new caches, stored per model
    assert_close(batched.cache, x.mean(1), msg="cache")
    assert batched.calls == 1  # as each original counts one call


class _SharedCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("cache", torch.zeros(3))  # equal in every model: one buffer shared by all

    def forward(self, x):
        self.cache = x.detach().mean(0) if self.training else self.fc.weight.new_ones(3)
        return self.fc(x)


def test_a_shared_buffer_assigned_in_forward() -> None:
    """Equal in every model, it stays one buffer; different values cannot be kept in one, and are refused."""
    batched, _ = _stacked(_SharedCache, 3)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    batched.eval()(x)
    assert batched.cache.shape == (3,) and torch.equal(batched.cache, torch.ones(3, dtype=torch.float64))
    cache = batched.cache
    with pytest.raises(ValueError, match="different values to 'cache'.*one buffer shared by all models"):
        batched.train()(x)
    assert batched.cache is cache


class _Counts(nn.Module):
    def __init__(self, how: str = "+=") -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros(()))  # equal in every model: one buffer shared by all
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))
        self.how = how

    def forward(self, x):
        # each original counts its own calls and keeps its own statistics; the shared buffers would see M
        # updates per call
        if self.how == "+=":
            self.steps += 1
        elif self.how == ".data":  # a write through .data: a tensor with its own version counter
            self.steps.data.add_(1)
        elif self.how == "F.batch_norm":  # updates its running statistics without bumping their versions
            return F.batch_norm(self.fc(x), self.mean, self.var, training=True, momentum=0.3)
        return self.fc(x) * self.steps


class _Stateful(nn.Module):
    """Python state that forward changes: a call counter (the same in every model), a stashed tensor (each
    model's own), or a number read from the data (different in every model, not storable in one attribute)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.what, self.calls, self.seen = what, 0, []
        self.log: dict[str, list[int]] = {}
        self.cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.total = torch.zeros(())  # a plain attribute, not a buffer

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.size(0))
        self.log.setdefault("sizes", []).append(x.size(1))  # a list inside a dict
        h = self.fc(x) * min(1.0, self.calls / 2)  # a warm-up that counts calls
        if self.what == "stash":
            self.features = h.detach()
        if self.what == "stash in a list and a dict":  # (a history of features, the last ones by name)
            self.seen_features = getattr(self, "seen_features", [])
            self.seen_features.append(h.detach())
            self.cache["last"] = h.detach() * 2
        if self.what == "a number of the data":
            self.largest = float(x.max())
        if self.what == "a cache of the weights":  # filled once, read afterwards (timm's attention bias caches)
            if "bias" not in self.cache:
                self.cache["bias"] = self.fc.bias.detach() * 2
            h = h + self.cache["bias"]
        if self.what == "a tensor written in place":
            self.total.add_(1)
        return h


@pytest.mark.parametrize("what", ["counter", "stash", "stash in a list and a dict", "a cache of the weights"])
def test_python_state_changed_in_forward_is_each_models_own(what: str) -> None:
    """Each model's pass starts from the state the call started with, as each original's call does: the
    counter counts calls, not passes; a list appended to grows by one; a stashed tensor is stored per model,
    also in a list or a dict (each pass then reads its model's, and so does each unstacked model); a cache
    filled once from each model's weights is each model's (timm's attention bias caches; refused before)."""
    batched, references = _stacked(lambda: _Stateful(what), 3)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 3, dtype=torch.float64))
    assert batched.calls == references[0].calls == 3 and batched.seen == references[0].seen
    assert batched.log == references[0].log == {"sizes": [3, 3, 3]}
    if what == "stash":
        assert_close(batched.features, torch.stack([r.features for r in references]), msg="stash")
    if what in ("stash in a list and a dict", "a cache of the weights"):
        for i, (own, reference) in enumerate(zip(bl.unstack(batched), references)):
            for name in ("seen_features", "cache"):
                got, expected = getattr(own, name, None), getattr(reference, name, None)
                assert type(got) is type(expected), f"model {i}'s {name}"
                for key in range(len(expected)) if isinstance(expected, list) else expected or ():
                    assert_close(got[key], expected[key], msg=f"model {i}'s {name}[{key!r}]")


REFUSED_STATE = {
    "a number of the data": "forward left 'largest' with different values in different models",
    "a tensor written in place": r"wrote in place into a tensor of shape \(\) held in a plain attribute",
}


@pytest.mark.parametrize("what", list(REFUSED_STATE))
def test_python_state_that_differs_between_models_is_refused(what: str) -> None:
    batched, _ = _stacked(lambda: _Stateful(what), 3)
    with pytest.raises(ValueError, match=REFUSED_STATE[what]):
        batched(torch.randn(3, 2, 3, dtype=torch.float64))
    assert batched.calls == 0 and batched.seen == [] and batched.log == {} and "largest" not in vars(batched)
    assert not batched.cache


@pytest.mark.parametrize("how", ["+=", ".data", "F.batch_norm"])
def test_a_small_shared_buffer_written_in_forward_is_each_models_own(how: str) -> None:
    """However forward writes it (some writes do not bump the tensor's version), a small buffer shared by all
    models is each pass's own copy: kept one where every pass left the same values (a step counter, which
    counted once per call), stored per model where they differ (running statistics). Refused before."""
    batched, references = _stacked(lambda: _Counts(how), 3)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 3, dtype=torch.float64))
    for name, value in batched.named_buffers():
        expected = torch.stack([dict(r.named_buffers())[name] for r in references])
        assert_close(value if value.dim() == expected.dim() else value.expand_as(expected), expected, msg=name)
    assert "steps" in shared_buffers(batched), "a counter equal in every model stays one buffer"
    assert ("mean" in shared_buffers(batched)) == (how != "F.batch_norm"), "stored per model once they differ"


class _WritesALargeTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("table", torch.zeros(CLONED_SHARED_MAX_NUMEL + 1))

    def forward(self, x):
        self.table[0] += 1
        return self.fc(x) * self.table[0]


def test_a_large_shared_buffer_modified_in_place_is_refused() -> None:
    """A shared buffer too large to copy for every pass (a mask, a table) is the one tensor in every pass: a
    write into it is refused, with its value at the call's start back."""
    batched, _ = _stacked(_WritesALargeTable, 3)
    with pytest.raises(RuntimeError, match="modified the buffer 'table' in place, but it is one copy shared"):
        batched(torch.randn(3, 2, 3, dtype=torch.float64))
    assert not batched.table.any()


def test_copies_pickles_select_and_unstack() -> None:
    batched, references = _stacked(zoo.CNN, 3)
    x = _images((3, 2))
    batched.eval()
    expected = batched(x)
    for clone in (copy.deepcopy(batched), pickle.loads(pickle.dumps(batched))):
        assert vars(clone)["forward"].root is clone
        assert_close(clone(x), expected, msg="copy")
    picked = bl.select(batched, [2, 0])
    assert vars(picked)["forward"].root is picked
    assert_close(picked(x[[2, 0]]), expected[[2, 0]], msg="select")
    for model, reference in zip(bl.unstack(batched), references):
        assert "forward" not in vars(model)
        assert_close(model.eval()(x[0]), reference.eval()(x[0]), msg="unstacked")


def test_set_execution_on_stacked_models_made_otherwise(tmp_path) -> None:
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.pt")
        torch.save(seeded(zoo.CNN, i).state_dict(), paths[-1])
    loaded = bl.set_execution(bl.stack_checkpoints(zoo.CNN().double(), paths), "model_by_model")
    assert isinstance(vars(loaded)["forward"], ModelByModel)
    references = [seeded(zoo.CNN, i) for i in range(3)]
    compare_training(loaded, references, _images)
    back = bl.set_execution(loaded, "batched")
    assert back is loaded and "forward" not in vars(loaded)
    compare_training(loaded, references, _images)  # both trained on, batched now
    made = bl.set_execution(bl.replicate(zoo.MLP, 2), "model_by_model")
    assert isinstance(vars(made)["forward"], ModelByModel)
    with pytest.raises(ValueError, match="execution must be one of"):
        bl.set_execution(loaded, "loop")
    with pytest.raises(TypeError, match="expected a model stacked by batchlayers.stack"):
        bl.set_execution(bl.BatchedLinear(2, 3, 3), "model_by_model")


def test_threads_calling_one_model_each_get_their_own_results() -> None:
    """A pass swaps layers into the model: calls from several threads run one at a time."""
    batched, references = _stacked(zoo.GPT, 2)
    inputs = [_tokens((2, b)) for b in (1, 2, 3, 4)]
    assert_threads_get_their_own(batched, references, inputs, output=lambda out: out.logits)


class _Checkpointed(nn.Module):
    """A segment of forward under torch.utils.checkpoint, run again in backward."""

    def __init__(self, segment: str, reentrant: bool) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.segment, self.reentrant = segment, reentrant

    def forward(self, x):
        segments = {
            "a layer": lambda t: torch.tanh(self.fc(t)),
            "a reduction over the samples": lambda t: torch.tanh(t - t.mean(0)),
        }
        h = torch.utils.checkpoint.checkpoint(segments[self.segment], self.fc(x), use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_layers_are_refused(reentrant: bool) -> None:
    """Run again in backward, after the pass, the segment would call the batched layer with one model's
    batch (M models' weights for B samples: silently wrong where B == M): refused in forward."""
    batched, _ = _stacked(lambda: _Checkpointed("a layer", reentrant), 2)
    x = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"'fc' runs inside torch.utils.checkpoint in a model-by-model pass"):
        batched(x)
    assert isinstance(batched.fc, bl.BatchedLinear)  # put back


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_code_without_layers_is_exact(reentrant: bool) -> None:
    factory = lambda: _Checkpointed("a reduction over the samples", reentrant)  # noqa: E731
    batched, references = _stacked(factory, 3)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 4, dtype=torch.float64, requires_grad=True))


class _NumberOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x), float(x.max())  # a number of the data: not one value for all models


class _HeldInAList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.layers = [self.fc]  # a plain list: not a submodule

    def forward(self, x):
        return self.layers[0](x)


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="execution must be one of"):
        bl.stack([zoo.MLP(), zoo.MLP()], execution="loop")
    batched, _ = _stacked(zoo.MLP, 3)
    with pytest.raises(ValueError, match=r"expected every tensor input shaped \(M, B, \*\) with M=3.*\(2, 4, 6\)"):
        batched(torch.randn(2, 4, 6, dtype=torch.float64))
    batched.fc1.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="'fc1' .*hooks of its own"):
        batched(torch.randn(3, 4, 6, dtype=torch.float64))
    numbers, _ = _stacked(_NumberOut, 2)
    with pytest.raises(ValueError, match=r"model 1's output\[1\] differs from model 0's and is not a tensor"):
        numbers(torch.randn(2, 4, 3, dtype=torch.float64))
    held, _ = _stacked(_HeldInAList, 2)
    with pytest.raises(ValueError, match="not a submodule"):
        held(torch.randn(2, 4, 3, dtype=torch.float64))


# Dynamo itself reads .grad of the output's tensors while tracing the root's output hook.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_torch_compile_runs_the_batched_forward() -> None:
    batched, references = _stacked(zoo.MLP, 2)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    bl.check_batched(batched, x)  # fullgraph=True: its batched forward checked first
    batched.compile(backend="aot_eager", fullgraph=True)
    assert_close(batched(x), torch.stack([r(x[i]) for i, r in enumerate(references)]), msg="compiled")


class _SharesAMovingAverage(nn.Module):
    """One buffer registered in two modules, written through one and read through the other."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        average = torch.zeros(3, dtype=torch.float64)  # (.double() would convert it once per module: untied)
        self.writer, self.reader = nn.Module(), nn.Module()
        self.writer.register_buffer("average", average)
        self.reader.register_buffer("average", average)

    def forward(self, x):
        h = self.fc(x)
        self.writer.average.lerp_(h.detach().mean(0), 0.5)
        return h - self.reader.average


def test_a_small_shared_buffer_held_by_two_modules() -> None:
    """Each pass's copy is one tensor for both modules, and the buffer is stored per model once (the second
    module's entry looked for the name that the first had moved per model)."""
    batched, references = _stacked(_SharesAMovingAverage, 2)
    compare_training(batched, references, lambda lead: torch.randn(*lead, 3, dtype=torch.float64))
    assert batched.writer.average is batched.reader.average
    assert_close(batched.writer.average, torch.stack([r.writer.average for r in references]), msg="average")
