"""batchlayers.backends.cpu.keep_freed_memory: memory freed by one training step stays in the process for the
next, instead of going back to the system (and being faulted in anew). Each check runs in a fresh interpreter:
the setting is process-wide and cannot be undone."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import sys, torch
import batchlayers
keep = sys.argv[1] == "keep"
assert not batchlayers.backends.cpu.keeps_freed_memory  # importing changes nothing
if keep:
    assert batchlayers.backends.cpu.keep_freed_memory()
assert batchlayers.backends.cpu.keeps_freed_memory == keep
def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
x = torch.ones(16 * 1024 * 1024)  # 64 MiB of activations, touched
held = resident_mib()
del x
print(held - resident_mib())  # MiB given back to the system by freeing it
"""


def _mib_returned_on_free(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_keep_freed_memory_keeps_large_tensors_memory_for_reuse() -> None:
    assert _mib_returned_on_free("default") > 60  # torch's default: a large tensor's pages go back at once
    assert _mib_returned_on_free("keep") < 1  # kept: the next step reuses them without faulting them in
