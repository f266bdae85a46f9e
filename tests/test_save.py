"""batchlayers.save / batchlayers.load: crash-safe checkpoint files with an optional checksum (issue 13, item 3).

The references are the ordinary readers (``torch.load``, ``safetensors.torch.load_file``) and the saved objects
themselves; a crash is a writer, ``os.fsync`` or ``os.replace`` that raises, or a process killed with SIGKILL.
"""

from __future__ import annotations

import copy
import errno
import io
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import models as zoo
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import batchlayers as bl
from batchlayers.optim import Adam

REPO = pathlib.Path(__file__).resolve().parents[1]


# -- what is saved ---------------------------------------------------------------------------------------


def _state_dict():
    torch.manual_seed(0)
    return zoo.MLP().state_dict()


def _tensors():
    """A flat dict of tensors of several dtypes and layouts (a transposed view, a 0-d and an empty tensor)."""
    torch.manual_seed(1)
    return {
        "float64": torch.randn(3, 4, dtype=torch.float64),
        "bfloat16": torch.randn(5).bfloat16(),
        "transposed": torch.randn(4, 3).t(),
        "int64": torch.arange(6).view(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


def _nested():
    return {"model": _state_dict(), "step": 7, "history": [torch.randn(2), (torch.ones(3), 1.5)], "name": "run"}


def _optimizers():
    """A torch.optim and a batchlayers.optim state dict (integer keys, per-model tensor hyperparameters)."""
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(3, 4, 2)), torch.nn.Parameter(torch.randn(3, 2))]
    optimizers = [torch.optim.AdamW(params, lr=1e-3), Adam(params, lr=torch.tensor([1e-3, 1e-2, 1e-1]).double())]
    for p in params:
        p.grad = torch.randn_like(p)
    for opt in optimizers:
        opt.step()
    return {"adamw": optimizers[0].state_dict(), "batched_adam": optimizers[1].state_dict()}


OBJECTS = {"state_dict": _state_dict, "tensors": _tensors, "nested": _nested, "optimizers": _optimizers}
FLAT = ["state_dict", "tensors"]  # what a .safetensors file can hold
ROUND_TRIPS = [(kind, ".pt") for kind in OBJECTS] + [(kind, ".safetensors") for kind in FLAT]


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and len(a) == len(b) and set(a) == set(b)  # safetensors has its own order
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _plain_read(path: pathlib.Path):
    """What the ordinary reader of the format finds in the file."""
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    return torch.load(path, weights_only=True)


def _listing(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# -- round trips -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
@pytest.mark.parametrize("kind, suffix", ROUND_TRIPS, ids=[f"{k}{s}" for k, s in ROUND_TRIPS])
def test_round_trip(kind, suffix, checksum, tmp_path) -> None:
    obj = OBJECTS[kind]()
    before = copy.deepcopy(obj)
    views = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor) and not v.is_contiguous()}
    path = tmp_path / f"checkpoint{suffix}"
    bl.save(obj, path if checksum else str(path), checksum=checksum)  # os.PathLike and str

    _assert_same(before, obj)  # the object is not changed, not even made contiguous
    assert all(obj[k] is v and not v.is_contiguous() for k, v in views.items())
    _assert_same(obj, bl.load(path))
    _assert_same(obj, bl.load(str(path), mmap=True, map_location="cpu"))
    _assert_same(obj, bl.load_checkpoint(path))
    plain = _plain_read(path)
    if checksum and suffix == ".pt":
        assert set(plain) == {"__batchlayers_checksum__", "data"}
        plain = plain["data"]
    _assert_same(obj, plain)  # an ordinary file of its format
    if suffix == ".safetensors":
        with safe_open(path, "pt") as f:
            assert ("batchlayers.checksum" in (f.metadata() or {})) == checksum
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_stack_checkpoints_reads_checksummed_files(suffix, tmp_path) -> None:
    states = [zoo.MLP().state_dict() for _ in range(2)]
    paths = [tmp_path / f"model{i}{suffix}" for i in range(len(states))]
    for state, path in zip(states, paths):
        bl.save(state, path, checksum=True)
    stacked = bl.stack_checkpoints(zoo.MLP(), paths).state_dict()
    for i, state in enumerate(states):
        _assert_same(state, {name: value[i] for name, value in stacked.items()})


