"""Checkpoint files: crash-safe saving (``save``), loading with clear errors (``load``, ``load_checkpoint``),
and loading N checkpoints (files, or ``save_pretrained`` folders, sharded or not) into one stacked model without
holding N models in memory (``stack_checkpoints``).

A checksum written by ``save(..., checksum=True)`` is a SHA-256 digest of every tensor's bytes (with its
dtype and shape), in the order the tensors are met walking the saved dicts, lists and tuples. A torch file
holds it beside the data, ``{"__batchlayers_checksum__": {...}, "data": obj}``; a ``.safetensors`` file in
its metadata under ``"batchlayers.checksum"``. Every loader here verifies it and unwraps the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hashlib
import json
import os
import pickle
import secrets
import stat
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._architecture import check_models, names_by_tensor, tensor_table
from .convert import _skeleton

__all__ = ["load", "load_checkpoint", "save", "stack_checkpoints"]

_CHECKSUM_KEY = "__batchlayers_checksum__"  # the torch-file wrapper's entry
_METADATA_KEY = "batchlayers.checksum"  # the safetensors metadata entry
# sha256 (SHA-NI) hashed 100 MB in 0.06 s on a 2-core Xeon VM, blake2b in 0.12 s, so checksums use sha256
_ALGORITHM = "sha256"


def save(obj: Any, path: str | os.PathLike, *, checksum: bool = False) -> None:
    """Write ``obj`` to ``path`` so that a crash never leaves a half-written checkpoint behind.

    The file is written to a temporary file in the same directory (``.<name>.tmp-<pid>-<random>``), flushed
    to disk (``os.fsync``), then renamed onto ``path`` in one step (``os.replace``), and the directory is
    flushed too (on POSIX). Until the rename, a file already at ``path`` is untouched: after a crash, a
    kill or a full disk, ``path`` holds either the previous file or the new one, whole, never a mix. On an
    exception the temporary file is removed; after a hard kill (``SIGKILL``, power loss) it may remain,
    hidden, next to ``path``.

    Args:
        obj: what to save. For a path ending in ``.safetensors``, a flat dict of ``str`` -> ``Tensor`` (a
            ``state_dict()``), written with safetensors; for any other path, anything ``torch.save`` writes
            (nested dicts, optimizer state dicts, ...). ``obj`` is not changed.
        path: the file to write (``str`` or ``os.PathLike``). Its directory must exist. A symbolic link is
            followed: the file it points to is replaced.
        checksum: also store a SHA-256 digest of every tensor's bytes, dtype and shape (for tensors in
            nested dicts, lists and tuples), which ``batchlayers.load``, ``load_checkpoint`` and
            ``stack_checkpoints`` verify, naming the first tensor that differs. A torch file then holds
            ``{"__batchlayers_checksum__": ..., "data": obj}`` (those loaders return ``obj``); a
            ``.safetensors`` file keeps the digest in its metadata and stays an ordinary safetensors
            file. Costs about one extra read of the tensors at save and at load (measured in the docs, Reliability).

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``; or a ``.safetensors`` file was given
            anything but a flat dict of ``str`` -> ``Tensor`` (the offending key is named); or
            ``checksum=True`` meets a sparse, quantized or meta tensor.
        FileNotFoundError: the directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.

    Examples::

        >>> batchlayers.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "run/last.pt")
        >>> batchlayers.save(model.state_dict(), "run/model.safetensors", checksum=True)
        >>> model.load_state_dict(batchlayers.load("run/model.safetensors"))
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"save: path must be a str or os.PathLike (the file is replaced by renaming a temporary file onto "
            f"it), got a {type(path).__name__}"
        )
    path = os.fsdecode(os.fspath(path))
    target = os.path.realpath(path) if os.path.islink(path) else path
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"save: cannot write '{path}': its directory '{directory}' does not exist")
    if os.path.isdir(target):
        raise IsADirectoryError(f"save: cannot write '{path}': it is a directory")
    write: Callable[[str], None]
    if path.endswith(".safetensors"):
        tensors = _flat_tensors(obj, path)
        metadata = {_METADATA_KEY: json.dumps(_checksum(tensors))} if checksum else None

        def write(temporary: str) -> None:
            from safetensors.torch import save_file

            save_file(tensors, temporary, metadata=metadata)

    else:
        payload = {_CHECKSUM_KEY: _checksum(obj), "data": obj} if checksum else obj

        def write(temporary: str) -> None:
            torch.save(payload, temporary)

    _replace_atomically(target, directory, write)


