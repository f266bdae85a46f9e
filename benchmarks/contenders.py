"""The contenders: ways to train or run M models of one architecture, each as a one-step callable.

Every contender is built from the same M torch.nn models and the same data, so the first steps agree
numerically (checked before timing). A training step is forward, per-model mean cross entropy, backward and
a ``torch.optim.Adam`` step, the same implementation for every contender (Adam is elementwise, so one
optimizer over stacked parameters equals M
optimizers); inference is a forward pass under ``torch.no_grad()`` in eval mode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .workloads import Workload, per_model_loss

__all__ = ["CONTENDERS", "Runner", "Unavailable", "build_runner"]

LR = 1e-3
MODEL_BY_MODEL = "batchlayers-mbm"  # stack(models, execution="model_by_model")
OPTIMIZER_IMPLS = ("default", "fused", "foreach", "for-loop")


def make_adam(params, impl: str) -> torch.optim.Adam:
    """``torch.optim.Adam`` with the chosen implementation, the same for every contender."""
    flags = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[
        impl
    ]
    return torch.optim.Adam(params, lr=LR, **flags)


class Unavailable(Exception):
    """This contender cannot run this workload (yet); the message says why."""


@dataclass
class Runner:
    """One contender set up for one configuration.

    ``step()`` runs one training step or one inference and returns what the contender computed per model
    (losses ``(M,)`` for training, outputs ``(M, B, ..., C)`` for inference) as a tensor or list of tensors.
    ``holds()`` lists the tensors the contender keeps between steps (parameters, gradients, optimizer state,
    data, batchlayers' kept buffers), for the memory report.
    """

    name: str
    step: Callable[[], Tensor | list[Tensor]]
    holds: Callable[[], list[Tensor]]
    note: str = ""


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]


def _params_and_grads(params: Sequence[Tensor]) -> list[Tensor]:
    return [t for p in params for t in (p, p.grad) if t is not None]


def _maybe_compile(fn: Callable, enabled: bool) -> Callable:
    """``fn`` compiled when ``enabled``: a module with ``nn.Module.compile``, a function with ``torch.compile``."""
    if not enabled:
        return fn
    if isinstance(fn, torch.nn.Module):
        fn.compile()
        return fn
    return torch.compile(fn)


def _compile_stacked(model: nn.Module, x: Tensor) -> Callable[[Tensor], Tensor]:
    """A stacked model compiled as docs/conversion.md advises: checked once (``bl.check_batched``), then called
    from a compiled function, which compiles the root's folding hooks and its forward as one frame. torch
    2.13 compiles a module's hooks and its forward as frames of their own under ``model.compile()`` and
    ``torch.compile(model)`` (three regions), and the check the first compiled call runs itself is a graph
    break that the calling frame keeps (four). GPT-mini, M=8, training step against compiled torch.func
    (interleaved, 3 processes each): 1.03-1.16x this way, 0.97-1.08x with ``model.compile()``."""
    from batchlayers.verify import check_batched

    check_batched(model, x)
    return torch.compile(lambda inputs: model(inputs))


def batchlayers_loss(logits: Tensor, target: Tensor) -> Tensor:
    """The batchlayers contender's per-model loss: ``batchlayers.losses.cross_entropy`` (its two-class fast path
    included) for ``(M, B, C)`` logits, the common :func:`per_model_loss` for per-token/per-pixel logits."""
    if logits.dim() == 3:
        from batchlayers.losses import cross_entropy

        return cross_entropy(logits, target)
    return per_model_loss(logits, target)


def _stepper(
    params: Sequence[Tensor],
    forward: Callable[[], Tensor],
    target: Tensor,
    train: bool,
    optim_impl: str,
    loss: Callable[[Tensor, Tensor], Tensor] = per_model_loss,
):
    """A training or inference step over one set of (stacked) parameters and one forward function."""
    optimizer = make_adam(params, optim_impl) if train else None

    def train_step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        losses = loss(forward(), target)
        losses.sum().backward()
        optimizer.step()
        return losses.detach()

    @torch.no_grad()
    def infer_step() -> Tensor:
        return forward()

    def holds() -> list[Tensor]:
        return _params_and_grads(params) + (_optimizer_state(optimizer) if optimizer else [])

    return (train_step if train else infer_step), holds


def _loop(workload: Workload, models, x, y, train, compile, optim_impl, *, single=False) -> Runner:
    models = [copy.deepcopy(m).train(train) for m in (models[:1] if single else models)]
    shared = workload.shared
    xs = [x if shared else x[i] for i in range(len(models))]
    ys = [y if shared else y[i] for i in range(len(models))]
    optimizers = [make_adam(m.parameters(), optim_impl) for m in models] if train else []
    forwards = [_maybe_compile(m, compile) for m in models]

    def train_step() -> list[Tensor]:
        losses = []
        for forward, optimizer, xi, yi in zip(forwards, optimizers, xs, ys):
            optimizer.zero_grad(set_to_none=True)
            out = forward(xi)
            loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), yi.reshape(-1))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return losses

    @torch.no_grad()
    def infer_step() -> list[Tensor]:
        return [forward(xi) for forward, xi in zip(forwards, xs)]

    def holds() -> list[Tensor]:
        held = [t for m in models for t in _params_and_grads(list(m.parameters()))]
        return held + [t for o in optimizers for t in _optimizer_state(o)] + [x, y]

    note = "one torch.nn model (models[0]) with its own optimizer" if single else ""
    return Runner("single" if single else "loop", train_step if train else infer_step, holds, note)


def _torch_func(workload: Workload, models, x, y, train, compile, optim_impl) -> Runner:
    # The official model-ensembling recipe: stack_module_state + functional_call + vmap.
    from torch.func import functional_call, stack_module_state, vmap

    if any(isinstance(m, nn.RNNBase) for m in models[0].modules()):
        raise Unavailable("vmap has no batching rule for torch's LSTM/GRU/RNN kernels (aten::lstm and co.)")
    params, buffers = stack_module_state([m.train(train) for m in models])
    base = copy.deepcopy(models[0]).to("meta")
    # BatchNorm keeps its running statistics: with buffers stacked like the parameters (in_dims 0), vmap updates
    # each model's in place (torch 2.13), so this contender does the work the loop does. (The ensembling
    # tutorial's replace_all_batch_norm_modules_ is for buffers shared by all models.)
    note = ""
    if not train:
        params = {k: v.detach() for k, v in params.items()}
    # Moving the base to "meta" unties shared parameters (a tied GPT head), so name every alias.
    first_name: dict[int, str] = {}
    call_params = dict(params)
    for name, p in models[0].named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(p), name)
        call_params[name] = params[first]

    def call(p, b, xi):
        return functional_call(base, (p, b), (xi,))

    batched_call = _maybe_compile(vmap(call, in_dims=(0, 0, None if workload.shared else 0)), compile)
    target = y.expand(len(models), *y.shape) if workload.shared else y
    step, holds = _stepper(
        list(params.values()), lambda: batched_call(call_params, buffers, x), target, train, optim_impl
    )
    return Runner("torch.func", step, lambda: holds() + list(buffers.values()) + [x, y], note)


def _batched_model(workload: Workload, models: Sequence[nn.Module], execution: str = "batched") -> nn.Module:
    if workload.batched == "layers":
        # An MLP written with the layers: BatchedSequential runs Linear-ReLU-Linear as one autograd node.
        from batchlayers.container import BatchedSequential
        from batchlayers.linear import BatchedLinear

        layers = []
        for module in models[0]:
            if isinstance(module, nn.Linear):
                factory = {"device": module.weight.device, "dtype": module.weight.dtype}
                layer = BatchedLinear(len(models), module.in_features, module.out_features, **factory)
                idx = list(models[0]).index(module)
                with torch.no_grad():
                    layer.weight.copy_(torch.stack([m[idx].weight for m in models]))
                    layer.bias.copy_(torch.stack([m[idx].bias for m in models]))
                layers.append(layer)
            else:
                layers.append(copy.deepcopy(module))
        return BatchedSequential(*layers)
    try:
        from batchlayers.convert import stack
    except ImportError as exc:
        raise Unavailable(f"batchlayers.stack is not available yet ({exc})") from None
    try:
        return stack(list(models), execution=execution)
    except Exception as exc:  # a layer type without a batched counterpart yet
        raise Unavailable(f"stack failed: {type(exc).__name__}: {exc}") from None


def _batchlayers(
    workload: Workload, models, x, y, train, compile, optim_impl, *, copies=False, execution="batched"
) -> Runner:
    model = _batched_model(workload, models, execution).to(x.device).train(train)
    num_models = len(models)
    if workload.shared:
        # The shared batch as a stride-0 expand (never copied); "copies" materialises it per model.
        x = x.expand(num_models, *x.shape)
        y = y.expand(num_models, *y.shape)
        if copies:
            x, y = x.contiguous(), y.contiguous()
    if compile and workload.batched == "stack":
        forward = _compile_stacked(model, x)
    else:
        forward = _maybe_compile(model, compile)
    step, holds = _stepper(list(model.parameters()), lambda: forward(x), y, train, optim_impl, batchlayers_loss)
    name = "batchlayers-copies" if copies else "batchlayers"
    note = "the shared batch copied per model" if copies else ""
    if execution != "batched":
        name, note = MODEL_BY_MODEL, "stack(models, execution='model_by_model')"
    # (the kept buffers first: their step replaces the gradients that holds() lists)
    return Runner(name, step, lambda: _kept_buffers(step) + holds() + list(model.buffers()) + [x, y], note)


def _kept_buffers(step: Callable[[], object]) -> list[Tensor]:
    """The buffers batchlayers' own kernels keep between steps (``batchlayers._workspace``): held memory like the
    optimizer state, allocated before a measured step and so not in its peak. The pool is the thread's, shared
    by every batchlayers contender the process runs, so this contender's are those one step of its own leaves
    in an emptied pool (after the timing: the step changes nothing that is reported)."""
    from batchlayers import _workspace

    _workspace.release()
    step()
    return list(_workspace._pool())


def _reference(workload: Workload, models, x, y, train, compile, optim_impl) -> Runner:
    if workload.reference is None:
        raise Unavailable("no hand-written reference for this workload")
    params, forward = workload.reference(models)
    params = [p.to(x.device) if train else p.detach().to(x.device) for p in params]
    if workload.shared:
        x = x.expand(len(models), *x.shape)
        y = y.expand(len(models), *y.shape)
    compiled = _maybe_compile(forward, compile)
    step, holds = _stepper(params, lambda: compiled(params, x), y, train, optim_impl)
    return Runner("reference", step, lambda: holds() + [x, y], "hand-written baddbmm / grouped conv")


CONTENDERS: dict[str, Callable[..., Runner]] = {
    "single": lambda *a: _loop(*a, single=True),
    "loop": _loop,
    "torch.func": _torch_func,
    "batchlayers": _batchlayers,
    "batchlayers-copies": lambda *a: _batchlayers(*a, copies=True),
    MODEL_BY_MODEL: lambda *a: _batchlayers(*a, execution="model_by_model"),
    "reference": _reference,
}


def build_runner(
    name: str,
    workload: Workload,
    models: Sequence[nn.Module],
    x: Tensor,
    y: Tensor,
    *,
    train: bool,
    compile: bool = False,
    optim_impl: str = "default",
) -> Runner:
    """Set up contender ``name``; raises :class:`Unavailable` when it cannot run this workload."""
    if name == "batchlayers-copies" and not workload.shared:
        raise Unavailable("only for shared-batch workloads")
    if name == MODEL_BY_MODEL and workload.batched != "stack":
        raise Unavailable("only for models converted with stack")
    return CONTENDERS[name](workload, models, x, y, train, compile, optim_impl)
