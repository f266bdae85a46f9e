"""LayerCases for BatchedLayerNorm, BatchedRMSNorm and BatchedGroupNorm."""

import torch
from harness import LayerCase
from torch import nn

from batchlayers.normalization import BatchedGroupNorm, BatchedLayerNorm, BatchedRMSNorm


@torch.no_grad()
def perturbed(module):
    """The module with its weight, bias and running statistics moved off their constant init (ones, zeros),
    so that a mix-up between models' parameters or statistics shows in the comparison with the loop.

    The cases' ``prepare``: the init itself is still checked against torch.nn's by the common checks."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name == "running_var":
            t.uniform_(0.5, 2.0)
        elif t.is_floating_point():
            t.add_(0.5 * torch.randn_like(t))
    return module


def randn_input(sample_shape):
    """Inputs off zero mean and unit scale, so that the statistics matter."""
    return lambda lead, dt: 1.5 * torch.randn(*lead, *sample_shape, dtype=dt) + 0.5


def shape_row(id, shape_fn, pattern, exc=ValueError):
    """A bad-input row made from a shape ``shape_fn(num_models)``."""
    return (id, lambda m, dt: torch.randn(*shape_fn(m), dtype=dt), exc, pattern)


def type_row(name):
    return ("type", lambda m, dt: [[0.0] * 4] * m, TypeError, rf"{name}.*Tensor")


def channel_stats_case(id, batched_cls, torch_cls, num_features, spatial, one_value, make_input=randn_input, **kwargs):
    """A LayerCase for the BatchNorm/InstanceNorm families, ``(M, B, C, *spatial)`` inputs, 3 steps so the running
    statistics are compared over updates. ``one_value``: ``(batch, message)`` of an input with one value per
    statistic, which torch.nn refuses."""
    name = batched_cls.__name__
    wrong_ndim = (3,) if len(spatial) == 2 else (3, 3)  # a 1d input for 2d/3d, another number of dims for 1d
    batch, message = one_value
    return LayerCase(
        id=id,
        batched=lambda m, dt: batched_cls(m, num_features, **kwargs, dtype=dt),
        torch=lambda dt: torch_cls(num_features, **kwargs, dtype=dt),
        prepare=perturbed,
        input=make_input((num_features, *spatial)),
        steps=3,
        bad_inputs=[
            shape_row("models", lambda m: (m + 1, 2, num_features, *spatial), rf"{name}.*dimension 0 \(models\) is 4"),
            shape_row(
                "channels", lambda m: (m, 2, num_features + 1, *spatial), rf"{name}.*C={num_features}.*channels\) is"
            ),
            shape_row("ndim", lambda m: (m, 2, num_features, *wrong_ndim), rf"{name}: expected a .*-D input"),
            shape_row("one-value", lambda m: (m, batch, num_features, *[1] * len(spatial)), rf"{name}.*{message}"),
            type_row(name),
        ],
    )


def _trailing_case(id, batched_cls, torch_cls, normalized_shape, extra_dims=(), **kwargs):
    name = batched_cls.__name__
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    wrong = (*ns[:-1], ns[-1] + 1)
    return LayerCase(
        id=id,
        batched=lambda m, dt: batched_cls(m, normalized_shape, **kwargs, dtype=dt),
        torch=lambda dt: torch_cls(normalized_shape, **kwargs, dtype=dt),
        prepare=perturbed,
        input=randn_input((*extra_dims, *ns)),
        bad_inputs=[
            shape_row("models", lambda m: (m + 1, 2, *ns), rf"{name}.*dimension 0 \(models\) is 4, not 3"),
            shape_row("normalized_shape", lambda m: (m, 2, *wrong), rf"{name}.*normalized_shape.*is {ns[-1] + 1}"),
            shape_row("ndim", lambda m: ns, rf"{name}.*too few"),
            type_row(name),
        ],
    )


def _group_case(id, num_groups, num_channels, spatial=(), **kwargs):
    name = "BatchedGroupNorm"
    return LayerCase(
        id=id,
        batched=lambda m, dt: BatchedGroupNorm(m, num_groups, num_channels, **kwargs, dtype=dt),
        torch=lambda dt: nn.GroupNorm(num_groups, num_channels, **kwargs, dtype=dt),
        prepare=perturbed,
        input=randn_input((num_channels, *spatial)),
        bad_inputs=[
            shape_row("models", lambda m: (m + 1, 2, num_channels, *spatial), rf"{name}.*dimension 0 \(models\) is 4"),
            shape_row("channels", lambda m: (m, 2, num_channels + 1), rf"{name}.*C={num_channels}.*channels\) is"),
            shape_row("ndim", lambda m: (m, num_channels), rf"{name}.*too few"),
            type_row(name),
        ],
    )


_per_channel = _group_case("GroupNorm-per-channel", 4, 4, (5,))
_per_channel.bad_inputs.append(
    shape_row("one-value", lambda m: (m, 1, 4), r"BatchedGroupNorm.*more than 1 value per channel.*\(3, 1, 4\)")
)

CASES = [
    _trailing_case("LayerNorm", BatchedLayerNorm, nn.LayerNorm, 6, extra_dims=(3,)),
    _trailing_case("LayerNorm-2d-shape", BatchedLayerNorm, nn.LayerNorm, (3, 4), eps=1e-3),
    _trailing_case("LayerNorm-nobias", BatchedLayerNorm, nn.LayerNorm, 5, bias=False),
    _trailing_case("LayerNorm-noaffine", BatchedLayerNorm, nn.LayerNorm, 5, elementwise_affine=False),
    _trailing_case("RMSNorm", BatchedRMSNorm, nn.RMSNorm, 6, extra_dims=(3,)),
    _trailing_case("RMSNorm-2d-shape-eps", BatchedRMSNorm, nn.RMSNorm, [3, 4], eps=1e-3),
    _trailing_case("RMSNorm-noaffine", BatchedRMSNorm, nn.RMSNorm, 5, elementwise_affine=False),
    _group_case("GroupNorm", 2, 6, (4,)),
    _group_case("GroupNorm-2d", 3, 6, (3, 3), eps=1e-3),
    _per_channel,
    _group_case("GroupNorm-nobias", 2, 4, (3,), bias=False),
    _group_case("GroupNorm-noaffine", 1, 4, (3,), affine=False),
]
