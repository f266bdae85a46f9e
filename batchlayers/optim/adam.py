"""Batched counterparts of ``torch.optim.Adam`` and ``torch.optim.AdamW``."""

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
    foreach_addcmul_scaled_,
    hyperparameter_dtype,
    is_zero,
    new_step_counts,
    per_model_tensor,
)

__all__ = ["Adam", "AdamW"]


class Adam(BatchedOptimizer):
    r"""Adam for ``M`` models at once, each with its own hyperparameters.

    Equal to ``M`` independent :class:`torch.optim.Adam` runs, model ``m`` with ``lr[m]``,
    ``betas[0][m]``, ``betas[1][m]``, ``eps[m]``, ``weight_decay[m]``. Arguments and defaults are torch's;
    each numeric one (each beta on its own) may be a float or a tensor of shape ``(M,)``. All models are
    updated by a few ``torch._foreach_*`` kernels over the parameter list.

    Args:
        params: parameters shaped ``(M, *)`` (or param-group dicts).
        lr: learning rate. Default: ``1e-3``.
        betas: coefficients of the running averages of the gradient and its square.
            Default: ``(0.9, 0.999)``.
        eps: term added to the denominator. Default: ``1e-8``.
        weight_decay: L2 penalty added to the gradient (decoupled with ``decoupled_weight_decay=True``,
            which is :class:`AdamW`). Default: ``0``.
        amsgrad: the AMSGrad variant. Default: ``False``.
        maximize: maximize the objective instead of minimizing it.
        foreach, capturable, differentiable, fused: accepted for signature compatibility; the update always
            uses foreach kernels, and ``True`` for the other three raises.
        decoupled_weight_decay: decay the weights directly (AdamW). Default: ``False``.

    State per parameter: ``step`` (``(M,)``, each model's own step count, used in its bias correction),
    ``exp_avg``, ``exp_avg_sq`` and with ``amsgrad`` ``max_exp_avg_sq`` (the parameter's shape).

    Examples::

        >>> lrs = torch.logspace(-4, -1, 8)                 # one learning rate per model
        >>> opt = batchlayers.optim.Adam(model.parameters(), lr=lrs, betas=(0.9, torch.rand(8) * 0.1 + 0.9))
    """

    per_model_hyperparameters = ("lr", ("betas", 0), ("betas", 1), "eps", "weight_decay")

    def __init__(
        self,
        params,
        lr: Hyperparameter = 1e-3,
        betas: tuple[Hyperparameter, Hyperparameter] = (0.9, 0.999),
        eps: Hyperparameter = 1e-8,
        weight_decay: Hyperparameter = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{type(self).__name__}: betas must be a pair (beta1, beta2), got {betas!r}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults)

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        state = {
            "step": new_step_counts(param),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update(self, group, params, grads, states, num_models) -> None:
        lr, beta1, beta2, eps, weight_decay = (
            self.hyperparameter(group, key, num_models) for key in self.per_model_hyperparameters
        )
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        torch._foreach_add_(steps, 1.0)
        if not is_zero(weight_decay):
            if group["decoupled_weight_decay"]:
                torch._foreach_mul_(params, broadcast_per_model(1 - lr * weight_decay, params))
            else:
                grads = foreach_add_scaled(grads, params, broadcast_per_model(weight_decay, params))

        torch._foreach_lerp_(exp_avgs, grads, broadcast_per_model(1 - beta1, params))
        torch._foreach_mul_(exp_avg_sqs, broadcast_per_model(beta2, params))
        foreach_addcmul_scaled_(exp_avg_sqs, grads, grads, broadcast_per_model(1 - beta2, params))
        del grads

        # Bias corrections from each model's own step count: (parameters, M), in float64 like torch's
        # Python-float arithmetic.
        device = steps[0].device
        step = torch.stack(steps).to(hyperparameter_dtype(device))
        beta1_m = per_model_tensor(beta1, num_models, device)
        beta2_m = per_model_tensor(beta2, num_models, device)
        step_size = -per_model_tensor(lr, num_models, device) / (1 - beta1_m**step)
        bias_correction2_sqrt = (1 - beta2_m**step).sqrt()

        if group["amsgrad"]:
            max_exp_avg_sqs = [s["max_exp_avg_sq"] for s in states]
            torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
            denom = torch._foreach_sqrt(max_exp_avg_sqs)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, broadcast_per_parameter(bias_correction2_sqrt, params))
        torch._foreach_add_(denom, broadcast_per_model(eps, params))
        update = torch._foreach_div(exp_avgs, denom)
        del denom
        torch._foreach_mul_(update, broadcast_per_parameter(step_size, params))
        torch._foreach_add_(params, update)


class AdamW(Adam):
    r"""AdamW (Adam with decoupled weight decay) for ``M`` models at once; see :class:`Adam`.

    Equal to ``M`` independent :class:`torch.optim.AdamW` runs. Same arguments and defaults as
    :class:`torch.optim.AdamW` (``weight_decay=1e-2``); each numeric one may be a float or an ``(M,)``
    tensor.
    """

    def __init__(
        self,
        params,
        lr: Hyperparameter = 1e-3,
        betas: tuple[Hyperparameter, Hyperparameter] = (0.9, 0.999),
        eps: Hyperparameter = 1e-8,
        weight_decay: Hyperparameter = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
        )
