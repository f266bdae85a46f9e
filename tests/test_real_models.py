"""transformers models built from tiny configs (nothing downloaded), stacked and compared with the N original
models in float64: outputs and parameter gradients, then unstack. Code nobody here wrote: Conv1D linears,
RMSNorm/T5LayerNorm subclasses, learned/offset/sinusoidal position embeddings, class tokens, relative
attention biases, caches, pooled tokens gathered by ``arange``."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
import transformers as tf
from harness import assert_close

from batchlayers import losses, stack, stack_state_dicts, unstack, verify

M, B, T = 2, 3, 5  # M * B != T; test_provenance covers the coincidences
_LM = dict(vocab_size=50, bos_token_id=0, eos_token_id=0)
_CLIP_TOWER = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32)
IMAGES = 2  # images per model beside the B texts of the contrastive models: pairs of B x IMAGES

CONFIGS = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=16, **_LM)),
    "llama": lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                       intermediate_size=32, max_position_embeddings=16, pad_token_id=0, **_LM)
    ),
    "mistral": lambda: tf.MistralForCausalLM(
        tf.MistralConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                         intermediate_size=32, max_position_embeddings=16, pad_token_id=0, **_LM)
    ),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, ffn_dim=32, max_position_embeddings=16,
                     word_embed_proj_dim=16, pad_token_id=1, **_LM)
    ),
    "bert": lambda: tf.BertModel(
        tf.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=50,
                      max_position_embeddings=16)
    ),
    "t5": lambda: tf.T5ForConditionalGeneration(
        tf.T5Config(num_layers=2, num_heads=2, d_model=16, d_kv=8, d_ff=32, vocab_size=50, decoder_start_token_id=0,
                    pad_token_id=0, eos_token_id=1)
    ),
    "bart": lambda: tf.BartForConditionalGeneration(
        tf.BartConfig(encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                      d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=50, max_position_embeddings=16,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    ),
    "vit": lambda: tf.ViTForImageClassification(
        tf.ViTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32, image_size=16,
                     patch_size=4, num_labels=3)
    ),
    "clip-text": lambda: tf.CLIPTextModel(
        tf.CLIPTextConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                          max_position_embeddings=16, projection_dim=8, vocab_size=50)
    ),
    # Contrastive image-text models: logits over pairs of one model's texts and images (text @ image.T)
    "clip": lambda: tf.CLIPModel(
        tf.CLIPConfig(text_config=_CLIP_TOWER | dict(max_position_embeddings=16, vocab_size=50),
                      vision_config=_CLIP_TOWER | dict(image_size=16, patch_size=8), projection_dim=8)
    ),
    "siglip": lambda: tf.SiglipModel(
        tf.SiglipConfig(text_config=_CLIP_TOWER | dict(max_position_embeddings=16, vocab_size=50),
                        vision_config=_CLIP_TOWER | dict(image_size=16, patch_size=8))
    ),
    "whisper": lambda: tf.WhisperForConditionalGeneration(
        tf.WhisperConfig(encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                         d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8,
                         max_target_positions=16, pad_token_id=0, decoder_start_token_id=0, **_LM)
    ),
    # speech recognition fine-tuning: F.ctc_loss of targets concatenated by labels.masked_select(labels >= 0)
    "wav2vec2-ctc": lambda: tf.Wav2Vec2ForCTC(
        tf.Wav2Vec2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                          conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                          num_conv_pos_embedding_groups=2, vocab_size=12, mask_time_prob=0.0, layerdrop=0.0,
                          ctc_loss_reduction="mean")
    ),
    # load-state-dict pre-hooks that rename old checkpoints' keys (kept on the stacked model)
    "mamba": lambda: tf.MambaModel(
        tf.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3)
    ),
    "esm": lambda: tf.EsmModel(
        tf.EsmConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     pad_token_id=1, mask_token_id=49, position_embedding_type="rotary", max_position_embeddings=16)
    ),
}  # fmt: skip


def _moe(model: type, config: type, implementation: str, **options: object):
    """A small mixture-of-experts causal LM: 4 experts, 2 per token, run by ``implementation``."""
    common = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                  max_position_embeddings=16, pad_token_id=0, num_experts_per_tok=2, **_LM)  # fmt: skip
    return lambda: model(config(**common, **options, experts_implementation=implementation))


# transformers' mixture-of-experts layers (``@use_experts_implementation``): "eager" reads which experts some
# token was routed to into Python, "batched_mm" gathers every token's experts' weights.
MOE = {
    "mixtral": _moe(tf.MixtralForCausalLM, tf.MixtralConfig, "eager", intermediate_size=24, num_local_experts=4),
    "mixtral-batched_mm": _moe(
        tf.MixtralForCausalLM, tf.MixtralConfig, "batched_mm", intermediate_size=24, num_local_experts=4
    ),
    "qwen2_moe": _moe(  # and a shared expert with its own gate
        tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig, "eager", intermediate_size=24, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_experts=4,
    ),
    "gpt_oss": _moe(  # biases, transposed weights, its own gate activation, sinks
        tf.GptOssForCausalLM, tf.GptOssConfig, "eager", intermediate_size=24, num_local_experts=4, head_dim=8
    ),
}  # fmt: skip
CONFIGS.update(MOE)


WITH_CACHE = ("gpt2", "llama", "mistral", "opt", "t5", "bart", "whisper", "mamba", *MOE)


def _inputs(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 50, (M, B, T))
    if name == "vit":
        return {"pixel_values": torch.randn(M, B, 3, 16, 16, dtype=torch.float64)}
    if name == "whisper":
        return {"input_features": torch.randn(M, B, 8, 16, dtype=torch.float64), "decoder_input_ids": ids[..., :4]}
    if name in ("t5", "bart"):
        return {"input_ids": ids, "decoder_input_ids": ids[..., :4]}
    if name in ("clip", "siglip"):
        return {"input_ids": ids, "pixel_values": torch.randn(M, IMAGES, 3, 16, 16, dtype=torch.float64)}
    if name == "wav2vec2-ctc":
        return {"input_values": torch.randn(M, B, 200, dtype=torch.float64)}  # 19 frames
    return {"input_ids": ids}


def _main_output(out) -> torch.Tensor:
    for key in ("logits", "logits_per_image"):
        if hasattr(out, key):
            return getattr(out, key)
    return out.last_hidden_state


@pytest.fixture(autouse=True)
def _quiet_transformers():
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()
    yield
    tf.logging.set_verbosity(verbosity)


def _originals(name: str) -> list[torch.nn.Module]:
    models = []
    for i in range(M):
        torch.manual_seed(i)
        models.append(CONFIGS[name]().double().eval())
    return models


def _assert_same_gradients(batched: torch.nn.Module, models: list[torch.nn.Module], name: str) -> None:
    references = [dict(m.named_parameters()) for m in models]
    for pname, p in batched.named_parameters():
        if p.grad is not None:
            expected = torch.stack([ref[pname].grad for ref in references])
            assert_close(p.grad, expected, msg=f"{name}: gradient of {pname}")


@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_model_stacks_exactly(name: str, execution: str) -> None:
    """Model by model, each model's cache object differs and is not stacked: the decoders run without one."""
    models = _originals(name)
    batched = stack(models, execution=execution)
    inputs = _inputs(name)
    options = {"use_cache": False} if execution == "model_by_model" and name in WITH_CACHE else {}
    out = batched(**inputs, **options)
    refs = [models[i](**{k: v[i] for k, v in inputs.items()}, **options) for i in range(M)]
    _assert_same_outputs(out, refs, name)
    grad = torch.randn_like(_main_output(out))
    (_main_output(out) * grad).sum().backward()
    for i, r in enumerate(refs):
        (_main_output(r) * grad[i]).sum().backward()
    _assert_same_gradients(batched, models, name)
    for original, back in zip(models, unstack(batched)):
        assert type(back) is type(original)
        state = back.state_dict()
        for key, value in original.state_dict().items():
            assert_close(state[key], value, msg=f"{name}: unstacked {key}")