def _flat_tensors(obj: Any, path: str) -> dict[str, Tensor]:
    """``obj`` as safetensors wants it (contiguous, detached), or a TypeError naming what does not fit."""
    if not isinstance(obj, Mapping):
        raise TypeError(
            f"save: '{path}' is a .safetensors file, which holds a flat dict of str -> Tensor, but got an object "
            f"of type {type(obj).__name__} (save it to a torch file, e.g. '.pt', instead)"
        )
    for key, value in obj.items():
        if not isinstance(key, str):
            raise TypeError(
                f"save: '{path}' is a .safetensors file, whose keys must be str, but key {key!r} is of type "
                f"{type(key).__name__}"
            )
        if not isinstance(value, Tensor):
            raise TypeError(
                f"save: '{path}' is a .safetensors file, which holds only tensors, but entry '{key}' is of type "
                f"{type(value).__name__} (save nested dicts, optimizer states and other values to a torch "
                f"file, e.g. '.pt', instead)"
            )
    # safetensors refuses non-contiguous tensors; copies are made here so that obj itself is never changed
    return {key: value.detach().contiguous() for key, value in obj.items()}


def _replace_atomically(target: str, directory: str, write: Callable[[str], None]) -> None:
    """``write`` a temporary file next to ``target``, flush it to disk and rename it onto ``target``."""
    name = os.path.basename(target)[:180]  # room for the suffix within the usual 255-byte name limit
    temporary = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    binary = getattr(os, "O_BINARY", 0)
    # O_EXCL: never clobber another writer's file. Mode 0o666 less the umask, what a new file gets anyway.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | binary, 0o666)
    try:
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            mode = stat.S_IMODE(os.stat(target).st_mode)  # a replaced file keeps its permissions
        os.chmod(temporary, stat.S_IRUSR | stat.S_IWUSR)  # writable by its writer whatever the umask
        write(temporary)
        fd = os.open(temporary, os.O_RDWR | binary)
        try:
            os.fsync(fd)  # the data is on disk before the rename makes it the checkpoint
        finally:
            os.close(fd)
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    """Flush the rename itself to disk (POSIX); skipped where directories cannot be opened (Windows)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:
        # some file systems (e.g. network or FUSE ones) do not support fsync on a directory
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _named_tensors(obj: Any, prefix: str = "", active: set[int] | None = None) -> Iterator[tuple[str, Tensor]]:
    """Every tensor in ``obj``'s nested dicts, lists and tuples, named by its path, in a defined order:
    dicts in their insertion order (which pickle keeps), sequences by index."""
    if isinstance(obj, Tensor):
        yield prefix, obj
        return
    if not isinstance(obj, (Mapping, list, tuple)):
        return
    active = set() if active is None else active
    if id(obj) in active:  # a container holding itself: pickle keeps the cycle, the walk stops
        return
    active.add(id(obj))
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            name = (f"{prefix}.{key}" if prefix else key) if isinstance(key, str) else f"{prefix}[{key!r}]"
            yield from _named_tensors(value, name, active)
    else:
        for i, value in enumerate(obj):
            yield from _named_tensors(value, f"{prefix}[{i}]", active)
    active.discard(id(obj))


def _digest(tensor: Tensor, name: str) -> str:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.is_meta:
        raise TypeError(
            f"checksum: tensor '{name}' is a {tensor.layout} {'quantized ' if tensor.is_quantized else ''}"
            f"{'meta ' if tensor.is_meta else ''}tensor; checksums cover dense tensors that hold their data"
        )
    data = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    # .data: the array's memoryview (numpy's stubs give ndarray the Buffer protocol only from Python 3.12)
    return hashlib.new(_ALGORITHM, data.numpy().data).hexdigest()


def _checksum(obj: Any) -> dict[str, Any]:
    """What ``save(..., checksum=True)`` stores: ``[name, dtype, shape, digest]`` for every tensor, in order."""
    entries = [[name, str(t.dtype), list(t.shape), _digest(t, name)] for name, t in _named_tensors(obj)]
    return {"algorithm": _ALGORITHM, "tensors": entries}


def _verify(found: list[tuple[str, Tensor]], checksum: Any, where: str, path: Any, by_name: bool) -> None:
    """A ValueError naming the file and the first tensor that differs from what ``save`` recorded in
    ``checksum`` (a JSON string when ``by_name``, i.e. from safetensors metadata)."""
    file = f"{where}: '{os.fspath(path) if isinstance(path, (str, os.PathLike)) else path}'"
    try:
        checksum = json.loads(checksum) if by_name else checksum
        algorithm = checksum["algorithm"]
        entries = [(str(n), str(d), [int(x) for x in shape], str(h)) for n, d, shape, h in checksum["tensors"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{file} is corrupt: its checksum record is not one batchlayers.save writes") from error
    if by_name:
        order = {entry[0]: i for i, entry in enumerate(entries)}
        found = sorted(found, key=lambda item: order.get(item[0], len(order)))
    if algorithm != _ALGORITHM:
        raise ValueError(f"{file} has a checksum of an unknown algorithm {algorithm!r} (expected {_ALGORITHM!r})")
    for i, (name, dtype, shape, digest) in enumerate(entries):
        if i >= len(found):
            raise ValueError(
                f"{file} is corrupt: it holds {len(found)} tensors but was saved with {len(entries)} (the first "
                f"missing one is '{name}')"
            )
        got_name, tensor = found[i]
        if got_name != name:
            raise ValueError(f"{file} is corrupt: tensor {i} is '{got_name}' but was saved as '{name}'")
        if str(tensor.dtype) != dtype or list(tensor.shape) != shape:
            raise ValueError(
                f"{file} is corrupt: tensor '{name}' is {tensor.dtype} of shape {tuple(tensor.shape)} but was "
                f"saved as {dtype} of shape {tuple(shape)}"
            )
        got = _digest(tensor, name)
        if got != digest:
            raise ValueError(
                f"{file} is corrupt: the bytes of tensor '{name}' differ from those it was saved with "
                f"({algorithm} {got[:16]}... instead of {digest[:16]}...): the file was changed or damaged "
                f"after it was written"
            )
    if len(found) > len(entries):
        raise ValueError(
            f"{file} is corrupt: it holds {len(found)} tensors but was saved with {len(entries)} (the first "
            f"extra one is '{found[len(entries)][0]}')"
        )


def load(
    path: str | os.PathLike,
    *,
    map_location: Any = None,
    weights_only: bool = True,
    mmap: bool = False,
    verify: bool = True,
    **kwargs: Any,
) -> Any:
    """Read what ``batchlayers.save`` wrote (or any ``torch.save`` or ``.safetensors`` file), verifying its
    checksum if it has one.

    Args:
        path: the file. A path ending in ``.safetensors`` is read with safetensors, anything else with
            ``torch.load``.
        map_location: as in ``torch.load``; for a ``.safetensors`` file, the device (default ``"cpu"``).
        weights_only: passed to ``torch.load``; keep ``True`` for files you did not write yourself.
        mmap: passed to ``torch.load``.
        verify: check the checksum that ``save(..., checksum=True)`` stored, if any. A file saved without
            one is read exactly as ``torch.load`` / ``safetensors.torch.load_file`` read it.
        **kwargs: further ``torch.load`` arguments (e.g. ``pickle_module``); none for ``.safetensors``.

    Returns:
        The saved object (for a file saved with ``checksum=True``, the object itself, not the wrapper).

    Raises:
        ValueError: the file is not a checkpoint, is truncated or corrupt, or its tensors differ from the
            checksum stored with them (the file and the first differing tensor are named).

    Examples::

        >>> batchlayers.save({"model": model.state_dict(), "step": 7}, "last.pt", checksum=True)
        >>> batchlayers.load("last.pt")["step"]
        7
    """
    return _load(path, "load", verify=verify, map_location=map_location, weights_only=weights_only, mmap=mmap, **kwargs)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
    mmap: bool = False,
) -> Mapping[str, Tensor]:
    """One checkpoint file: a ``.safetensors`` file, or anything ``torch.load`` reads (``weights_only=True`` by
    default: a checkpoint file can run code when unpickled, so only plain tensors and containers are read;
    ``mmap`` as in ``torch.load``). A checksum stored by ``batchlayers.save(..., checksum=True)`` is verified.

    Raises:
        ValueError: the file is not a checkpoint, or is truncated or corrupt (the reader's own error is
            chained as ``__cause__``), or its tensors differ from its stored checksum.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint: expected the path as a str or os.PathLike, got {type(path).__name__}")
    return _load(path, "load_checkpoint", map_location=map_location, weights_only=weights_only, mmap=mmap)


