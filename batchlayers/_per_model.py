"""Per-model values inside a stacked ``forward``: tensors of which every model has its own.

A stacked model's parameters and buffers are stored ``(M, *S)``: model ``i``'s value is ``t[i]``. Batched
layers use them as such. The architecture's own code, though, reads them as the one model it was written
for: ``self.pos_embed`` of shape ``S``, added to the samples, expanded to the batch, indexed by a position
table. So does a batched layer's output for an input without samples (a position embedding of ``arange(T)``).

Such tensors carry the tag :class:`PerModel` (``tensor._batchlayers_models is PerModel``, see
``batchlayers._provenance``) and keep their ``(M, *S)`` storage. While a stacked ``forward`` runs, the
provenance tracker hands every torch call that sees one to :func:`call`, which makes it behave exactly like
the one model's value, for every model at once:

- **Sizes are the one model's**: ``t.shape``, ``t.size(d)``, ``t.dim()``, ``len(t)``, ``t.numel()`` report
  ``S``; code that reads its configuration from a weight (``self.pos.weight.shape[0]``) sees one model.
- **Fast paths** compute common calls on the whole ``(M, *S)`` tensor: views and reshapes (as views, so
  writing through them writes the model's value), broadcasting arithmetic with the folded samples (each
  operand brought to a leading model dimension and back), ``F.linear``/``addmm`` as one batched matmul,
  layer/group/RMS norms with per-model affine parameters.
- **Anything else runs per model**: model ``i``'s call gets ``t[i]`` for a per-model tensor, block ``i`` of
  a tensor holding the samples, the shared value for the rest; the results are joined on the model
  dimension (a per-model result) or, where they hold samples, concatenated along the dimension the
  provenance rule names for one model. That is exact for any torch function, by construction; it costs M
  calls. A result that is not a tensor (``bool(t)``, ``t.item()``, Python control flow) is returned when all
  models agree and refused otherwise, naming the call.

A reduction over the models' samples (a mean, a loss) gives a per-model value too: the samples are viewed
``(M, *one model's shape)`` and reduced as the one model would (losses with fast paths: cross-entropy and
NLL through ``batchlayers.losses``, elementwise losses reduced per model). See ``batchlayers._provenance``.

Never is model 0's value used for all models: a call that cannot be done per model raises.
"""

from __future__ import annotations

import inspect
import os
import string
import sys
from collections.abc import Callable, Sequence
from types import FrameType, SimpleNamespace
from typing import Any, NoReturn, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from . import losses as batched_losses
from ._numbers import FoldedSize
from ._provenance import (
    _INPLACE,
    _RULES,
    Lost,
    PerModel,
    _getter,
    _name,
    _norm,
    _outputs,
    _tagged,
    each_models_positions,
    einsum_labels,
    einsum_operands,
    einsum_tag,
    from_size_alone,
    from_size_message,
    get_tag,
    in_place_name,
    loss_arguments,
    set_tag,
)
from .functional import multi_head_attention as _batched_attention
from .functional import rnn as _batched_rnn

__all__ = ["call"]


def _same_view(*args: object) -> bool:
    """``tensor.data = value`` with ``value`` the same view of the same memory as ``tensor``."""
    if len(args) != 2 or not all(isinstance(a, Tensor) for a in args):
        return False
    a, b = cast(tuple[Tensor, Tensor], args)
    same_memory = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    layout = [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) for t in (a, b)]
    return same_memory and layout[0] == layout[1]


def call(ctx, func: Callable, args: tuple, kwargs: dict) -> object:
    """Run ``func`` on arguments of which at least one is a per-model tensor (``ctx``: the tracker)."""
    if func in _PASS:
        return func(*args, **kwargs)
    if func == _SET_DATA:
        if _same_view(*args):  # ``module.to(dtype)`` to the dtype it has (Switch Transformers' router): no change
            return None
        raise ValueError(
            "batchlayers: a stacked forward assigns to .data of a per-model value (a parameter, buffer or a value "
            "computed from one): its (M, *) storage cannot take one model's tensor. Write into it in place "
            "(with torch.no_grad(): w.clamp_(-0.5, 0.5)), or stack with execution='model_by_model'"
        )
    ctx.refuse_checkpointing(_name(func))
    rule = _RULES.get(func)
    if rule is not None and rule.over_samples is not None:
        tagged = _tagged(args, kwargs)
        if any(isinstance(i.tag, int) for i in tagged) and rule.over_samples(rule.name, args, kwargs, tagged):
            args = cast(tuple, _samples_per_model(ctx.num_models, args))
            kwargs = cast(dict, _samples_per_model(ctx.num_models, kwargs))
    lost = next((t for t in _all_tags(args, kwargs) if isinstance(t, Lost)), None)
    if lost is not None:
        raise ValueError(
            f"{_name(func)} inside a stacked forward combines a per-model value (a parameter, buffer or a value "
            f"computed from one) with a tensor whose rows cannot be assigned to models: it was made by "
            f"{lost.reason}"
        )
    if ctx.num_models > 1 and func not in _TAKES_THE_FOLDED_SIZE:
        _refuse_folded_sizes(ctx, func, (args, kwargs))
        args, kwargs = cast(tuple, each_models_positions(ctx, args)), cast(dict, each_models_positions(ctx, kwargs))
        alone = from_size_alone(args, kwargs)
        if alone is not None:
            raise ValueError(
                from_size_message(f"batchlayers: {_name(func)} on a per-model value gets a tensor that", alone)
            )
    meta = _META.get(func)
    if meta is not None and args and get_tag(args[0]) is PerModel:
        return meta(ctx.num_models, args[0], *args[1:], **kwargs)
    fast = _FAST.get(func)
    if fast is not None:
        result = fast(ctx, func, args, kwargs)
        if result is not NotImplemented:
            return result
    if ctx.num_models > 1 and func in _TAKES_THE_FOLDED_SIZE:
        _refuse_folded_sizes(ctx, func, (args, kwargs))  # (a size-taking call its fast path did not take)
    return _per_model_loop(ctx, func, args, kwargs)