def _assert_same_outputs(out: object, refs: list, name: str) -> None:
    for key in ("logits", "last_hidden_state", "pooler_output", "logits_per_image", "logits_per_text", "image_embeds"):
        if getattr(refs[0], key, None) is not None:
            assert_close(getattr(out, key), torch.stack([getattr(r, key) for r in refs]), msg=f"{name} {key}")


@pytest.mark.parametrize("execution", ["batched", "model_by_model"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_model_under_inference_mode(name: str, execution: str) -> None:
    """Under ``torch.inference_mode()`` tensors have no version counters and views do not record their base,
    which batchlayers' checks of in-place writes read: the outputs are still each original's."""
    models = _originals(name)
    batched = stack(models, execution=execution)
    inputs = _inputs(name)
    options = {"use_cache": False} if execution == "model_by_model" and name in WITH_CACHE else {}
    with torch.inference_mode():
        out = batched(**inputs, **options)
        refs = [models[i](**{k: v[i] for k, v in inputs.items()}, **options) for i in range(M)]
    _assert_same_outputs(out, refs, name)


def test_load_state_dict_hooks_rename_old_checkpoints_keys() -> None:
    """Mamba renames an old checkpoint's ``embedding.`` keys before loading: on the stacked model too (its
    tensors move as they are), and the unstacked models get the hook back as it was."""
    models = _originals("mamba")
    old_style = [{k.replace("embeddings.", "embedding."): v for k, v in m.state_dict().items()} for m in models]
    assert any(k.startswith("embedding.") for k in old_style[0])
    batched = stack([_originals("mamba")[0]] * M)  # other weights: loading must bring the originals'
    with torch.inference_mode():  # (tensors made there have no version counter)
        stacked_old_style = stack_state_dicts(old_style)
    batched.load_state_dict(stacked_old_style)
    ids = torch.randint(3, 50, (M, B, T))
    expected = torch.stack([m(input_ids=ids[i]).last_hidden_state for i, m in enumerate(models)])
    assert_close(batched(input_ids=ids).last_hidden_state, expected, msg="after loading old keys")
    for i, back in enumerate(unstack(batched)):
        back.load_state_dict(old_style[i])
        assert_close(back(input_ids=ids[i]).last_hidden_state, expected[i], msg=f"unstacked model {i}")


class _TransposesOldWeights(torch.nn.Module):
    """Its load-state-dict hook transposes an old checkpoint's weight: a value computed per model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self._register_load_state_dict_pre_hook(self._transpose_old)

    def _transpose_old(self, state_dict, prefix, *args) -> None:
        old = state_dict.pop(prefix + "fc.weight_t", None)
        if old is not None:
            state_dict[prefix + "fc.weight"] = old.transpose(-1, -2)

    def forward(self, x):
        return self.fc(x)


def test_load_state_dict_hook_that_computes_values_is_refused() -> None:
    batched = stack([_TransposesOldWeights() for _ in range(M)])
    state = batched.state_dict()
    batched.load_state_dict(state)  # (nothing to rename: the hook leaves the entries as they are)
    state["fc.weight_t"] = state.pop("fc.weight")
    with pytest.raises(ValueError, match=r"hook of the model itself \(_TransposesOldWeights\) read the state dict's"):
        batched.load_state_dict(state)


class _BranchesOnShape(torch.nn.Module):
    """Its hook moves an old entry by its shape: on a stacked state dict it would see (M, *) shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self._register_load_state_dict_pre_hook(self._by_shape)

    def _by_shape(self, state_dict, prefix, *args) -> None:
        old = state_dict.pop(prefix + "old", None)
        if old is not None:
            state_dict[prefix + ("fc.bias" if old.shape[0] == 4 else "fc.weight")] = old

    def forward(self, x):
        return self.fc(x)


def test_load_state_dict_hook_that_reads_shapes_is_refused() -> None:
    batched = stack([_BranchesOnShape() for _ in range(M)])
    state = batched.state_dict()
    state["old"] = state.pop("fc.bias")
    with pytest.raises(ValueError, match=r"hook of the model itself \(_BranchesOnShape\) read .*\(Tensor.shape"):
        batched.load_state_dict(state)


def _labels(name: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Labels with a different number of ignored (-100) positions per model."""
    if name == "vit":
        return torch.randint(0, 3, (M, B))
    if name == "wav2vec2-ctc":  # CTC targets: up to 5 characters (1..11; 0 is the blank), -100 after
        labels = torch.randint(1, 12, (M, B, 5))
        labels[0, 0, 2:] = -100
        labels[1, 2, 1:] = -100
        return labels
    shape = inputs.get("decoder_input_ids", inputs.get("input_ids")).shape
    labels = torch.randint(3, 50, shape)
    labels[0, 0, 1:] = -100
    labels[1, :, -1] = -100
    return labels


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "t5", "bart", "vit", "whisper", "wav2vec2-ctc"])
def test_transformers_loss_is_each_models_own(name: str) -> None:
    """``labels`` given: the model computes its loss in forward (transformers' own loss functions, -100
    ignored); the stacked ``loss`` is ``(M,)``, each model's own, and its sum trains each model exactly."""
    models = _originals(name)
    batched = stack(models)
    inputs = _inputs(name)
    inputs["labels"] = _labels(name, inputs)
    out = batched(**inputs)
    expected = torch.stack([models[i](**{k: v[i] for k, v in inputs.items()}).loss for i in range(M)])
    assert_close(out.loss, expected, msg=f"{name} loss")
    out.loss.sum().backward()
    expected.sum().backward()
    _assert_same_gradients(batched, models, name)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("name", ["gpt2", "llama", "opt"])
def test_cached_decoding_is_exact(name: str, mode: type) -> None:
    """A prefill then T = 1 steps, each model with its own cache (transformers' DynamicCache): the stacked
    model's cache holds every model's keys and values, and every step's logits are each model's own."""
    models = _originals(name)
    batched = stack(models)
    cache = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    ids = torch.randint(3, 50, (M, B, T))
    with mode():
        out = batched(input_ids=ids, use_cache=True)
        refs = [m(input_ids=ids[i], use_cache=True) for i, m in enumerate(models)]
        for step in range(4):
            assert_close(out.logits, torch.stack([r.logits for r in refs]), msg=f"{name} step {step}")
            if step == 3:
                break
            token = out.logits[:, :, -1:].argmax(-1)
            out = batched(input_ids=token, use_cache=True, **{cache: getattr(out, cache)})
            refs = [
                m(input_ids=token[i], use_cache=True, **{cache: getattr(r, cache)})
                for i, (m, r) in enumerate(zip(models, refs))
            ]


@pytest.mark.parametrize("shared", [True, False], ids=["shared padded batch", "own padded batches"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "opt", "clip-text", "bert", "t5", "bart"])
def test_padded_attention_masks(name: str, shared: bool) -> None:
    """Padding in the attention mask (transformers builds its masks by indexing with arange(B) and kv
    positions). A shared padded batch is exact for every model; so is each model's own batch with padding
    in one model's batch only, where transformers asks whether a model's mask is all ones (``mask.all()``,
    ``mask.sum() == mask.numel()``) to skip building it: the models answer differently, and all of them
    build their masks (right for any mask)."""
    models = _originals(name)
    batched = stack(models)
    lead = (B,) if shared else (M, B)
    ids = torch.randint(3, 50, (*lead, T))
    mask = torch.ones(*lead, T, dtype=torch.long)
    mask[(0,) * len(lead) + (slice(-2, None),)] = 0  # the first sample (of model 0 only, when not shared)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name in ("t5", "bart"):
        inputs["decoder_input_ids"] = ids[..., :4]
    if shared:
        inputs = {k: v.expand(M, *v.shape) for k, v in inputs.items()}
    result = verify(models, batched, **inputs)
    assert result.passed.all(), f"{name}\n{result}"


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"])
def test_moe_layers_in_float32(implementation: str) -> None:
    """Mixtral in float32 with each of transformers' experts implementations (``grouped_mm``, its default,
    sorts the tokens by expert and takes no float64): the stacked model is each original model, its experts
    layer a batched layer that also takes ``(M, B, *)`` tensors on its own (an index past the experts
    treated as each original treats it), and it saves and copies."""
    config = tf.MixtralConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=32,
                              intermediate_size=48, max_position_embeddings=16, pad_token_id=0, num_local_experts=4,
                              num_experts_per_tok=2, experts_implementation=implementation, **_LM)  # fmt: skip
    models = []
    for i in range(M):
        torch.manual_seed(i)
        models.append(tf.MixtralForCausalLM(config).eval())
    batched = stack(models)
    ids = torch.randint(3, 50, (M, B, T))
    result = verify(models, batched, input_ids=ids)
    assert result.passed.all(), f"{implementation}\n{result}"

    layer = batched.model.layers[1].mlp.experts
    originals = [m.model.layers[1].mlp.experts for m in models]
    hidden = torch.randn(M, B * T, 32)
    weights, index = torch.randn(M, B * T, 4).softmax(-1).topk(2)
    expected = torch.stack([e(hidden[i], index[i], weights[i]) for i, e in enumerate(originals)])
    assert_close(layer(hidden, index, weights), expected, msg="the experts layer called on its own")
    buffer = io.BytesIO()
    torch.save(batched, buffer)
    buffer.seek(0)
    with torch.no_grad():
        logits = batched(input_ids=ids).logits
        for other in (torch.load(buffer, weights_only=False), copy.deepcopy(batched)):
            assert torch.equal(other(input_ids=ids).logits, logits)

    if implementation == "grouped_mm":  # its row for an index past the experts is memory never written (the
        return  # original's own output differs from call to call)
    index[0, 0, 0] = 4  # no expert (nor model 1's first): each implementation's own answer (dropped, or an IndexError)
    try:
        expected = torch.stack([e(hidden[i], index[i], weights[i]) for i, e in enumerate(originals)])
    except IndexError:
        with pytest.raises(IndexError):
            layer(hidden, index, weights)
    else:
        assert_close(layer(hidden, index, weights), expected, msg="an index past the experts")


class _RoutedModel(torch.nn.Module):
    """A router and an experts layer of the user's own class, decorated by transformers, whose forward keeps
    how many tokens each expert got: in place (``counted_in_place``) or by assigning the buffer anew."""

    def __init__(self, counted_in_place: bool) -> None:
        super().__init__()
        config = tf.MixtralConfig(hidden_size=16, num_local_experts=4, experts_implementation="eager")
        self.router = torch.nn.Linear(16, 4, bias=False)
        self.experts = _CountingExperts(config)
        self.experts.in_place = counted_in_place

    def forward(self, x: torch.Tensor, fixed_weights: bool = False) -> torch.Tensor:
        weights, index = self.router(x).softmax(-1).topk(2)
        if fixed_weights:  # one table for all the tokens, sized by the batch: no samples in it
            weights = torch.full((B, T, 2), 0.5, dtype=x.dtype)
        return self.experts(x.flatten(0, 1), index.flatten(0, 1), weights.flatten(0, 1)).view_as(x)


@tf.integrations.moe.use_experts_implementation
class _CountingExperts(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 16))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 8))
        self.act_fn = torch.nn.SiLU()
        self.register_buffer("counts", torch.zeros(4))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        counts = torch.bincount(top_k_index.flatten(), minlength=self.num_experts).to(self.counts.dtype)
        if self.in_place:
            self.counts.add_(counts)
        else:
            self.counts = self.counts + counts
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():  # only the experts this model's tokens were routed to
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, -1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


