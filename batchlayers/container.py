"""Running ordinary, parameter-free torch.nn modules between batched layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import Tensor, nn

from . import _fold
from ._utils import check_input, global_module_hooks, is_shared, layer_name
from .functional._mlp import (
    chain_fuses,
    chain_fuses_natively,
    chain_may_fuse_natively,
    fusable_context,
    fused_linear_chain,
)
from .linear import BatchedLinear

__all__ = ["BatchedSequential", "Folded"]

# Modules that draw random numbers in training mode: each model needs its own draw, like a loop would make.
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)


def _has_randomness(module: nn.Module) -> bool:
    return any(isinstance(m, _RANDOM_MODULES) and m.training for m in module.modules())


def _per_model_state(module: nn.Module) -> str | None:
    """Why ``module`` cannot run folded (one instance for all models), or ``None`` when it can."""
    for name, _ in module.named_parameters():
        return f"it holds the parameter '{name}', which all models would share"
    for name, _ in module.named_buffers():
        return f"it holds the buffer '{name}', which all models would share"
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            where = f" ('{name}')" if name else ""
            return f"batch norm{where} mixes the samples of all models into one set of batch statistics"
    return None


class Folded(nn.Module):
    r"""Apply an ordinary module to ``(M, B, *)`` tensors by folding the models into the batch.

    Pooling, flattening, upsampling, dropout, activations and any other module that treats the samples of
    a batch independently and holds no per-model state see one batch of ``M * B`` samples; the output is
    unfolded back to ``(M, B, *)``. This is how torch.nn building blocks go between batched layers
    without reshapes by hand. The result equals a loop that applies ``module`` to each model's ``(B, *)``.

    A shared batch (a stride-0 expand) is computed once, on ``(B, *)``, and returned as a stride-0 expand
    again, so it stays one copy, unless the module draws random numbers in training mode (dropout, RReLU):
    then the batch is computed per model, so that every model gets its own mask, as in a loop.

    Modules with parameters or buffers are refused (they would be one set of weights shared by all models;
    use the batched layers, or :func:`batchlayers.convert` for whole models), and so is batch norm, whose
    batch statistics would mix the models' samples. Randomness is detected only in torch.nn's own dropout
    and RReLU modules: a custom module that draws random numbers must not be given a shared batch.

    Args:
        module: the module to apply, e.g. ``nn.MaxPool2d(2)`` or ``nn.Flatten()``. It must map a batch of
            ``N`` samples to a single tensor with a batch of ``N`` samples.

    Shape:
        - Input: ``(M, B, *)``.
        - Output: ``(M, B, *')`` where ``(B, *')`` is ``module``'s output for a ``(B, *)`` input.

    Examples::

        >>> net = nn.Sequential(
        ...     Folded(nn.Flatten()), BatchedLinear(4, 28 * 28, 64), Folded(nn.ReLU()),
        ...     Folded(nn.Dropout(0.1)), BatchedLinear(4, 64, 10))
        >>> net(torch.randn(4, 16, 1, 28, 28)).shape
        torch.Size([4, 16, 10])
        >>> pool = Folded(nn.MaxPool2d(2))
        >>> image = torch.randn(16, 3, 32, 32)        # one batch for all 4 models
        >>> pooled = pool(image.expand(4, *image.shape))
        >>> pooled.shape, pooled.stride(0)            # computed once, still a stride-0 expand
        (torch.Size([4, 16, 3, 16, 16]), 0)
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"Folded: expected an nn.Module to wrap, got {type(module).__name__}")
        reason = _per_model_state(module)
        if reason is not None:
            raise ValueError(f"Folded({type(module).__name__}): cannot run one instance for all models: {reason}")
        self.module = module

    def _name(self) -> str:
        return layer_name(self, f"Folded({type(self.module).__name__})")

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, Tensor):
            raise TypeError(f"{self._name()}: expected a Tensor, got {type(input).__name__}")
        if input.dim() < 2:
            raise ValueError(f"{self._name()}: expected input (M, B, *), got shape {tuple(input.shape)}")
        num_models, batch = input.shape[:2]
        if is_shared(input) and not _has_randomness(self.module):
            out = self._checked(self.module(input[0]), batch, f"{batch} samples of the shared batch")
            return out.expand(num_models, *out.shape)
        out = self.module(input.reshape(num_models * batch, *input.shape[2:]))
        out = self._checked(out, num_models * batch, f"{num_models} models x {batch} samples = {num_models * batch}")
        return out.view(num_models, batch, *out.shape[1:])

    def _checked(self, out: object, expected_batch: int, what: str) -> Tensor:
        if not isinstance(out, Tensor):
            raise TypeError(f"{self._name()}: the wrapped module must return one Tensor, got {type(out).__name__}")
        if out.dim() == 0 or out.shape[0] != expected_batch:
            raise ValueError(
                f"{self._name()}: the wrapped module must keep the batch dimension ({what}), but its output has "
                f"shape {tuple(out.shape)}"
            )
        return out


