"""transformers' mixture-of-experts models with ``grouped_mm`` (transformers' default experts implementation,
which a stacked model runs for all models in one call): every model type of ``survey_transformers.py`` that has a
``use_experts_implementation`` layer, built by its recipe (feed-forward width 40: ``grouped_mm`` needs strides of
16 bytes) in float32 (``grouped_mm`` takes no float64), stacked from two models and compared with the originals by
:func:`batchlayers.verify` at float32 tolerances (rtol 1e-4, atol 1e-5): every output and gradient.

    python scripts/survey_moe_grouped.py            # one line per model type: ok, DIFF, refused or error

Left out: model types that do not build this way (without an experts layer they refuse ``grouped_mm``) and those
whose original does not run on ``input_ids``.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import survey_transformers as survey  # noqa: E402

import batchlayers as bl  # noqa: E402
from batchlayers import _experts  # noqa: E402


def main() -> None:
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    torch.set_num_threads(1)
    survey.EXPERTS = "grouped_mm"
    survey._RECIPES = ({**survey._RECIPES[0], "ffn": 40}, survey._RECIPES[1])
    counts: dict[str, int] = {}
    for model_type in MODEL_MAPPING_NAMES:
        survey._alarm(survey.CHECK_SECONDS)
        try:
            try:  # skipped: not built, no experts layer, or the original does not run on these inputs
                models, _ = survey._build(model_type)
                if not any(_experts.claims(type(m)) for m in models[0].modules()):
                    continue
                models = [m.float().eval() for m in models]
                ids = torch.randint(0, survey.VOCAB, (survey.M, survey.B, survey.T))
                models[0](input_ids=ids[0], attention_mask=torch.ones_like(ids[0]))
            except Exception:  # noqa: BLE001
                continue
            plain = [survey._Plain(m) for m in models]
            stacked = survey._Plain(bl.stack(models), stacked=True)
            result = bl.verify(plain, stacked, input_ids=ids, attention_mask=torch.ones_like(ids), rtol=1e-4, atol=1e-5)
            verdict = "ok" if bool(result.passed.all()) else f"DIFF\n{result}"
        except Exception as exc:  # noqa: BLE001  (the survey goes on)
            kind = "refused" if isinstance(exc, (ValueError, TypeError)) else "error"  # (the originals ran)
            verdict = f"{kind}: {type(exc).__name__}: {survey._first_line(exc)}"
        finally:
            survey.signal.alarm(0)
        kind = verdict.split(":")[0].split("\n")[0]
        counts[kind] = counts.get(kind, 0) + 1
        print(model_type, verdict, flush=True)
    print(", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
