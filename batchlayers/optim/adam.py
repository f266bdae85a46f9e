"""Batched counterparts of ``torch.optim.Adam`` and ``torch.optim.AdamW``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _native
from ._base import (
    BatchedOptimizer,
    Hyperparameter,
    broadcast_per_model,
    divide,
    fma,
    foreach_add_scaled,
    foreach_addcdiv_scaled_,
    foreach_addcmul_scaled_,
    is_zero,
    kernel_sqrt,
    kernel_value,
    lerp,
    lerp_form,
    new_step_counts,
    pack_kernel_inputs,
    per_model_inputs,
    power,
    torch_fused_kernel,
    unit_rate_kernel,
    unpack_kernel_inputs,
)

__all__ = ["Adam", "AdamW"]


class Adam(BatchedOptimizer):
    r"""Adam for ``M`` models at once, each with its own hyperparameters.

    Equal to ``M`` independent :class:`torch.optim.Adam` runs, model ``m`` with ``lr[m]``,
    ``betas[0][m]``, ``betas[1][m]``, ``eps[m]``, ``weight_decay[m]`` (bit for bit on CPU). Arguments and
    defaults are torch's; each numeric one (each beta on its own) may be a float or a tensor of shape
    ``(M,)``. All models are updated by a few ``torch._foreach_*`` kernels over the parameter list, or with
    ``fused=True`` by one fused kernel.

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
        fused: ``True`` runs one fused kernel per step instead of foreach kernels: in float32 with float
            hyperparameters (every model at one step) torch's own; on contiguous float32 CPU parameters
            otherwise batchlayers' C kernel (:attr:`batchlayers.backends.CpuSettings.native_optimizers`);
            otherwise a compiled one (``torch.compile``: its first step compiles it, seconds). float64: the
            foreach path's numbers bit for bit; float32: a few elements per step may differ by a few ulps (see
            :class:`~batchlayers.optim.BatchedOptimizer`). Default ``None``: foreach kernels, each model's
            slice bit for bit its own torch.optim step.
        foreach, capturable, differentiable: accepted for signature compatibility; ``True`` for the last two
            raises.
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

    def _hyperparameters(self, group: dict[str, Any], num_models: int) -> list[Hyperparameter]:
        return [self.hyperparameter(group, key, num_models) for key in self.per_model_hyperparameters]

    def _update(self, group, params, grads, states, num_models) -> None:
        lr, beta1, beta2, eps, weight_decay = self._hyperparameters(group, num_models)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        step = self._steps_after_increment(steps)
        neg_step_size, bias_correction2_sqrt = bias_corrections(lr, beta1, beta2, step, params[0].device)
        self._increment_steps(steps)
        self._counted(steps, step)
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        if not is_zero(weight_decay):
            if group["decoupled_weight_decay"]:
                torch._foreach_mul_(params, broadcast_per_model(1 - lr * weight_decay, params))
            else:
                grads = foreach_add_scaled(grads, params, broadcast_per_model(weight_decay, params))

        torch._foreach_lerp_(exp_avgs, grads, broadcast_per_model(1 - beta1, params))
        torch._foreach_mul_(exp_avg_sqs, broadcast_per_model(beta2, params))
        foreach_addcmul_scaled_(exp_avg_sqs, grads, grads, broadcast_per_model(1 - beta2, params))
        del grads

        if group["amsgrad"]:
            max_exp_avg_sqs = [s["max_exp_avg_sq"] for s in states]
            torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
            denom = torch._foreach_sqrt(max_exp_avg_sqs)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, broadcast_per_model(bias_correction2_sqrt, params))
        torch._foreach_add_(denom, broadcast_per_model(eps, params))
        foreach_addcdiv_scaled_(params, exp_avgs, denom, broadcast_per_model(neg_step_size, params))

    def _update_fused(self, group, params, grads, states, num_models) -> None:
        lr, beta1, beta2, eps, weight_decay = self._hyperparameters(group, num_models)
        steps = [s["step"] for s in states]
        step = self._steps_after_increment(steps)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        max_exp_avg_sqs = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
        decoupled = bool(group["decoupled_weight_decay"])
        tensors = [params, grads, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if max_exp_avg_sqs else [])]
        name = "adamw" if decoupled else "adam"
        kernel = torch_fused_kernel(name, tensors, lr, beta1, beta2, eps, weight_decay, step)
        operands = _native.operands(tensors) if kernel is None else None
        if operands is not None:  # a per-model value, or models at different steps
            corrections = bias_correction_terms(beta1, beta2, step, params[0].device)
            values = [lr, beta1, beta2, eps, weight_decay, *corrections]
            decay_kind = _native.DECAY_DECOUPLED if decoupled else _native.DECAY_L2
            _native.adam_f32(
                operands,
                values,
                maximize=bool(group["maximize"]),
                decay=_native.DECAY_NONE if is_zero(weight_decay) else decay_kind,
                counts=self._steps_for_native_kernel(steps),
            )
            self._counted(steps, step)
            return
        unit_rate = None if kernel is not None else unit_rate_kernel("adam", tensors, beta1, beta2, eps, step)
        if unit_rate is not None:  # a per-model lr or weight decay
            maximize = bool(group["maximize"])
            if not decoupled:
                grads, maximize = self._decayed_gradients(grads, params, weight_decay, maximize)
            elif not is_zero(weight_decay):
                decay: float | list[Tensor]
                if isinstance(lr, Tensor) and not isinstance(weight_decay, Tensor):
                    wd = weight_decay
                    decay = self._per_model_scales(("decay", wd), lr, params, lambda v: 1 - v * wd)
                else:
                    decay = broadcast_per_model(1 - lr * weight_decay, params)
                torch._foreach_mul_(params, decay)
            targets = self._unit_rate_targets(params)
            self._increment_steps(steps)
            unit_rate(
                targets,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                [steps[0][0]] * len(params),
                lr=1.0,
                beta1=beta1,
                beta2=beta2,
                weight_decay=0.0,
                eps=eps,
                amsgrad=bool(group["amsgrad"]),
                maximize=maximize,
            )
            self._add_unit_rate_steps(params, targets, lr)
            self._counted(steps, step)
            return
        if kernel is not None:
            self._increment_steps(steps)
            # torch's kernel reads one step count per parameter: every model's, all being at one step.
            kernel(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                [steps[0][0]] * len(params),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=bool(group["amsgrad"]),
                maximize=bool(group["maximize"]),
            )
            self._counted(steps, step)
            return
        neg_step_size, bias_correction2_sqrt = bias_corrections(lr, beta1, beta2, step, params[0].device)
        self._compiled(adam_kernel)(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            **pack_kernel_inputs(
                params[0].device,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                *per_model_inputs(num_models, params[0].device, neg_step_size, bias_correction2_sqrt),
            ),
            maximize=bool(group["maximize"]),
            has_weight_decay=not is_zero(weight_decay),
            decoupled_weight_decay=decoupled,
            average_form=lerp_form(1 - beta1),
        )
        self._counted(steps, step)