def _load(path, where: str, *, verify: bool = True, **torch_kwargs) -> Any:
    safetensors = isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".safetensors")
    if safetensors:
        device = _safetensors_device(where, **torch_kwargs)
    checksum = None
    try:
        if safetensors:
            from safetensors import safe_open
            from safetensors.torch import load_file

            state: Any = load_file(os.fspath(path), device=device)
            with safe_open(os.fspath(path), "pt") as f:
                checksum = (f.metadata() or {}).get(_METADATA_KEY)
        else:
            state = torch.load(path, **torch_kwargs)
            if isinstance(state, dict) and state.keys() == {_CHECKSUM_KEY, "data"}:
                checksum, state = state[_CHECKSUM_KEY], state["data"]
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:
        if not isinstance(path, (str, os.PathLike)):
            raise
        try:
            mmap = torch_kwargs.get("mmap", False)
            problem = _safetensors_problem(path) if safetensors else _torch_file_problem(path, error, mmap)
        except OSError:
            problem = None
        if problem is None:
            raise  # the file looks sound: the reader's own error says what is wrong
        raise ValueError(f"{where}: '{os.fspath(path)}' {problem}") from error
    if verify and checksum is not None:
        # safetensors orders tensors its own way: they are compared in the order they were saved
        _verify(list(_named_tensors(state)), checksum, where, path, by_name=safetensors)
    return state


