"""What every batched optimizer shares: per-model hyperparameters, the active mask, state handling."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["PerModelValue"]

Hyperparameter = float | Tensor


class PerModelValue(Tensor):
    r"""An ``(M,)`` hyperparameter tensor as stored in a batched optimizer's ``param_groups``.

    A plain tensor in every respect (operations on it return plain tensors) except ``fill_``, which also
    accepts an ``(M,)`` tensor and copies it. ``torch.optim.lr_scheduler`` writes a new learning rate into an
    existing tensor with ``group["lr"].fill_(new_lr)``; for a per-model learning rate ``new_lr`` is the
    ``(M,)`` tensor the schedule computed, which a plain ``fill_`` rejects.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def fill_(self, value):  # type: ignore[override]
        if isinstance(value, Tensor) and value.dim() > 0:
            if value.shape != self.shape:
                raise ValueError(
                    f"cannot set a per-model hyperparameter of shape {tuple(self.shape)} to a value of shape "
                    f"{tuple(value.shape)}"
                )
            return self.copy_(value)
        return super().fill_(value)

    def __deepcopy__(self, memo: dict) -> PerModelValue:
        return self.as_subclass(Tensor).clone().as_subclass(PerModelValue)

    def __reduce_ex__(self, protocol):
        # Pickle as a plain tensor and wrap again on load, so checkpoints load with ``weights_only=True``.
        return _as_per_model_value, (self.as_subclass(Tensor).clone(),)


def _as_per_model_value(tensor: Tensor) -> PerModelValue:
    return tensor.as_subclass(PerModelValue)


def hyperparameter_dtype(device: torch.device) -> torch.dtype:
    # Per-model arithmetic (bias corrections, schedules) runs in float64 like torch's Python-float
    # hyperparameters, where the device has float64.
    return torch.float32 if device.type == "mps" else torch.float64


def broadcast_per_model(value: Hyperparameter, like: Sequence[Tensor]) -> float | list[Tensor]:
    """A float stays a float; an ``(M,)`` tensor becomes, for each tensor in ``like``, an ``(M, 1, ..., 1)``
    view in its dtype, so a ``torch._foreach_*`` op applies model ``m``'s value to slice ``m``."""
    if not isinstance(value, Tensor):
        return value
    values = value.to(like[0].dtype)
    return [values.view(-1, *([1] * (t.dim() - 1))) for t in like]


