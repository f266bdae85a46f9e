"""Optimizers for batched models: every numeric hyperparameter may differ per model.

``batchlayers.optim.SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` take torch's arguments; each numeric
hyperparameter (``lr``, ``weight_decay``, ``momentum``, ``dampening``, each of ``betas``, ``eps``,
``alpha``) may be a float, shared by all models, or a tensor of shape ``(M,)``, one value per model.
Stepping equals ``M`` independent ``torch.optim`` runs, one per model slice with that model's values, and
runs as a few ``torch._foreach_*`` kernels over the parameter list (no loop over models).

``step(active=mask)`` updates only the models where the ``(M,)`` bool ``mask`` is ``True``; the others do
not change at all (parameters, momentum, moments, step count).

Learning-rate schedules
-----------------------
``torch.optim.lr_scheduler`` works unchanged:

- with a float ``lr`` the schedule is the same for every model, exactly as in torch;
- with an ``(M,)`` tensor ``lr``, a scheduler computes each model's value from that model's base
  learning rate (``StepLR``, ``MultiStepLR``, ``ExponentialLR``, ``LambdaLR``, ``MultiplicativeLR``,
  ``LinearLR``, ``CosineAnnealingLR``, ``SequentialLR``...), so model ``m`` follows the schedule a torch
  scheduler would give it with ``lr[m]``. ``group["lr"]`` is a :class:`PerModelValue`, a plain ``(M,)``
  tensor whose ``fill_`` also accepts the ``(M,)`` result (torch's schedulers write learning rates with
  ``fill_``). torch's ``ReduceLROnPlateau`` reads one metric for all models and needs a float ``lr``; for a
  metric per model use :class:`batchlayers.optim.lr_scheduler.ReduceLROnPlateau`, which takes the ``(M,)``
  metrics and reduces each model's learning rate on its own plateau;
- a schedule whose *shape* differs per model (its own warm-up length, decay rate...) is a ``LambdaLR``
  whose function returns an ``(M,)`` factor, e.g. ``lambda epoch: torch.clamp((epoch + 1) / warmup,
  max=1.0)`` with ``warmup`` an ``(M,)`` tensor; this works from a float ``lr`` too.

A schedule counts the population's steps: a model frozen with ``step(active=...)`` keeps following it
(its learning rate is not used while it is frozen).

Change per-model values in place, e.g. ``optimizer.param_groups[0]["lr"][m] *= 0.8`` (population-based
training); ``batchlayers.population`` keeps or copies models together with their optimizer state.
"""

from . import lr_scheduler
from ._base import BatchedOptimizer, PerModelValue
from .adam import Adam, AdamW
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["Adam", "AdamW", "BatchedOptimizer", "PerModelValue", "RMSprop", "SGD", "lr_scheduler"]