def _safetensors_device(where: str, *, map_location=None, weights_only=True, mmap=False, **unsupported) -> str:
    """The device to read a ``.safetensors`` file to; ``weights_only`` and ``mmap`` have nothing to do
    (safetensors never runs code and always maps the file)."""
    if unsupported:
        raise TypeError(f"{where}: {sorted(unsupported)} are torch.load arguments, not ones for a .safetensors file")
    if map_location is None:
        return "cpu"
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            f"{where}: map_location for a .safetensors file is a device (str or torch.device), got a "
            f"{type(map_location).__name__}"
        )
    return str(map_location)


# what torch.save's legacy (pre-1.6, non-zip) format starts with: its magic number pickled with protocol 2
_LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)


def _torch_file_problem(path: str | os.PathLike, error: Exception, mmap: bool) -> str | None:
    """Why ``torch.load`` could not read ``path``, when the file itself is at fault; else None."""
    size = os.path.getsize(path)
    if size == 0:
        return "is empty (0 bytes), not a checkpoint: was it cut short while being written?"
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return (
                f"is truncated or corrupt: it starts like a torch.save zip archive but has no end record "
                f"({size} bytes; was it cut short while being written or copied?)"
            )
        return None
    if head == _LEGACY_MAGIC:
        # torch.save's legacy format: with mmap torch's own message (save it again, or pass mmap=False) is right
        if not mmap and isinstance(error, (EOFError, RuntimeError)):
            return f"is truncated or corrupt: a legacy torch.save file that could not be read to its end ({error})"
        return None
    return (
        f"is not a checkpoint: it is neither a torch.save zip archive nor a legacy torch.save file (its first "
        f"bytes are {head[:8]!r})"
    )