@pytest.mark.parametrize("counted_in_place", [True, False], ids=["in place", "assigned anew"])
def test_own_experts_layer_runs_each_model(counted_in_place: bool) -> None:
    """An experts layer of the user's own class (decorated with transformers' ``use_experts_implementation``)
    runs each model on its own tokens: its outputs, gradients and the count it keeps in place are each
    model's own; a buffer assigned anew in forward cannot be kept per model, and is refused by name."""
    models = []
    for i in range(M):
        torch.manual_seed(i)
        models.append(_RoutedModel(counted_in_place).double())
    batched = stack(models)
    x = torch.randn(M, B, T, 16, dtype=torch.float64)
    if not counted_in_place:
        with pytest.raises(ValueError, match="'experts': its forward assigned 'counts' anew"):
            batched(x)
        return
    result = verify(models, batched, x)
    assert result.passed.all(), str(result)
    batched(x)
    for i, model in enumerate(models):
        model(x[i])
        assert_close(batched.experts.counts[i], model.experts.counts, msg=f"model {i}'s counts")


def test_experts_layer_input_without_samples_is_refused() -> None:
    """An experts layer's inputs are rows of tokens: one that holds no samples (a table the model built for its
    own batch size) would give each model a table of every model's size; refused, naming the layer."""
    models = [_RoutedModel(counted_in_place=True).double() for _ in range(M)]
    for model in models:  # each original runs with the table
        model(torch.randn(B, T, 16, dtype=torch.float64), fixed_weights=True)
    with pytest.raises(ValueError, match="'experts': its input of shape \\(15, 2\\) holds none of the models' samples"):
        stack(models)(torch.randn(M, B, T, 16, dtype=torch.float64), fixed_weights=True)


