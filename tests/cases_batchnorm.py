"""LayerCases for BatchedBatchNorm1d/2d/3d (steps=3 so the running statistics are compared over updates)."""

from cases_norm import perturbed, randn_input, shape_row, type_row
from harness import LayerCase
from torch import nn

from batchlayers.batchnorm import BatchedBatchNorm1d, BatchedBatchNorm2d, BatchedBatchNorm3d


def _case(id, batched_cls, torch_cls, num_features, spatial=(), **kwargs):
    name = batched_cls.__name__
    wrong_ndim = (3,) if len(spatial) == 2 else (3, 3)  # a 1d input for 2d/3d, a 5-D one for 1d
    return LayerCase(
        id=id,
        batched=lambda m, dt: batched_cls(m, num_features, **kwargs, dtype=dt),
        torch=lambda dt: torch_cls(num_features, **kwargs, dtype=dt),
        prepare=perturbed,
        input=randn_input((num_features, *spatial)),
        steps=3,
        bad_inputs=[
            shape_row("models", lambda m: (m + 1, 2, num_features, *spatial), rf"{name}.*dimension 0 \(models\) is 4"),
            shape_row(
                "channels", lambda m: (m, 2, num_features + 1, *spatial), rf"{name}.*C={num_features}.*channels\) is"
            ),
            shape_row("ndim", lambda m: (m, 2, num_features, *wrong_ndim), rf"{name}: expected a .*-D input"),
            shape_row(
                "one-value",
                lambda m: (m, 1, num_features, *[1] * len(spatial)),
                rf"{name}.*more than 1 value per channel when training",
            ),
            type_row(name),
        ],
    )


CASES = [
    _case("BatchNorm1d", BatchedBatchNorm1d, nn.BatchNorm1d, 4),
    _case("BatchNorm1d-seq", BatchedBatchNorm1d, nn.BatchNorm1d, 4, (3,), eps=1e-3, momentum=0.3),
    _case("BatchNorm2d", BatchedBatchNorm2d, nn.BatchNorm2d, 3, (3, 3)),
    _case("BatchNorm3d", BatchedBatchNorm3d, nn.BatchNorm3d, 2, (2, 2, 2)),
    _case("BatchNorm2d-cumulative", BatchedBatchNorm2d, nn.BatchNorm2d, 3, (2, 2), momentum=None),
    _case("BatchNorm2d-nobias", BatchedBatchNorm2d, nn.BatchNorm2d, 3, (2, 2), bias=False),
    _case("BatchNorm2d-noaffine", BatchedBatchNorm2d, nn.BatchNorm2d, 3, (2, 2), affine=False),
    _case("BatchNorm1d-untracked", BatchedBatchNorm1d, nn.BatchNorm1d, 4, (3,), track_running_stats=False),
]