def _refuse_folded_sizes(ctx, func: Callable, obj: object) -> None:
    """Refuse a size read from the models' samples (``B = x.size(0)``, ``M * B`` in the folded forward) given
    to a call on a per-model value other than one that brings it to the samples (``expand``, ``repeat``,
    ``new_zeros``): ``table[:B]``, ``table[B]``, ``table.narrow(0, 0, B)`` would read ``M * B`` of each
    model's value where each original model reads ``B``."""
    if isinstance(obj, FoldedSize):
        raise ValueError(
            f"batchlayers: {_name(func)} gets {obj.folded()}, {obj.where()}, with a per-model value (a parameter, "
            f"buffer or a value computed from one) whose size it does not bring to the samples: each original "
            f"model reads its own ({obj.own}). Slice or index per-model values by their own sizes, or stack with "
            "execution='model_by_model'"
        )
    if isinstance(obj, (list, tuple)):
        for o in obj:
            _refuse_folded_sizes(ctx, func, o)
    elif isinstance(obj, dict):
        for o in obj.values():
            _refuse_folded_sizes(ctx, func, o)
    elif isinstance(obj, slice):
        _refuse_folded_sizes(ctx, func, (obj.start, obj.stop, obj.step))


def _all_tags(args: Sequence, kwargs: dict) -> list:
    return [i.tag for i in _tagged(args, kwargs)]


# ----------------------------------------------------------------------------------------------------------
# One model's view of a tensor: its shape, and the (M or 1, *shape) form with the models first


