"""LayerCases for BatchedBatchNorm1d/2d/3d (steps=3 so the running statistics are compared over updates)."""

from cases_norm import channel_stats_case
from torch import nn

from batchlayers.batchnorm import BatchedBatchNorm1d, BatchedBatchNorm2d, BatchedBatchNorm3d


def _case(id, batched_cls, torch_cls, num_features, spatial=(), **kwargs):
    one_value = (1, "more than 1 value per channel when training")
    return channel_stats_case(id, batched_cls, torch_cls, num_features, spatial, one_value, **kwargs)


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
