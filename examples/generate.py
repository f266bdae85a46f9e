"""Text generation with N causal language models at once, each with its own key/value cache.

N GPT-2-style models (tiny configs built here, different seeds, saved with ``save_pretrained`` and loaded
back the way fine-tuned checkpoints are) are stacked into one model. A ``generate()``-style loop then decodes
for all of them together: one prefill call over the prompts, then one call per new token with ``T = 1``
and the stacked model's own cache (transformers' ``DynamicCache``, holding every model's keys and values).
Greedy decoding must give, model by model, exactly the tokens of each model's own ``model.generate()``;
sampling draws each model's next token from its own distribution with its own temperature.

    python examples/generate.py           # 8 models, 32 new tokens
    python examples/generate.py --quick   # 3 models, 8 new tokens
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import tempfile
import time
from dataclasses import dataclass

import torch
import transformers
from torch import Tensor

import batchlayers


def make_models(num_models: int, folder: pathlib.Path) -> list[transformers.PreTrainedModel]:
    """N "checkpoints": tiny GPT-2 models with different weights, saved and loaded back."""
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    models = []
    for i in range(num_models):
        torch.manual_seed(i)
        transformers.GPT2LMHeadModel(config).save_pretrained(folder / f"model-{i}")
        models.append(transformers.GPT2LMHeadModel.from_pretrained(folder / f"model-{i}").eval())
    return models


def _cache_name(model: torch.nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (both in and out); use what this version has."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    stacked: torch.nn.Module,
    prompts: Tensor,
    new_tokens: int,
    temperature: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Decode ``new_tokens`` tokens for every model: ``prompts`` ``(M, B, T)`` -> ``(M, B, T + new_tokens)``.

    Greedy where ``temperature`` is None, else sampled with model ``i``'s temperature ``temperature[i]``.
    """
    name = _cache_name(stacked)
    out = stacked(input_ids=prompts, use_cache=True)
    tokens = [prompts]
    for step in range(new_tokens):
        logits = out.logits[:, :, -1]  # (M, B, vocab): each model's next-token logits
        if temperature is None:
            token = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
            token = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(*logits.shape[:2], 1)
        tokens.append(token)
        if step + 1 < new_tokens:
            out = stacked(input_ids=token, use_cache=True, **{name: getattr(out, name)})
    return torch.cat(tokens, dim=-1)


@dataclass
class Result:
    stacked_tokens: Tensor  # (M, B, T + new): greedy, stacked
    own_tokens: Tensor  # (M, B, T + new): each model's own generate()
    sampled: Tensor  # (M, B, T + new): sampled with per-model temperatures
    stacked_seconds: float
    loop_seconds: float


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 models, 8 new tokens")
    args = parser.parse_args(argv)
    num_models, new_tokens, batch = (3, 8, 2) if args.quick else (8, 32, 4)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as folder:
        models = make_models(num_models, pathlib.Path(folder))
    stacked = batchlayers.stack(models)
    prompt = torch.randint(1, 64, (batch, 6), generator=torch.Generator().manual_seed(0))
    prompts = prompt.expand(num_models, *prompt.shape)  # one prompt batch for every model, never copied

    start = time.perf_counter()
    stacked_tokens = generate(stacked, prompts, new_tokens)
    stacked_seconds = time.perf_counter() - start
    start = time.perf_counter()
    own = [m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False) for m in models]
    loop_seconds = time.perf_counter() - start
    own_tokens = torch.stack(own)

    temperature = torch.linspace(0.5, 1.5, num_models)
    sampled = generate(stacked, prompts, new_tokens, temperature, torch.Generator().manual_seed(0))

    same = (stacked_tokens == own_tokens).all(dim=(1, 2))
    print(f"{num_models} models, batch {batch}, {new_tokens} new tokens")
    print(f"greedy tokens equal to each model's own generate(): {same.tolist()}")
    print(f"stacked decoding {stacked_seconds:.3f} s, loop of generate() {loop_seconds:.3f} s")
    print(f"sampled, model 0 (temperature {temperature[0]:.2f}): {sampled[0, 0, prompt.shape[1] :].tolist()}")
    return Result(stacked_tokens, own_tokens, sampled, stacked_seconds, loop_seconds)


if __name__ == "__main__":
    main()
