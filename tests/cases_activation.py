"""LayerCases for BatchedPReLU."""

import torch
from cases_norm import perturbed, shape_row, type_row
from harness import LayerCase
from torch import nn

from batchlayers.activation import BatchedPReLU


def with_zeros(sample_shape):
    """Inputs with exact zeros among them, where torch's PReLU takes the gradient of the ``a x`` side."""

    def make(lead, dt):
        x = torch.randn(*lead, *sample_shape, dtype=dt)
        return x.masked_fill(x.abs() < 0.3, 0.0)

    return make


def _case(id, sample_shape, num_parameters=1, **kwargs):
    name = "BatchedPReLU"
    bad_inputs = [
        shape_row("models", lambda m: (m + 1, 2, *sample_shape), rf"{name}.*dimension 0 \(models\) is 4, not 3"),
        shape_row("ndim", lambda m: (m,), rf"{name}.*too few"),
        type_row(name),
    ]
    if num_parameters > 1:
        wrong = (num_parameters + 1, *sample_shape[1:])
        bad_inputs += [
            shape_row(
                "channels",
                lambda m: (m, 2, *wrong),
                rf"{name}.*num_parameters={num_parameters}.*dimension 2 \(channels\) is {num_parameters + 1}",
            ),
            shape_row("no-channels", lambda m: (m, 2), rf"{name}.*num_parameters={num_parameters}.*too few"),
        ]
    return LayerCase(
        id=id,
        batched=lambda m, dt: BatchedPReLU(m, num_parameters, **kwargs, dtype=dt),
        torch=lambda dt: nn.PReLU(num_parameters, **kwargs, dtype=dt),
        prepare=perturbed,
        input=with_zeros(sample_shape),
        bad_inputs=bad_inputs,
    )


CASES = [
    _case("PReLU", (4, 3)),
    _case("PReLU-no-channel-dim", ()),
    _case("PReLU-features", (6,), init=0.1),
    _case("PReLU-channels", (4, 3), num_parameters=4),
    _case("PReLU-channels-2d", (3, 2, 2), num_parameters=3, init=-0.5),
]
