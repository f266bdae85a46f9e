"""How much of HuggingFace ``transformers`` ``batchlayers.stack`` converts exactly: the base model (``AutoModel``)
of every model type in ``transformers.MODEL_MAPPING_NAMES``, built from its configuration class's defaults
shrunk by one generic recipe (nothing downloaded), stacked from two models with their own weights and compared
with the two originals by :func:`batchlayers.verify` in float64: every output tensor (hidden states, pooled
output, logits, the keys and values of a returned cache, ...) and the gradients of every parameter and of the
floating-point inputs. The text and multimodal counterpart of ``survey_real_models.py``.

    python scripts/survey_transformers.py                     # every model type, a markdown table on stdout
    python scripts/survey_transformers.py gpt2 llama t5       # some of them
    python scripts/survey_transformers.py --model-by-model    # stacked with execution="model_by_model"

The recipe (:func:`_shrink`) sets, where the configuration has them: 2 layers, width 32, 2 attention heads
(1 key/value head), feed-forward width 37, vocabulary 99, 64 positions, a sliding window of 4, 4 experts
(2 per token, run by the eager per-expert loop: ``grouped_mm`` takes no float64), 32x32 images in patches of 8,
every dropout, drop path, layer drop and SpecAugment probability 0; the same in nested configurations
(``text_config``, ``vision_config``, ...). Where that configuration does not build, a second recipe (width 64,
4 heads as key/value heads too, feed-forward 64) is tried. The inputs are those of the model's
``main_input_name``: ``input_ids`` (T=8, with an all-ones ``attention_mask`` and, for an encoder-decoder,
``decoder_input_ids`` of length 5), ``pixel_values``, ``input_values`` (800 samples) or ``input_features``;
``pixel_values`` are added where a model needs both (CLIP). Multimodal models run on text alone. The first set
of inputs the original model runs on is used; a model that runs on none is skipped.

Each model type runs in a worker process, one type at a time with a time limit (a crash or a hang costs only
that type), in eval mode and in train mode (batch 3 per model, 6 in train mode where the model has BatchNorm).
With ``--model-by-model`` the models run with ``use_cache=False``: a model-by-model pass does not stack
transformers' cache objects. A result is:

- ``exact``: every output and gradient within float64 tolerances (``verify``'s: rtol 1e-7, atol 1e-7).
- ``refused``: ``stack`` or the stacked forward raised a ``ValueError``/``TypeError`` from batchlayers' code.
- ``error``: anything else raised (with the last batchlayers frame, if the traceback passes through one).
- ``ill-conditioned``: outside tolerance, but the original model itself moves by at least a tenth as much
  from rounding alone (every parameter and floating input changed by one part in 1e15, or its batch reversed);
  or within float32 tolerances in a model that computes in float32 itself (an RMSNorm's ``.to(torch.float32)``),
  where rounding is float32's and a nudge of 1e-15 is lost.
- ``WRONG``: outside tolerance for no such reason. A silent wrong result: the worst bug batchlayers can have.
- ``skipped``: the model type is not built from the shrunk configuration in time or within 200 MB, needs a
  package or a download, or its original does not run on the generic inputs (or gives NaN or inf); in one
  mode: the original itself raises there (wav2vec2 in train mode sets ``requires_grad`` on a non-leaf input).
"""

from __future__ import annotations

import collections
import copy
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's batchlayers

from survey_real_models import M, _distinct_statistics, _first_line, _no_randomness  # noqa: E402

import batchlayers as bl  # noqa: E402
from batchlayers._fold import map_tensors  # noqa: E402

B, T, T_DECODER, VOCAB = 3, 8, 5, 99
BUILD_SECONDS, CHECK_SECONDS, MAX_BYTES = 20, 60, 200 * 2**20
EXPERTS = "eager"  # how transformers runs mixture-of-experts layers (--experts=...; grouped_mm takes no float64)
_LAYERS = (
    "num_hidden_layers",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "n_layer",
    "n_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "depth",
    "num_text_layers",
    "num_vision_layers",
)
_WIDTHS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim")
_HEADS = ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_FFN = (
    "intermediate_size",
    "ffn_dim",
    "d_ff",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "n_inner",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_intermediate_size",
)
_POSITIONS = ("max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions")
_FIXED = {"vocab_size": VOCAB, "sliding_window": 4, "num_experts": 4, "num_local_experts": 4,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
          "first_k_dense_replace": 1, "image_size": 32, "window_size": 2, "embedding_size": 16,
          "projection_dim": 16, "d_kv": 16, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
          "qk_nope_head_dim": 8, "qk_head_dim": 16, "v_head_dim": 16, "router_jitter_noise": 0.0,
          "use_pretrained_backbone": False, "use_timm_backbone": False}  # fmt: skip