def single_shape(t: Tensor, num_models: int) -> torch.Size:
    tag = get_tag(t)
    if tag is PerModel:
        return t.shape[1:]
    if isinstance(tag, int):
        return t.shape[:tag] + (t.shape[tag] // num_models,) + t.shape[tag + 1 :]
    return t.shape


def split_models(t: Tensor, dim: int, num_models: int) -> Tensor:
    """``t`` with dimension ``dim``, which holds the models' samples (model-major), split into ``(M, B)`` in
    place: a view, no dimension moved."""
    return t.unflatten(dim, (num_models, t.shape[dim] // num_models))


def explicit(t: Tensor, num_models: int, ndim: int | None = None) -> Tensor:
    """``t`` as ``(M, *S)`` (a per-model tensor or one holding samples, as a view) or ``(1, *S)`` (a shared
    one), with ``S`` padded by leading 1s to ``ndim`` dimensions (broadcasting aligns from the right)."""
    tag = get_tag(t)
    if tag is PerModel:
        e = t
    elif isinstance(tag, int):
        e = split_models(t, tag, num_models).movedim(tag, 0)
    else:
        e = t.unsqueeze(0)
    pad = 0 if ndim is None else ndim - (e.dim() - 1)
    return e[(slice(None),) + (None,) * pad] if pad > 0 else e


def _samples_per_model(m: int, obj: object) -> object:
    """Tensors holding the models' samples in ``obj`` (arguments, nested) viewed ``(M, *one model's
    shape)`` as per-model values: for a reduction over the samples, which gives each model its own."""
    if isinstance(obj, Tensor) and isinstance(tag := get_tag(obj), int):
        return per_model(split_models(obj, tag, m).movedim(tag, 0))
    if isinstance(obj, dict):
        return {k: _samples_per_model(m, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_samples_per_model(m, o) for o in obj)
    return obj


def per_model(t: Tensor) -> Tensor:
    set_tag(t, PerModel)
    return t


def refold(r: Tensor, d: int) -> Tensor:
    """``(M, *S)`` with the samples on ``S``'s dimension ``d`` -> the folded tensor, model-major on ``d``."""
    out = r.movedim(0, d).flatten(d, d + 1)
    set_tag(out, d)
    return out


def _result(r: Tensor, sample_dim: int | None) -> Tensor:
    return per_model(r) if sample_dim is None else refold(r, sample_dim)


def _checked(r: Tensor, d: int | None, tensors: Sequence[Tensor], num_models: int, func: Callable) -> Tensor:
    """Refuse a broadcast that stretched the samples of a model (a value without samples that spans the
    folded batch, e.g. sized from ``x.size(0)``)."""
    if d is not None:
        n = next(t.shape[tag] // num_models for t in tensors if isinstance(tag := get_tag(t), int))
        if r.shape[d + 1] != n:
            raise ValueError(
                f"{_name(func)} inside a stacked forward: a value without the models' samples spans the folded batch "
                f"(size {r.shape[d + 1]}, each model has {n} rows); build batch-sized tensors from the inputs "
                "(torch.zeros_like(x), x.new_zeros(...))"
            )
    return _result(r, d)


# ----------------------------------------------------------------------------------------------------------
# Sizes: the one model's


def _size(m, t, dim=None):
    if dim is None:
        return t.shape[1:]
    return t.shape[1 + _norm(dim, t.dim() - 1)]


def _len(m, t):
    if t.dim() == 1:
        raise TypeError("len() of a 0-d tensor")
    return t.shape[1]


_META: dict[Callable, Callable] = {
    _getter("shape"): lambda m, t: t.shape[1:],
    Tensor.size: _size,
    Tensor.dim: lambda m, t: t.dim() - 1,
    Tensor.ndimension: lambda m, t: t.dim() - 1,
    _getter("ndim"): lambda m, t: t.dim() - 1,
    Tensor.numel: lambda m, t: t.numel() // m,
    Tensor.nelement: lambda m, t: t.numel() // m,
    torch.numel: lambda m, t: t.numel() // m,
    Tensor.__len__: _len,
}

# Calls that do not depend on the model dimension: run on the stored tensor as they are.
_PASS = {
    _getter("dtype"), _getter("device"), _getter("requires_grad"), _getter("is_leaf"),
    _getter("grad_fn"), _getter("layout"), _getter("is_cuda"), Tensor.is_floating_point,
    Tensor.is_complex, Tensor.element_size, Tensor.get_device, Tensor.__hash__, Tensor.__repr__,
    Tensor.requires_grad_, Tensor.retain_grad, Tensor.is_contiguous, Tensor.data_ptr, Tensor.untyped_storage,
    _getter("is_sparse"), _getter("is_meta"), _getter("is_quantized"), torch.is_tensor,
    torch.is_floating_point, torch.is_complex, Tensor.__format__,
}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Fast paths: the whole (M, *S) tensor in one call


def _elementwise(ctx, func, args, kwargs):
    """Broadcasting arithmetic: every tensor operand with the models first, then back (in place: the
    first operand's storage is written through a view)."""
    if any(isinstance(v, Tensor) for v in kwargs.values()):
        return NotImplemented
    m = ctx.num_models
    tensors = [a for a in args if isinstance(a, Tensor)]
    ndim = max(len(single_shape(t, m)) for t in tensors)
    dims = {get_tag(t) + ndim - len(single_shape(t, m)) for t in tensors if isinstance(get_tag(t), int)}
    if len(dims) > 1:
        return NotImplemented  # the samples on two dimensions: per model, where the rule decides
    d = dims.pop() if dims else None
    inplace = func in _INPLACE_FUNCS
    if inplace and get_tag(args[0]) is None:
        raise ValueError(
            f"{_name(func)} inside a stacked forward writes per-model values into a tensor that all models share"
        )
    try:
        r = func(*[explicit(a, m, ndim) if isinstance(a, Tensor) else a for a in args], **kwargs)
    except RuntimeError as error:
        _refuse_unbroadcastable(func, tensors, m, error)
    if inplace:
        return args[0]
    if not isinstance(r, Tensor):
        return NotImplemented
    return _checked(r, d, tensors, m, func)


def _broadcast_tensors(ctx, func, args, kwargs):
    """``torch.broadcast_tensors`` (``torch.distributions``' ``broadcast_all``: ``Normal(mu(x), log_std.exp())``)
    with per-model operands: every operand with the models first, broadcast together, each result a per-model
    value or, where an operand holds the samples, folded back on their dimension."""
    if kwargs or not args or not all(isinstance(a, Tensor) for a in args):
        return NotImplemented
    m = ctx.num_models
    ndim = max(len(single_shape(t, m)) for t in args)
    dims = {get_tag(t) + ndim - len(single_shape(t, m)) for t in args if isinstance(get_tag(t), int)}
    if len(dims) > 1:
        return NotImplemented  # the samples on two dimensions: per model, where the rule decides
    d = dims.pop() if dims else None
    try:
        results = torch.broadcast_tensors(*[explicit(a, m, ndim) for a in args])
    except RuntimeError as error:
        _refuse_unbroadcastable(func, args, m, error)
    return tuple(_checked(r.expand(m, *r.shape[1:]), d, args, m, func) for r in results)


def _refuse_unbroadcastable(func: Callable, tensors: Sequence[Tensor], m: int, error: RuntimeError) -> NoReturn:
    """Raise torch's broadcasting ``error`` of one model's operands as batchlayers' refusal, naming why sizes
    that each original model broadcasts may not broadcast here."""
    if "must match the size" not in str(error):
        raise error
    kinds: dict[object, str] = {PerModel: "per model", None: "shared"}
    shapes = ", ".join(f"{tuple(single_shape(t, m))} ({kinds.get(get_tag(t), 'samples')})" for t in tensors)
    raise ValueError(
        f"{_name(func)} inside a stacked forward: operands of one model's shapes {shapes} do not broadcast. A "
        "value sized from a size read in forward has all models' samples in it (x.size(0) is N * B there); "
        "build it from the inputs (e.g. torch.zeros_like), or stack with execution='model_by_model', which "
        "runs each model's forward on its own batch"
    ) from error


def _only_per_model(args, kwargs) -> bool:
    """Every tensor argument is per-model or shared: no samples involved."""
    return not any(isinstance(t, int) for t in _all_tags(args, kwargs))


def _on_stored(transform: Callable) -> Callable:
    """A view or shape op of a per-model tensor alone, done on its ``(M, *S)`` storage: ``transform(t, s,
    *args, **kwargs)`` gets the stored tensor and the one model's shape ``s``."""

    def fast(ctx, func, args, kwargs):
        if not args or get_tag(args[0]) is not PerModel or not _only_per_model(args[1:], kwargs):
            return NotImplemented
        if any(get_tag(a) is PerModel for a in _flat(args[1:], kwargs)):
            return NotImplemented
        out = transform(args[0], args[0].shape[1:], *args[1:], **kwargs)
        if out is NotImplemented:
            return out
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if get_tag(o) is None:  # (an expand to the folded batch holds samples: tagged already)
                per_model(o)
        return out

    return fast


def _flat(args, kwargs) -> list[Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, Tensor))
    return found


def _sizes(sizes: tuple) -> list:
    return list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)) else list(sizes)


def _shift(d: int, ndim: int) -> int:
    return _norm(d, ndim) + 1


def _shift_dims(dims, ndim: int):
    return _shift(dims, ndim) if isinstance(dims, int) else tuple(_shift(d, ndim) for d in dims)


def _reshape(t, s, *shape, **kw):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return NotImplemented
    return t.reshape(t.shape[0], *_sizes(shape or (kw["shape"],)))


def _view(t, s, *shape, **kw):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return NotImplemented
    return t.view(t.shape[0], *_sizes(shape or (kw["size"],)))


def _flatten(t, s, start_dim=0, end_dim=-1):
    if not s:
        return t.reshape(t.shape[0], 1)
    return t.flatten(_shift(start_dim, len(s)), _shift(end_dim, len(s)))


def _squeeze(t, s, dim=None):
    if dim is None:
        dim = tuple(i for i, v in enumerate(s) if v == 1)
    return t.squeeze(_shift_dims(dim, len(s))) if s else t


def _permute(t, s, *dims, **kw):
    dims = _sizes(dims or (kw["dims"],))
    return t.permute(0, *(_shift(d, len(s)) for d in dims))


def _transpose(t, s, dim0, dim1):
    return t.transpose(_shift(dim0, len(s)), _shift(dim1, len(s)))


def _t(t, s):
    return t.transpose(1, 2) if len(s) == 2 else t


def _index(t, s, index):
    items = index if isinstance(index, tuple) else (index,)
    advanced = [i for i in items if isinstance(i, (Tensor, list)) and not (isinstance(i, Tensor) and i.dim() == 0)]
    if len(advanced) > 1:
        return NotImplemented  # several index tensors may move their dimensions to the front
    return t[(slice(None),) + items]


def _dim_op(method: str, position: int = 0, default=None, key: str = "dim") -> Callable:
    """``t.method(..., dim, ...)`` with ``dim`` (argument ``position`` after the tensor) shifted past the
    model dimension."""

    def transform(t, s, *args, **kwargs):
        args = list(args)
        kwargs.pop("_stacklevel", None)  # (F.softmax's, which the Tensor method does not take)
        if key in kwargs:
            kwargs[key] = _shift_dims(kwargs[key], len(s))
        elif len(args) > position:
            args[position] = _shift_dims(args[position], len(s))
        elif default is not None:
            kwargs[key] = _shift_dims(default, len(s))
        else:
            return NotImplemented
        return getattr(t, method)(*args, **kwargs)

    return transform


def _reduce(method: str) -> Callable:
    """Reductions: over the given dims, or over every dimension of the one model (``dim=None``)."""

    def transform(t, s, *args, **kwargs):
        args = list(args)
        if "dim" in kwargs:
            dim = kwargs.pop("dim")
        else:
            dim = args.pop(0) if args and not isinstance(args[0], torch.dtype) else None
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            if not s:
                return NotImplemented
            dim = tuple(range(len(s)))
        return getattr(t, method)(_shift_dims(dim, len(s)), *args, **kwargs)

    return transform


def _expand(ctx, method: str = "expand"):
    """``expand``/``broadcast_to``, ``repeat`` or ``tile`` of a per-model value to one model's sizes. A size-1
    dimension brought to the folded batch size read from the inputs (``pos.expand(B, -1, -1)``,
    ``pos.repeat(B, 1, 1)`` with ``B = x.size(0)``) holds copies of each model's value: every model gets ``B``
    of them, as its own samples. So does a dimension of any size repeated (tiled) that many times
    (DeBERTa's ``keys.repeat(q.size(0) // heads, 1, 1)``): ``B`` copies of each model's rows, one per sample."""

    def transform(t, s, *sizes):
        sizes = _sizes(sizes)
        if method == "tile" and len(sizes) < len(s):
            sizes = [1] * (len(s) - len(sizes)) + sizes  # tile repeats the trailing dimensions
        if len(sizes) < len(s):
            return NotImplemented
        t = t[(slice(None),) + (None,) * (len(sizes) - len(s))]
        folded = None
        if ctx.size_read and ctx.num_models > 1:
            folded = next(
                (
                    k
                    for k, v in enumerate(sizes)
                    if (int.__int__(v) if isinstance(v, int) else v) in ctx.folded_sizes  # (no marked ==)
                    and (t.shape[k + 1] == 1 or (method != "expand" and isinstance(v, FoldedSize)))
                ),
                None,
            )
        if folded is not None:
            sizes[folded] = sizes[folded] // ctx.num_models
        out = t.expand(t.shape[0], *sizes) if method == "expand" else t.repeat(1, *sizes)
        return out if folded is None else refold(out, folded)

    return transform


def _new_tensor(ctx, func, args, kwargs):
    """``w.new_zeros(size)`` and friends on a per-model ``w``: a new tensor with ``w``'s dtype and device only,
    the same for every model (batch-sized as the tracker's ``_new_creator`` decides)."""
    if _flat(args[1:], kwargs):
        return NotImplemented
    out = func(*args, **kwargs)
    _RULES[func].rule(ctx, _RULES[func].name, args, kwargs, out, [])
    return out


def _linear(ctx, func, args, kwargs):
    """``F.linear(x, W, b)`` with per-model ``W`` (``b``): one batched matmul over the models."""
    m = ctx.num_models
    x = args[0]
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    if get_tag(w) is not PerModel or (b is not None and get_tag(b) is not PerModel) or get_tag(x) is PerModel:
        return NotImplemented
    tag = get_tag(x)
    s = single_shape(x, m)
    if isinstance(tag, int) and tag == len(s) - 1:
        return NotImplemented  # the samples on the features' dimension: per model
    xe = explicit(x, m).expand(m, *s)
    rows = xe.reshape(m, -1, s[-1])
    out = torch.bmm(rows, w.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), rows, w.transpose(1, 2))
    return _result(out.reshape(m, *s[:-1], w.shape[1]), tag if isinstance(tag, int) else None)


def _addmm(ctx, func, args, kwargs):
    """``torch.addmm(b, x, W)`` (``Conv1D``-style linears) with per-model ``W``: one batched matmul."""
    if kwargs or len(args) != 3:
        return NotImplemented
    b, x, w = args
    m = ctx.num_models
    tag = get_tag(x)
    if get_tag(w) is not PerModel or tag == 1 or tag is PerModel or get_tag(b) not in (PerModel, None):
        return NotImplemented
    rows = explicit(x, m).expand(m, *single_shape(x, m))
    out = torch.baddbmm(explicit(b, m, 2), rows, w)
    return _result(out, 0 if tag == 0 else None)


def _matmul(ctx, func, args, kwargs):
    """``a @ b`` (``matmul``, ``mm``, ``bmm``) of two per-model values of at least two dimensions (the samples
    of a product that contracts them, see ``batchlayers._provenance._contracts_samples``): one matmul, the
    models a batch dimension of both; ``mm`` and ``bmm`` keep their own checks of the one model's shapes."""
    if kwargs or len(args) != 2 or not all(get_tag(t) is PerModel for t in args):
        return NotImplemented
    dims = {len(single_shape(t, ctx.num_models)) for t in args}
    wanted = {torch.mm: {2}, Tensor.mm: {2}, torch.bmm: {3}, Tensor.bmm: {3}}.get(func)
    if min(dims) < 2 or (wanted is not None and dims != wanted):
        return NotImplemented  # (per model: torch's own result or error)
    # one model's batch dimensions broadcast from the right, so the models' dimension goes first in both
    return per_model(torch.matmul(*(explicit(t, ctx.num_models, max(dims)) for t in args)))


def _einsum(ctx, func, args, kwargs):
    """``torch.einsum`` with per-model operands: one einsum over all models, with a model subscript in front
    of every per-model operand, every operand holding samples (viewed ``(M, n, ...)``) and the output."""
    operands = einsum_operands(args)
    if kwargs or not args or not isinstance(args[0], str) or not all(isinstance(t, Tensor) for t in operands):
        return NotImplemented
    m = ctx.num_models
    shapes = [single_shape(t, m) for t in operands]
    parsed = einsum_labels(args[0], [len(s) for s in shapes])
    model = next((c for c in string.ascii_letters if c not in args[0]), None)
    if parsed is None or model is None:
        return NotImplemented
    labels, out_labels = parsed
    d = None
    if any(isinstance(get_tag(t), int) for t in operands):
        d = einsum_tag("torch.einsum", operands, labels, out_labels)
        if not isinstance(d, int):
            return NotImplemented  # per model, where the one model's rule decides or refuses
    lhs, arrow, rhs = args[0].replace(" ", "").partition("->")
    if not arrow:
        rhs = ("..." if "..." in lhs else "") + "".join(x for x in out_labels if isinstance(x, str))
    own = [get_tag(t) is PerModel or isinstance(get_tag(t), int) for t in operands]
    terms = [model + term if o else term for term, o in zip(lhs.split(","), own)]
    r = torch.einsum(",".join(terms) + "->" + model + rhs, *[explicit(t, m) if o else t for t, o in zip(operands, own)])
    if d is not None:
        rows = next(s[tag] for t, s in zip(operands, shapes) if isinstance(tag := get_tag(t), int))
        if r.shape[d + 1] != rows:
            return NotImplemented  # another operand stretched one sample (B = 1) to the folded size: per model
    return _result(r, d)


def _affine_norm(norm: Callable, names: tuple[str, ...], channel_dim: int | None) -> Callable:
    """Normalisations with per-model ``weight``/``bias`` (arguments 2 and 3: layer_norm, rms_norm,
    group_norm): normalise without them (no model dimension involved), then scale and shift each model by
    its own."""

    def fast(ctx, func, args, kwargs):
        m = ctx.num_models
        args, kwargs = list(args), dict(kwargs)
        params = []
        for k, name in enumerate(names):
            if name in kwargs:
                params.append(kwargs.pop(name))
            elif len(args) > 2 + k:
                params.append(args[2 + k])
                args[2 + k] = None
            else:
                params.append(None)
        x = args[0]
        tag = get_tag(x)
        if tag is PerModel or any(p is not None and get_tag(p) not in (PerModel, None) for p in params):
            return NotImplemented
        s = single_shape(x, m)
        kept = 1 if channel_dim is not None else len(s) - len(_sizes((args[1],)))
        if isinstance(tag, int) and tag >= kept:
            return NotImplemented  # the samples among the normalised dimensions: per model
        y = norm(*args, **kwargs)
        set_tag(y, tag)
        e = explicit(y, m)
        for k, p in enumerate(params):
            if p is None:
                continue
            pe = explicit(p, m)  # (M or 1, *P)
            if channel_dim is not None:  # (C,) scales dimension 1 of (N, C, *)
                pe = pe.reshape(pe.shape[0], *pe.shape[1:], *([1] * (len(s) - channel_dim - 1)))
            pe = pe[(slice(None),) + (None,) * (len(s) - (pe.dim() - 1))]
            e = e * pe if k == 0 else e + pe
        return _result(e, tag if isinstance(tag, int) else None)

    return fast


def _class_loss(ctx, func, args, kwargs):
    """``F.cross_entropy``/``F.nll_loss`` reduced per model: ``batchlayers.losses`` on the ``(M, N, C, *)``
    view, one kernel for all models and each model's mean over its own valid targets (or their summed class
    weights), so ``ignore_index`` and class weights give every model exactly its own loss."""
    a = loss_arguments(func, args, kwargs)
    if a["reduction"] not in ("mean", "sum") or get_tag(a.get("weight")) is not None:
        return NotImplemented  # (per model, below)
    m = ctx.num_models
    x, target = a["input"], a["target"]
    sx, st = single_shape(x, m), single_shape(target, m)
    xe, te = explicit(x, m).expand(m, *sx), explicit(target, m).expand(m, *st)
    if len(sx) == 1:  # an unbatched (C,) input: one row per model
        xe, te = xe.unsqueeze(1), te.unsqueeze(1)
    extra = {"label_smoothing": a.get("label_smoothing", 0.0)} if func is F.cross_entropy else {}
    fn = batched_losses.cross_entropy if func is F.cross_entropy else batched_losses.nll_loss
    kwargs = {"weight": a.get("weight"), "ignore_index": a.get("ignore_index", -100), "reduction": a["reduction"]}
    return per_model(fn(xe, te, **kwargs, **extra))


def _elementwise_loss(ctx, func, args, kwargs):
    """Losses that reduce an elementwise ``reduction='none'`` result (mse, l1, BCE, KL, ...): that result for
    all models at once, reduced per model."""
    a = loss_arguments(func, args, kwargs)
    reduction = a["reduction"]
    m = ctx.num_models
    shapes = {k: single_shape(v, m) for k, v in a.items() if isinstance(v, Tensor)}
    if reduction not in ("mean", "sum", "batchmean") or (reduction == "batchmean" and not shapes["input"]):
        return NotImplemented
    ndim = max(len(v) for v in shapes.values())
    for k in shapes:  # each with the models first, then as the one model's shapes broadcast
        e = explicit(a[k], m, ndim)
        a[k] = e.expand(m, *e.shape[1:])
    a["reduction"] = "none"
    if reduction != "batchmean":
        return per_model(batched_losses._reduce(func(**a), reduction))
    return per_model(batched_losses._reduce(func(**a), "sum") / shapes["input"][0])


_MHA_PARAMETERS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


def _multi_head_attention(ctx, func: Callable, args: tuple, kwargs: dict) -> object:
    """``F.multi_head_attention_forward`` (every torch.nn.MultiheadAttention) with per-model weights:
    ``batchlayers.functional.multi_head_attention``, batched matmuls for the projections and one attention call
    over all models' samples. Sequence-first ``(L, M * B, E)`` inputs holding the samples on dimension 1."""
    a = dict(zip(_MHA_PARAMETERS, args))
    a.update(kwargs)
    m = ctx.num_models
    sequences = [a["query"], a["key"], a["value"]]
    if any(get_tag(t) != 1 or t.dim() != 3 for t in sequences) or a.get("static_k") is not None:
        return NotImplemented
    if a.get("static_v") is not None or a["query"].shape[-1] != a["embed_dim_to_check"]:
        return NotImplemented
    padding, mask = a.get("key_padding_mask"), a.get("attn_mask")
    if padding is not None and get_tag(padding) != 0:
        return NotImplemented
    if mask is not None and not (
        (mask.dim() == 2 and get_tag(mask) is None) or (mask.dim() == 3 and get_tag(mask) == 0)
    ):
        return NotImplemented
    weights = ("in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj_weight", "out_proj_bias",
               "q_proj_weight", "k_proj_weight", "v_proj_weight")  # fmt: skip
    if any(a.get(n) is not None and get_tag(a[n]) is not PerModel for n in weights):
        return NotImplemented
    batch_first: dict[int, Tensor] = {}  # one view per distinct input: self-attention stays one projection
    for t in sequences:
        batch_first.setdefault(id(t), explicit(t, m).transpose(1, 2))
    separate = a.get("use_separate_proj_weight", False)
    query, key, value = (batch_first[id(t)] for t in sequences)
    out, attention = _batched_attention(
        query,
        key,
        value,
        a["num_heads"],
        None if separate else a["in_proj_weight"],
        a["in_proj_bias"],
        a["bias_k"],
        a["bias_v"],
        a["add_zero_attn"],
        a["dropout_p"],
        a["out_proj_weight"],
        a["out_proj_bias"],
        training=a.get("training", True),
        key_padding_mask=None if padding is None else explicit(padding, m),
        need_weights=a.get("need_weights", True),
        attn_mask=mask if mask is None or mask.dim() == 2 else explicit(mask, m),
        q_proj_weight=a.get("q_proj_weight") if separate else None,
        k_proj_weight=a.get("k_proj_weight") if separate else None,
        v_proj_weight=a.get("v_proj_weight") if separate else None,
        average_attn_weights=a.get("average_attn_weights", True),
        is_causal=a.get("is_causal", False),
    )
    return refold(out.transpose(1, 2), 1), None if attention is None else refold(attention, 0)


_RECURRENT_MODES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}