# as in test_compile: inductor's first import, and dynamo reading .grad of the tensors it traces
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_moe_model_is_each_original() -> None:
    """``torch.compile`` of a stacked Mixtral: the experts layers run eagerly between compiled graphs (their
    loops over experts depend on the data), outputs and gradients each model's own."""
    models = _originals("mixtral")
    batched = stack(models)
    ids = torch.randint(3, 50, (M, B, T))
    out = torch.compile(batched)(input_ids=ids, use_cache=False).logits
    refs = [m(input_ids=ids[i], use_cache=False).logits for i, m in enumerate(models)]
    assert_close(out, torch.stack(refs), msg="compiled logits")
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    for i, r in enumerate(refs):
        (r * grad[i]).sum().backward()
    _assert_same_gradients(batched, models, "compiled mixtral")


@pytest.mark.parametrize("shape", [(M, 3, 6), (M, 1, 2), (M, 2, 1), (M, 2, 4)],
                         ids=["T == M*B", "B == 1, T == M", "T == 1", "M*B == T == experts"])  # fmt: skip
@pytest.mark.parametrize("name", ["mixtral", "mixtral-batched_mm"])
def test_moe_layers_where_sizes_coincide(name: str, shape: tuple[int, int, int]) -> None:
    """The experts layers' rows are told by the tracker, not by sizes: exact where the token count, the batch,
    the models and the 4 experts coincide."""
    models = _originals(name)
    result = verify(models, stack(models), input_ids=torch.randint(3, 50, shape))
    assert result.passed.all(), f"{name} {shape}\n{result}"