_RECIPES = ({"width": 32, "heads": 2, "kv_heads": 1, "ffn": 37}, {"width": 64, "heads": 4, "kv_heads": 4, "ffn": 64})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _random_off(key: str, value: object) -> bool:
    """Dropout, drop path, layer drop, SpecAugment masking: each model would draw its own random numbers."""
    if not isinstance(value, float) or isinstance(value, bool):
        return False
    return ("dropout" in key or "drop_path" in key or "layerdrop" in key or key.endswith("pdrop")
            or (key.startswith("mask_") and key.endswith("_prob")))  # fmt: skip


def _overrides(config, recipe: dict) -> dict:
    """The shrunk values of ``config``'s attributes, by name (:func:`_shrink`)."""
    from transformers import PreTrainedConfig

    width, heads = recipe["width"], recipe["heads"]
    out: dict = {}
    tokens = iter(range(90, VOCAB))
    for key, value in config.to_dict().items():
        value = getattr(config, key, value)
        if isinstance(value, PreTrainedConfig):
            out[key] = _shrink(value, recipe)
        elif _random_off(key, value):
            out[key] = 0.0
        elif key in _FIXED and (type(value) is type(_FIXED[key]) or value is None and key == "sliding_window"):
            out[key] = _FIXED[key] if value is not None else None
        elif not _is_int(value) and key not in ("depths", "hidden_sizes", "layer_types", "mlp_layer_types"):
            if key in ("eos_token_id",) and isinstance(value, list):
                out[key] = [v if v < 90 else 2 for v in value]
            elif key == "rope_parameters" and isinstance(value, dict) and "mrope_section" in value:
                out[key] = {**value, "mrope_section": [2, 3, 3]}  # sums to head_dim // 2 = 8
        elif key in _LAYERS:
            out[key] = 2
        elif key in _WIDTHS:
            out[key] = width
        elif key in _HEADS:
            out[key] = heads
        elif key in _KV_HEADS:
            out[key] = recipe["kv_heads"]
        elif key == "head_dim":
            out[key] = width // heads
        elif key in _FFN:
            out[key] = recipe["ffn"]
        elif key in _POSITIONS:
            out[key] = 64
        elif key == "patch_size":
            out[key] = min(value, 8)
        elif key.endswith(("token_id", "token_index")) and value >= 90:
            out[key] = next(tokens, 98)
        elif key == "depths" and isinstance(value, list):
            out[key] = [1] * len(value)
        elif key == "hidden_sizes" and isinstance(value, list):
            out[key] = [16 * 2**i for i in range(len(value))]
        elif key in ("layer_types", "mlp_layer_types") and isinstance(value, list) and value:
            kinds = list(dict.fromkeys(value))  # every kind of layer once, where there are two
            out[key] = (kinds * 2)[:2]
    if isinstance(getattr(config, "num_heads", None), list):
        out["num_heads"] = [heads] * len(config.num_heads)
    return out


def _shrink(config, recipe: dict):
    """A small configuration of ``config``'s class: ``config``'s values with :func:`_overrides`'s on top."""
    cls = type(config)
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    overrides = _overrides(config, recipe)
    values = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "model_type")}
    values = {k: getattr(config, k, v) for k, v in values.items()}
    values.update(overrides)
    if not takes_any:
        values = {k: v for k, v in values.items() if k in parameters}
    try:
        return cls(**values)
    except Exception:  # a derived value that no longer fits: the class's defaults with the overrides only
        return cls(**{k: v for k, v in overrides.items() if takes_any or k in parameters})


class _Timeout(Exception):
    pass


def _alarm(seconds: int):
    def fire(signum, frame):
        raise _Timeout(f"over {seconds} s")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)


