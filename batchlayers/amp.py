"""Per-model gradient scaling for mixed-precision training: one loss scale per model.

``torch.amp.GradScaler`` keeps one scale for everything it scales: on a batched model, one model whose
gradients overflow makes it skip the optimizer step of every model and back off the scale of all of them.
:class:`GradScaler` here keeps an ``(M,)`` scale and an ``(M,)`` growth tracker and finds the non-finite
gradients model by model, so model ``m`` is scaled, skipped, backed off and grown exactly as a
``torch.amp.GradScaler`` would treat model ``m`` trained on its own; the other models do not notice.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["GradScaler", "OptState"]


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


# The scalers that have unscaled or stepped each optimizer since the models were last selected, so that
# batchlayers.population can refuse to reorder the models under a scaler it was not given (its per-model scales
# would stay at the old positions, each model then using another model's scale without an error).
_STEPPED: weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet[GradScaler]] = weakref.WeakKeyDictionary()


def stepping_scalers(optimizer: Optimizer) -> list[GradScaler]:
    """The live :class:`GradScaler` objects that have unscaled or stepped ``optimizer`` since the last selection of
    models (:func:`batchlayers.population.keep_models_` or :func:`~batchlayers.population.copy_model_`) that
    carried them."""
    return list(_STEPPED.get(optimizer, ()))


def stepped_optimizers(scaler: GradScaler) -> list[Optimizer]:
    """The live optimizers ``scaler`` has unscaled or stepped since the last selection of models that carried it."""
    return [optimizer for optimizer, scalers in list(_STEPPED.items()) if scaler in scalers]


def _fresh_optimizer_state() -> dict[str, Any]:
    # A module-level factory (not a lambda), so that the scaler pickles, as torch's.
    return {"stage": OptState.READY, "found_inf": None}


class GradScaler:
    r"""``torch.amp.GradScaler`` with one scale per model: an overflow in one model skips only its own step.

    The API is torch's. ``scale(losses)`` multiplies model ``m``'s loss (or its slice of any ``(M, *)``
    output) by model ``m``'s scale; ``step(optimizer)`` unscales each model's gradients by its own scale,
    finds the models with an ``inf`` or ``NaN`` gradient and calls ``optimizer.step(active=...)`` for the
    others; ``update()`` backs off the scale of every model that overflowed and grows the scale of every
    model that has not overflowed for ``growth_interval`` steps in a row. Model ``m``'s scale, growth
    tracker and weights are bit for bit those of ``torch.amp.GradScaler`` and a torch optimizer run on
    model ``m`` alone with the same gradients.

    Args:
        device: the device type the scaler is used with, ``"cuda"`` or ``"cpu"`` (as for torch: for
            ``"cuda"`` without CUDA the scaler is disabled, with a warning).
        init_scale: the initial scale of every model, or an ``(M,)`` tensor of one per model.
            Default: ``2.0**16``.
        growth_factor, backoff_factor, growth_interval: as for ``torch.amp.GradScaler``, the same for
            every model (each model counts its own steps without overflow).
        enabled: ``False`` makes every method a no-op (``step`` calls ``optimizer.step()``).
        num_models: ``M``; by default taken from the first tensor given to :meth:`scale` (or from an
            ``(M,)`` ``init_scale``).

    The optimizer must accept ``step(active=mask)`` (every :mod:`batchlayers.optim` optimizer does): a
    ``torch.optim`` optimizer cannot leave one model's slice (and its step count) unchanged.

    :func:`batchlayers.population.keep_models_` and :func:`~batchlayers.population.copy_model_` index and copy
    each model's scale and growth tracker when the scaler is passed in ``scalers=[...]``; they refuse a call that
    leaves behind a scaler that has stepped the optimizer.

    Examples::

        >>> scaler = batchlayers.amp.GradScaler("cpu")
        >>> optimizer = batchlayers.optim.Adam(model.parameters(), lr=1e-3)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     losses = batchlayers.losses.cross_entropy(model(x), y)    # (M,)
        >>> optimizer.zero_grad()
        >>> scaler.scale(losses).sum().backward()    # scale each model's loss, then sum
        >>> scaler.step(optimizer)                   # models whose gradients overflowed do not step
        >>> scaler.update()
        >>> scaler.get_scale()                       # (M,)
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float | Tensor = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        num_models: int | None = None,
    ) -> None:
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("batchlayers.amp.GradScaler is enabled, but CUDA is not available. Disabling.", stacklevel=2)
            self._enabled = False
        if self._enabled and growth_factor <= 1.0:
            raise ValueError(f"GradScaler: growth_factor must be > 1.0, got {growth_factor}")
        if self._enabled and backoff_factor >= 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be < 1.0, got {backoff_factor}")
        self._num_models = num_models
        self._init_scale = self._check_per_model("init_scale", init_scale, torch.float32)
        self._init_growth_tracker: float | Tensor = 0
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        # Created on the device of the first tensor scale() sees, as torch's.
        self._scale: Tensor | None = None
        self._growth_tracker: Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    # -- the number of models ----------------------------------------------------------------------------

    def _check_per_model(self, name: str, value: float | Tensor, dtype: torch.dtype) -> float | Tensor:
        """A float (every model), or an ``(M,)`` tensor copied to CPU ``dtype``, fixing ``M`` if unknown."""
        if not isinstance(value, Tensor) or value.dim() == 0:
            return value.item() if isinstance(value, Tensor) else value
        if value.dim() != 1:
            raise ValueError(f"GradScaler: {name} must be a number or an (M,) tensor, got shape {tuple(value.shape)}")
        self._set_num_models(value.shape[0], f"{name} of shape {tuple(value.shape)}")
        return value.detach().to("cpu", dtype, copy=True)

    def _set_num_models(self, num_models: int, source: str) -> None:
        if self._num_models is None:
            self._num_models = num_models
        elif num_models != self._num_models:
            raise ValueError(
                f"GradScaler: this scaler holds M = {self._num_models} models, but got {source}; every tensor "
                "it scales and every parameter it unscales needs the model dimension first"
            )

    @property
    def num_models(self) -> int | None:
        """``M``, or ``None`` before the scaler has seen a tensor (or was given ``num_models``)."""
        return self._num_models

    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        num_models = self._num_models
        assert num_models is not None  # (the caller has set it)
        self._scale = torch.empty(num_models, dtype=torch.float32, device=device)
        self._scale.copy_(torch.as_tensor(self._init_scale, dtype=torch.float32).expand(num_models))
        self._growth_tracker = torch.empty(num_models, dtype=torch.int32, device=device)
        self._growth_tracker.copy_(torch.as_tensor(self._init_growth_tracker, dtype=torch.int32).expand(num_models))

    def _check_scale_growth_tracker(self, caller: str) -> tuple[Tensor, Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"GradScaler.{caller}: no scale yet; call scaler.scale(losses) (or outputs) earlier in the iteration"
            )
        return self._scale, self._growth_tracker

    # -- scaling -----------------------------------------------------------------------------------------

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Tensor | Iterable[Tensor]:
        """Multiply model ``m``'s slice of ``outputs`` by model ``m``'s scale.

        Args:
            outputs: an ``(M,)`` tensor of per-model losses, any ``(M, *)`` tensor, or an iterable of them
                (lists and tuples come back as such).

        Returns:
            the scaled tensors, each of the dtype it came in (as ``loss * scale`` in torch). Sum the scaled
            ``(M,)`` losses to call ``backward()``: every model then gets its own scaled gradient.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return self._scale_one(outputs)
        if isinstance(outputs, Iterable):
            scaled: Iterable[Any] = map(self.scale, outputs)
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise TypeError(f"GradScaler.scale: outputs must be a Tensor or an iterable of Tensors, got {type(outputs)}")

    def _scale_one(self, output: Tensor) -> Tensor:
        if output.dim() == 0:
            raise ValueError(
                "GradScaler.scale: got a 0-d tensor, but each model needs its own scale: pass the (M,) per-model "
                "losses (or (M, *) outputs) and sum after scaling, scaler.scale(losses).sum().backward()"
            )
        self._set_num_models(output.shape[0], f"a tensor of shape {tuple(output.shape)}")
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(output.device)
        assert self._scale is not None  # (created just above)
        scale = self._scale.to(output.device, non_blocking=True).view(-1, *[1] * (output.dim() - 1))
        # torch multiplies by a 0-d float32 scale: computed in float32 (or float64), returned in the output's dtype.
        return (output * scale).to(output.dtype)

    # -- unscaling and stepping --------------------------------------------------------------------------

    def _grads(self, optimizer: Optimizer, allow_fp16: bool) -> list[Tensor]:
        grads = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise ValueError("GradScaler: attempting to unscale FP16 gradients")
                if param.grad.dim() == 0:
                    raise ValueError("GradScaler: every parameter needs the model dimension first, got a 0-d one")
                self._set_num_models(param.grad.shape[0], f"a gradient of shape {tuple(param.grad.shape)}")
                if param.grad.is_sparse and param.grad.dtype == torch.float16:
                    # As torch: duplicate indices of scaled float16 values could overflow when summed later.
                    param.grad = param.grad.coalesce()
                grads.append(param.grad)
        return grads

    @torch.no_grad()
    def _unscale_grads_(self, optimizer: Optimizer, inv_scale: Tensor, allow_fp16: bool) -> Tensor:
        """Multiply model ``m``'s gradients by ``inv_scale[m]``; return the ``(M,)`` float32 flags (1 where a
        model has a non-finite gradient), on the scale's device."""
        num_models = self._num_models
        assert num_models is not None  # (known since the scale was created, as unscale_ checked)
        found_inf = torch.zeros(num_models, dtype=torch.float32, device=inv_scale.device)
        for grad in self._grads(optimizer, allow_fp16):
            inv = inv_scale.to(grad.device, non_blocking=True)
            if grad.is_sparse:
                # (M, rows, *) sparse COO with the model as the first sparse dimension: scale each value row by
                # the scale of the model it belongs to.
                values, model_of = grad._values(), grad._indices()[0]
                bad = ~values.reshape(values.shape[0], -1).isfinite().all(1)
                found = torch.zeros(num_models, dtype=torch.bool, device=grad.device).index_put_(
                    (model_of,), bad, accumulate=True
                )
                values.mul_(inv[model_of].view(-1, *[1] * (values.dim() - 1)))
            else:
                found = ~grad.reshape(grad.shape[0], -1).isfinite().all(1)
                # torch's kernel computes val * inv_scale in float32 (float64 for float64) and rounds to the
                # gradient's dtype: the in-place product with a float32 tensor does the same.
                grad.mul_(inv.view(-1, *[1] * (grad.dim() - 1)))
            found_inf = found_inf.maximum(found.to(found_inf.device, torch.float32))
        return found_inf

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide each model's gradients (those ``optimizer`` steps) by that model's scale, in place.

        As in torch, optional: :meth:`step` unscales if this was not called; call it to clip or inspect
        unscaled gradients (e.g. :func:`batchlayers.clip_grad_norm_`) between ``backward()`` and
        :meth:`step`, once per optimizer and iteration.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # As torch: the reciprocal in float64 (float32 division can be imprecise with some compile options).
        inv_scale = scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()
        state["found_inf"] = self._unscale_grads_(optimizer, inv_scale, allow_fp16=False)
        state["stage"] = OptState.UNSCALED
        _STEPPED.setdefault(optimizer, weakref.WeakSet()).add(self)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale the gradients (unless :meth:`unscale_` did) and step the models whose gradients are finite.

        Calls ``optimizer.step(*args, active=finite, **kwargs)``: the models with an ``inf`` or ``NaN``
        gradient do not change at all (weights, optimizer state, step count). An ``active`` mask passed here
        is combined with it. Returns what ``optimizer.step`` returns.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if "active" not in inspect.signature(optimizer.step).parameters:
            raise TypeError(
                f"GradScaler.step: {type(optimizer).__name__}.step() takes no active= mask, so it cannot skip the "
                "step of only the models whose gradients overflowed; use a batchlayers.optim optimizer "
                "(SGD, Adam, AdamW, RMSprop)"
            )
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        finite = state["found_inf"] == 0
        user_active = kwargs.pop("active", None)
        if user_active is not None:
            finite = finite & user_active.to(finite.device)
        step: Callable[..., Any] = optimizer.step  # (a batchlayers optimizer's: it takes active=, checked above)
        result = step(*args, active=finite, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    @torch.no_grad()
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Back off the scale of every model that overflowed this iteration; grow the scale of every model
        whose last ``growth_interval`` steps were all finite.

        Args:
            new_scale: instead, set every model's scale to this float, or to the entries of an ``(M,)``
                tensor (or a 0-d tensor for all).
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                if new_scale.requires_grad or new_scale.shape not in ((), (1,), scale.shape):
                    raise ValueError(
                        f"GradScaler.update: new_scale must be a float, a 0-d or an (M,) = ({self._num_models},) "
                        f"tensor without grad, got shape {tuple(new_scale.shape)}"
                    )
                scale.copy_(new_scale.reshape(-1).expand(scale.shape))
            else:
                scale.fill_(new_scale)
        else:
            found_infs = [
                state["found_inf"].to(scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                if state["found_inf"] is not None
            ]
            if not found_infs:
                raise RuntimeError("GradScaler.update: no inf checks were recorded prior to update.")
            found_inf = torch.stack(found_infs).sum(0)
            _update_scale_(scale, growth_tracker, found_inf, self._growth_factor, self._backoff_factor,
                           self._growth_interval)  # fmt: skip
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    # -- selecting models (batchlayers.population) ------------------------------------------------------

    def _in_iteration(self) -> bool:
        """Whether an optimizer has been unscaled or stepped since the last :meth:`update`."""
        return any(state["stage"] is not OptState.READY for state in self._per_optimizer_states.values())

    def _per_model_tensors(self) -> dict[str, Tensor]:
        """Every ``(M,)`` tensor of per-model state by attribute name: the scale and growth tracker, and the
        initial values when they are per model (used until the first :meth:`scale`, and after unpickling)."""
        names = ("_scale", "_growth_tracker", "_init_scale", "_init_growth_tracker")
        values = {name: getattr(self, name) for name in names}
        return {name: v for name, v in values.items() if isinstance(v, Tensor) and v.dim() > 0}

    @torch.no_grad()
    def _keep_models_(self, index: Tensor, optimizer: Optimizer) -> None:
        """Keep the models at ``index`` (in that order, repeats duplicate): each model's scale and growth tracker
        follow it. Called by :func:`batchlayers.population.keep_models_` (which checked ``index``) for the
        models ``optimizer`` steps."""
        for name, value in self._per_model_tensors().items():
            setattr(self, name, value.index_select(0, index.to(value.device)))
        if self._num_models is not None:
            self._num_models = index.numel()
        _carried_with(self, optimizer)

    @torch.no_grad()
    def _copy_models_(self, src: Tensor, dst: Tensor, optimizer: Optimizer) -> None:
        """Give model ``dst`` model ``src``'s scale and growth tracker (all reads before the writes). Called by
        :func:`batchlayers.population.copy_model_`."""
        for value in self._per_model_tensors().values():
            value.index_copy_(0, dst.to(value.device), value.index_select(0, src.to(value.device)))
        _carried_with(self, optimizer)

    # -- reading and saving the state --------------------------------------------------------------------

    def get_scale(self) -> Tensor:
        """Every model's current scale, an ``(M,)`` float32 tensor (a copy); ones if the scaler is disabled.

        Before the scaler knows ``M`` (no :meth:`scale` call yet, no ``num_models``), a 0-d tensor holding
        the initial scale of every model."""
        if not self._enabled:
            return torch.ones(()) if self._num_models is None else torch.ones(self._num_models)
        if self._scale is not None:
            return self._scale.clone()
        init = torch.as_tensor(self._init_scale, dtype=torch.float32)
        return init.clone() if self._num_models is None else init.expand(self._num_models).clone()

    def _get_growth_tracker(self) -> Tensor:
        if self._growth_tracker is not None:
            return self._growth_tracker.clone()
        init = torch.as_tensor(self._init_growth_tracker, dtype=torch.int32)
        return init.clone() if self._num_models is None else init.expand(self._num_models).clone()

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """torch's keys: ``"scale"`` and ``"_growth_tracker"`` are ``(M,)`` tensors on the CPU (0-d before
        ``M`` is known), the factors and the interval numbers. Empty if the scaler is disabled. Save it after
        :meth:`update`."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale().cpu(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker().cpu(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s result; a ``torch.amp.GradScaler``'s (floats) gives every model its scale."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        init_scale = self._check_per_model("scale", state_dict["scale"], torch.float32)
        tracker = self._check_per_model("_growth_tracker", state_dict["_growth_tracker"], torch.int32)
        self._init_scale, self._init_growth_tracker = init_scale, tracker
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        if self._scale is not None:
            assert self._growth_tracker is not None  # (created with the scale)
            self._scale.copy_(torch.as_tensor(init_scale, dtype=torch.float32).expand(self._scale.shape))
            self._growth_tracker.copy_(torch.as_tensor(tracker, dtype=torch.int32).expand(self._scale.shape))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise RuntimeError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end "
                    "after scaler.update()."
                )
            # As torch: the unpickled scaler creates its tensors again, on the device of its first scale().
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _carried_with(scaler: GradScaler, optimizer: Optimizer) -> None:
    """After a selection of models that carried ``scaler`` with ``optimizer``: the other optimizers it steps (one
    scaler over the optimizers of several models, e.g. a GAN's two) need not, and must not, carry it again in
    their own selection calls. It is registered with them again when it next steps them."""
    for other in stepped_optimizers(scaler):
        if other is not optimizer:
            _STEPPED[other].discard(scaler)
    _STEPPED.setdefault(optimizer, weakref.WeakSet()).add(scaler)


def _update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """``torch._amp_update_scale_`` for every model at once, with the same arithmetic: ``scale * factor`` in
    float64, rounded to float32; a grown scale that is not finite is not taken; the tracker counts finite steps
    and restarts at 0 after an overflow or a growth."""
    wide = torch.float32 if scale.device.type == "mps" else torch.float64
    found = found_inf != 0
    successful = growth_tracker + 1
    grow = ~found & (successful == growth_interval)
    backed_off = (scale.to(wide) * backoff_factor).float()
    grown = (scale.to(wide) * growth_factor).float()
    grown = torch.where(grown.isfinite(), grown, scale)
    scale.copy_(torch.where(found, backed_off, torch.where(grow, grown, scale)))
    growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(successful), successful))
