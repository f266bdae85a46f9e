import torch
from harness import LayerCase
from torch import nn

from batchlayers.sparse import BatchedEmbedding


def _indices_with(num_models: int, num_embeddings: int, model: int, value: int) -> torch.Tensor:
    idx = torch.randint(0, num_embeddings, (num_models, 2, 3))
    idx[model, 1, 2] = value
    return idx


def _bad_inputs(num: int) -> list:
    return [
        (
            "models",
            lambda m, dt: torch.randint(0, num, (m + 1, 2, 3)),
            ValueError,
            r"BatchedEmbedding.*dimension 0 \(models\) is 4, not 3",
        ),
        ("ndim", lambda m, dt: torch.randint(0, num, (m,)), ValueError, r"BatchedEmbedding.*too few"),
        ("float", lambda m, dt: torch.zeros(m, 2, 3, dtype=dt), TypeError, r"BatchedEmbedding.*integer.*float32"),
        ("bool", lambda m, dt: torch.zeros(m, 2, 3, dtype=torch.bool), TypeError, r"BatchedEmbedding.*integer"),
        ("type", lambda m, dt: [[0, 1]] * m, TypeError, r"BatchedEmbedding.*Tensor"),
        # -1 in model 1 and num in model 0 would be rows of models 0 and 1 in a flat table with offsets.
        ("negative", lambda m, dt: _indices_with(m, num, 1, -1), IndexError, r"BatchedEmbedding.*-1.*model 1"),
        ("too_large", lambda m, dt: _indices_with(m, num, 0, num), IndexError, rf"BatchedEmbedding.*{num}.*model 0"),
        ("far_out", lambda m, dt: _indices_with(m, num, 2, 10**6), IndexError, r"BatchedEmbedding.*model 2"),
    ]


def _case(id, num, dim, sample_shape=(3,), index_dtype=torch.int64, bad_inputs=False, **options):
    return LayerCase(
        id=id,
        batched=lambda m, dt: BatchedEmbedding(m, num, dim, **options, dtype=dt),
        torch=lambda dt: nn.Embedding(num, dim, **options, dtype=dt),
        input=lambda lead, dt: torch.randint(0, num, (*lead, *sample_shape), dtype=index_dtype),
        bad_inputs=_bad_inputs(num) if bad_inputs else [],
        input_requires_grad=False,
    )


CASES = [
    _case("Embedding", 11, 4, bad_inputs=True),
    _case("Embedding-pad-int32", 5, 3, sample_shape=(2, 3), index_dtype=torch.int32, padding_idx=1),
    _case("Embedding-freq-pad", 4, 3, sample_shape=(6,), scale_grad_by_freq=True, padding_idx=-1),
    # max_norm renormalises looked-up rows of the weight in place during forward.
    _case("Embedding-max-norm", 6, 4, max_norm=1.2, norm_type=1.5),
]