def _activation(module: nn.Module | None) -> tuple[str, object] | None:
    """``(name, argument)`` of a torch.nn activation a fused run can hold, or None."""
    kind = type(module)
    if kind is nn.ReLU:
        return ("relu", None)
    if kind is nn.Tanh:
        return ("tanh", None)
    if kind is nn.GELU:
        return ("gelu", cast(nn.GELU, module).approximate)
    if kind is nn.SiLU:
        return ("silu", None)
    if kind is nn.LeakyReLU:
        leaky = cast(nn.LeakyReLU, module)
        # torch refuses the backward of an in-place LeakyReLU with a slope <= 0; module by module, so does this
        return None if leaky.inplace and leaky.negative_slope <= 0 else ("leaky_relu", leaky.negative_slope)
    return None


class BatchedSequential(nn.Sequential):
    r"""A :class:`torch.nn.Sequential` that computes each run of batched linear layers with elementwise
    activations between them as one autograd node.

    Children, indexing, ``state_dict`` keys and results are ``nn.Sequential``'s. A run is
    ``BatchedLinear, act, BatchedLinear[, act, BatchedLinear ...]`` with each ``act`` an ``nn.ReLU``,
    ``nn.Tanh``, ``nn.GELU``, ``nn.SiLU`` or ``nn.LeakyReLU``; while training, its forward is the same
    ``baddbmm`` (small layers on CPU: ``bmm`` and an in-place bias add) and activation kernels, and its
    backward is written by hand (the activations' own backward kernels, writing into the gradient they read;
    on CPU a product whose result has a short side is computed with that side first). Results equal
    ``nn.Sequential``'s up to the summation order of the weight gradients.
    Measured on a 2-core CPU (forward, loss and backward; the table is in ``docs/layers.md``): a 10-20-2 MLP
    1.03-1.09x at M=64 and 1.7-1.8x at M=1024, 784-256-256-10 at M=64 1.19x, an SAC critic 17-256-256-1 at
    M=10 1.15x (1.05-1.18x with GELU). Runs below ``batchlayers.functional._mlp.CHAIN_MIN_MACS``
    multiply-adds a call are not fused, except ReLU runs of small layers on CPU (at most 400 multiply-adds a
    sample a layer), which batchlayers' own C kernels compute at any size, one call forward and one backward
    (:attr:`batchlayers.backends.CpuSettings.native_chain`: the 10-20-2 MLP's training step 1.17x at M=64).

    Everything else runs module by module, and so does a run whenever fusing could change what happens:
    a module of the run holds hooks (or global module hooks exist), is a subclass (a parametrized layer
    is one), or the shapes do not chain (the layers then raise their own errors); under autocast,
    ``torch.compile``, torch.func transforms and forward-mode AD. A second derivative
    (``create_graph=True``, e.g. a gradient penalty) recomputes the run with recorded ops, so it is
    exact too.

    Examples::

        >>> critic = BatchedSequential(
        ...     BatchedLinear(10, 17, 256), nn.ReLU(), BatchedLinear(10, 256, 256), nn.ReLU(),
        ...     BatchedLinear(10, 256, 1))
        >>> critic(torch.randn(10, 32, 17)).shape
        torch.Size([10, 32, 1])
        >>> list(critic.state_dict())[:2]
        ['0.weight', '0.bias']
    """

    def forward(self, input):
        modules = list(self._modules.values())
        hooked = global_module_hooks()
        i = 0
        while i < len(modules):
            end = i if hooked or not isinstance(input, Tensor) else _run_end(modules, i)
            if end > i:
                input = _run_chain(modules[i:end], input)
                i = end
            else:
                input = modules[i](input)
                i += 1
        return input


