"""Loading N checkpoint files into one stacked model without holding N models in memory."""

from __future__ import annotations

import gc
import json
import os
import pickle
import zipfile
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from ._architecture import check_models, names_by_tensor, tensor_table
from .convert import _skeleton

__all__ = ["load_checkpoint", "stack_checkpoints"]


def load_checkpoint(
    path: str | os.PathLike,
    *,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
    mmap: bool = False,
) -> Mapping[str, Tensor]:
    """One checkpoint file: a ``.safetensors`` file, or anything ``torch.load`` reads (``weights_only=True`` by
    default: a checkpoint file can run code when unpickled, so only plain tensors and containers are read;
    ``mmap`` as in ``torch.load``).

    Raises:
        ValueError: the file is not a checkpoint, or is truncated or corrupt (the reader's own error is
            chained as ``__cause__``).
    """
    return _load(path, "load_checkpoint", map_location=map_location, weights_only=weights_only, mmap=mmap)


def _load(path, where: str, *, map_location, weights_only: bool, mmap: bool) -> Mapping[str, Tensor]:
    safetensors = isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".safetensors")
    try:
        if safetensors:
            from safetensors.torch import load_file

            return load_file(os.fspath(path), device=str(map_location))
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:
        if not isinstance(path, (str, os.PathLike)):
            raise
        try:
            problem = _safetensors_problem(path) if safetensors else _torch_file_problem(path, error, mmap)
        except OSError:
            problem = None
        if problem is None:
            raise  # the file looks sound: the reader's own error says what is wrong
        raise ValueError(f"{where}: '{os.fspath(path)}' {problem}") from error


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


def stack_checkpoints(
    model: nn.Module,
    paths: Sequence[str | os.PathLike],
    *,
    key: str | None = None,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
    mmap: bool = True,
) -> nn.Module:
    """A stacked model of ``model``'s architecture holding the weights saved in ``paths``, one model per file.

    The files are read one at a time into the preallocated stacked tensors, so the peak memory is about the
    stacked model plus one checkpoint (and ``model``), not N models.

    Args:
        model: one instance of the architecture; only its structure, configuration, dtype and its
            non-persistent buffers are used, not its weights.
        paths: checkpoint files holding ``model.state_dict()``-style dicts: ``.safetensors`` files or
            ``torch.save`` files.
        key: when each file holds a dict with the state dict under a key (e.g. ``"model"``), that key.
        map_location: where tensors are loaded before being copied into the stacked model (its device is
            ``model``'s).
        weights_only: passed to ``torch.load``; keep ``True`` for files you did not write yourself.
        mmap: passed to ``torch.load``: the file is mapped, not read into a buffer first, so that reading
            it never needs two copies of one model. Pass ``False`` for files in torch's legacy
            (pre-1.6, non-zip) format.

    Examples::

        >>> paths = [f"runs/seed{s}/model.pt" for s in range(8)]
        >>> batched = batchlayers.stack_checkpoints(MyNet(), paths)
    """
    check_models([model], "stack_checkpoints")
    paths = list(paths)
    if not paths:
        raise ValueError("stack_checkpoints: got an empty list of checkpoint files")
    expected = model.state_dict()
    defaults = tensor_table(model)
    # every other name of a tied tensor: safetensors files keep only one of them
    aliases = {n: [a for a in names if a != n] for names in names_by_tensor(model) for n in names}
    result = _skeleton(model, len(paths))
    for i, path in enumerate(paths):
        where = f"stack_checkpoints (file {i + 1} of {len(paths)})"
        state = _load(path, where, map_location=map_location, weights_only=weights_only, mmap=mmap)
        if key is not None:
            if not isinstance(state, Mapping) or key not in state:
                raise KeyError(f"stack_checkpoints: '{path}' holds no entry '{key}'")
            state = state[key]
        if not isinstance(state, Mapping):
            raise TypeError(f"stack_checkpoints: '{path}' holds a {type(state).__name__}, not a state dict")
        missing = [k for k in expected if k not in state and not any(a in state for a in aliases.get(k, ()))]
        unexpected = [k for k in state if k not in expected]
        if missing or unexpected:
            raise ValueError(
                f"stack_checkpoints: '{path}' does not fit {type(model).__name__}: missing keys {missing[:5]}, "
                f"unexpected keys {unexpected[:5]}"
                + (" (is its state dict under a key? pass key=...)" if missing else "")
            )
        tensors = {}
        for name, default in defaults.items():
            value = state.get(name)
            if value is None:
                value = next((state[a] for a in aliases.get(name, ()) if a in state), default)
            if value.shape != default.shape:
                raise ValueError(
                    f"stack_checkpoints: '{name}' has shape {tuple(value.shape)} in '{path}' but "
                    f"{tuple(default.shape)} in {type(model).__name__}"
                )
            tensors[name] = value
        result.fill(i, tensors, f"'{path}'")
        del state, tensors
        gc.collect()  # an unpickled checkpoint can sit in reference cycles: free it before reading the next
    return result.module
