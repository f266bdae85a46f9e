"""``python -m benchmarks.moe``: a stacked transformers mixture-of-experts model against a loop over its originals.

N small Mixtral causal LMs (2 layers, 8 experts, 2 per token, width 64) built from a config (nothing downloaded),
each on its own 8 sequences of 32 tokens: one training step's forward and backward (``labels`` given, the loss
summed over models) and one inference forward, for the Python loop over the N models, the stacked model
(``batchlayers.stack``) and the stacked model run ``execution="model_by_model"``, interleaved in one process
(``benchmarks.measure.time_interleaved``), medians. Needs transformers (the ``test`` extra).

Examples::

    python -m benchmarks.moe                                   # grouped_mm (transformers' default), N = 4 and 8
    python -m benchmarks.moe --experts eager batched_mm --num-models 4
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable, Sequence

import torch

import batchlayers as bl

from .measure import median, time_interleaved

__all__ = ["main"]

CONTENDERS = ("loop", "stacked", "model by model")


def _models(implementation: str, num_models: int) -> list[torch.nn.Module]:
    import transformers as tf

    tf.logging.set_verbosity_error()
    config = tf.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
                              max_position_embeddings=64, experts_implementation=implementation)  # fmt: skip
    models: list[torch.nn.Module] = []
    for i in range(num_models):
        torch.manual_seed(i)
        models.append(tf.MixtralForCausalLM(config))
    return models


def _agreement(models: list[torch.nn.Module], stacked: list[torch.nn.Module], ids: torch.Tensor) -> float:
    """The largest difference of the stacked contenders' logits from the originals', relative to their largest."""
    with torch.no_grad():
        expected = torch.stack([m(input_ids=ids[i], use_cache=False).logits for i, m in enumerate(models)])
        got = [s(input_ids=ids, use_cache=False).logits for s in stacked]
    return max(float((g - expected).abs().max() / expected.abs().max()) for g in got)


def _steps(
    models: list[torch.nn.Module], stacked: torch.nn.Module, by_model: torch.nn.Module, ids: torch.Tensor, train: bool
) -> list[Callable[[], object]]:
    labels = {"labels": ids} if train else {}

    def loop() -> None:
        with torch.set_grad_enabled(train):
            for i, model in enumerate(models):
                out = model(input_ids=ids[i], use_cache=False, **{k: v[i] for k, v in labels.items()})
                if train:
                    out.loss.backward()

    def run(model: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            with torch.set_grad_enabled(train):
                out = model(input_ids=ids, use_cache=False, **labels)
                if train:
                    out.loss.sum().backward()

        return step

    return [loop, run(stacked), run(by_model)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--experts", nargs="+", default=["grouped_mm"], help="experts implementations")
    parser.add_argument("--num-models", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--iters", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--budget-s", type=float, default=20.0, help="seconds of timed rounds per configuration")
    args = parser.parse_args(argv)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("\n| experts | N | mode | loop ms | stacked ms | model by model ms | stacked x loop | model by model x loop "
          "| logits' largest relative difference |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for implementation in args.experts:
        for num_models in args.num_models:
            models = _models(implementation, num_models)
            stacked, by_model = bl.stack(models), bl.stack(models, execution="model_by_model")
            ids = torch.randint(0, 256, (num_models, 8, 32))
            difference = _agreement(models, [stacked, by_model], ids)
            for mode in ("train", "infer"):
                steps = _steps(models, stacked, by_model, ids, train=mode == "train")
                times = time_interleaved(steps, torch.device("cpu"), warmup=2, iters=args.iters, budget_s=args.budget_s)
                ms = [median(t) * 1e3 for t in times]
                print(f"| {implementation} | {num_models} | {mode} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | "
                      f"{ms[0] / ms[1]:.2f} | {ms[0] / ms[2]:.2f} | {difference:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
