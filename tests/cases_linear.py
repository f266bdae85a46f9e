import torch
from harness import LayerCase
from torch import nn

from batchlayers import BatchedLinear


def _case(id, in_f, out_f, bias, extra_dims=()):
    return LayerCase(
        id=id,
        batched=lambda m, dt: BatchedLinear(m, in_f, out_f, bias, dtype=dt),
        torch=lambda dt: nn.Linear(in_f, out_f, bias, dtype=dt),
        input=lambda lead, dt: torch.randn(*lead, *extra_dims, in_f, dtype=dt),
        bad_inputs=[
            (
                "models",
                lambda m, dt: torch.randn(m + 1, 2, in_f, dtype=dt),
                ValueError,
                r"BatchedLinear.*dimension 0 \(models\) is 4, not 3",
            ),
            (
                "features",
                lambda m, dt: torch.randn(m, 2, in_f + 1, dtype=dt),
                ValueError,
                rf"BatchedLinear.*in_features={in_f}.*is {in_f + 1}",
            ),
            ("ndim", lambda m, dt: torch.randn(in_f, dtype=dt), ValueError, r"BatchedLinear.*too few"),
            ("type", lambda m, dt: [[0.0] * in_f] * m, TypeError, r"BatchedLinear.*Tensor"),
        ],
    )


CASES = [
    _case("Linear", 7, 5, True),
    _case("Linear-nobias", 7, 5, False),
    _case("Linear-seq", 6, 4, True, extra_dims=(3,)),
    _case("Linear-wide", 64, 48, True),
]