def test_replacing_keeps_permissions_and_follows_links(tmp_path) -> None:
    if os.name != "posix":
        pytest.skip("POSIX permissions and symbolic links")
    fresh = tmp_path / "fresh.pt"
    bl.save(_state_dict(), fresh)
    ordinary = tmp_path / "ordinary.pt"
    torch.save(_state_dict(), ordinary)
    assert fresh.stat().st_mode == ordinary.stat().st_mode  # what a new file gets under the umask
    ordinary.chmod(0o640)
    link = tmp_path / "link.pt"
    link.symlink_to(ordinary.name)
    bl.save(_tensors(), link)
    assert link.is_symlink() and (ordinary.stat().st_mode & 0o777) == 0o640
    _assert_same(_tensors(), torch.load(ordinary, weights_only=True))


# -- crashes ---------------------------------------------------------------------------------------------


def _write_half_then_raise(exception):
    """A writer that writes half of a real file to the temporary file it was given, then raises."""
    calls = []

    def write(obj, path, *args, **kwargs):
        calls.append(pathlib.Path(path))
        buffer = io.BytesIO()
        torch.save(obj if isinstance(obj, dict) else {}, buffer)
        pathlib.Path(path).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise exception

    return write, calls


CRASHES = ["writer-error", "writer-interrupt", "fsync", "replace"]


@pytest.mark.parametrize("crash", CRASHES)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_crash_leaves_previous_file(suffix, crash, tmp_path, monkeypatch) -> None:
    path = tmp_path / f"model{suffix}"
    bl.save(_state_dict(), path)
    before = _listing(tmp_path)
    exception = {"writer-interrupt": KeyboardInterrupt(), "fsync": OSError(errno.EIO, "I/O error")}.get(
        crash, OSError(errno.ENOSPC, "No space left on device")
    )
    calls = []
    if crash.startswith("writer"):
        write, calls = _write_half_then_raise(exception)
        if suffix == ".pt":
            real_save = torch.save

            def save_or_crash(obj, f, *args, **kwargs):
                return write(obj, f) if isinstance(f, str) else real_save(obj, f)

            monkeypatch.setattr(torch, "save", save_or_crash)
        else:
            monkeypatch.setattr(safetensors.torch, "save_file", lambda tensors, f, metadata=None: write(tensors, f))
    else:

        def fail(*args, **kwargs):
            raise exception

        monkeypatch.setattr(os, crash, fail)
    torch.manual_seed(5)
    with pytest.raises(type(exception)):
        bl.save(zoo.MLP().state_dict(), path, checksum=True)
    monkeypatch.undo()
    assert _listing(tmp_path) == before  # byte-identical, and no temporary file left
    _assert_same(_state_dict(), bl.load(path))
    for temporary in calls:  # the half-written file was a hidden sibling of the checkpoint
        assert temporary.parent == tmp_path and temporary.name.startswith(f".{path.name}.tmp-{os.getpid()}-")