def _safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a sound safetensors file, or None if its layout is sound."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if size < 8:
            return f"is not a safetensors file, or is truncated: it has {size} bytes, less than the 8-byte header size"
        header_size = int.from_bytes(head, "little")
        if 8 + header_size > size:
            return (
                f"is not a safetensors file, or is truncated: its first 8 bytes give a header of {header_size} "
                f"bytes but the file has {size} bytes"
            )
        try:
            header = json.loads(f.read(header_size))
            end = max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is not a safetensors file: its header is not a safetensors JSON header"
    if 8 + header_size + end != size:
        return (
            f"is truncated or corrupt: its header describes {8 + header_size + end} bytes of tensors and header "
            f"but the file has {size} bytes"
        )
    return None


# What a Hugging Face ``save_pretrained`` folder holds, in the order ``from_pretrained`` looks for them.
_HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclasses.dataclass
class _Checkpoint:
    """One model's checkpoint: a single file, or the shards of a sharded one that its index lists."""

    given: Any  # the entry of ``paths``
    file: Any  # the single file, or the index of a sharded checkpoint
    shards: list[tuple[str, list[str]]] | None  # each shard file and the tensors its index places in it
    folder: bool  # given as a folder or an index, not as a file of its own


def _resolve(path: Any, where: str, key: str | None) -> _Checkpoint:
    """What entry ``path`` of ``stack_checkpoints``' ``paths`` holds: a file, a ``save_pretrained`` folder
    (its single file or its index) or an index file."""
    if not isinstance(path, (str, os.PathLike)):
        return _Checkpoint(path, path, None, False)
    name = os.fsdecode(os.fspath(path))
    if os.path.isdir(name):
        found = next((f for f in _HF_FILES if os.path.isfile(os.path.join(name, f))), None)
        if found is None:
            held = sorted(os.listdir(name))
            raise ValueError(
                f"{where}: '{name}' is a directory without a checkpoint: it holds none of {', '.join(_HF_FILES)} "
                f"(what save_pretrained writes); it holds {held[:8] if held else 'nothing'}"
                + (f" and {len(held) - 8} more" if len(held) > 8 else "")
                + ". Pass the checkpoint file itself if it has another name"
            )
        file = os.path.join(name, found)
    elif name.endswith(".json"):
        file = name
    else:
        return _Checkpoint(path, path, None, False)
    if key is not None:
        raise ValueError(
            f"{where}: key={key!r} picks the state dict out of a checkpoint file holding a dict, but '{name}' is a "
            f"save_pretrained folder or index, whose files hold the state dict itself: pass key=None (or pass the "
            f"folders and the files in separate calls)"
        )
    return _Checkpoint(path, file, _read_index(file, where) if file.endswith(".json") else None, True)


