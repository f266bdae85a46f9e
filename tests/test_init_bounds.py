"""Initialisation bounds of the linear layers from the fan-in, on enough models to see a bound taken from the
wrong side (the convolutions' are in test_conv.py)."""

from __future__ import annotations

import math

import pytest
import torch
from harness import assert_uniform_init

from batchlayers import BatchedBilinear, BatchedLinear


@pytest.mark.parametrize("layer", ["Linear", "Bilinear"])
def test_init_bounds_are_torchs(layer: str) -> None:
    """Weight and bias bounds from the fan-in (in_features, in1_features), not the fan-out: checked on 64
    models with in != out, so a bound from the wrong side shows."""
    torch.manual_seed(0)
    if layer == "Linear":
        batched = BatchedLinear(64, 48, 6, dtype=torch.float64)
        weight_bound, bias_bound = 1 / math.sqrt(48), 1 / math.sqrt(48)  # kaiming_uniform(a=sqrt(5)) = 1/sqrt(fan_in)
    else:
        batched = BatchedBilinear(64, 40, 7, 5, dtype=torch.float64)
        weight_bound = bias_bound = 1 / math.sqrt(40)
    assert_uniform_init(batched.weight, weight_bound, f"{layer} weight")
    assert_uniform_init(batched.bias, bias_bound, f"{layer} bias")
