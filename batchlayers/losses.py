r"""Per-model losses: ``(M, B, *)`` outputs and targets in, an ``(M,)`` loss vector out.

Each function here is its ``torch.nn.functional`` namesake computed for every model at once: entry ``m``
equals ``F.<loss>(input[m], target[m], ...)``, including the exact meaning of ``'mean'`` (e.g. the
class-weighted mean of ``cross_entropy``, which skips ``ignore_index``). No loop over models.

Train with the SUM over models, not the mean::

    losses = batchlayers.losses.cross_entropy(model(x), y)   # (M,): losses[m] is model m's mean loss
    losses.sum().backward()                                  # every model gets exactly its own gradient
    optimizer.step()

Model ``m``'s parameters only influence ``losses[m]``, so the gradient of ``losses.sum()`` with respect to
them is exactly the gradient of model ``m``'s own mean loss: training ``M`` models together is then the
same as training each alone. ``losses.mean()`` divides every model's gradient by ``M``: for SGD that is an
``M`` times smaller learning rate (it changes when you change how many models you train), and for Adam,
which divides by the gradient's running RMS, it shifts the balance between the gradient and ``eps``, so
the models no longer match their single-model runs either. Report ``losses`` (or ``losses.detach()``)
per model instead of averaging them into one number.

``reduction`` is per model: ``'mean'`` (default) and ``'sum'`` give ``(M,)``, ``'none'`` the unreduced
``(M, B, *)`` losses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native
from ._utils import function_transform_active, is_shared, no_function_transforms

__all__ = [
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "cross_entropy",
    "huber_loss",
    "kl_div",
    "l1_loss",
    "mse_loss",
    "nll_loss",
    "smooth_l1_loss",
]


def _fmt(shape) -> str:
    return str(tuple(int(s) for s in shape))


def _check_tensor(name: str, what: str, x: object, min_ndim: int, layout: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"batchlayers.losses.{name}: expected {what} to be a Tensor, got {type(x).__name__}")
    if x.dim() < min_ndim:
        raise ValueError(
            f"batchlayers.losses.{name}: expected {what} {layout} (models first), got shape {_fmt(x.shape)}"
        )
    if what == "input" and x.shape[0] == 0:  # (torch's reshapes, or a division by M, would raise instead)
        raise ValueError(
            f"batchlayers.losses.{name}: expected {what} {layout} of at least one model (M >= 1), got shape "
            f"{_fmt(x.shape)}"
        )
    return x


def _check_reduction(name: str, reduction: str, allowed=("mean", "sum", "none")) -> None:
    if reduction not in allowed:
        raise ValueError(f"batchlayers.losses.{name}: reduction must be one of {allowed}, got {reduction!r}")


def _elementwise(name: str, loss_fn, input: Tensor, target: Tensor, reduction: str, **kwargs) -> Tensor:
    """Losses whose ``'mean'`` is the plain mean over one model's elements."""
    _check_reduction(name, reduction)
    _check_tensor(name, "input", input, 2, "(M, B, *)")
    _check_tensor(name, "target", target, 2, "(M, B, *)")
    if target.shape != input.shape:
        raise ValueError(
            f"batchlayers.losses.{name}: expected target with the input's shape {_fmt(input.shape)}, "
            f"got {_fmt(target.shape)}"
        )
    for what, value in kwargs.items():
        if isinstance(value, Tensor) and not _broadcasts_to(value.shape, input.shape):
            raise ValueError(
                f"batchlayers.losses.{name}: {what} of shape {_fmt(value.shape)} does not broadcast to the input "
                f"{_fmt(input.shape)} (M, B, *) without growing it"
            )
    # Elementwise on the whole (M, B, *) tensor: a shared target (a stride-0 expand) is never copied.
    unreduced = loss_fn(input, target, reduction="none", **kwargs)
    return _reduce(unreduced, reduction)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _reduce(unreduced: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return unreduced
    per_model = unreduced.reshape(unreduced.shape[0], -1)
    return per_model.mean(dim=1) if reduction == "mean" else per_model.sum(dim=1)


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Per-model :func:`torch.nn.functional.mse_loss`. ``input``, ``target``: ``(M, B, *)``; returns ``(M,)``."""
    return _elementwise("mse_loss", F.mse_loss, input, target, reduction)


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Per-model :func:`torch.nn.functional.l1_loss`. ``input``, ``target``: ``(M, B, *)``; returns ``(M,)``."""
    return _elementwise("l1_loss", F.l1_loss, input, target, reduction)


def smooth_l1_loss(input: Tensor, target: Tensor, reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """Per-model :func:`torch.nn.functional.smooth_l1_loss`; returns ``(M,)``."""
    return _elementwise("smooth_l1_loss", F.smooth_l1_loss, input, target, reduction, beta=beta)


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0) -> Tensor:
    """Per-model :func:`torch.nn.functional.huber_loss`; returns ``(M,)``."""
    return _elementwise("huber_loss", F.huber_loss, input, target, reduction, delta=delta)


def binary_cross_entropy(
    input: Tensor, target: Tensor, weight: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """Per-model :func:`torch.nn.functional.binary_cross_entropy` on probabilities; returns ``(M,)``.

    ``weight`` broadcasts against ``(M, B, *)`` (e.g. ``(*)`` shared, or ``(M, 1, *)`` per model).
    """
    return _elementwise("binary_cross_entropy", F.binary_cross_entropy, input, target, reduction, weight=weight)


def binary_cross_entropy_with_logits(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    reduction: str = "mean",
    pos_weight: Tensor | None = None,
) -> Tensor:
    """Per-model :func:`torch.nn.functional.binary_cross_entropy_with_logits`; returns ``(M,)``.

    ``weight`` and ``pos_weight`` broadcast against ``(M, B, *)`` as in torch (``pos_weight`` along the
    last, class, dimension).
    """
    return _elementwise(
        "binary_cross_entropy_with_logits",
        F.binary_cross_entropy_with_logits,
        input,
        target,
        reduction,
        weight=weight,
        pos_weight=pos_weight,
    )


def kl_div(input: Tensor, target: Tensor, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """Per-model :func:`torch.nn.functional.kl_div`; ``'batchmean'`` divides each model's sum by ``B``."""
    _check_reduction("kl_div", reduction, ("mean", "batchmean", "sum", "none"))
    if reduction != "batchmean":
        return _elementwise("kl_div", F.kl_div, input, target, reduction, log_target=log_target)
    return _elementwise("kl_div", F.kl_div, input, target, "sum", log_target=log_target) / input.shape[1]


def _check_classification(name: str, input: Tensor, target: Tensor) -> bool:
    """Validate ``(M, B, C, *d)`` input against class-index ``(M, B, *d)`` or probability targets; return
    whether the target holds class indices."""
    _check_tensor(name, "input", input, 3, "(M, B, C, *d)")
    _check_tensor(name, "target", target, 2, "(M, B, *d) class indices or (M, B, C, *d) probabilities")
    class_indices = not target.is_floating_point()
    expected = (*input.shape[:2], *input.shape[3:]) if class_indices else tuple(input.shape)
    if tuple(target.shape) != expected:
        kind = "class indices" if class_indices else "class probabilities"
        raise ValueError(
            f"batchlayers.losses.{name}: for input (M, B, C, *d) = {_fmt(input.shape)}, expected target "
            f"{kind} of shape {_fmt(expected)}, got {_fmt(target.shape)}"
        )
    return class_indices


def _classification(
    name: str,
    loss_fn,
    input: Tensor,
    target: Tensor,
    weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    **kwargs,
) -> Tensor:
    _check_reduction(name, reduction)
    class_indices = _check_classification(name, input, target)
    num_models, batch, num_classes = input.shape[:3]
    if weight is not None and (not isinstance(weight, Tensor) or weight.shape != (num_classes,)):
        got = _fmt(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(
            f"batchlayers.losses.{name}: expected weight of shape ({num_classes},), one per class of the input "
            f"{_fmt(input.shape)}, got {got}"
        )
    # (Not where the values cannot be read: compiled, or under a torch.func transform; torch's kernel checks them.)
    if (
        class_indices
        and target.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not function_transform_active()
    ):
        _check_class_indices(name, target, num_classes, ignore_index)
    # Models folded into the batch: one kernel for all models, then each model's part reduced on its own.
    flat_input = input.reshape(num_models * batch, *input.shape[2:])
    flat_target = target.reshape(num_models * batch, *target.shape[2:])
    unreduced = loss_fn(flat_input, flat_target, weight=weight, ignore_index=ignore_index, reduction="none", **kwargs)
    unreduced = unreduced.view(num_models, batch, *unreduced.shape[1:])
    if reduction != "mean" or not class_indices:
        return _reduce(unreduced, reduction)
    # torch's 'mean' with class indices divides by the summed weights of the targets that are not ignored.
    counted = target != ignore_index
    if weight is None:
        denominator = counted.reshape(num_models, -1).sum(dim=1).to(unreduced.dtype)
    else:
        target_weight = weight[torch.where(counted, target, 0)] * counted
        denominator = target_weight.reshape(num_models, -1).sum(dim=1)
    return unreduced.reshape(num_models, -1).sum(dim=1) / denominator


def _check_class_indices(name: str, target: Tensor, num_classes: int, ignore_index: int) -> None:
    """An ``IndexError`` naming the model and position of a class index outside ``[0, C)`` (torch's own
    message names only the value, of a folded batch). CPU only: elsewhere it would wait for the device."""
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise IndexError(
            f"batchlayers.losses.{name}: target {int(target[where])} of model {where[0]} at position "
            f"{where[1:]} is out of range for C={num_classes} classes (and not ignore_index={ignore_index})"
        )


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    r"""Per-model :func:`torch.nn.functional.cross_entropy`: ``(M,)`` with entry ``m`` equal to
    ``F.cross_entropy(input[m], target[m], ...)``.

    Args:
        input: logits ``(M, B, C, *d)``.
        target: class indices ``(M, B, *d)`` or class probabilities ``(M, B, C, *d)``; a target shared by
            every model may be a stride-0 expand.
        weight: ``(C,)`` class weights, shared by every model.
        ignore_index, label_smoothing: as in torch.
        reduction: per model, ``'mean'`` (torch's weighted mean), ``'sum'`` or ``'none'``.

    Returns:
        ``(M,)`` (or the unreduced ``(M, B, *d)`` for ``reduction='none'``). Train with ``.sum()``.

    Two classes on the CPU (class indices, no ``weight`` or ``label_smoothing``) take a direct formula,
    ``softplus`` of the logits' difference, instead of torch's log-softmax; reduced per model with int64
    targets and ``(M, B, 2)`` logits whose rows are contiguous, one C call forward and one backward
    (:attr:`batchlayers.backends.cpu.native_losses`). Values and gradients equal torch's to rounding.
    """
    if (
        isinstance(input, Tensor)
        and input.dim() >= 3
        and input.shape[2] == 2
        and input.is_floating_point()
        and input.device.type == "cpu"
        and isinstance(target, Tensor)
        and not target.is_floating_point()
        and weight is None
        and label_smoothing == 0.0
        and reduction in ("mean", "sum", "none")
        and not torch.compiler.is_compiling()  # it branches on the targets' values; inductor fuses torch's path
        and no_function_transforms()  # (its Functions have no vmap or jvp rule)
    ):
        _check_classification("cross_entropy", input, target)
        if input.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled("cpu"):
            input = input.float()  # autocast's own cast: torch's cross_entropy is on its float32 list
        fast = _two_class_cross_entropy(input, target, ignore_index, reduction)
        if fast is not None:
            return fast
    return _classification(
        "cross_entropy",
        F.cross_entropy,
        input,
        target,
        weight,
        ignore_index,
        reduction,
        label_smoothing=label_smoothing,
    )


class _TwoClassCrossEntropy(torch.autograd.Function):
    """Unreduced two-class cross entropy ``softplus(x_other - x_target)`` with a hand-written backward
    (``sigmoid`` of the same difference): a few elementwise passes over ``(M, B, *d)``, where torch's
    log-softmax over a class dimension of 2 runs a slow strided kernel forward and backward (measured in
    benchmarks/README.md). ``sign`` is :func:`_two_class_sign`'s; ``counted`` masks ``ignore_index`` targets out
    (loss 0, and gradient 0 whatever flows back, as torch).

    The logits themselves are saved too (torch saves its log-softmax, the same size), for the two cases the
    formula does not serve, both taken with torch's own recorded ops (:func:`_recorded_input_grad`): a backward
    with ``create_graph=True`` (a gradient penalty differentiates the gradient again), and logits that are not
    all finite (see :func:`_two_class_terms`)."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, ignore_index: int, sign: Tensor, counted: Tensor | None) -> Tensor:
        ctx.ignore_index = ignore_index
        terms = _two_class_terms(input, sign)
        ctx.recorded = terms is None
        if terms is None:
            ctx.save_for_backward(input, target, None, None)
            return _torch_two_class_loss(input, target, ignore_index)
        signed_probability, loss = terms
        ignored = None if counted is None else ~counted
        if ignored is not None:
            loss.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(input, target, signed_probability, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        input, target, signed_probability, ignored = ctx.saved_tensors
        if ctx.recorded or torch.is_grad_enabled():
            return _recorded_input_grad(input, target, ctx.ignore_index, grad), None, None, None, None
        if ignored is not None:
            # torch writes 0 for an ignored target, even where the incoming gradient is inf or NaN (a 'mean'
            # over a model whose targets are all ignored divides by 0)
            grad = grad.masked_fill(ignored, 0.0)
        return _two_class_input_grad(signed_probability, grad, input.shape), None, None, None, None


# Signs and the two halves of the gradient are written with multiplies and ``out=`` views: on a 2-core CPU
# ``torch.where`` on a boolean mask and ``torch.stack`` of the halves each took about 400 us on 1024 x 64
# targets, against 10-120 us for these. The 10-20-2 MLP's whole training step (interleaved medians of 30
# rounds, where/stack -> this, same numbers bit for bit): 1.07-1.08x at M=64, 1.04-1.15x at M=1024.


# ``[1, -1]`` per floating dtype, made at import (``torch.tensor`` costs 12 us a call, 1% of the 10-20-2 MLP's
# training step at M=64), so that no mode active at a first call (a fake-tensor or a tracing mode) makes the
# table every later call reads. Only read by ``index_select``; the formula runs on CPU only.
_SIGN_TABLES = {
    dtype: torch.tensor([1.0, -1.0], dtype=dtype, device="cpu")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _two_class_sign(target: Tensor, dtype: torch.dtype) -> Tensor:
    """``+1`` where ``target`` is class 0, ``-1`` where it is class 1 (every target is one of them), as
    ``dtype``: the sign that turns ``x_1 - x_0`` into the other class's logit minus the target's."""
    if is_shared(target):
        # Targets shared by every model (a stride-0 expand): one model's signs, expanded, never M copies.
        return _two_class_sign(target[0], dtype).expand(target.shape)
    table = _SIGN_TABLES.get(dtype) if target.device.type == "cpu" else None
    if table is None:
        table = torch.tensor([1.0, -1.0], dtype=dtype, device=target.device)
    index = target.reshape(-1)
    if index.dtype not in (torch.int32, torch.int64):  # uint8 targets (torch takes them), a boolean mask
        index = index.long()
    return table.index_select(0, index).view(target.shape)


def _two_class_sign_if_counted(target: Tensor, dtype: torch.dtype) -> Tensor | None:
    """:func:`_two_class_sign` when every target is 0 or 1, else None. On CPU (this path's only device)
    ``index_select`` checks every index itself, raising ``IndexError`` for any other value: a separate check
    of the targets cost 3% of the 10-20-2 MLP's training step at M=64 (interleaved medians, 60 rounds). On a
    GPU an index out of range would be a device-side assert instead."""
    if target.device.type != "cpu":
        return None  # torch's path raises its own error for targets on another device than the logits
    try:
        return _two_class_sign(target, dtype)
    except IndexError:
        return None


def _two_class_terms(input: Tensor, sign: Tensor) -> tuple[Tensor, Tensor] | None:
    """With ``z = sign * (x_1 - x_0)``, the other class's logit minus the target's: ``sign * sigmoid(z)``
    (the gradient of the loss by ``x_1 - x_0``) and the unreduced loss ``softplus(z)``.

    ``None`` when some ``z`` is infinite or NaN. torch's log-softmax subtracts the row's maximum, so a ``+inf``
    logit makes its loss and gradient NaN, where ``softplus(-inf) = 0`` would hide the diverged model; a
    ``-inf`` logit alone is finite in both. The caller then takes torch's own ops. One sum over ``z`` finds
    them, and only when it is not finite are the elements looked at (a finite sum that overflows stays here).
    The sum costs 1.9 us on 64 x 64 targets and 4.4 us on 1024 x 64 (2-core CPU, one thread, timeit minima);
    forward + backward stayed within noise of the unchecked formula's (interleaved, 0.97-1.03x), as dropping
    ``once_differentiable``'s wrapper from the backward saves about as much."""
    z = torch.sub(input.select(2, 1), input.select(2, 0)).mul_(sign)
    if not math.isfinite(z.sum().item()) and not bool(z.isfinite().all()):
        return None
    # threshold 50, not softplus' 20: above it log1p(exp(-z)) < 2e-22 is below float64's resolution
    return torch.sigmoid(z).mul_(sign), F.softplus(z, threshold=50.0)


def _torch_two_class_loss(input: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """torch's own unreduced cross entropy of ``(M, B, 2, *d)`` logits, recorded (differentiable again)."""
    flat = F.cross_entropy(
        input.flatten(0, 1), target.flatten(0, 1).long(), ignore_index=ignore_index, reduction="none"
    )
    return flat.view(target.shape)


def _recorded_input_grad(input: Tensor, target: Tensor, ignore_index: int, grad: Tensor) -> Tensor:
    """The gradient by the logits of ``(grad * unreduced loss).sum()``, by torch's ops. With ``create_graph=True``
    (grad mode on in backward) the saved logits carry their history, so the result is differentiable again,
    exactly as torch's (a gradient from the formula's saved probabilities would be a constant)."""
    create_graph = torch.is_grad_enabled()
    logits = input if create_graph else input.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = _torch_two_class_loss(logits, target, ignore_index)
        (by_logits,) = torch.autograd.grad(loss, logits, grad.expand(loss.shape), create_graph=create_graph)
    return by_logits


def _two_class_input_grad(signed_probability: Tensor, scale: Tensor, input_shape: torch.Size) -> Tensor:
    """The gradient by the ``(M, B, 2, *d)`` logits: ``scale * signed_probability`` by ``x_1``, its negative
    by ``x_0``."""
    grad = signed_probability.new_empty(input_shape)
    by_second = torch.mul(signed_probability, scale, out=grad.select(2, 1))
    torch.neg(by_second, out=grad.select(2, 0))
    return grad


class _TwoClassCrossEntropyReduced(torch.autograd.Function):
    """:class:`_TwoClassCrossEntropy` with every target counted, summed per model and divided by ``divisor``
    (the number of targets per model for ``'mean'``, 1 for ``'sum'``) in the same node: the reduction's
    reshape, sum and division nodes cost more than the loss itself on a small batch."""

    @staticmethod
    def forward(
        ctx,
        input: Tensor,
        target: Tensor,
        ignore_index: int,
        sign: Tensor | None,
        divisor: float,
        native: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        """``native``: :func:`_native_two_class_terms`' result, else ``sign`` is :func:`_two_class_sign`'s."""
        ctx.ignore_index = ignore_index
        ctx.divisor = divisor
        if native is not None:
            ctx.recorded = False
            ctx.save_for_backward(input, target, native[1])
            return native[0]
        terms = _two_class_terms(input, sign)  # type: ignore[arg-type]  # (a Tensor without native)
        ctx.recorded = terms is None
        if terms is None:
            signed_probability, loss = None, _torch_two_class_loss(input, target, ignore_index)
        else:
            signed_probability, loss = terms
        ctx.save_for_backward(input, target, signed_probability)
        total = loss.reshape(input.shape[0], -1).sum(dim=1)
        return total if divisor == 1 else total.div_(divisor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        input, target, signed_probability = ctx.saved_tensors
        if not ctx.recorded and not torch.is_grad_enabled():
            native = _native_two_class_input_grad(signed_probability, grad, ctx.divisor, input.shape)
            if native is not None:
                return native, None, None, None, None, None
        scale = grad if ctx.divisor == 1 else grad / ctx.divisor
        scale = scale.view(-1, *[1] * (target.dim() - 1))
        if ctx.recorded or torch.is_grad_enabled():
            return _recorded_input_grad(input, target, ctx.ignore_index, scale), None, None, None, None, None
        return _two_class_input_grad(signed_probability, scale, input.shape), None, None, None, None, None


# Whether two classes' reduced loss may run batchlayers' C kernels (``_losses_native.c``, compiled with the
# optimizers', see :mod:`batchlayers._native`): ``backends.cpu.native_losses``. One call forward and one
# backward where the formula above makes about twenty torch calls (a few microseconds each on a 2-core CPU).
native_kernel = True


def _native_kernel(direction: str, dtype: torch.dtype):
    return _native.kernel(f"two_class_{direction}", dtype) if native_kernel else None


def _native_two_class_terms(input: Tensor, target: Tensor, divisor: float) -> tuple[Tensor, Tensor] | None:
    """The C kernel's ``(M,)`` loss, each model's sum divided by ``divisor``, and the ``(M, B)`` signed
    probability of :func:`_two_class_terms`, for float32 or float64 logits ``(M, B, 2)`` on the CPU whose
    ``(B, 2)`` rows are contiguous and int64 targets ``(M, B)`` whose rows are (a shared row too: model stride
    0). ``None`` where it does not apply, or where a target is neither 0 nor 1 or some ``x_1 - x_0`` is not
    finite: the caller's other paths then decide, as without the kernel. The kernel reads memory by address:
    only dense tensors of the CPU (a target on another device, a meta one's address 0, a sparse one, a negative
    view, go to torch's ops and their errors)."""
    if (
        input.dim() != 3
        or type(input) is not Tensor
        or type(target) is not Tensor
        or target.dtype != torch.int64
        or target.device != input.device
        or input.layout != torch.strided
        or target.layout != torch.strided
    ):
        return None
    num_models, batch = target.shape
    if input.stride(2) != 1 or (batch > 1 and (input.stride(1) != 2 or target.stride(1) != 1)):
        return None
    if input.is_neg() or target.is_neg():  # (negative views: their memory holds the values' negatives)
        return None
    kernel = _native_kernel("forward", input.dtype)
    if kernel is None:
        return None
    signed_probability = input.new_empty(num_models, batch)
    total = input.new_empty(num_models)
    failed = kernel(
        num_models,
        batch,
        input.data_ptr(),
        input.stride(0),
        target.data_ptr(),
        target.stride(0),
        divisor,
        signed_probability.data_ptr(),
        total.data_ptr(),
    )
    return None if failed else (total, signed_probability)


def _native_two_class_input_grad(
    signed_probability: Tensor, grad: Tensor, divisor: float, input_shape: torch.Size
) -> Tensor | None:
    """:func:`_two_class_input_grad` of ``grad / divisor`` (``grad``: ``(M,)``) by the C kernel, for ``(M, B, 2)``
    logits; ``None`` where it does not apply."""
    if (
        len(input_shape) != 3
        or type(grad) is not Tensor
        or grad.dtype != signed_probability.dtype
        or grad.device != signed_probability.device
        or grad.layout != torch.strided
        or grad.is_neg()
        or not signed_probability.is_contiguous()
    ):
        return None
    kernel = _native_kernel("backward", signed_probability.dtype)
    if kernel is None:
        return None
    grad_input = signed_probability.new_empty(input_shape)
    num_models, batch = signed_probability.shape
    pointers = (signed_probability.data_ptr(), grad.data_ptr(), grad.stride(0), divisor, grad_input.data_ptr())
    kernel(num_models, batch, *pointers)
    return grad_input


def _two_class_cross_entropy(input: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor | None:
    """Two-class cross entropy of class indices by :class:`_TwoClassCrossEntropy`; ``None`` when a target is
    neither class nor ``ignore_index`` (torch's path then raises its error)."""
    # ignore_index 0 or 1 is a real class: its targets are ignored, so not every target counts
    ignores_a_class = ignore_index in (0, 1)
    if reduction != "none" and not ignores_a_class:
        num_models = input.shape[0]
        divisor = float(int(target.numel()) // num_models) if reduction == "mean" else 1.0
        native = _native_two_class_terms(input, target, divisor)
        sign = None if native is not None else _two_class_sign_if_counted(target, input.dtype)
        if native is not None or sign is not None:
            return _TwoClassCrossEntropyReduced.apply(input, target, ignore_index, sign, divisor, native)
    second = target == 1
    classes = second | (target == 0)
    counted: Tensor | None = classes
    if ignores_a_class:
        if not bool(classes.all()):
            return None
        counted = second if ignore_index == 0 else ~second
    elif bool(classes.all()):
        counted = None
    elif not bool((classes | (target == ignore_index)).all()):
        return None
    sign = _two_class_sign(second, input.dtype)  # (ignored targets: +1, masked out)
    unreduced = _TwoClassCrossEntropy.apply(input, target, ignore_index, sign, counted)
    if reduction == "none":
        return unreduced
    num_models = input.shape[0]
    total = unreduced.reshape(num_models, -1).sum(dim=1)
    if reduction == "sum":
        return total
    if counted is None:
        return total / (target.numel() // num_models)
    return total / counted.reshape(num_models, -1).sum(dim=1).to(unreduced.dtype)


def nll_loss(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    r"""Per-model :func:`torch.nn.functional.nll_loss` on log-probabilities ``(M, B, C, *d)`` and class
    indices ``(M, B, *d)``; returns ``(M,)``. Arguments as in :func:`cross_entropy`."""
    if not isinstance(target, Tensor) or target.is_floating_point():
        got = target.dtype if isinstance(target, Tensor) else type(target).__name__
        raise TypeError(f"batchlayers.losses.nll_loss: expected target class indices (an integer tensor), got {got}")
    return _classification("nll_loss", F.nll_loss, input, target, weight, ignore_index, reduction)