CHILD = """
import os, sys, time
import torch
import batchlayers as bl

# The rename never comes, so the kill cannot land after it (the test kills while the file is written).
os.replace = lambda *args: time.sleep(600)
bl.save({"w": torch.ones(16_000_000)}, sys.argv[1], checksum=True)  # 64 MB
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
def test_sigkill_while_writing_leaves_previous_file(tmp_path) -> None:
    # one format: both go through the same temporary file and rename, and a child process costs seconds
    path = tmp_path / "model.pt"
    bl.save(_state_dict(), path)
    before = path.read_bytes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        # killed as soon as the temporary file holds some bytes: while its 64 MB are being written
        while not [p for p in tmp_path.iterdir() if p.name.startswith(f".{path.name}.tmp-") and p.stat().st_size]:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    _assert_same(_state_dict(), bl.load(path))


# -- checksums -------------------------------------------------------------------------------------------


def _flip(path: pathlib.Path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of ``tensor``'s bytes inside the file."""
    data = bytearray(path.read_bytes())
    pattern = tensor.contiguous().numpy().tobytes()
    start = data.find(pattern)
    assert start >= 0 and data.find(pattern, start + 1) < 0, "the tensor's bytes are in the file exactly once"
    data[start + len(pattern) // 2] ^= 0x01
    path.write_bytes(bytes(data))


LOADERS = {
    "load": bl.load,
    "load_checkpoint": bl.load_checkpoint,
    "stack_checkpoints": lambda path: {
        k: v[0] for k, v in bl.stack_checkpoints(zoo.MLP(), [path]).state_dict().items()
    },
}


@pytest.mark.parametrize("flipped", [["fc2.weight"], ["fc3.weight", "fc1.bias"]], ids=["one", "two"])
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_checksum_names_file_and_first_changed_tensor(suffix, loader, flipped, tmp_path) -> None:
    state = _state_dict()
    path = tmp_path / f"model{suffix}"
    bl.save(state, path, checksum=True)
    for name in flipped:
        _flip(path, state[name])
    first = next(name for name in state if name in flipped)  # the first in the order they were saved
    prefix = "stack_checkpoints (file 1 of 1)" if loader == "stack_checkpoints" else loader
    pattern = re.escape(prefix) + rf": '[^']*model{suffix}' is corrupt: the bytes of tensor '{first}' differ"
    with pytest.raises(ValueError, match=pattern):
        LOADERS[loader](path)
    # Not verified on request: the flipped bit is there.
    loaded = bl.load(path, verify=False)
    assert [name for name in state if not torch.equal(state[name], loaded[name])] == [n for n in state if n in flipped]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_without_checksum_nothing_is_verified(suffix, tmp_path) -> None:
    state = _state_dict()
    path = tmp_path / f"model{suffix}"
    bl.save(state, path)
    _flip(path, state["fc2.weight"])
    for loader in LOADERS.values():
        loaded = loader(path)
        changed = (loaded["fc2.weight"] != state["fc2.weight"]).sum().item()
        assert changed == 1 and all(torch.equal(state[k], loaded[k]) for k in state if k != "fc2.weight")


# -- bad inputs ------------------------------------------------------------------------------------------


BAD = [
    (
        "nested-safetensors",
        "m.safetensors",
        _nested,
        TypeError,
        r"'[^']*m\.safetensors' .* entry 'model' is of type OrderedDict",
    ),
    (
        "int-safetensors",
        "m.safetensors",
        lambda: {"w": torch.ones(1), "step": 3},
        TypeError,
        r"entry 'step' is of type int",
    ),
    ("key-safetensors", "m.safetensors", lambda: {0: torch.ones(1)}, TypeError, r"key 0 is of type int"),
    ("list-safetensors", "m.safetensors", lambda: [torch.ones(1)], TypeError, r"got an object of type list"),
    ("no-dir-pt", "missing/m.pt", _state_dict, FileNotFoundError, r"'[^']*missing[/\\]m\.pt': its directory"),
    ("no-dir-safetensors", "missing/m.safetensors", _state_dict, FileNotFoundError, r"missing[/\\]m\.safetensors'"),
    ("directory", ".", _state_dict, IsADirectoryError, r"it is a directory"),
    (
        "sparse-checksum",
        "m.pt",
        lambda: {"s": torch.eye(3).to_sparse()},
        TypeError,
        r"tensor 's' is a torch\.sparse_coo",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_and_writes_nothing(case, tmp_path) -> None:
    _, name, make, exception, pattern = case
    (tmp_path / "keep.pt").write_bytes(b"previous")
    with pytest.raises(exception, match=pattern):
        bl.save(make(), tmp_path / name, checksum=True)
    assert _listing(tmp_path) == {"keep.pt": b"previous"}


def test_path_must_be_a_file_name() -> None:
    with pytest.raises(TypeError, match=r"save: path must be a str or os\.PathLike .* got a BytesIO"):
        bl.save(_state_dict(), io.BytesIO())


@pytest.mark.parametrize(
    "name, data, pattern",
    [
        ("noise.pt", os.urandom(4096), r"load: '[^']*noise\.pt' is not a checkpoint"),
        ("noise.safetensors", os.urandom(4096), r"load: '[^']*noise\.safetensors' is not a safetensors file"),
        ("empty.pt", b"", r"load: '[^']*empty\.pt' is empty \(0 bytes\)"),
    ],
    ids=["random-pt", "random-safetensors", "empty-pt"],
)
def test_load_explains_broken_files(name, data, pattern, tmp_path) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=pattern):
        bl.load(tmp_path / name)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_load_explains_truncated_files(suffix, tmp_path) -> None:
    path = tmp_path / f"cut{suffix}"
    bl.save(_state_dict(), path, checksum=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"load: '[^']*cut{suffix}' is (truncated or corrupt|not a safetensors)"):
        bl.load(path)
