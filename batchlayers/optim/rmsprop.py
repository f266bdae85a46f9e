"""Batched counterpart of ``torch.optim.RMSprop``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._base import (
    BatchedOptimizer,
    Hyperparameter,
    broadcast_per_model,
    foreach_add_scaled,
    foreach_add_scaled_,
    foreach_addcmul_scaled_,
    is_zero,
    new_step_counts,
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

    State per parameter: ``step`` (``(M,)``), ``square_avg``, with momentum ``momentum_buffer``, and when
    centered ``grad_avg``.
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
        }
        super().__init__(params, defaults)

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        state = {
            "step": new_step_counts(param),
            "square_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if not is_zero(group["momentum"]):
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
        torch._foreach_add_([s["step"] for s in states], 1.0)
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

        # With a zero momentum for some models the buffer is just grad / avg: the plain RMSprop step.
        if not is_zero(momentum):
            bufs = [s["momentum_buffer"] for s in states]
            torch._foreach_mul_(bufs, broadcast_per_model(momentum, params))
            torch._foreach_addcdiv_(bufs, grads, avg)
            foreach_add_scaled_(params, bufs, broadcast_per_model(-lr, params))
        else:
            foreach_add_scaled_(params, torch._foreach_div(grads, avg), broadcast_per_model(-lr, params))
