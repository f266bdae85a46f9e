import torch
from harness import LayerCase
from torch.nn.modules.utils import _ntuple

from batchlayers.conv import BatchedConvTranspose1d, BatchedConvTranspose2d, BatchedConvTranspose3d


def _output_can_vanish(dims, kernel_size, padding=0, output_padding=0, dilation=1, **_):
    """Whether an input of size 1 gives an empty output: 2 * padding > dilation * (kernel - 1) + output_padding."""
    k, p, op, d = (_ntuple(dims)(v) for v in (kernel_size, padding, output_padding, dilation))
    return any(2 * pj > dj * (kj - 1) + opj for kj, pj, opj, dj in zip(k, p, op, d))


def _bad_inputs(cls, in_channels, spatial, too_small):
    name = cls.__name__
    too_small_row = (
        "too_small",
        lambda m, dt: torch.randn(m, 2, in_channels, *[1] * len(spatial), dtype=dt),
        ValueError,
        rf"{name}: input .*=1 is too small: the output would have .*_out=-?\d+ .*shape \(3, 2, {in_channels}",
    )
    return [
        *([too_small_row] if too_small else []),
        (
            "models",
            lambda m, dt: torch.randn(m + 1, 2, in_channels, *spatial, dtype=dt),
            ValueError,
            rf"{name}.*dimension 0 \(models\) is 4, not 3",
        ),
        (
            "channels",
            lambda m, dt: torch.randn(m, 2, in_channels + 1, *spatial, dtype=dt),
            ValueError,
            rf"{name}.*C_in={in_channels}, but dimension 2 \(channels\) is {in_channels + 1}",
        ),
        (
            "ndim_unbatched",
            lambda m, dt: torch.randn(m, in_channels, *spatial, dtype=dt),
            ValueError,
            rf"{name}: expected a {len(spatial) + 3}-D input .*got {len(spatial) + 2}-D",
        ),
        (
            "ndim_extra",
            lambda m, dt: torch.randn(m, 2, 1, in_channels, *spatial, dtype=dt),
            ValueError,
            rf"{name}: expected a {len(spatial) + 3}-D input",
        ),
        ("type", lambda m, dt: [[0.0]] * m, TypeError, rf"{name}.*Tensor"),
    ]


def _case(id, cls, in_channels, out_channels, kernel_size, spatial, bad=False, **kwargs):
    too_small = _output_can_vanish(len(spatial), kernel_size, **kwargs)
    return LayerCase(
        id=id,
        batched=lambda m, dt: cls(m, in_channels, out_channels, kernel_size, **kwargs, dtype=dt),
        torch=lambda dt: cls.torch_module(in_channels, out_channels, kernel_size, **kwargs, dtype=dt),
        input=lambda lead, dt: torch.randn(*lead, in_channels, *spatial, dtype=dt),
        bad_inputs=_bad_inputs(cls, in_channels, spatial, too_small) if bad else [],
    )


# One row per configuration; kept as a table. output_padding must be smaller than stride or dilation.
# fmt: off
CASES = [
    _case("ConvTranspose1d", BatchedConvTranspose1d, 3, 4, 3, (7,), stride=2, bad=True),
    _case("ConvTranspose1d-outpad-dilation-nobias", BatchedConvTranspose1d, 2, 3, 3, (5,), stride=3, padding=1,
          output_padding=2, dilation=2, bias=False),
    _case("ConvTranspose1d-groups", BatchedConvTranspose1d, 4, 6, 4, (6,), stride=2, padding=1, groups=2),
    _case("ConvTranspose2d", BatchedConvTranspose2d, 3, 4, 3, (6, 6), padding=2, bad=True),
    _case("ConvTranspose2d-decoder", BatchedConvTranspose2d, 4, 2, 4, (5, 6), stride=2, padding=1),
    _case("ConvTranspose2d-tuples-groups-outpad", BatchedConvTranspose2d, 4, 6, (2, 3), (4, 5), stride=(2, 3),
          padding=(0, 1), output_padding=(1, 2), groups=2),
    _case("ConvTranspose2d-depthwise-dilation-nobias", BatchedConvTranspose2d, 4, 8, 3, (5, 5), padding=2, groups=4,
          dilation=2, bias=False),
    _case("ConvTranspose2d-outpad-below-dilation", BatchedConvTranspose2d, 2, 3, 2, (4, 5), output_padding=(1, 0),
          dilation=(2, 1)),
    _case("ConvTranspose3d", BatchedConvTranspose3d, 2, 3, 2, (3, 3, 3), stride=2, bad=True),
    _case("ConvTranspose3d-groups-outpad-nobias", BatchedConvTranspose3d, 4, 2, (1, 2, 3), (3, 4, 3),
          stride=(1, 2, 2), padding=(0, 1, 1), output_padding=(0, 1, 1), groups=2, dilation=(1, 1, 2), bias=False),
]
# fmt: on
