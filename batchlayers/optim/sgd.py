"""Batched counterpart of ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any

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
    is_zero,
    kernel_value,
    new_step_counts,
    pack_kernel_inputs,
    per_model_inputs,
    restore_models,
    save_models,
    torch_fused_kernel,
    unit_rate_kernel,
    unpack_kernel_inputs,
    zero_models,
)

__all__ = ["SGD"]


class SGD(BatchedOptimizer):
    r"""Stochastic gradient descent for ``M`` models at once, each with its own hyperparameters.

    Equal to ``M`` independent :class:`torch.optim.SGD` runs, model ``m`` with ``lr[m]``, ``momentum[m]``,
    ... . Arguments and defaults are torch's; every numeric one may be a float (the same for every model)
    or a tensor of shape ``(M,)`` (one value per model); each model's slice is bit for bit its torch.optim
    step on CPU. All models are updated by a few ``torch._foreach_*`` kernels over the parameter list, with
    per-model values broadcast as ``(M, 1, ..., 1)``, or with ``fused=True`` by one fused kernel.

    Args:
        params: parameters shaped ``(M, *)`` (or param-group dicts), e.g. ``model.parameters()`` of a
            batched model.
        lr: learning rate. Default: ``1e-3``.
        momentum: momentum factor. Default: ``0``.
        dampening: dampening for momentum. Default: ``0``.
        weight_decay: L2 penalty. Default: ``0``.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0`` for every model).
        maximize: maximize the objective instead of minimizing it.
        fused: ``True`` runs one fused kernel per step instead of foreach kernels: in float32 with float
            hyperparameters (every model at one step) torch's own (a few last bits may differ); on
            contiguous float32 CPU parameters otherwise batchlayers' C kernel
            (:attr:`batchlayers.backends.CpuSettings.native_optimizers`), otherwise a compiled one
            (``torch.compile``: its first step compiles it, seconds), both with the foreach path's numbers
            bit for bit. Default ``None``: foreach kernels, each model's slice bit for bit its own
            torch.optim step.
        foreach, differentiable: accepted for signature compatibility; ``differentiable=True`` raises.

    State per parameter, once momentum is used: ``momentum_buffer`` (the parameter's shape) and ``step``
    (``(M,)``, each model's steps with momentum). ``step`` is kept (torch's SGD has none) because with
    :meth:`step(active=...) <BatchedOptimizer.step>` and per-model momentum models can be at different steps,
    and a model's first momentum step starts its buffer from the gradient, as in torch: a model's ``step`` 0
    stands for torch's ``momentum_buffer`` ``None``. While a model's momentum is 0 its buffer and ``step``
    stay as they are (torch keeps the buffer untouched), and it resumes from them when its momentum is set
    again.

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
        idle: Tensor | None = None
        saved: list[tuple[Tensor, Tensor]] = []
        if not is_zero(momentum):
            steps = [s["step"] for s in states]
            bufs = [s["momentum_buffer"] for s in states]
            idle, saved = self._set_aside_models_without_momentum(momentum, steps, bufs)
            step = self._steps_after_increment(steps)
            momentum_now, keep_now = momentum_factors(momentum, dampening, step)
            torch._foreach_mul_(bufs, broadcast_per_model(momentum_now, params))
            foreach_add_scaled_(bufs, grads, broadcast_per_model(keep_now, params))
            self._increment_steps(steps)
            self._counted(steps, step)
            if group["nesterov"]:
                nesterov_grads = foreach_add_scaled(grads, bufs, broadcast_per_model(momentum, params))
                if idle is not None:  # the plain gradient, as torch takes it (grad + 0 * inf would be NaN)
                    for nesterov_grad, grad in zip(nesterov_grads, grads):
                        nesterov_grad.index_copy_(0, idle, grad.index_select(0, idle))
                grads = nesterov_grads
            else:
                grads = bufs
        foreach_add_scaled_(params, grads, broadcast_per_model(-lr, params))
        restore_models(saved, idle)

    def _update_fused(self, group, params, grads, states, num_models) -> None:
        lr, momentum, dampening, weight_decay = (
            self.hyperparameter(group, key, num_models) for key in self.per_model_hyperparameters
        )
        has_momentum = not is_zero(momentum)
        steps = [s["step"] for s in states] if has_momentum else []
        bufs = [s["momentum_buffer"] for s in states] if has_momentum else []
        idle, saved = self._set_aside_models_without_momentum(momentum, steps, bufs) if has_momentum else (None, [])
        step = self._steps_after_increment(steps) if has_momentum else 1.0
        kernel = torch_fused_kernel(
            "sgd", [params, grads, *([bufs] if bufs else [])], lr, momentum, dampening, weight_decay, step
        )
        if kernel is not None:  # (every model has momentum or none has: floats)
            kernel(
                params,
                grads,
                bufs,
                weight_decay=weight_decay,
                momentum=momentum,
                lr=lr,
                dampening=dampening,
                nesterov=bool(group["nesterov"]),
                maximize=bool(group["maximize"]),
                is_first_step=step == 1,
            )
            if has_momentum:
                self._increment_steps(steps)
                self._counted(steps, step)
            restore_models(saved, idle)
            return
        operands = _native.operands([params, grads, *([bufs] if bufs else [])])
        if operands is not None:  # a per-model value, or models at different steps
            momentum_now, keep_now = momentum_factors(momentum, dampening, step) if has_momentum else (0.0, 0.0)
            nesterov = 0
            if has_momentum and group["nesterov"]:
                nesterov = _native.NESTEROV if idle is None else _native.NESTEROV_PLAIN_WITHOUT_MOMENTUM
            _native.sgd_f32(
                operands,
                [lr, momentum, weight_decay, momentum_now, keep_now],
                maximize=bool(group["maximize"]),
                decay=_native.DECAY_NONE if is_zero(weight_decay) else _native.DECAY_L2,
                nesterov=nesterov,
                counts=self._steps_for_native_kernel(steps) if has_momentum else None,
            )
            if has_momentum:
                self._counted(steps, step)
            restore_models(saved, idle)
            return
        unit_rate = unit_rate_kernel("sgd", [params, grads, bufs], momentum, dampening, step) if has_momentum else None
        if unit_rate is not None:  # a per-model lr or weight decay, every model with momentum
            grads, maximize = self._decayed_gradients(grads, params, weight_decay, bool(group["maximize"]))
            targets = self._unit_rate_targets(params)
            unit_rate(
                targets,
                grads,
                bufs,
                weight_decay=0.0,
                momentum=momentum,
                lr=1.0,
                dampening=dampening,
                nesterov=bool(group["nesterov"]),
                maximize=maximize,
                is_first_step=step == 1,
            )
            self._increment_steps(steps)
            self._counted(steps, step)
            self._add_unit_rate_steps(params, targets, lr)
            restore_models(saved, idle)
            return
        momentum_now, keep_now = momentum_factors(momentum, dampening, step) if has_momentum else (0.0, 0.0)
        self._compiled(sgd_kernel)(
            params,
            grads,
            bufs,
            steps,
            **pack_kernel_inputs(
                params[0].device,
                lr,
                momentum,
                weight_decay,
                *per_model_inputs(num_models, params[0].device, momentum_now, keep_now),
            ),
            maximize=bool(group["maximize"]),
            has_weight_decay=not is_zero(weight_decay),
            nesterov=bool(group["nesterov"]),
            plain_without_momentum=idle is not None and bool(group["nesterov"]),
        )
        if has_momentum:
            self._counted(steps, step)
        restore_models(saved, idle)

    @staticmethod
    def _set_aside_models_without_momentum(
        momentum: Hyperparameter, steps: list[Tensor], bufs: list[Tensor]
    ) -> tuple[Tensor | None, list[tuple[Tensor, Tensor]]]:
        """The models whose momentum is 0 and a copy of their step counts and buffers, which are put back after
        the step: torch keeps a model's buffer as it is while its momentum is 0 (or has none yet), and steps with
        the gradient. Their buffers are zeroed meanwhile, so the update computes ``0 * 0 + 1 * grad``, the
        gradient, for them (not ``0 * inf = NaN`` for an inf in the buffer)."""
        idle = zero_models(momentum)
        saved = save_models([*steps, *bufs], idle)
        if idle is not None:
            for buf in bufs:
                buf.index_fill_(0, idle, 0)
        return idle, saved


def momentum_factors(
    momentum: Hyperparameter, dampening: Hyperparameter, step: float | Tensor
) -> tuple[float | Tensor, float | Tensor]:
    """``(a, b)`` with ``buf = a * buf + b * grad`` for each model and parameter: torch's first momentum step
    sets ``buf = grad`` (here ``0 * buf + 1 * grad`` on a zero buffer), later ones ``buf = momentum * buf +
    (1 - dampening) * grad``; a model with momentum 0 gets ``buf = grad`` (its buffer zeroed for this step
    and put back after it), which torch steps with. ``step``: each model's step count with this step
    (:func:`steps_after_increment`). Floats when every model is at the same step and the values are
    shared, else tensors."""
    if not isinstance(step, Tensor):
        if step == 1:
            return 0.0, 1.0
        if not isinstance(momentum, Tensor):
            return momentum, 1 - dampening
        dampening = torch.as_tensor(dampening, dtype=momentum.dtype, device=momentum.device)
        return momentum, 1 - torch.where(momentum == 0, 0.0, dampening)
    momentum = torch.as_tensor(momentum, dtype=step.dtype, device=step.device)
    dampening = torch.as_tensor(dampening, dtype=step.dtype, device=step.device)
    first = step == 1  # (M,) or (parameters, M)
    return torch.where(first, 0.0, momentum), 1 - torch.where(first | (momentum == 0), 0.0, dampening)


def sgd_kernel(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    *,
    scalars: Tensor,
    tensors: list[Tensor],
    layout: tuple[int, ...],
    maximize: bool,
    has_weight_decay: bool,
    nesterov: bool,
    plain_without_momentum: bool = False,
) -> None:
    """The foreach path's arithmetic, op for op, per parameter: ``torch.compile`` makes one loop of each.
    ``plain_without_momentum``: a Nesterov step takes the plain gradient where a model's momentum is 0."""
    lr, momentum, weight_decay, momentum_now, keep_now = unpack_kernel_inputs(scalars, tensors, layout)
    for i, (param, grad) in enumerate(zip(params, grads)):
        if maximize:
            grad = -grad
        if has_weight_decay:
            grad = fma(param, kernel_value(weight_decay, param, i), grad)
        if momentum_buffers:
            buf = momentum_buffers[i]
            new_buf = fma(grad, kernel_value(keep_now, param, i), buf * kernel_value(momentum_now, param, i))
            buf.copy_(new_buf)
            steps[i].add_(1)
            if nesterov:
                nesterov_grad = fma(new_buf, kernel_value(momentum, param, i), grad)
                if plain_without_momentum:
                    nesterov_grad = torch.where(kernel_value(momentum, param, i) == 0, grad, nesterov_grad)
                grad = nesterov_grad
            else:
                grad = new_buf
        param.copy_(fma(grad, kernel_value(-lr, param, i), param))
