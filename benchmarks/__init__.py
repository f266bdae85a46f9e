"""Benchmarks: batchlayers side by side with a Python loop, torch.func and a hand-written floor.

Run ``python -m benchmarks --quick`` (or ``--help`` for the flags). Every contender of one configuration is
timed interleaved in one process, so ratios between them survive a noisy machine.
"""

__all__: list[str] = []