def bias_corrections(
    lr: Hyperparameter, beta1: Hyperparameter, beta2: Hyperparameter, step: float | Tensor, device: torch.device
) -> tuple[float | Tensor, float | Tensor]:
    """``-lr / (1 - beta1 ** t)`` and ``(1 - beta2 ** t) ** 0.5`` for each model's step ``t`` (this step
    included, :func:`steps_after_increment`), as torch's Adam computes them in Python floats: floats when
    every value is shared, else ``(M,)`` or ``(len(steps), M)`` tensors (models at different steps after
    ``step(active=...)``)."""
    bias_correction1, bias_correction2_sqrt = bias_correction_terms(beta1, beta2, step, device)
    return divide(lr, -bias_correction1, device), bias_correction2_sqrt  # -(a / b) == a / -b


def bias_correction_terms(
    beta1: Hyperparameter, beta2: Hyperparameter, step: float | Tensor, device: torch.device
) -> tuple[float | Tensor, float | Tensor]:
    """``1 - beta1 ** t`` and ``(1 - beta2 ** t) ** 0.5``, as :func:`bias_corrections` computes them."""
    return 1 - power(beta1, step, device), power(1 - power(beta2, step, device), 0.5, device)


def adam_kernel(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    scalars: Tensor,
    tensors: list[Tensor],
    layout: tuple[int, ...],
    maximize: bool,
    has_weight_decay: bool,
    decoupled_weight_decay: bool,
    average_form: str | None,
) -> None:
    """The foreach path's arithmetic, op for op, per parameter: ``torch.compile`` makes one loop of each."""
    lr, beta1, beta2, eps, weight_decay, neg_step_size, bias_correction2_sqrt = unpack_kernel_inputs(
        scalars, tensors, layout
    )
    for i, (param, grad, exp_avg, exp_avg_sq, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        step.add_(1)
        if maximize:
            grad = -grad
        decayed = param
        if has_weight_decay:
            if decoupled_weight_decay:
                decayed = param * kernel_value(1 - lr * weight_decay, param, i)
            else:
                grad = fma(param, kernel_value(weight_decay, param, i), grad)
        new_exp_avg = lerp(exp_avg, grad, kernel_value(1 - beta1, param, i), average_form)
        new_exp_avg_sq = fma(grad * kernel_value(1 - beta2, param, i), grad, exp_avg_sq * kernel_value(beta2, param, i))
        exp_avg.copy_(new_exp_avg)
        exp_avg_sq.copy_(new_exp_avg_sq)
        if max_exp_avg_sqs:
            new_exp_avg_sq = torch.maximum(max_exp_avg_sqs[i], new_exp_avg_sq)
            max_exp_avg_sqs[i].copy_(new_exp_avg_sq)
        denom = kernel_sqrt(new_exp_avg_sq) / kernel_value(bias_correction2_sqrt, param, i)
        denom = denom + kernel_value(eps, param, i)
        param.copy_(decayed + (new_exp_avg * kernel_value(neg_step_size, param, i)) / denom)


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
