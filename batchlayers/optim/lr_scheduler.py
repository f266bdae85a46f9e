"""Learning-rate schedules that decide per model: ``ReduceLROnPlateau`` on an ``(M,)`` metric.

``torch.optim.lr_scheduler``'s schedules of the step count (``StepLR``, ``CosineAnnealingLR``, ``LambdaLR``...)
work unchanged on a batched optimizer with per-model learning rates (see :mod:`batchlayers.optim`). A plateau
schedule decides from a metric, and each model has its own: :class:`ReduceLROnPlateau` takes the ``(M,)``
metrics and keeps, per model, the best value, the count of bad epochs and the cooldown, so model ``m`` follows
exactly what ``torch.optim.lr_scheduler.ReduceLROnPlateau`` gives an optimizer of model ``m`` alone stepped with
``metrics[m]``.
"""

from __future__ import annotations

import numbers
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.optim import Optimizer, lr_scheduler

from ._base import BatchedOptimizer, PerModelValue

__all__ = ["ReduceLROnPlateau"]

# The per-model schedulers alive for each optimizer, so that batchlayers.population can refuse to change the
# number of models under a scheduler it was not given (its per-model state would keep the old models).
_LIVE: weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet] = weakref.WeakKeyDictionary()


def live_schedulers(optimizer: Optimizer) -> list[ReduceLROnPlateau]:
    """The :class:`ReduceLROnPlateau` schedulers that exist for ``optimizer``."""
    return list(_LIVE.get(optimizer, ()))