def _state_of_samples(h: Tensor, rows: int) -> Tensor | None:
    """An RNN state ``(layers * directions, rows, H)`` as one holding the samples on dimension 1, where the
    input holds ``rows`` samples; None where that is not proven. torch.nn's RNNs make their initial state with
    ``zeros(layers * directions, x.size(batch), H)``: tagged 1 when the batch is the folded one, untagged when
    the input folds more than the models' samples into its batch (``x.reshape(-1, T, C)`` of a feature map),
    tagged 0 when ``layers * directions`` equals the folded size. A state the same for every sample along
    dimension 1 (untagged) or everywhere (tagged elsewhere) gives every model's block of rows exactly the
    value its own model would build."""
    tag = get_tag(h)
    if tag == 1:
        return h
    if tag is PerModel or isinstance(tag, Lost) or h.dim() != 3 or h.shape[1] != rows:
        return None
    same = h[:, :1] if tag is None else h.reshape(-1)[:1].view(1, 1, 1)
    if h.shape[1] > 1 and h.stride(1) != 0 and not torch.equal(h, same.expand_as(h)):
        return None
    state = h.view(h.shape)
    set_tag(state, 1)
    return state


def _recurrent(ctx, func, args, kwargs):
    """``torch.lstm/gru/rnn_tanh/rnn_relu`` (every torch.nn.RNN/LSTM/GRU) with per-model weights:
    ``batchlayers.functional.rnn``, the input projection of all steps one batched GEMM and the recurrence one
    batched GEMM per step for all models. Padded input only (a PackedSequence runs per model)."""
    if kwargs or len(args) != 9 or not isinstance(args[2], (list, tuple)):
        return NotImplemented
    x, hx, params, bias, num_layers, dropout, training, bidirectional, batch_first = args
    m, d = ctx.num_models, 0 if batch_first else 1
    if get_tag(x) != d or x.dim() != 3:
        return NotImplemented
    states = [_state_of_samples(h, x.shape[d]) for h in (hx if isinstance(hx, (list, tuple)) else [hx])]
    if any(h is None for h in states):
        return NotImplemented
    if not params or any(get_tag(p) is not PerModel for p in params):
        return NotImplemented
    directions = 2 if bidirectional else 1
    per_direction = len(params) // (num_layers * directions)
    projected = per_direction == 3 + 2 * bool(bias)  # w_ih, w_hh, [b_ih, b_hh], w_hr (M, proj_size, H)
    proj_size = params[per_direction - 1].shape[1] if projected else 0
    mode = _RECURRENT_MODES[func.__name__]
    h0 = tuple(explicit(h, m) for h in states)
    out, state = _batched_rnn(
        mode,
        explicit(x, m),
        h0 if mode == "LSTM" else h0[0],
        list(params),
        num_layers=num_layers,
        bias=bias,
        batch_first=batch_first,
        dropout=dropout,
        training=training,
        bidirectional=bidirectional,
        proj_size=proj_size,
    )
    states_out = state if mode == "LSTM" else (state,)
    return (refold(out, d), *(refold(h, 1) for h in states_out))