def test_contrastive_loss_outside_forward_is_each_clip_models_own() -> None:
    """CLIP's in-forward loss (``return_loss=True``) reads ``len(logits)``, a plain number batchlayers cannot
    follow: refused, naming ``len()``. The documented replacement, batchlayers' cross-entropy of the stacked
    ``(M, B, B)`` logits against ``arange(B)``, is each model's own ``clip_loss`` and trains each exactly."""
    models = _originals("clip")
    batched = stack(models)
    ids, pixels = torch.randint(3, 50, (M, B, T)), torch.randn(M, B, 3, 16, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"len\(\) of a tensor that holds the models' samples"):
        batched(input_ids=ids, pixel_values=pixels, return_loss=True)
    out = batched(input_ids=ids, pixel_values=pixels)
    targets = torch.arange(B).expand(M, B)
    loss = (
        losses.cross_entropy(out.logits_per_text, targets) + losses.cross_entropy(out.logits_per_image, targets)
    ) / 2
    expected = torch.stack(
        [m(input_ids=ids[i], pixel_values=pixels[i], return_loss=True).loss for i, m in enumerate(models)]
    )
    assert_close(loss, expected, msg="contrastive loss")
    loss.sum().backward()
    expected.sum().backward()
    _assert_same_gradients(batched, models, "clip")


