"""Test-session settings shared by every test file."""

import os

import pytest
from hypothesis import settings

from batchlayers import _workspace

# CI gates a merge, so its property tests draw the same examples every run (a failure there is then
# reproducible); local runs keep hypothesis' random exploration and its example database.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(params=[False, True], ids=["allocated", "kept"])
def kept(request, monkeypatch):
    """Runs a test twice: as usual, and with every buffer batchlayers' kernels keep between calls in kept memory
    whatever its size (``batchlayers._workspace``, from 1 MiB otherwise): the convolution loops' stacked results
    and input gradients, the fused chain's and the recurrent layers' buffers."""
    if request.param:
        monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.release()
    yield request.param
    _workspace.release()