# ----------------------------------------------------------------------------------------------------------
# Everything else: per model


# Checks that only decide whether an optimisation may be taken, where one answer is right for every input:
# transformers skips building an attention mask when a model's padding mask is all ones (SDPA's is_causal or
# no mask instead); building it is right for any mask. Where the models answer differently, a stacked
# forward takes that answer for all of them instead of refusing. (file suffix, function) -> the answer.
_CONSERVATIVE = {
    ("transformers/masking_utils.py", "_ignore_causal_mask_sdpa"): False,
    ("transformers/masking_utils.py", "_ignore_bidirectional_mask_sdpa"): False,
    ("transformers/masking_utils.py", "_can_skip_bidirectional_mask_xpu"): False,
}


def _conservative_answer(func: Callable, outs: list) -> bool | None:
    """The answer every model may take where the models' ``bool()`` answers differ inside a check of
    :data:`_CONSERVATIVE` (the nearest caller frames), else None."""
    if func is not Tensor.__bool__ or not all(isinstance(o, bool) for o in outs):
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        code = frame.f_code
        for (suffix, function), answer in _CONSERVATIVE.items():
            if code.co_name == function and code.co_filename.replace(os.sep, "/").endswith(suffix):
                return answer
        frame = frame.f_back
    return None


def _per_model_loop(ctx, func, args, kwargs):
    m = ctx.num_models
    name = _name(func)
    out = kwargs.get("out")  # (F.normalize, torch.norm pass out=None)
    inplace = func in _INPLACE_FUNCS or func is Tensor.__setitem__ or out is not None
    target = out if out is not None else args[0] if args else None
    if inplace and isinstance(target, Tensor) and get_tag(target) is None:
        raise ValueError(f"{name} inside a stacked forward writes per-model values into a tensor all models share")
    if inplace and getattr(func, "__name__", "") in _RESHAPES_IN_PLACE:
        raise ValueError(
            f"batchlayers: {name} inside a stacked forward changes the shape of a per-model value (a parameter, "
            "buffer or a value computed from one) in place, which its (M, *) storage cannot follow. Use the "
            f"out-of-place {name.rstrip('_').split('.')[-1]}, or stack with execution='model_by_model'"
        )
    samples = any(isinstance(t, int) for t in _all_tags(args, kwargs))
    rule = _RULES.get(func)
    if samples and rule is None:
        raise ValueError(
            f"{name} inside a stacked forward combines a per-model value with the models' samples, and "
            "batchlayers has no rule saying where the samples go in its result"
        )
    parts, outs = [], []
    for i in range(m):  # (each model's views made after the previous model's write: see the note below)
        a, k = tuple(_part(v, i, m) for v in args), {key: _part(v, i, m) for key, v in kwargs.items()}
        parts.append((a, k))
        outs.append(func(*a, **k))
    # A view made before an in-place write with gradients into another view of the same tensor would be a view
    # of a leaf that does not require grad, which autograd then rejects ("a leaf Variable that requires grad is
    # being used in an in-place operation"): an exponential moving average of x.mean(0) with x requiring grad.
    if inplace:
        return target
    first = outs[0]
    if not _has_tensor(first):
        if any(not _equal(o, first) for o in outs[1:]):
            answer = _conservative_answer(func, outs)
            if answer is not None:
                return answer
            other = next(o for o in outs if not _equal(o, first))
            raise ValueError(
                f"{name} inside a stacked forward gives different results for different models ({outs[0]!r} for "
                f"model 0, {other!r} for another); Python code that branches on per-model values cannot run for "
                "all models at once"
            )
        return first
    if samples:
        block = _block_size(args, kwargs, m)
        one = SimpleNamespace(num_models=1, folded=block, folded_sizes=(block,), size_read=False)
        first_args, first_kwargs = parts[0]
        tagged = _tagged(first_args, first_kwargs)
        rule.rule(one, rule.name, first_args, first_kwargs, first, tagged)
        # With one model nothing mixes models: an op that the rule refuses for mixing the samples (a batch
        # norm in training mode, a softmax over the batch) keeps them where its input had them, if it keeps
        # the input's shape. Any dimension holding each model's block of rows is exact; this one keeps the
        # architecture's view of the batch.
        for o in _outputs(first):
            lost = get_tag(o)
            if isinstance(lost, Lost):
                same = next((i for i in tagged if isinstance(i.tag, int) and i.shape == o.shape), None)
                if same is not None:
                    set_tag(o, same.tag)
    return _join(first, outs, name)