# Models whose forward applies custom torch.autograd.Functions (their backward is recomputed per model): bloom's
# GeLUFunction (in training), sew_d's XSoftmax, recurrent_gemma's SqrtBoundDerivative. Dropout off: the
# training-mode paths are deterministic and compare with the originals.
WITH_FUNCTIONS = {
    "bloom": lambda: tf.BloomForCausalLM(
        tf.BloomConfig(vocab_size=50, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0)
    ),
    "sew_d": lambda: tf.SEWDModel(
        tf.SEWDConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=2, squeeze_factor=2, max_position_embeddings=16,
                      position_buckets=8, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
                      feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)
    ),
    "recurrent_gemma": lambda: tf.RecurrentGemmaForCausalLM(
        tf.RecurrentGemmaConfig(num_hidden_layers=2, vocab_size=50, hidden_size=16, intermediate_size=32,
                                num_attention_heads=2, lru_width=16, attention_window_size=8, conv1d_width=4,
                                block_types=("recurrent", "attention"), head_dim=8, num_key_value_heads=1)
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", WITH_FUNCTIONS)
def test_custom_autograd_functions_in_training_are_each_models_own(name: str) -> None:
    models = []
    for i in range(M):
        torch.manual_seed(i)
        models.append(WITH_FUNCTIONS[name]().double().train())
    batched = stack(models)
    if name == "sew_d":
        inputs = {"input_values": torch.randn(M, B, 160, dtype=torch.float64)}
    else:  # (bloom builds its alibi bias from the mask)
        inputs = {"input_ids": torch.randint(3, 50, (M, B, T)), "attention_mask": torch.ones(M, B, T, dtype=torch.long)}
    out = _main_output(batched(**inputs))
    refs = [_main_output(m(**{k: v[i] for k, v in inputs.items()})) for i, m in enumerate(models)]
    assert_close(out, torch.stack(refs), msg=f"{name} output")
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    for i, r in enumerate(refs):
        (r * grad[i]).sum().backward()
    _assert_same_gradients(batched, models, name)
