"""Batched counterpart of ``torch.optim.RMSprop``."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from . import _native
from ._base import (
    BatchedOptimizer,
    Hyperparameter,
    broadcast_per_model,
    fma,
    foreach_add_scaled,
    foreach_add_scaled_,
    foreach_addcdiv_scaled_,
    foreach_addcmul_scaled_,
    is_zero,
    kernel_sqrt,
    kernel_value,
    lerp,
    lerp_form,
    new_step_counts,
    pack_kernel_inputs,
    restore_models,
    save_models,
    unpack_kernel_inputs,
    zero_models,
)

__all__ = ["RMSprop"]


class RMSprop(BatchedOptimizer):
    r"""RMSprop for ``M`` models at once, each with its own hyperparameters.

    Equal to ``M`` independent :class:`torch.optim.RMSprop` runs, model ``m`` with ``lr[m]``, ``alpha[m]``,
    ``eps[m]``, ``weight_decay[m]``, ``momentum[m]``. Arguments and defaults are torch's; each numeric one
    may be a float or a tensor of shape ``(M,)``.

    Args:
        params: parameters shaped ``(M, *)`` (or param-group dicts).
        lr: learning rate. Default: ``1e-2``.
        alpha: smoothing constant. Default: ``0.99``.
        eps: term added to the denominator. Default: ``1e-8``.
        weight_decay: L2 penalty. Default: ``0``.
        momentum: momentum factor. Default: ``0``.
        centered: normalise by the estimated variance of the gradient. Default: ``False``.
        capturable, foreach, differentiable: accepted for signature compatibility; ``True`` for
            ``capturable`` / ``differentiable`` raises.
        maximize: maximize the objective instead of minimizing it.
        fused: ``True`` runs one fused kernel per step instead of foreach kernels: on contiguous float32 CPU
            parameters batchlayers' C kernel (:attr:`batchlayers.backends.CpuSettings.native_optimizers`),
            otherwise a compiled one (``torch.compile``: the first step compiles it, seconds). float64: the
            foreach path's numbers bit for bit; other dtypes: a few elements per step may differ by a few
            ulps, from the square root (see :class:`~batchlayers.optim.BatchedOptimizer`). Default ``None``:
            foreach kernels, each model's slice bit for bit its own torch.optim step. (torch's RMSprop has no
            ``fused``.)

    State per parameter: ``step`` (``(M,)``), ``square_avg``, with momentum ``momentum_buffer``, and when
    centered ``grad_avg``. As in torch, the momentum buffer is created at a parameter's first step for the
    models whose momentum is > 0 then (``has_momentum_buffer``, ``(M,)`` bool, says which, where not all
    do); a step with momentum > 0 for a model without one raises ``KeyError``, as torch's does, and changes
    nothing. While a model's momentum is 0 its buffer stays as it is.
    """

    per_model_hyperparameters = ("lr", "alpha", "eps", "weight_decay", "momentum")

    def __init__(
        self,
        params,
        lr: Hyperparameter = 1e-2,
        alpha: Hyperparameter = 0.99,
        eps: Hyperparameter = 1e-8,
        weight_decay: Hyperparameter = 0,
        momentum: Hyperparameter = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        fused: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "alpha": alpha,
            "eps": eps,
            "centered": centered,
            "weight_decay": weight_decay,
            "capturable": capturable,
            "foreach": foreach,
            "maximize": maximize,
            "differentiable": differentiable,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _check_step(self, active: Tensor | None) -> None:
        """Refuse (``KeyError``, nothing changed) a step with momentum > 0 for a model that has no momentum
        buffer, as torch's RMSprop does."""
        for group in self.param_groups:
            self._check_momentum_buffers(group, active)

    def _check_momentum_buffers(self, group: dict[str, Any], active: Tensor | None) -> None:
        """Raise, before anything changes, where torch's RMSprop raises ``KeyError('momentum_buffer')``: a
        model with momentum > 0 that steps a parameter which has no momentum buffer for it."""
        if is_zero(group["momentum"]):
            return
        lacking = []
        for p in group["params"]:
            state = self.state.get(p)
            if p.grad is not None and state and ("momentum_buffer" not in state or "has_momentum_buffer" in state):
                lacking.append(state)
        if not lacking:
            return
        num_models = self._group_num_models(group)
        device = group["params"][0].device
        momentum = self.hyperparameter(group, "momentum", num_models)
        wanting = momentum > 0 if isinstance(momentum, Tensor) else torch.full((num_models,), momentum > 0)
        wanting = wanting.to(device)
        inactive = self._inactive_models(active, num_models, device)
        if inactive is not None:
            wanting = wanting.index_fill(0, inactive, False)
        for state in lacking:
            missing = wanting & ~state["has_momentum_buffer"] if "momentum_buffer" in state else wanting
            if bool(missing.any()):
                raise KeyError(
                    f"RMSprop: models {missing.nonzero().flatten().tolist()} have momentum > 0 but no "
                    "'momentum_buffer': their momentum was 0 at the parameter's first step, when torch.optim.RMSprop "
                    "creates the buffer, and a later step with momentum raises KeyError('momentum_buffer') there "
                    "too. Nothing was changed. Keep their momentum 0, freeze them with step(active=...), or create "
                    "the optimizer with momentum > 0 (setting it to 0 later keeps the buffer)"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "has_momentum_buffer" in state:  # torch's load casts state tensors to the parameter's dtype
                state["has_momentum_buffer"] = state["has_momentum_buffer"].to(torch.bool)

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        state = {
            "step": new_step_counts(param),
            "square_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        # As torch: a buffer for the models whose momentum is > 0 now, none for the others, ever.
        momentum = self.hyperparameter(group, "momentum", param.shape[0])
        if isinstance(momentum, Tensor):
            has_buffer = momentum > 0
            if bool(has_buffer.any()):
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if not bool(has_buffer.all()):
                    state["has_momentum_buffer"] = has_buffer
        elif momentum > 0:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if group["centered"]:
            state["grad_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update(self, group, params, grads, states, num_models) -> None:
        lr, alpha, eps, weight_decay, momentum = (
            self.hyperparameter(group, key, num_models) for key in self.per_model_hyperparameters
        )
        square_avgs = [s["square_avg"] for s in states]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        self._increment_steps([s["step"] for s in states])
        if not is_zero(weight_decay):
            grads = foreach_add_scaled(grads, params, broadcast_per_model(weight_decay, params))

        torch._foreach_mul_(square_avgs, broadcast_per_model(alpha, params))
        foreach_addcmul_scaled_(square_avgs, grads, grads, broadcast_per_model(1 - alpha, params))
        if group["centered"]:
            grad_avgs = [s["grad_avg"] for s in states]
            torch._foreach_lerp_(grad_avgs, grads, broadcast_per_model(1 - alpha, params))
            avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(square_avgs)
        torch._foreach_add_(avg, broadcast_per_model(eps, params))

        neg_lr = broadcast_per_model(-lr, params)
        bufs = momentum_buffers(momentum, states)
        if bufs is None:
            foreach_addcdiv_scaled_(params, grads, avg, neg_lr)
            return
        idle = zero_models(momentum)
        saved = save_models(bufs, idle)  # torch leaves a model's buffer as it is while its momentum is 0
        torch._foreach_mul_(bufs, broadcast_per_model(momentum, params))
        torch._foreach_addcdiv_(bufs, grads, avg)
        if idle is not None:
            # torch steps a model without momentum with addcdiv(grad, avg, value=-lr), which rounds unlike
            # buf = grad / avg followed by add(buf, alpha=-lr): take each model's slice from its own formula.
            with_momentum = foreach_add_scaled(params, bufs, neg_lr)
            foreach_addcdiv_scaled_(params, grads, avg, neg_lr)
            uses_momentum = cast(Tensor, momentum) > 0  # (a tensor: idle names its models at 0)
            for param, stepped in zip(params, with_momentum):
                param.copy_(torch.where(uses_momentum.view(-1, *([1] * (param.dim() - 1))), stepped, param))
            restore_models(saved, idle)
        else:
            foreach_add_scaled_(params, bufs, neg_lr)

    def _update_fused(self, group, params, grads, states, num_models) -> None:
        lr, alpha, eps, weight_decay, momentum = (
            self.hyperparameter(group, key, num_models) for key in self.per_model_hyperparameters
        )
        bufs = momentum_buffers(momentum, states)
        idle = None if bufs is None else zero_models(momentum)
        saved = save_models(bufs or [], idle)  # torch leaves a model's buffer as it is while its momentum is 0
        square_avgs = [s["square_avg"] for s in states]
        grad_avgs = [s["grad_avg"] for s in states] if group["centered"] else []
        operands = _native.operands(
            [params, grads, square_avgs, *([grad_avgs] if grad_avgs else []), *([bufs] if bufs else [])]
        )
        if operands is not None:  # (torch has no fused RMSprop)
            _native.rmsprop_f32(
                operands,
                [lr, alpha, eps, weight_decay, momentum if bufs else 0.0],
                maximize=bool(group["maximize"]),
                decay=_native.DECAY_NONE if is_zero(weight_decay) else _native.DECAY_L2,
                centered=bool(grad_avgs),
                momentum=bufs is not None,
                per_model_momentum=isinstance(momentum, Tensor),
                counts=self._steps_for_native_kernel([s["step"] for s in states]),
            )
            restore_models(saved, idle)
            return
        self._compiled(rmsprop_kernel)(
            params,
            grads,
            square_avgs,
            grad_avgs,
            bufs or [],
            [s["step"] for s in states],
            **pack_kernel_inputs(params[0].device, lr, alpha, eps, weight_decay, momentum),
            maximize=bool(group["maximize"]),
            has_weight_decay=not is_zero(weight_decay),
            per_model_momentum=isinstance(momentum, Tensor),
            average_form=lerp_form(1 - alpha),
        )
        restore_models(saved, idle)


def momentum_buffers(momentum: Hyperparameter, states: list[dict[str, Tensor]]) -> list[Tensor] | None:
    """The momentum buffers to update, or ``None`` to step without momentum: momentum 0, or a parameter without
    a buffer (:meth:`RMSprop._check_momentum_buffers` made sure that the models with momentum do not step)."""
    if is_zero(momentum):
        return None
    bufs = [s.get("momentum_buffer") for s in states]
    return None if any(buf is None for buf in bufs) else cast("list[Tensor]", bufs)


def rmsprop_kernel(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    grad_avgs: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    *,
    scalars: Tensor,
    tensors: list[Tensor],
    layout: tuple[int, ...],
    maximize: bool,
    has_weight_decay: bool,
    per_model_momentum: bool,
    average_form: str | None,
) -> None:
    """The foreach path's arithmetic, op for op, per parameter: ``torch.compile`` makes one loop of each."""
    lr, alpha, eps, weight_decay, momentum = unpack_kernel_inputs(scalars, tensors, layout)
    for i, (param, grad, square_avg, step) in enumerate(zip(params, grads, square_avgs, steps)):
        step.add_(1)
        if maximize:
            grad = -grad
        if has_weight_decay:
            grad = fma(param, kernel_value(weight_decay, param, i), grad)
        new_square_avg = fma(grad * kernel_value(1 - alpha, param, i), grad, square_avg * kernel_value(alpha, param, i))
        square_avg.copy_(new_square_avg)
        if grad_avgs:
            new_grad_avg = lerp(grad_avgs[i], grad, kernel_value(1 - alpha, param, i), average_form)
            grad_avgs[i].copy_(new_grad_avg)
            avg = kernel_sqrt(fma(-new_grad_avg, new_grad_avg, new_square_avg))
        else:
            avg = kernel_sqrt(new_square_avg)
        avg = avg + kernel_value(eps, param, i)
        neg_lr = kernel_value(-lr, param, i)
        plain_step = param + (grad * neg_lr) / avg
        if momentum_buffers:
            buf = momentum_buffers[i]
            new_buf = buf * kernel_value(momentum, param, i) + grad / avg
            buf.copy_(new_buf)
            stepped = fma(new_buf, neg_lr, param)
            if per_model_momentum:
                stepped = torch.where(kernel_value(momentum, param, i) > 0, stepped, plain_step)
            param.copy_(stepped)
        else:
            param.copy_(plain_step)