class ReduceLROnPlateau(lr_scheduler.ReduceLROnPlateau):
    r"""Reduce each model's learning rate when *its* metric has stopped improving.

    The per-model :class:`torch.optim.lr_scheduler.ReduceLROnPlateau`, with torch's arguments and defaults.
    :meth:`step` takes an ``(M,)`` tensor of metrics, one per model (e.g. each model's validation loss); every
    model keeps its own best value, bad-epoch count and cooldown, and only the models whose own metric has not
    improved for ``patience`` epochs have their learning rate multiplied by ``factor``. Model ``m`` follows
    exactly what torch's scheduler gives a ``torch.optim`` optimizer of model ``m`` alone, with
    ``lr[m]``, stepped with ``metrics[m]``.

    Args:
        optimizer: a :mod:`batchlayers.optim` optimizer; its ``lr`` may be a float or an ``(M,)`` tensor (a
            float becomes an ``(M,)`` tensor once the models' learning rates differ).
        mode, factor, patience, threshold, threshold_mode, cooldown, eps: as in torch, the same for every model.
        min_lr: a float, or an ``(M,)`` tensor of per-model lower bounds, or a list of either, one per param
            group.

    Attributes:
        best: ``(M,)`` float64, each model's best metric so far.
        num_bad_epochs: ``(M,)`` int64, each model's epochs since its last improvement.
        cooldown_counter: ``(M,)`` int64, each model's remaining cooldown epochs.

    :func:`batchlayers.population.keep_models_` and :func:`~batchlayers.population.copy_model_` index and copy
    this per-model state when the scheduler is passed in ``schedulers=[...]``.

    Example::

        >>> optimizer = batchlayers.optim.SGD(model.parameters(), lr=torch.tensor([0.1, 0.05, 0.01]))
        >>> scheduler = batchlayers.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=2)
        >>> for epoch in range(epochs):
        ...     train(model, optimizer)
        ...     scheduler.step(validation_losses(model))      # (M,)
    """

    # Per model: (M,) tensors where torch keeps one number.
    best: Tensor  # type: ignore[assignment]
    num_bad_epochs: Tensor  # type: ignore[assignment]
    cooldown_counter: Tensor  # type: ignore[assignment]
    min_lrs: list[float | Tensor]  # type: ignore[assignment]
    optimizer: BatchedOptimizer

    def __init__(
        self,
        optimizer: Optimizer,
        mode: Literal["min", "max"] = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: Literal["rel", "abs"] = "rel",
        cooldown: int = 0,
        min_lr: float | Tensor | Sequence[float | Tensor] = 0,
        eps: float = 1e-8,
    ) -> None:
        name = type(self).__name__
        if not isinstance(optimizer, BatchedOptimizer):
            raise TypeError(
                f"{name}: expected a batchlayers.optim optimizer (per-model learning rates), got "
                f"{type(optimizer).__name__}; for one metric shared by every model use "
                "torch.optim.lr_scheduler.ReduceLROnPlateau"
            )
        sizes = sorted({optimizer._group_num_models(group) for group in optimizer.param_groups})
        if len(sizes) != 1:
            raise ValueError(f"{name}: the optimizer's param groups hold different numbers of models {sizes}")
        num_models = sizes[0]
        for arg, value in (("patience", patience), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(cast(object, value), numbers.Integral) or value < 0:
                raise ValueError(f"{name}: {arg} must be a non-negative int, got {value!r}")
        # (cast: to mypy an int is no numbers.Integral, a float no numbers.Real, which would end the checks here)
        if isinstance(factor, bool) or not isinstance(cast(object, factor), numbers.Real) or not 0 <= factor < 1:
            raise ValueError(f"{name}: factor must be a number in [0, 1) (the lr is multiplied by it), got {factor!r}")
        if mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise ValueError(
                f"{name}: mode must be 'min' or 'max' and threshold_mode 'rel' or 'abs', got mode={mode!r}, "
                f"threshold_mode={threshold_mode!r}"
            )
        self._num_models = num_models  # read by _reset, which torch's __init__ calls
        # (torch's types say floats: (M,) tensors pass through to min_lrs, checked below)
        super().__init__(optimizer, mode, factor, patience, threshold, threshold_mode, cooldown, cast(Any, min_lr), eps)
        del self._num_models
        self.min_lrs = [self._check_min_lr(value, num_models) for value in self.min_lrs]
        _LIVE.setdefault(optimizer, weakref.WeakSet()).add(self)

    def _check_min_lr(self, value: object, num_models: int) -> float | Tensor:
        name = type(self).__name__
        if isinstance(value, Tensor):
            if value.shape != (num_models,) or value.is_complex() or value.dtype == torch.bool:
                raise ValueError(
                    f"{name}: min_lr must be a float or a real tensor of shape (M,) = ({num_models},), got a "
                    f"{value.dtype} tensor of shape {tuple(value.shape)}"
                )
            return value.detach().to(device="cpu", dtype=torch.float64, copy=True)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name}: min_lr must be a float or an (M,) = ({num_models},) tensor (or a list of them, one per "
                f"param group), got {type(value).__name__}"
            )
        return float(value)

    def _reset(self) -> None:
        num_models = getattr(self, "_num_models", None)
        if num_models is None:
            num_models = self.best.shape[0]
        self.best = torch.full((num_models,), self.mode_worse, dtype=torch.float64)
        self.cooldown_counter = torch.zeros(num_models, dtype=torch.int64)
        self.num_bad_epochs = torch.zeros(num_models, dtype=torch.int64)

    @property
    def in_cooldown(self) -> Tensor:
        """``(M,)`` bool: the models in their cooldown."""
        return self.cooldown_counter > 0

    def _metrics(self, metrics: object) -> Tensor:
        num_models = self.best.shape[0]
        name = type(self).__name__
        if not isinstance(metrics, Tensor):
            got = (
                f"a {type(metrics).__name__} of {len(metrics)} values; pass torch.tensor([...])"
                if isinstance(metrics, (list, tuple))
                else f"a {type(metrics).__name__}"
            )
            raise TypeError(
                f"{name}.step: metrics must be a tensor of shape (M,) = ({num_models},), one value per model, got "
                f"{got} (torch.optim.lr_scheduler.ReduceLROnPlateau takes one metric for all models)"
            )
        if metrics.shape != (num_models,):
            raise ValueError(
                f"{name}.step: metrics must be a tensor of shape (M,) = ({num_models},), one value per model, got "
                f"shape {tuple(metrics.shape)}"
            )
        if metrics.is_complex() or metrics.dtype == torch.bool:
            raise TypeError(f"{name}.step: metrics must be real numbers, got {metrics.dtype}")
        return metrics.detach().to(device="cpu", dtype=torch.float64)

    def step(self, metrics: Tensor, epoch: int | None = None) -> None:  # type: ignore[override]
        """One epoch: each model's ``metrics[m]`` against its own best; reduce the models on a plateau."""
        self._check_groups()
        current = self._metrics(metrics)
        if epoch is None:
            epoch = self.last_epoch + 1
        else:
            warnings.warn(lr_scheduler.EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
        self.last_epoch = epoch
        better = self._is_better(current, self.best)
        self.best = torch.where(better, current, self.best)
        self.num_bad_epochs = torch.where(better, 0, self.num_bad_epochs + 1)
        cooling = self.in_cooldown
        self.cooldown_counter = torch.where(cooling, self.cooldown_counter - 1, self.cooldown_counter)
        self.num_bad_epochs = torch.where(cooling, 0, self.num_bad_epochs)
        reduce = self.num_bad_epochs > self.patience
        if bool(reduce.any()):
            self._reduce_models(reduce)
            self.cooldown_counter = torch.where(reduce, self.cooldown, self.cooldown_counter)
            self.num_bad_epochs = torch.where(reduce, 0, self.num_bad_epochs)
        self._last_lr = lr_scheduler._param_groups_val_list(self.optimizer, "lr")

    def _check_groups(self) -> None:
        num_models, name = self.best.shape[0], type(self).__name__
        if len(self.min_lrs) != len(self.optimizer.param_groups):
            if self.default_min_lr is None:
                raise RuntimeError(
                    f"{name}: the optimizer has {len(self.optimizer.param_groups)} param groups, min_lr was given "
                    f"for {len(self.min_lrs)}; set the scheduler's min_lrs to one value per group"
                )
            self.min_lrs = [self._check_min_lr(self.default_min_lr, num_models)] * len(self.optimizer.param_groups)
        for index, group in enumerate(self.optimizer.param_groups):
            held = self.optimizer._group_num_models(group)
            if held != num_models:
                raise ValueError(
                    f"{name}: param group {index} holds {held} models, this scheduler's state {num_models}; keep or "
                    "copy models with batchlayers.population.keep_models_(model, optimizer, indices, "
                    "schedulers=[scheduler]) so the scheduler follows"
                )

    def _reduce_models(self, reduce: Tensor) -> None:
        num_models = self.best.shape[0]
        for group, min_lr in zip(self.optimizer.param_groups, self.min_lrs):
            lr = group["lr"]
            per_model = isinstance(lr, Tensor) and lr.dim() > 0
            old = (
                lr.detach().as_subclass(Tensor).to(device="cpu", dtype=torch.float64)
                if per_model
                else torch.full((num_models,), float(lr), dtype=torch.float64)
            )
            if old.shape != (num_models,):
                raise ValueError(
                    f"{type(self).__name__}: lr has shape {tuple(old.shape)} but the optimizer holds {num_models} "
                    "models"
                )
            # torch, per model: new = max(old * factor, min_lr), applied when old - new > eps.
            new = torch.maximum(old * self.factor, torch.as_tensor(min_lr, dtype=torch.float64))
            new = torch.where(reduce & (old - new > self.eps), new, old)
            if torch.equal(new, old):
                continue
            if isinstance(lr, PerModelValue):
                lr.copy_(new)
            elif per_model:
                group["lr"] = new.to(device=lr.device, dtype=lr.dtype)
            else:
                group["lr"] = new  # a float lr: the models now differ (adopted by the optimizer's next step)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state, tensors copied (a later step does not change a saved state)."""
        state = super().state_dict()
        return {
            key: value.clone()
            if isinstance(value, Tensor)
            else [v.clone() if isinstance(v, Tensor) else v for v in value]
            if isinstance(value, list)
            else value
            for key, value in state.items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved for the same number of models; nothing is loaded otherwise."""
        best = state_dict.get("best") if isinstance(state_dict, dict) else None
        num_models = self.best.shape[0]
        if not isinstance(best, Tensor) or best.shape != (num_models,):
            got = f"shape {tuple(best.shape)}" if isinstance(best, Tensor) else f"best={best!r}"
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected the state of a per-model scheduler of M = "
                f"{num_models} models (best of shape ({num_models},)), got {got}; nothing was loaded"
            )
        super().load_state_dict(
            {key: value.clone() if isinstance(value, Tensor) else value for key, value in state_dict.items()}
        )