def _equal(a: object, b: object) -> bool:
    """``a == b`` for what a call on one model's values returns: numbers, tuples, numpy arrays (``.numpy()``,
    ``.tolist()`` of a per-model value), compared whole."""
    try:
        return bool(a == b)
    except (ValueError, RuntimeError):  # (an array's == is elementwise)
        same_shape = getattr(a, "shape", None) == getattr(b, "shape", None)
        elementwise: Any = a == b
        return type(a) is type(b) and same_shape and bool(elementwise.all())


def _has_tensor(out: object) -> bool:
    return isinstance(out, Tensor) or (isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out))


def _join(first: Tensor | tuple | list, outs: list, name: str) -> object:
    if isinstance(first, Tensor):
        return _join_one(outs, name)
    items = [_join_one([o[j] for o in outs], name) if isinstance(first[j], Tensor) else first[j]
             for j in range(len(first))]  # fmt: skip
    return type(first)(items)  # a tuple, list or torch.return_types (max, sort, ...)


def _join_one(outs: list[Tensor], name: str) -> Tensor:
    tag = get_tag(outs[0])
    shapes = {tuple(o.shape) if not isinstance(tag, int) else tuple(o.shape[:tag] + o.shape[tag + 1 :]) for o in outs}
    if len(shapes) > 1:  # (h[:, w.sum(0) > 0]: a mask of each model's own selects its own number of columns)
        raise ValueError(
            f"batchlayers: {name} inside a stacked forward gives results of different shapes for different models "
            f"({', '.join(str(tuple(o.shape)) for o in outs[:3])}{', ...' if len(outs) > 3 else ''}), which cannot "
            "be held in one tensor. Stack with execution='model_by_model'"
        )
    if isinstance(tag, int):
        out = torch.cat(outs, dim=tag)
        set_tag(out, tag)
        return out
    if isinstance(tag, Lost):
        raise ValueError(
            f"{name} inside a stacked forward combines a per-model value with the models' samples by "
            f"{tag.reason}; batchlayers cannot tell which rows of the result are each model's"
        )
    return per_model(torch.stack(outs))