def _read_index(index: str, where: str) -> list[tuple[str, list[str]]]:
    """The shards of a sharded checkpoint, in file name order, each with the tensors its index places in it;
    a ValueError naming the index if it is not one or a shard file is missing."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{where}: '{index}' is not a checkpoint index: it is not a JSON file ({error})") from error
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items())
    ):
        raise ValueError(
            f"{where}: '{index}' is not a checkpoint index: it has no \"weight_map\" of tensor names to shard file "
            f"names (what save_pretrained writes in a model.safetensors.index.json)"
        )
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor)
    directory = os.path.dirname(index)
    shards: list[tuple[str, list[str]]] = []
    for shard in sorted(by_shard):
        names = by_shard[shard]
        file = os.path.join(directory, shard)
        if not os.path.isfile(file):
            raise ValueError(
                f"{where}: '{index}' places {len(names)} tensor{'s' if len(names) > 1 else ''} (the first "
                f"'{names[0]}') in the shard '{shard}', but '{file}' does not exist: is the folder incomplete?"
            )
        shards.append((file, names))
    return shards


def _check_shard(state: Mapping[str, Any], file: str, listed: list[str], index: str) -> None:
    """A ValueError unless shard ``file`` holds exactly the tensors its ``index`` places in it."""
    listed_set = set(listed)
    for names, problem in (
        ([n for n in listed if n not in state], "lacks the tensor {} that its index '{}' places in it"),
        ([n for n in state if n not in listed_set], "holds the tensor {}, which its index '{}' does not place in it"),
    ):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise ValueError(f"stack_checkpoints: '{file}' " + problem.format(f"'{names[0]}'{more}", index))


def stack_checkpoints(
    model: nn.Module,
    paths: Sequence[str | os.PathLike],
    *,
    key: str | None = None,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
    mmap: bool = True,
) -> nn.Module:
    """A stacked model of ``model``'s architecture holding the weights saved in ``paths``, one model per entry.

    The checkpoints are read one file at a time into the preallocated stacked tensors, so the peak memory is
    about the stacked model plus one checkpoint file (and ``model``), not N models; a sharded checkpoint is
    read one shard at a time, so its peak is one shard, not one whole model.

    Args:
        model: one instance of the architecture; only its structure, configuration, dtype and its
            non-persistent buffers are used, not its weights.
        paths: one checkpoint per model, each one of

            - a checkpoint file holding a ``model.state_dict()``-style dict: a ``.safetensors`` file or a
              ``torch.save`` file (or a ``batchlayers.save`` file: a checksum stored with it is verified);
            - a folder written by ``save_pretrained`` (``transformers``, ``timm``): its ``model.safetensors``
              or ``pytorch_model.bin``, or, sharded (``max_shard_size``), its ``model.safetensors.index.json``
              or ``pytorch_model.bin.index.json`` and the shard files it lists; a safetensors file is used
              before a torch one, as ``from_pretrained`` does;
            - such an index file itself (any file ending in ``.json``), its shards next to it.

            The tensor names must be ``model``'s state dict keys, as they are for a ``PreTrainedModel`` and its
            own folders (names that ``from_pretrained`` renames on loading, legacy ones or a base model's
            prefix, are not renamed here). A tied weight saved under one of its names (safetensors keeps only
            one) fills all of them. Entries of different kinds can be mixed.
        key: when each file holds a dict with the state dict under a key (e.g. ``"model"``), that key. Not
            for folders and index files, whose files hold the state dict itself.
        map_location: where tensors are loaded before being copied into the stacked model (its device is
            ``model``'s).
        weights_only: passed to ``torch.load``; keep ``True`` for files you did not write yourself.
        mmap: passed to ``torch.load``: the file is mapped, not read into a buffer first, so that reading
            it never needs two copies of one model. Pass ``False`` for files in torch's legacy
            (pre-1.6, non-zip) format.

    Raises:
        ValueError: a checkpoint does not fit ``model`` (missing or unexpected tensor names, a tensor of
            another shape; the file or shard and the tensor are named); a file is not a checkpoint, is
            truncated, or differs from its stored checksum; a directory holds no checkpoint; an index is not
            one, lists a shard file that does not exist, or disagrees with a shard about which tensors it
            holds; ``key`` is given with a folder or an index.
        TypeError: ``paths`` is one path, not a list of them; a file holds something other than a state dict.
        KeyError: a file holds no entry ``key``.

    Examples::

        >>> paths = [f"runs/seed{s}/model.pt" for s in range(8)]
        >>> batched = batchlayers.stack_checkpoints(MyNet(), paths)
        >>> folders = [f"finetunes/{name}" for name in names]  # save_pretrained folders, sharded or not
        >>> batched = batchlayers.stack_checkpoints(BertForSequenceClassification(config), folders)
    """
    check_models([model], "stack_checkpoints")
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError(
            f"stack_checkpoints: expected a list of checkpoint files, one per model, got the one path {paths!r}"
        )
    paths = list(paths)
    if not paths:
        raise ValueError("stack_checkpoints: got an empty list of checkpoint files")
    expected = model.state_dict()
    defaults = tensor_table(model)
    groups = names_by_tensor(model)
    # every other name of a tied tensor: safetensors files keep only one of them
    aliases = {n: [a for a in names if a != n] for names in groups for n in names}

    def check_names(names: Collection[str], label: str, hint: str) -> None:
        missing = [k for k in expected if k not in names and not any(a in names for a in aliases.get(k, ()))]
        unexpected = [k for k in names if k not in expected]
        if missing or unexpected:
            raise ValueError(
                f"stack_checkpoints: {label} does not fit {type(model).__name__}: missing keys {missing[:5]}, "
                f"unexpected keys {unexpected[:5]}" + (hint if missing else "")
            )

    # Folders and indexes are checked before anything is read: a bad one fails at once, not after N-1 models.
    checkpoints: list[_Checkpoint] = []
    for i, path in enumerate(paths):
        checkpoint = _resolve(path, f"stack_checkpoints (checkpoint {i + 1} of {len(paths)})", key)
        if checkpoint.shards is not None:
            weight_map = [name for _, names in checkpoint.shards for name in names]
            check_names(weight_map, f"'{checkpoint.file}' (its weight_map)", "")
        checkpoints.append(checkpoint)

    result = _skeleton(model, len(paths))
    # each stacked (or shared) tensor, by any of its names; its names in the order a value is taken from
    owner: dict[str, str] = {}
    preferred: dict[str, list[str]] = {}
    for names in groups:
        target = next((n for n in names if n in result.stacked or n in result.shared), None)
        if target is not None:
            owner.update(dict.fromkeys(names, target))
            preferred[target] = [target] + aliases[target]

    def fill(index: int, state: Mapping[str, Any], file: Any, chosen: Mapping[str, str | None]) -> None:
        """Copy ``state``, one file's tensors, into model ``index``'s slices."""
        tensors = {}
        for name in defaults:
            if name not in state:
                continue
            value, default = state[name], defaults[name]
            if not isinstance(value, Tensor):
                raise TypeError(f"stack_checkpoints: '{name}' in '{file}' is a {type(value).__name__}, not a tensor")
            if value.shape != default.shape:
                raise ValueError(
                    f"stack_checkpoints: '{name}' has shape {tuple(value.shape)} in '{file}' but "
                    f"{tuple(default.shape)} in {type(model).__name__}"
                )
            target = owner.get(name)
            if target is not None and chosen[target] == name:
                tensors[target] = value
        part = dataclasses.replace(
            result,
            stacked={k: t for k, t in result.stacked.items() if k in tensors},
            shared={k: t for k, t in result.shared.items() if k in tensors},
        )
        part.fill(index, tensors, f"'{file}'")
        for name in [n for n in part.stacked if n in result.shared]:  # (a buffer this file made per model)
            result.stacked[name] = result.shared.pop(name)

    for i, checkpoint in enumerate(checkpoints):
        parts: list[tuple[Any, list[str] | None]] = [(checkpoint.file, None)]
        chosen: dict[str, str | None] = {}  # each stacked tensor -> the name its value is read under
        if checkpoint.shards is not None:
            parts = list(checkpoint.shards)
            in_shards = {name for _, listed in checkpoint.shards for name in listed}
            chosen = {t: next((n for n in p if n in in_shards), None) for t, p in preferred.items()}
        for k, (file, listed) in enumerate(parts):
            where = f"stack_checkpoints (file {i + 1} of {len(paths)})"
            if checkpoint.shards is not None:
                where = f"stack_checkpoints (checkpoint {i + 1} of {len(paths)}, shard {k + 1} of {len(parts)})"
            state = _load(file, where, map_location=map_location, weights_only=weights_only, mmap=mmap)
            if key is not None:
                if not isinstance(state, Mapping) or key not in state:
                    raise KeyError(f"stack_checkpoints: '{file}' holds no entry '{key}'")
                state = state[key]
            if not isinstance(state, Mapping):
                raise TypeError(f"stack_checkpoints: '{file}' holds a {type(state).__name__}, not a state dict")
            if listed is None:
                hint = "" if checkpoint.folder else " (is its state dict under a key? pass key=...)"
                check_names(state, f"'{file}'", hint)
                chosen = {t: next((n for n in p if n in state), None) for t, p in preferred.items()}
            else:
                _check_shard(state, file, listed, checkpoint.file)
            fill(i, state, file, chosen)
            del state
            if not (isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(".safetensors")):
                gc.collect()  # an unpickled checkpoint can sit in reference cycles: free it before the next file
        # the tensors that no file holds (non-persistent buffers) are model's own
        own = [t for t, name in chosen.items() if name is None]
        fill(i, {t: defaults[t] for t in own}, checkpoint.given, {t: t for t in own})
    return result.module