def broadcast_per_parameter(values: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Row ``i`` of a ``(len(params), M)`` tensor as an ``(M, 1, ..., 1)`` view in ``params[i]``'s dtype."""
    values = values.to(params[0].dtype)
    return [row.view(-1, *([1] * (p.dim() - 1))) for row, p in zip(values, params)]


def per_model_tensor(value: Hyperparameter, num_models: int, device: torch.device) -> Tensor:
    """A hyperparameter as an ``(M,)`` tensor in the dtype per-model arithmetic runs in."""
    dtype = hyperparameter_dtype(device)
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((num_models,), float(value), dtype=dtype, device=device)


def foreach_add_scaled_(tensors: list[Tensor], others: list[Tensor], scale: float | list[Tensor]) -> None:
    """``tensors += scale * others`` for a float or per-model ``scale``."""
    if isinstance(scale, list):
        torch._foreach_add_(tensors, torch._foreach_mul(others, scale))
    else:
        torch._foreach_add_(tensors, others, alpha=scale)


def foreach_add_scaled(tensors: list[Tensor], others: list[Tensor], scale: float | list[Tensor]) -> list[Tensor]:
    """``tensors + scale * others``, out of place."""
    if isinstance(scale, list):
        return torch._foreach_add(tensors, torch._foreach_mul(others, scale))
    return torch._foreach_add(tensors, others, alpha=scale)


def foreach_addcmul_scaled_(
    tensors: list[Tensor], factors: list[Tensor], others: list[Tensor], scale: float | list[Tensor]
) -> None:
    """``tensors += scale * factors * others`` for a float or per-model ``scale`` (one fused ``addcmul`` for
    a float, as torch's own optimizers do)."""
    if isinstance(scale, list):
        torch._foreach_addcmul_(tensors, torch._foreach_mul(factors, scale), others)
    else:
        torch._foreach_addcmul_(tensors, factors, others, value=scale)


def new_step_counts(param: Tensor) -> Tensor:
    """Steps taken by each model, ``(M,)``: models may be at different steps (``step(active=...)``)."""
    return torch.zeros(param.shape[0], dtype=torch.float32, device=param.device)


def is_zero(value: Hyperparameter) -> bool:
    return not isinstance(value, Tensor) and value == 0


class BatchedOptimizer(Optimizer):
    """Base class: ``torch.optim.Optimizer`` over parameters shaped ``(M, *)``, one model per slice.

    Subclasses list their numeric hyperparameters in ``per_model_hyperparameters`` (a name, or
    ``("betas", i)`` for an entry of a tuple), create their state in ``_init_state`` and update one
    device/dtype bucket of tensors in ``_update``.
    """

    per_model_hyperparameters: tuple[str | tuple[str, int], ...] = ()

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        for flag in ("differentiable", "capturable", "fused"):
            if defaults.get(flag):
                raise ValueError(f"{type(self).__name__}: {flag}=True is not supported")
        super().__init__(params, defaults)

    # -- hyperparameters -------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._adopt_hyperparameters(self.param_groups[-1])

    def _group_num_models(self, group: dict[str, Any]) -> int:
        sizes = {p.shape[0] if p.dim() > 0 else None for p in group["params"]}
        if None in sizes:
            raise ValueError(
                f"{type(self).__name__}: every parameter needs the model dimension first, got a 0-d parameter"
            )
        if len(sizes) != 1:
            raise ValueError(
                f"{type(self).__name__}: all parameters of a group need the same number of models "
                f"(size of dimension 0), got sizes {sorted(sizes)}"
            )
        return sizes.pop()

    def _get(self, group: dict[str, Any], key: str | tuple[str, int]) -> Any:
        return group[key] if isinstance(key, str) else group[key[0]][key[1]]

    def _set(self, group: dict[str, Any], key: str | tuple[str, int], value: Any) -> None:
        if isinstance(key, str):
            group[key] = value
        else:
            entries = list(group[key[0]])
            entries[key[1]] = value
            group[key[0]] = tuple(entries)

    @staticmethod
    def _key_name(key: str | tuple[str, int]) -> str:
        return key if isinstance(key, str) else f"{key[0]}[{key[1]}]"

    def _adopt_hyperparameters(self, group: dict[str, Any]) -> None:
        """Check every hyperparameter and store tensor ones as this group's own ``PerModelValue``."""
        num_models = self._group_num_models(group)
        device = group["params"][0].device
        for key in self.per_model_hyperparameters:
            value = self._get(group, key)
            name = self._key_name(key)
            if not isinstance(value, (Tensor, numbers.Real)):
                got = (
                    f"a {type(value).__name__} of {len(value)} values"
                    if isinstance(value, (list, tuple))
                    else f"a {type(value).__name__}"
                )
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a float or a tensor of shape (M,) = ({num_models},), "
                    f"one value per model, got {got}"
                    + ("; pass torch.tensor([...]) for per-model values" if isinstance(value, (list, tuple)) else "")
                )
            if isinstance(value, Tensor):
                if value.is_meta:
                    raise ValueError(
                        f"{type(self).__name__}: {name} is a tensor on the meta device, which holds no values; "
                        f"expected a float or an (M,) = ({num_models},) tensor with values (on any device: it is "
                        f"copied to the parameters' device {device})"
                    )
                if value.dim() == 0:
                    value = value.item()
                elif value.shape != (num_models,):
                    raise ValueError(
                        f"{type(self).__name__}: {name} must be a float or a tensor of shape (M,) = "
                        f"({num_models},), one value per model, got shape {tuple(value.shape)}"
                    )
                elif value.is_complex() or value.dtype == torch.bool:
                    raise TypeError(f"{type(self).__name__}: {name} must be a real tensor, got {value.dtype}")
                else:
                    # A copy: the user's tensor is never changed by schedulers, and groups never alias.
                    dtype = hyperparameter_dtype(device)
                    value = value.detach().to(device=device, dtype=dtype, copy=True).as_subclass(PerModelValue)
            self._check_value(name, value)
            self._set(group, key, value)

    def _check_value(self, name: str, value: Hyperparameter) -> None:
        values = value.as_subclass(Tensor) if isinstance(value, Tensor) else torch.tensor([float(value)])
        ok = values.isfinite() & (values >= 0)
        if name.startswith("betas"):
            ok &= values < 1  # [0, 1) as in torch
        if not bool(ok.all()):
            allowed = "in [0, 1)" if name.startswith("betas") else "finite and >= 0"
            raise ValueError(f"{type(self).__name__}: invalid {name} {values[~ok].tolist()}: must be {allowed}")

    def hyperparameter(self, group: dict[str, Any], key: str | tuple[str, int], num_models: int) -> Hyperparameter:
        """The value to compute with: a float, or an ``(M,)`` tensor (checked against the current ``M``)."""
        value = self._get(group, key)
        if isinstance(value, Tensor):
            if value.dim() == 0:
                return value.item()
            if value.shape != (num_models,):
                raise ValueError(
                    f"{type(self).__name__}: {self._key_name(key)} has shape {tuple(value.shape)} but the "
                    f"parameters hold {num_models} models; keep or select models with "
                    "batchlayers.population.keep_models_(model, optimizer, ...) so both change together"
                )
            if not isinstance(value, PerModelValue):
                # A tensor put in by hand or by a scheduler (a float lr times an (M,) factor): check it and
                # keep a PerModelValue copy, so the next scheduler step can fill it and the caller's tensor
                # is never written to.
                self._adopt_hyperparameters(group)
                value = self._get(group, key)
            return value.as_subclass(Tensor)
        if not isinstance(value, numbers.Real):
            self._adopt_hyperparameters(group)  # raises: names the hyperparameter and what it got
        return value

    # -- state dict ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # Plain tensor copies: the checkpoint does not change when a scheduler later fills the live values,
        # and loads with weights_only=True.
        for group in state["param_groups"]:
            for key, value in list(group.items()):
                if isinstance(value, Tensor):
                    group[key] = value.as_subclass(Tensor).clone()
                elif isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
                    group[key] = tuple(v.as_subclass(Tensor).clone() if isinstance(v, Tensor) else v for v in value)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_num_models(state_dict)  # before anything changes: torch's load replaces state and groups
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._adopt_hyperparameters(group)
            for p in group["params"]:
                step = self.state.get(p, {}).get("step")
                if isinstance(step, Tensor):
                    self.state[p]["step"] = step.to(p.device)

    def _check_num_models(self, state_dict: dict[str, Any]) -> None:
        """Refuse a state dict saved for a different number of models than each group's parameters hold."""
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            return  # torch's load_state_dict reports this
        saved_state = state_dict.get("state", {})
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved.get("params", ())) != len(group["params"]):
                return  # torch's load_state_dict reports this
            num_models = self._group_num_models(group)
            found: list[tuple[str, int]] = []
            for key in self.per_model_hyperparameters:
                try:
                    value = self._get(saved, key)
                except (KeyError, IndexError, TypeError):
                    continue
                if isinstance(value, Tensor) and value.dim() > 0:
                    found.append((self._key_name(key), value.shape[0]))
            for saved_id, p in zip(saved["params"], group["params"]):
                entries = saved_state.get(saved_id, {})
                for name, value in entries.items() if isinstance(entries, dict) else ():
                    if isinstance(value, Tensor) and value.dim() > 0 and p.dim() > 0:
                        found.append((f"state '{name}' of a parameter of shape {tuple(p.shape)}", value.shape[0]))
            for what, saved_models in found:
                if saved_models != num_models:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the state dict was saved for M = {saved_models} "
                        f"models ({what} in param group {index}), but this optimizer's parameters hold "
                        f"M = {num_models}; nothing was loaded. Select the saved models first, or build the "
                        f"optimizer for a model of {saved_models} models"
                    )

    # -- stepping --------------------------------------------------------------------------------------

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        raise NotImplementedError

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: list[dict[str, Tensor]],
        num_models: int,
    ) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, active: Tensor | None = None) -> Any:
        """Perform one optimization step for every model, or only for the ``active`` ones.

        Args:
            closure: re-evaluates the model and returns the loss, as in ``torch.optim``.
            active: optional bool tensor of shape ``(M,)``. Models with ``False`` do not change at all:
                not their parameters, not their optimizer state (momentum, moments, step count). Use it to
                freeze finished models, or to skip models with a non-finite loss
                (``active=~batchlayers.nonfinite_models(losses, model)``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            num_models = self._group_num_models(group)
            inactive = self._inactive_models(active, num_models, params[0].device)
            if inactive is not None and inactive.numel() == num_models:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if p.is_complex():
                    raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
            states = []
            for p in params:
                if len(self.state[p]) == 0:  # before the snapshot below, so new state is masked too
                    self.state[p].update(self._init_state(p, group))
                states.append(self.state[p])
            saved = None
            if inactive is not None and inactive.numel() > 0:
                # Put inactive models' slices back afterwards: exact, and it covers every state entry.
                saved = [
                    [(t, t.index_select(0, inactive)) for t in (p, *s.values()) if isinstance(t, Tensor)]
                    for p, s in zip(params, states)
                ]
            buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
            for i, p in enumerate(params):
                buckets.setdefault((p.device, p.dtype), []).append(i)
            for indices in buckets.values():
                self._update(
                    group,
                    [params[i] for i in indices],
                    [params[i].grad for i in indices],
                    [states[i] for i in indices],
                    num_models,
                )
            if saved is not None:
                for entries in saved:
                    for tensor, old in entries:
                        tensor.index_copy_(0, inactive, old)
        return loss

    def _inactive_models(self, active: Tensor | None, num_models: int, device: torch.device) -> Tensor | None:
        if active is None:
            return None
        if not isinstance(active, Tensor) or active.dtype != torch.bool:
            raise TypeError(
                f"{type(self).__name__}.step: active must be a bool tensor of shape (M,), got "
                f"{active.dtype if isinstance(active, Tensor) else type(active).__name__}"
            )
        if active.shape != (num_models,):
            raise ValueError(
                f"{type(self).__name__}.step: active must have shape (M,) = ({num_models},), got {tuple(active.shape)}"
            )
        return (~active).nonzero().squeeze(1).to(device)