def _part(obj: object, i: int, m: int) -> object:
    """Model ``i``'s part of an argument."""
    if isinstance(obj, Tensor):
        tag = get_tag(obj)
        if tag is PerModel:
            part = obj[i]
            # model i's own value, made here: to the rule that tags the call's result (the call is model i's
            # alone), a value the tracker saw, not code it never saw (see batchlayers._provenance.untracked)
            part._batchlayers_seen = True  # type: ignore[attr-defined]  # (syntax: see set_tag)
            return part
        if isinstance(tag, int):
            n = obj.shape[tag] // m
            block = obj.narrow(tag, i * n, n)
            set_tag(block, tag)
            return block
        return obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_part(o, i, m) for o in obj)
    return obj


def _block_size(args, kwargs, m: int) -> int:
    for t in _flat(args, kwargs):
        tag = get_tag(t)
        if isinstance(tag, int):
            return t.shape[tag] // m
    return 0


# ----------------------------------------------------------------------------------------------------------
# The table


class _WritesInPlace:
    """``func in _INPLACE_FUNCS``: whether ``func`` writes into its first argument (or ``out=``). By name, as
    torch names them (``mul_``, ``index_fill_``, ``__iadd__``), so that no in-place op is taken for one that
    returns a new tensor (the loop's results are joined by a copy, which a chained ``v.mul_(2).add_(1)`` would
    then write into instead of ``v``)."""

    def __init__(self, known: set) -> None:
        self._known = dict.fromkeys(known, True)

    def __contains__(self, func: object) -> bool:
        found = self._known.get(func)
        if found is None:
            found = self._known[func] = in_place_name(getattr(func, "__name__", ""))
        return found