def fusable_runs(sequential: nn.Sequential) -> bool:
    """Whether ``sequential`` holds a run that :class:`BatchedSequential` can train as one autograd node."""
    modules = list(sequential._modules.values())
    return any(_run_end(modules, i) > i for i in range(len(modules)))


def _plain(module: nn.Module | None) -> bool:
    return module is not None and not (
        module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks
    )


def _run_end(modules: Sequence[nn.Module | None], start: int) -> int:
    """The end of the longest fusable run ``linear (act linear)+`` from ``start``, or ``start`` if there is none.
    Its linears are all plain or all swapped into a stacked model (holding only the folding hooks)."""
    first = modules[start]
    if type(first) is not BatchedLinear:
        return start
    plain = _plain if _plain(first) else _fold.only_fold_hooks
    end = i = start
    while i < len(modules) and type(modules[i]) is BatchedLinear and plain(modules[i]):
        end = i + 1
        act = modules[i + 1] if i + 1 < len(modules) else None
        if _activation(act) is None or not _plain(act):
            break
        i += 2
    return end if end - start >= 3 else start


def _run_chain(run: list[nn.Module], x: Tensor) -> Tensor:
    if not fusable_context(x):  # decided before a stacked model's folding hook runs
        return _one_by_one(run, x)
    if _fold.is_swapped_leaf(run[0]):
        # In a stacked model: unfolded and folded once for the run, as its first and last layer would
        y = _fold.run_as_one_leaf(run[0], run[-1], x, lambda unfolded: _fused(run, unfolded))
    else:
        y = _fused(run, x)
    return _one_by_one(run, x) if y is None else y


def _fused(run: list[nn.Module], x: Tensor) -> Tensor | None:
    """The run as one node where :func:`chain_fuses` and the layers chain; None where they must run one by one."""
    layers = cast(list[BatchedLinear], run[0::2])
    first = layers[0]
    activations = tuple(cast(tuple[str, object], _activation(act)) for act in run[1::2])
    # Decided from the sizes first, so that a run too small to fuse costs no more than nn.Sequential; a ReLU
    # run may still fuse with the C kernels (decided below, once the layers are known to chain).
    rows = x.numel() // max(first.in_features, 1)
    macs = rows * sum(layer.in_features * layer.out_features for layer in layers)
    large = chain_fuses(macs)  # (the context was checked by _run_chain)
    if not large and not chain_may_fuse_natively(x, activations):
        return None
    check_input(first, x, trailing=[("in_features", first.in_features)], layout="(M, *, in_features)")
    weights: list[Tensor] = [layer.weight for layer in layers]
    biases: list[Tensor | None] = [layer.bias for layer in layers]
    chained = all(
        a.out_features == b.in_features and a.num_models == b.num_models for a, b in zip(layers, layers[1:])
    ) and all(t.device == x.device and t.dtype == x.dtype for t in (*weights, *biases) if t is not None)
    if not chained:  # the layers raise their own errors
        return None
    x3 = x if x.dim() == 3 else x.reshape(first.num_models, -1, first.in_features)
    if not large and not chain_fuses_natively(x3, weights, biases, activations):
        return None
    y = fused_linear_chain(x3, weights, biases, activations)
    return y if x.dim() == 3 else y.view(*x.shape[:-1], layers[-1].out_features)


def _one_by_one(run: list[nn.Module], x: Tensor) -> Tensor:
    for module in run:
        x = module(x)
    return x
