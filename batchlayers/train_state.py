"""Everything an exact resume needs in one state dict: models, optimizers, schedulers, data streams and the
random number generators."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["TrainState"]

_RNG = "rng"
_RNG_KEYS = ("torch", "cuda", "python", "numpy")


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class TrainState:
    r"""Bundles the objects of a training run so that one state dict saves it and one call resumes it exactly.

    :meth:`state_dict` collects every object's ``state_dict()`` under its name and, with ``rng=True``, the
    states of the random number generators; :meth:`load_state_dict` puts them all back. A run that saves
    ``state.state_dict()`` after step ``k`` (with :func:`batchlayers.save`) and is resumed from that file
    continues exactly as the uninterrupted run: the same batches (a :class:`~batchlayers.ModelBatchSampler`,
    :class:`~batchlayers.ModelTensorLoader` or :func:`~batchlayers.model_data_loader` resumes in the middle
    of an epoch), the same dropout masks and the same weights, bit for bit.

    Args:
        rng: also save and restore the random number generators: torch's CPU generator, the generator of
            every CUDA device (when CUDA is available), Python's ``random`` and numpy's global generator
            (when numpy is installed). Default: ``True``.
        **objects: the objects to save, by name: anything with ``state_dict()`` and ``load_state_dict()``
            (modules, optimizers, ``torch.optim.lr_scheduler`` schedulers, samplers and loaders,
            ``torch.amp.GradScaler``, ...), or a list or tuple of them.

    Attributes:
        objects: the objects by name, as given.
        rng: whether the random number generators are part of the state.

    Like :meth:`torch.nn.Module.state_dict`, :meth:`state_dict` returns the objects' tensors themselves, not
    copies: save it (or ``copy.deepcopy`` it) before training goes on. To resume, build every object as the
    run did (after :func:`~batchlayers.keep_models_`, with the number of models kept) and load the state
    into them.

    Examples::

        >>> state = batchlayers.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
        >>> batchlayers.save(state.state_dict(), "last.pt")  # every k steps
        >>> # after a crash: build model, optimizer, scheduler and loader as before, then
        >>> state.load_state_dict(batchlayers.load("last.pt"))
    """

    def __init__(self, *, rng: bool = True, **objects: Any) -> None:
        for name, value in objects.items():
            for obj in value if isinstance(value, (list, tuple)) else [value]:
                if not all(callable(getattr(obj, method, None)) for method in ("state_dict", "load_state_dict")):
                    raise TypeError(
                        f"TrainState: '{name}' must have state_dict() and load_state_dict() (or be a list or "
                        f"tuple of such objects), got a {type(obj).__name__}"
                    )
        self.objects = objects
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        """Every object's ``state_dict()`` under its name (a list for a list of objects), and under ``"rng"``
        the random number generators' states."""
        state: dict[str, Any] = {}
        for name, value in self.objects.items():
            if isinstance(value, (list, tuple)):
                state[name] = [obj.state_dict() for obj in value]
            else:
                state[name] = value.state_dict()
        if self.rng:
            state[_RNG] = _rng_state()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load every object's state, then (with ``rng=True``) the random number generators'.

        The names, list lengths and generator states are checked before anything is loaded; an object's own
        ``load_state_dict`` may still reject its part, after the objects named before it were loaded.

        Raises:
            ValueError: the state does not have this TrainState's names, a list of another length, or
                generator states of another form.
        """
        where = "TrainState.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: expected a state dict (a Mapping), got {type(state_dict).__name__}")
        expected = [*self.objects, *([_RNG] if self.rng else [])]
        missing = [name for name in expected if name not in state_dict]
        unexpected = sorted(str(name) for name in state_dict if name not in expected)
        if missing or unexpected:
            problems = ([f"missing keys {missing}"] if missing else []) + (
                [f"unexpected keys {unexpected}"] if unexpected else []
            )
            raise ValueError(f"{where}: {' and '.join(problems)}; expected the keys {expected}")
        for name, value in self.objects.items():
            if isinstance(value, (list, tuple)):
                got = state_dict[name]
                if not isinstance(got, (list, tuple)) or len(got) != len(value):
                    actual = f"length {len(got)}" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
                    raise ValueError(f"{where}: expected '{name}' to be a list of {len(value)} states, got {actual}")
        if self.rng:
            _check_rng_state(where, state_dict[_RNG])
        for name, value in self.objects.items():
            if isinstance(value, (list, tuple)):
                for obj, state in zip(value, state_dict[name]):
                    obj.load_state_dict(state)
            else:
                value.load_state_dict(state_dict[name])
        if self.rng:
            # Last: loading the objects must not draw from generators that are then restored.
            _set_rng_state(state_dict[_RNG])

    def __repr__(self) -> str:
        names = ", ".join(f"{name}={type(value).__name__}" for name, value in self.objects.items())
        return f"{type(self).__name__}({names}{'' if self.rng else ', rng=False'})"


def _rng_state() -> dict[str, Any]:
    # Plain tensors, ints, tuples and strings: the state loads with torch.load(weights_only=True).
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        kind, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(numpy.int64)), position, has_gauss, cached_gaussian)
    return state


def _check_rng_state(where: str, state: Any) -> None:
    if not isinstance(state, Mapping) or "torch" not in state or "python" not in state:
        got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{where}: expected 'rng' to be a dict with at least the keys ['python', 'torch'], got {got}")
    unexpected = sorted(str(key) for key in state if key not in _RNG_KEYS)
    if unexpected:
        raise ValueError(f"{where}: unexpected keys {unexpected} in 'rng'; expected keys of {sorted(_RNG_KEYS)}")
    if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
        raise ValueError(f"{where}: expected rng['torch'] to be a uint8 tensor (torch.get_rng_state())")
    python = state["python"]
    if not isinstance(python, (tuple, list)) or len(python) != 3:
        raise ValueError(f"{where}: expected rng['python'] to be a state of random.getstate()")
    numpy = state.get("numpy")
    if numpy is not None and (not isinstance(numpy, (tuple, list)) or len(numpy) != 5):
        raise ValueError(f"{where}: expected rng['numpy'] to be a state of numpy.random.get_state()")


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy = _numpy()
    if "numpy" in state and numpy is not None:
        kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype(numpy.uint32), position, has_gauss, cached_gaussian))
    if "cuda" in state:
        saved = list(state["cuda"])
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count != len(saved):
            warnings.warn(
                f"TrainState.load_state_dict: the state holds the random generators of {len(saved)} CUDA "
                f"devices, this process has {count}; only the first {min(count, len(saved))} are restored",
                stacklevel=3,
            )
        for device, generator_state in enumerate(saved[:count]):
            torch.cuda.set_rng_state(generator_state, device)
