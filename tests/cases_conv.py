import torch
from harness import LayerCase

from batchlayers.conv import BatchedConv1d, BatchedConv2d, BatchedConv3d


def _bad_inputs(cls, in_channels, spatial, unpadded):
    name = cls.__name__
    too_small = (
        "too_small",
        lambda m, dt: torch.randn(m, 2, in_channels, *[1] * len(spatial), dtype=dt),
        ValueError,
        rf"{name}: input .*=1 \(padded: 1\) is smaller than the kernel",
    )
    return [
        *([too_small] if unpadded else []),
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
    return LayerCase(
        id=id,
        batched=lambda m, dt: cls(m, in_channels, out_channels, kernel_size, **kwargs, dtype=dt),
        torch=lambda dt: cls.torch_module(in_channels, out_channels, kernel_size, **kwargs, dtype=dt),
        input=lambda lead, dt: torch.randn(*lead, in_channels, *spatial, dtype=dt),
        bad_inputs=_bad_inputs(cls, in_channels, spatial, "padding" not in kwargs) if bad else [],
    )


# One row per configuration; kept as a table.
# fmt: off
CASES = [
    _case("Conv1d", BatchedConv1d, 3, 4, 3, (8,), bad=True),
    _case("Conv1d-same-even-dilated-reflect-groups", BatchedConv1d, 4, 6, 4, (9,), padding="same", dilation=2,
          padding_mode="reflect", groups=2),
    _case("Conv1d-stride-circular-nobias", BatchedConv1d, 2, 3, 3, (7,), stride=2, padding=2, padding_mode="circular",
          bias=False),
    _case("Conv2d", BatchedConv2d, 3, 4, 3, (6, 6), padding=1, bad=True),
    _case("Conv2d-tuples", BatchedConv2d, 2, 4, (2, 3), (7, 8), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    _case("Conv2d-same-even-replicate", BatchedConv2d, 2, 3, (2, 4), (5, 6), padding="same", dilation=(1, 2),
          padding_mode="replicate"),
    _case("Conv2d-depthwise-valid", BatchedConv2d, 4, 8, 3, (5, 5), padding="valid", groups=4),
    _case("Conv2d-groups-circular-nobias", BatchedConv2d, 4, 6, 3, (5, 4), padding=1, groups=2,
          padding_mode="circular", bias=False),
    _case("Conv3d", BatchedConv3d, 2, 3, 2, (4, 4, 4), bad=True),
    _case("Conv3d-same-reflect-groups", BatchedConv3d, 4, 4, 3, (4, 4, 3), padding="same", padding_mode="reflect",
          groups=2),
    _case("Conv3d-stride-dilation-nobias", BatchedConv3d, 2, 2, (1, 2, 2), (4, 5, 4), stride=(1, 2, 1),
          padding=(0, 1, 1), dilation=(1, 1, 2), bias=False),
    # 'same' with zero padding and a kernel (and dilation) that differs per dimension: each dimension's padding
    # is its own (torch pads inside the convolution when every dimension's padding is symmetric).
    _case("Conv2d-same-zeros-rect-dilated", BatchedConv2d, 2, 3, (3, 5), (6, 9), padding="same", dilation=(1, 2)),
    _case("Conv2d-same-zeros-rect-even-groups", BatchedConv2d, 4, 2, (5, 2), (7, 6), padding="same", dilation=(1, 2),
          groups=2),
    _case("Conv3d-same-zeros-rect-last1", BatchedConv3d, 2, 3, (3, 5, 1), (4, 7, 3), padding="same",
          dilation=(2, 1, 1)),
    _case("Conv3d-same-zeros-rect-first1", BatchedConv3d, 2, 2, (1, 3, 5), (3, 5, 8), padding="same",
          dilation=(1, 2, 1)),
]
# fmt: on