_SET_DATA = Tensor.data.__set__  # type: ignore[attr-defined]  # (a method-wrapper: compared with ==)
_INPLACE_FUNCS = _WritesInPlace(
    {fn for n in _INPLACE.split() for owner in (torch, Tensor) if callable(fn := getattr(owner, n, None))}
)
# in-place ops that change a tensor's shape or storage, not its values: a per-model view cannot pass them on
_RESHAPES_IN_PLACE = frozenset(
    "unsqueeze_ squeeze_ t_ transpose_ swapaxes_ swapdims_ resize_ resize_as_ as_strided_ set_".split()
)
_FAST: dict[Callable, Callable] = {}

_ELEMENTWISE_FAST = """
add sub subtract mul multiply div divide true_divide pow where maximum minimum lerp addcmul addcdiv
eq ne lt le gt ge __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ __rpow__
__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __neg__ neg exp log sqrt rsqrt sigmoid tanh relu abs square reciprocal
add_ sub_ mul_ div_ __iadd__ __isub__ __imul__ __itruediv__ copy_
"""
_UNARY_FAST = "contiguous clone detach to type float double half bfloat16 long int bool"


def _register(handler: Callable, names: str) -> None:
    for n in names.split():
        for owner in (torch, Tensor, F):
            fn = getattr(owner, n, None)
            if callable(fn):
                _FAST.setdefault(fn, handler)


def _unary(ctx, func, args, kwargs):
    if get_tag(args[0]) is not PerModel or _flat(args[1:], kwargs):
        return NotImplemented
    return per_model(func(*args, **kwargs))


_register(_elementwise, _ELEMENTWISE_FAST)
_register(_unary, _UNARY_FAST)
_register(_on_stored(_reshape), "reshape")
_register(_on_stored(_view), "view")
_register(_on_stored(_flatten), "flatten")
_register(_on_stored(_dim_op("unflatten")), "unflatten")
_register(_on_stored(lambda t, s, dim: t.unsqueeze(_norm(dim, len(s) + 1) + 1)), "unsqueeze")
_register(_on_stored(_squeeze), "squeeze")
_register(_on_stored(_permute), "permute")
_register(_on_stored(_transpose), "transpose swapaxes swapdims")
_register(_on_stored(_t), "t")
_register(_on_stored(_dim_op("select")), "select")
_register(_on_stored(_dim_op("narrow")), "narrow")
_register(_on_stored(_dim_op("split", 1, 0)), "split")
_register(_on_stored(_dim_op("chunk", 1, 0)), "chunk")
_register(_on_stored(_dim_op("unbind", 0, 0)), "unbind")
_register(_on_stored(_dim_op("softmax")), "softmax")
_register(_on_stored(_dim_op("log_softmax")), "log_softmax")
_register(_on_stored(_dim_op("cumsum")), "cumsum")
for _method in ("sum", "mean", "amax", "amin", "nansum", "logsumexp", "all", "any", "std", "var"):
    _register(_on_stored(_reduce(_method)), _method)
# .data of a parameter or buffer: the stored tensor's own, so that a write through it (weight clipping,
# data-dependent initialisation) reaches every model's slice as it reaches the original's
_FAST[_getter("data")] = _unary


def _grad(ctx, func, args, kwargs):
    """``p.grad``: the stored ``(M, *)`` gradient, each model's slice its own (``None`` before a backward); each
    model's view of it would be a non-leaf's, whose ``.grad`` torch warns about and leaves ``None``."""
    grad = func(*args, **kwargs)
    return grad if grad is None else per_model(grad)


_FAST[_getter("grad")] = _grad
_FAST[Tensor.__getitem__] = _on_stored(_index)
_FAST[_getter("mT")] = _on_stored(lambda t, s: t.mT if len(s) >= 2 else NotImplemented)
_FAST[_getter("T")] = _on_stored(lambda t, s: t.permute(0, *range(t.dim() - 1, 0, -1)))
_FAST[F.linear] = _linear
_FAST[torch.broadcast_tensors] = _broadcast_tensors
_FAST[torch._is_all_true] = _on_stored(lambda t, s: t.reshape(t.shape[0], s.numel()).all(1))
_FAST[torch.addmm] = _addmm
_FAST[torch.einsum] = _einsum
for _product in (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, Tensor.mm, torch.bmm, Tensor.bmm):
    _FAST[_product] = _matmul
del _product
_FAST[F.layer_norm] = _affine_norm(F.layer_norm, ("weight", "bias"), None)
_FAST[F.rms_norm] = _affine_norm(F.rms_norm, ("weight",), None)
_FAST[F.group_norm] = _affine_norm(F.group_norm, ("weight", "bias"), 1)
_FAST[F.cross_entropy] = _FAST[F.nll_loss] = _class_loss
_FAST[F.multi_head_attention_forward] = _multi_head_attention
for _name_ in _RECURRENT_MODES:
    _FAST[getattr(torch, _name_)] = _recurrent
for _name_ in "mse_loss l1_loss smooth_l1_loss huber_loss soft_margin_loss kl_div".split():
    _FAST[getattr(F, _name_)] = _elementwise_loss
_FAST[F.binary_cross_entropy] = _FAST[F.binary_cross_entropy_with_logits] = _elementwise_loss
del _method, _name_


_EXPANDS: dict[Callable, str] = {Tensor.expand: "expand", Tensor.broadcast_to: "expand", torch.broadcast_to: "expand",
            Tensor.repeat: "repeat", Tensor.tile: "tile", torch.tile: "tile"}  # fmt: skip


def _expand_fast(ctx, func, args, kwargs):
    if kwargs:
        return NotImplemented
    return _on_stored(_expand(ctx, _EXPANDS[func]))(ctx, func, args, kwargs)


for _fn in _EXPANDS:
    _FAST[_fn] = _expand_fast
# calls on a per-model value that may take the size of the samples, B = x.size(0) (see _refuse_folded_sizes)
_TAKES_THE_FOLDED_SIZE = {*_EXPANDS, *_PASS, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_empty}
for _fn in (Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_empty):
    _FAST[_fn] = _new_tensor
del _fn
