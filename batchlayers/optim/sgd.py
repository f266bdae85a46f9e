"""Batched counterpart of ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._base import (
    BatchedOptimizer,
    Hyperparameter,
    broadcast_per_model,
    broadcast_per_parameter,
    foreach_add_scaled,
    foreach_add_scaled_,
    is_zero,
    new_step_counts,
    per_model_tensor,
)

__all__ = ["SGD"]


class SGD(BatchedOptimizer):
    r"""Stochastic gradient descent for ``M`` models at once, each with its own hyperparameters.

    Equal to ``M`` independent :class:`torch.optim.SGD` runs, model ``m`` with ``lr[m]``, ``momentum[m]``,
    ... . Arguments and defaults are torch's; every numeric one may be a float (the same for every model)
    or a tensor of shape ``(M,)`` (one value per model). All models are updated by a few
    ``torch._foreach_*`` kernels over the parameter list, with per-model values broadcast as
    ``(M, 1, ..., 1)``.

    Args:
        params: parameters shaped ``(M, *)`` (or param-group dicts), e.g. ``model.parameters()`` of a
            batched model.
        lr: learning rate. Default: ``1e-3``.
        momentum: momentum factor. Default: ``0``.
        dampening: dampening for momentum. Default: ``0``.
        weight_decay: L2 penalty. Default: ``0``.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0`` for every model).
        maximize: maximize the objective instead of minimizing it.
        foreach, differentiable, fused: accepted for signature compatibility; the update always uses
            foreach kernels, and ``differentiable=True`` / ``fused=True`` raise.

    State per parameter, once momentum is used: ``momentum_buffer`` (the parameter's shape) and ``step``
    (``(M,)``, each model's steps with momentum). ``step`` is kept (torch's SGD has none) because with
    :meth:`step(active=...) <BatchedOptimizer.step>` models can be at different steps, and a model's first
    momentum step starts its buffer from the gradient, as in torch.

    Examples::

        >>> model = BatchedLinear(4, 10, 1)
        >>> opt = batchlayers.optim.SGD(model.parameters(), lr=torch.tensor([0.1, 0.03, 0.01, 0.003]),
        ...                              momentum=0.9)
        >>> losses = batchlayers.losses.mse_loss(model(x), y)   # (M,)
        >>> losses.sum().backward()
        >>> opt.step()
    """

    per_model_hyperparameters = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(
        self,
        params,
        lr: Hyperparameter = 1e-3,
        momentum: Hyperparameter = 0,
        dampening: Hyperparameter = 0,
        weight_decay: Hyperparameter = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
            "fused": fused,
        }
        super().__init__(params, defaults)

    def _adopt_hyperparameters(self, group: dict[str, Any]) -> None:
        super()._adopt_hyperparameters(group)
        if group["nesterov"]:
            momentum, dampening = torch.as_tensor(group["momentum"]), torch.as_tensor(group["dampening"])
            if not bool((momentum > 0).all()) or not bool((dampening == 0).all()):
                raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening for every model")

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        # Nothing without momentum; created on the first step with momentum, also if it is switched on later.
        if is_zero(group["momentum"]):
            return {}
        return {
            "step": new_step_counts(param),
            "momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format),
        }

    def _update(self, group, params, grads, states, num_models) -> None:
        lr, momentum, dampening, weight_decay = (
            self.hyperparameter(group, key, num_models) for key in self.per_model_hyperparameters
        )
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        if not is_zero(weight_decay):
            grads = foreach_add_scaled(grads, params, broadcast_per_model(weight_decay, params))
        if not is_zero(momentum):
            steps = [s["step"] for s in states]
            bufs = [s["momentum_buffer"] for s in states]
            # Per model and parameter: the first step sets buf = grad (momentum 0, no dampening, on a zero
            # buffer), later ones buf = momentum * buf + (1 - dampening) * grad. A model with momentum 0
            # keeps buf = grad, which is what torch then steps with.
            first = torch.stack(steps) == 0  # (parameters, M)
            momentum_m = per_model_tensor(momentum, num_models, first.device)
            dampening_m = per_model_tensor(dampening, num_models, first.device)
            momentum_now = torch.where(first, 0.0, momentum_m)
            keep_now = 1 - torch.where(first | (momentum_m == 0), 0.0, dampening_m)
            torch._foreach_mul_(bufs, broadcast_per_parameter(momentum_now, params))
            torch._foreach_add_(bufs, torch._foreach_mul(grads, broadcast_per_parameter(keep_now, params)))
            torch._foreach_add_(steps, 1.0)
            if group["nesterov"]:
                grads = foreach_add_scaled(grads, bufs, broadcast_per_model(momentum, params))
            else:
                grads = bufs
        foreach_add_scaled_(params, grads, broadcast_per_model(-lr, params))