def _build(model_type: str) -> tuple[list[nn.Module], str]:
    """M models of ``model_type`` with their own weights, float64, and what was changed to build them."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES[model_type]
    cls = getattr(tf, name[0] if isinstance(name, tuple) else name)
    default = tf.CONFIG_MAPPING[model_type]()
    failure: Exception | None = None
    for number, recipe in enumerate(_RECIPES):
        try:
            config = _shrink(default, recipe)
            config._experts_implementation = EXPERTS
            with torch.device("meta"):
                size = sum(p.numel() for p in cls(config).parameters()) * 8
            if size > MAX_BYTES:
                raise _Skip(f"{size / 2**20:.0f} MB in float64")
            torch.manual_seed(0)
            first = cls(config)
        except (_Timeout, _Skip):
            raise
        except Exception as exc:
            failure = failure or exc
            continue
        models = [first]
        for i in range(1, M):
            torch.manual_seed(i)
            models.append(cls(config))
        return [_no_randomness(m).double() for m in models], "" if number == 0 else "recipe 2"
    assert failure is not None
    raise failure


class _Skip(Exception):
    pass


def _cache_tensors(obj: object, unfold) -> object:
    """A transformers cache (or any of its parts) as nested dicts of its tensors, each through ``unfold``."""
    if isinstance(obj, torch.Tensor):
        return unfold(obj)
    if isinstance(obj, (list, tuple)):
        return [_cache_tensors(v, unfold) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _cache_tensors(v, unfold) for k, v in obj.items()}
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers"):
        return {k: _cache_tensors(v, unfold) for k, v in vars(obj).items() if not k.startswith("_")}
    return None


def _is_cache(obj: object) -> bool:
    return "cache" in type(obj).__name__.lower() and type(obj).__module__.startswith("transformers")


class _Plain(nn.Module):
    """``model``'s output with every cache object replaced by its tensors, which ``verify`` then compares. A
    stacked model's caches hold the models' samples one after the other, ``(M * B, *)``: returned ``(M, B, *)``."""

    def __init__(self, model: nn.Module, stacked: bool = False):
        super().__init__()
        self.model, self.stacked = model, stacked

    def forward(self, **inputs):
        batch = next(t for t in inputs.values() if isinstance(t, torch.Tensor)).shape[1 if self.stacked else 0]

        def unfold(t: torch.Tensor) -> torch.Tensor:
            if self.stacked and t.dim() == 1 and t.numel() == 0:  # an empty placeholder (a layer not filled yet)
                return t.expand(M, 0)
            if self.stacked and t.dim() == 0:  # a number the cache keeps for all its rows (bailing_hybrid's)
                return t.expand(M)
            return t.unflatten(0, (M, batch)) if self.stacked and t.dim() and t.shape[0] == M * batch else t

        def plain(obj: object) -> object:
            if _is_cache(obj):
                return _cache_tensors(obj, unfold)
            if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
                return [plain(v) for v in obj]
            if isinstance(obj, dict):
                return {str(k): plain(v) for k, v in obj.items()}
            return obj

        return plain(self.model(**inputs))


def _outputs_and_gradients(model: nn.Module, inputs: dict, options: dict, flip: bool = False) -> dict:
    """Every output tensor of ``model`` on the first model's inputs (its batch reversed, and the outputs back),
    and the gradients of its parameters for random cotangents, by name."""
    own = {k: v[0].flip(0) if flip else v[0] for k, v in inputs.items()}
    own = {k: v.detach().requires_grad_() if v.is_floating_point() else v for k, v in own.items()}
    batch = next(iter(own.values())).shape[0]
    found: dict[str, torch.Tensor] = {}
    map_tensors(_Plain(model)(**own, **options), lambda t, where: found.setdefault(where, t))
    if flip:
        found = {k: t.flip(0) if t.dim() and t.shape[0] == batch else t for k, t in found.items()}
    generator = torch.Generator().manual_seed(0)
    total = sum(
        (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
        for t in found.values()
        if t.requires_grad and t.is_floating_point()
    )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if isinstance(total, torch.Tensor) and named:
        grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
        found.update({f"grad of {n}": g for (n, _), g in zip(named, grads) if g is not None})
    return found


def _sensitivity(model: nn.Module, inputs: dict, options: dict, nudge: float = 1e-15) -> float:
    """How much the original model's outputs and gradients move from rounding alone: every parameter and
    floating input changed by one part in 1e15 (``nudge``), or its batch reversed
    (``survey_real_models._sensitivity``, for keyword inputs and for the gradients too)."""
    reference = _outputs_and_gradients(model, inputs, options)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1 + nudge)
    nudged = {k: v * (1 + nudge) if v.is_floating_point() else v for k, v in inputs.items()}
    moved = 0.0
    for other in (_outputs_and_gradients(twin, nudged, options), _outputs_and_gradients(model, inputs, options, True)):
        for name, t in other.items():
            if name in reference and t.shape == reference[name].shape and t.is_floating_point() and t.numel():
                moved = max(moved, (t.detach() - reference[name].detach()).abs().max().item())
    return moved


def _inputs(model: nn.Module, batch: int) -> list[dict[str, torch.Tensor]]:
    """Candidate keyword inputs for ``model``, each tensor ``(M, batch, *)``, the likeliest first."""
    config = model.config
    parameters = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(7)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = min(getattr(text, "vocab_size", None) or VOCAB, 90)
    vision = getattr(config, "vision_config", None) or config

    def ids(length: int) -> torch.Tensor:
        return torch.randint(3, max(vocab, 4), (M, batch, length), generator=generator)

    def floats(*shape: int) -> torch.Tensor:
        return torch.randn(M, batch, *shape, generator=generator, dtype=torch.float64)

    channels = getattr(vision, "num_channels", None) or 3
    size = getattr(vision, "image_size", None) or 32
    size = size[0] if isinstance(size, (list, tuple)) else size
    pixels = {"pixel_values": floats(channels, size, size)}
    main = model.main_input_name
    base: dict[str, torch.Tensor] = {}
    if main == "input_ids":
        base["input_ids"] = ids(T)
        if "attention_mask" in parameters:
            base["attention_mask"] = torch.ones(M, batch, T, dtype=torch.long)
    elif main == "pixel_values":
        base.update(pixels)
    elif main == "input_values":
        base["input_values"] = floats(800)
    elif main == "input_features":
        mels = next((getattr(config, k) for k in ("num_mel_bins", "feature_size", "input_feat_per_channel",
                                                    "n_mels", "num_mel_bins") if _is_int(getattr(config, k, None))),
                    80)  # fmt: skip
        frames = 2 * getattr(config, "max_source_positions", 32) if _is_int(getattr(config, "max_source_positions",
                                                                                      None)) else 64  # fmt: skip
        base["input_features"] = floats(mels, frames)
        if "attention_mask" in parameters:
            base["attention_mask"] = torch.ones(M, batch, frames, dtype=torch.long)
    else:
        return []
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        base["decoder_input_ids"] = ids(T_DECODER)
    candidates = [base]
    if main != "input_features" and "attention_mask" in base:
        candidates.append({k: v for k, v in base.items() if k != "attention_mask"})
    if main != "pixel_values" and "pixel_values" in parameters:
        candidates.append({**base, **pixels})
    if main == "input_features":
        transposed = {**base, "input_features": base["input_features"].transpose(-1, -2).contiguous()}
        transposed.pop("attention_mask", None)
        candidates.append(transposed)
    return candidates


def _runs(model: nn.Module, inputs: dict, options: dict) -> Exception | None:
    try:
        with torch.no_grad():
            out = model.eval()(**{k: v[0] for k, v in inputs.items()}, **options)
        bad: list[str] = []
        map_tensors(out, lambda t, where: bad.append(where) if t.is_floating_point() and not t.isfinite().all() else 0)
        if bad:
            return ValueError(f"the original's {bad[0]} is not finite")
    except _Timeout:
        raise
    except Exception as exc:
        return exc
    return None


def _batchlayers_frame(exc: BaseException) -> str:
    """The last frame of ``exc``'s traceback in batchlayers' code (not this survey's), as file:line function."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}batchlayers{os.sep}" in f.filename]
    frames = [f for f in frames if not f.filename.endswith("verify.py")] or frames
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"


def _raised_in_batchlayers(exc: BaseException) -> bool:
    """Whether a ``raise`` statement of batchlayers raised ``exc`` (not a call that batchlayers made)."""
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    return bool(last) and f"{os.sep}batchlayers{os.sep}" in last[0].filename and last[0].line.startswith("raise")


def _verdict_of(exc: BaseException) -> dict:
    where = _batchlayers_frame(exc)
    if isinstance(exc, _Timeout):
        return {"verdict": "error", "detail": f"timeout: {exc}", "where": where}
    if (isinstance(exc, (ValueError, TypeError)) and _raised_in_batchlayers(exc)
            and not str(exc).startswith("verify:")):  # fmt: skip
        return {"verdict": "refused", "detail": _first_line(exc), "where": where}
    return {"verdict": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}", "where": where}


def _low_precision_ops(model: nn.Module, inputs: dict, options: dict) -> set[str]:
    """The operators that give float32, float16 or bfloat16 results in a float64 model's forward and backward
    (``hidden_states.to(torch.float32)`` in an RMSNorm): there rounding is that of float32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found: set[str] = set()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            low = (torch.float32, torch.float16, torch.bfloat16)
            if any(isinstance(t, torch.Tensor) and t.dtype in low for t in torch.utils._pytree.tree_leaves(out)):
                found.add(str(func.overloadpacket.__name__))
            return out

    with Watch():
        _outputs_and_gradients(model, inputs, options)
    return found


def _check(models: list[nn.Module], stacked: nn.Module, inputs: dict, options: dict, train: bool) -> dict:
    for model in (*models, stacked):
        model.train(train)
    arguments = ([_Plain(m) for m in models], _Plain(stacked, stacked=True))
    try:
        result = bl.verify(*arguments, **inputs, **options)
    except _Timeout:
        raise
    except Exception as exc:
        try:  # the same in the original alone (train mode, gradients of the inputs)?
            _outputs_and_gradients(models[0], inputs, options)
        except Exception as own:
            return {"verdict": "skipped", "detail": f"the original raises {type(own).__name__}: {_first_line(own)}"}
        return _verdict_of(exc)
    largest = max(result.outputs.max().item(), result.gradients.max().item())
    worst = int(torch.maximum(result.outputs, result.gradients).argmax())
    at = result.worst_gradient[worst] if result.gradients[worst] > result.outputs[worst] else result.worst_output[worst]
    if bool(result.passed.all()):
        return {"verdict": "exact", "detail": f"{largest:.0e}"}
    moved = _sensitivity(models[0], inputs, options)
    if moved >= 0.1 * largest:
        return {"verdict": "ill-conditioned", "detail": f"{largest:.0e} at {at}; the original alone moves {moved:.0e}"}
    low = _low_precision_ops(models[0], inputs, options)
    if low and bool(bl.verify(*arguments, **inputs, **options, rtol=1.3e-6, atol=1e-5).passed.all()):
        return {
            "verdict": "ill-conditioned",
            "detail": f"{largest:.0e} at {at}, within float32 tolerances; the "
            f"original computes in float32 ({', '.join(sorted(low)[:3])}), where a nudge of 1e-15 is lost",
        }
    if low:  # an element summed from large terms that cancel: float32's rounding of the terms, not of it
        moved = _sensitivity(models[0], inputs, options, nudge=2.0**-24)
        if moved >= 0.1 * largest:
            return {
                "verdict": "ill-conditioned",
                "detail": f"{largest:.0e} at {at}; the original computes in float32 ({', '.join(sorted(low)[:3])}), "
                f"and one float32 rounding of its parameters and inputs moves it {moved:.0e}",
            }
    # The relative difference where the absolute one is largest.
    return {"verdict": "WRONG", "detail": f"{largest:.1e} at {at} (model {worst}); rounding moves {moved:.0e}"}


def _survey_one(model_type: str, execution: str) -> dict:
    start = time.perf_counter()
    row: dict = {"type": model_type}
    try:
        _alarm(BUILD_SECONDS)
        models, note = _build(model_type)
        signal.alarm(0)
    except _Skip as exc:
        return {**row, "eval": {"verdict": "skipped", "detail": str(exc)}}
    except Exception as exc:
        signal.alarm(0)
        reason = "timeout" if isinstance(exc, _Timeout) else f"{type(exc).__name__}: {_first_line(exc)}"
        return {**row, "eval": {"verdict": "skipped", "detail": f"not built: {reason}"}}
    with torch.no_grad():
        _distinct_statistics(models)
    options = {}
    parameters = inspect.signature(models[0].forward).parameters
    if execution == "model_by_model" and "use_cache" in parameters:
        options["use_cache"] = False
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in models[0].modules())
    try:
        _alarm(CHECK_SECONDS)
        chosen, first_failure = None, None
        for candidate in _inputs(models[0], B):
            failure = _runs(copy.deepcopy(models[0]), candidate, options)  # (a forward may change a model)
            if failure is None:
                chosen = candidate
                break
            first_failure = first_failure or failure
        signal.alarm(0)
    except _Timeout:
        return {**row, "eval": {"verdict": "skipped", "detail": "the original is slow"}}
    if chosen is None:
        why = f"{type(first_failure).__name__}: {_first_line(first_failure)}" if first_failure else "no inputs"
        return {**row, "eval": {"verdict": "skipped", "detail": f"inputs ({models[0].main_input_name}): {why}"}}
    row["inputs"] = ",".join(chosen)
    row["note"] = note
    for model in models:
        model.eval()
    try:
        _alarm(CHECK_SECONDS)
        stacked = bl.stack(models, execution=execution)
        signal.alarm(0)
    except Exception as exc:
        signal.alarm(0)
        verdict = _verdict_of(exc)
        verdict["detail"] = ("" if verdict["detail"].startswith("stack") else "stack: ") + verdict["detail"]
        return {**row, "eval": verdict, "seconds": time.perf_counter() - start}
    for mode, train in (("eval", False), ("train", True)):
        inputs = _grow(chosen) if train and has_batchnorm else chosen
        try:
            _alarm(CHECK_SECONDS)
            row[mode] = _check(models, stacked, inputs, options, train)
        except _Timeout as exc:
            row[mode] = _verdict_of(exc)
        finally:
            signal.alarm(0)
    row["seconds"] = time.perf_counter() - start
    return row


def _grow(inputs: dict) -> dict:
    """Twice the batch: the same samples, then them again with the floating ones negated (BatchNorm's train
    statistics then come from 6 samples)."""
    return {k: torch.cat([v, -v if v.is_floating_point() else v], dim=1) for k, v in inputs.items()}


def _worker(types: list[str], execution: str) -> None:
    """Survey ``types`` one after the other, a JSON line each on stdout."""
    import transformers as tf

    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    torch.set_num_threads(1)
    for model_type in types:
        print(json.dumps({"start": model_type}), flush=True)
        try:
            row = _survey_one(model_type, execution)
        except BaseException as exc:  # noqa: BLE001 (the survey goes on)
            row = {"type": model_type, "eval": {"verdict": "error", "detail": f"survey: {type(exc).__name__}: "
                                                f"{_first_line(exc)}"}}  # fmt: skip
        print(json.dumps(row), flush=True)


def _cell(result: dict | None) -> str:
    if not result:
        return ""
    text = result["verdict"] + (f": {result['detail']}" if result.get("detail") else "")
    if result.get("where"):
        text += f" [{result['where']}]"
    return text.replace("|", "\\|")


def main(argv: list[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    global EXPERTS
    execution = "model_by_model" if "--model-by-model" in argv else "batched"
    EXPERTS = next((a.split("=", 1)[1] for a in argv if a.startswith("--experts=")), EXPERTS)
    if "--worker" in argv:
        return _worker([a for a in argv if not a.startswith("--")], execution)
    names = [a for a in argv if not a.startswith("--")]
    unknown = [n for n in names if n not in MODEL_MAPPING_NAMES]
    if unknown:
        raise SystemExit(f"unknown model types {unknown}; known: {', '.join(MODEL_MAPPING_NAMES)}")
    todo = names or list(MODEL_MAPPING_NAMES)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, M={M}, B={B}, T={T}, float64, "
          f"execution={execution!r}, experts={EXPERTS!r}\n")  # fmt: skip
    print("| model type | eval | train | inputs | note | s |\n|---|---|---|---|---|---|", flush=True)
    counts: dict[str, collections.Counter] = {"eval": collections.Counter(), "train": collections.Counter()}
    began = time.perf_counter()
    while todo:
        flags = ["--worker", f"--experts={EXPERTS}"] + (["--model-by-model"] if execution == "model_by_model" else [])
        worker = subprocess.Popen([sys.executable, __file__, *flags, *todo], stdout=subprocess.PIPE, text=True,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
        current = None
        assert worker.stdout is not None
        for line in worker.stdout:
            message = json.loads(line)
            if "start" in message:
                current = message["start"]
                continue
            todo.remove(message["type"])
            current = None
            _report(message, counts)
        worker.wait()
        if current is not None:  # the worker died on it
            todo.remove(current)
            _report({"type": current, "eval": {"verdict": "error", "detail": f"worker died ({worker.returncode})"}},
                    counts)  # fmt: skip
        elif todo:
            break
    print(f"\n{time.perf_counter() - began:.0f} s")
    for mode, counter in counts.items():
        print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in counter.most_common()))


def _report(row: dict, counts: dict[str, collections.Counter]) -> None:
    for mode in ("eval", "train"):
        if row.get(mode):
            counts[mode][row[mode]["verdict"]] += 1
    seconds = f"{row['seconds']:.1f}" if "seconds" in row else ""
    print(f"| {row['type']} | {_cell(row.get('eval'))} | {_cell(row.get('train'))} | {row.get('inputs', '')} "
          f"| {row.get('note', '')} | {seconds} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
