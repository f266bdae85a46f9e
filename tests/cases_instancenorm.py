"""LayerCases for BatchedInstanceNorm1d/2d/3d (steps=3 so tracked running statistics are compared over updates)."""

from cases_norm import channel_stats_case, randn_input
from torch import nn

from batchlayers.normalization import BatchedInstanceNorm1d, BatchedInstanceNorm2d, BatchedInstanceNorm3d


def packed_input(sample_shape):
    """Per-model inputs as the transposed view of a packed ``(B, M*C, *)`` tensor (what a batched convolution
    returns), which the layer normalises without a copy; a shared batch as usual."""
    plain = randn_input(sample_shape)

    def make(lead, dt):
        if len(lead) == 1:
            return plain(lead, dt)
        num_models, batch = lead
        return plain((batch, num_models), dt).transpose(0, 1)

    return make


def _case(id, batched_cls, torch_cls, num_features, spatial, make_input=randn_input, **kwargs):
    one_value = (3, "more than 1 spatial element")
    return channel_stats_case(id, batched_cls, torch_cls, num_features, spatial, one_value, make_input, **kwargs)


_tracked = dict(affine=True, track_running_stats=True)

CASES = [
    _case("InstanceNorm1d", BatchedInstanceNorm1d, nn.InstanceNorm1d, 4, (5,)),
    _case("InstanceNorm2d", BatchedInstanceNorm2d, nn.InstanceNorm2d, 3, (3, 2)),
    _case("InstanceNorm3d", BatchedInstanceNorm3d, nn.InstanceNorm3d, 2, (2, 2, 3)),
    _case("InstanceNorm2d-affine", BatchedInstanceNorm2d, nn.InstanceNorm2d, 3, (3, 3), affine=True, eps=1e-3),
    _case("InstanceNorm1d-nobias", BatchedInstanceNorm1d, nn.InstanceNorm1d, 4, (5,), affine=True, bias=False),
    _case("InstanceNorm1d-tracked", BatchedInstanceNorm1d, nn.InstanceNorm1d, 4, (5,), **_tracked),
    _case("InstanceNorm2d-tracked", BatchedInstanceNorm2d, nn.InstanceNorm2d, 3, (2, 3), momentum=0.3, **_tracked),
    _case("InstanceNorm3d-tracked", BatchedInstanceNorm3d, nn.InstanceNorm3d, 2, (2, 2, 2), **_tracked),
    _case(
        "InstanceNorm2d-tracked-noaffine", BatchedInstanceNorm2d, nn.InstanceNorm2d, 3, (2, 2), track_running_stats=True
    ),
    _case(
        "InstanceNorm2d-momentum-None",
        BatchedInstanceNorm2d,
        nn.InstanceNorm2d,
        3,
        (2, 2),
        momentum=None,
        track_running_stats=True,
    ),
    _case("InstanceNorm2d-packed", BatchedInstanceNorm2d, nn.InstanceNorm2d, 3, (3, 2), packed_input, affine=True),
    _case("InstanceNorm1d-packed-tracked", BatchedInstanceNorm1d, nn.InstanceNorm1d, 4, (5,), packed_input, **_tracked),
]
