from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._utils import _fmt, check_call_input, check_weight, function_transform_active, no_function_transforms

__all__ = ["embedding", "embedding_bag"]


class _FlatTable(torch.autograd.Function):
    """``(M, num, dim) -> (M * num, dim)`` whose backward also accepts a sparse gradient.

    A plain ``view`` cannot carry the sparse gradient of ``F.embedding(..., sparse=True)`` back to the
    3-D parameter (reshape is not implemented for sparse tensors); this turns the flat row index of each
    gradient entry back into a ``(model, row)`` pair, giving a hybrid COO gradient of the parameter's shape.
    """

    @staticmethod
    def forward(weight: Tensor) -> Tensor:
        return weight.reshape(-1, weight.shape[-1])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.table_shape = inputs[0].shape

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        if not grad.is_sparse:
            return grad.reshape(ctx.table_shape)
        num_embeddings = ctx.table_shape[1]
        flat_rows = grad._indices()[0]
        model_and_row = torch.stack(
            [flat_rows.div(num_embeddings, rounding_mode="floor"), flat_rows.remainder(num_embeddings)]
        )
        return torch.sparse_coo_tensor(model_and_row, grad._values(), ctx.table_shape, check_invariants=False)


class _PaddedLookup(torch.autograd.Function):
    """``table.index_select(0, flat_index)`` whose gradient skips the positions that look up a padding row.

    Every model has its own padding row, so no single ``padding_idx`` of torch's kernels fits the flat table.
    The backward accumulates into one scratch row past the end of the table instead (``grad_index`` points
    padding positions there) and drops it: measured up to 2x faster on CPU than cutting the gradient with a
    ``torch.where`` over the whole output.
    """

    @staticmethod
    def forward(table: Tensor, flat_index: Tensor, grad_index: Tensor) -> Tensor:
        return table.index_select(0, flat_index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        table, _, grad_index = inputs
        ctx.save_for_backward(grad_index)
        ctx.num_rows = table.shape[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (grad_index,) = ctx.saved_tensors
        grad_table = grad.new_zeros(ctx.num_rows + 1, grad.shape[-1]).index_add_(0, grad_index, grad)
        return grad_table[:-1], None, None


class _FrequencyScaledTable(torch.autograd.Function):
    """Identity on the flat ``(M * num, dim)`` table whose backward scales each row's gradient like
    ``scale_grad_by_freq`` in torch's CPU ``embedding_bag`` kernel, run on each model's ``(n,)`` indices alone.

    That kernel sorts the indices and scales the gradient of the ``i``-th distinct index by ``1 / count`` of
    the ``i``-th *sorted* index (``counts[indices_data[i]]`` in ``_embedding_bag_dense_backward_cpu_sum_mean``),
    which is not always the index's own count. Rows of different models never share an index, so sorting all
    models' flat indices sorts each model's on its own, laid end to end.
    """

    @staticmethod
    def forward(table: Tensor, index: Tensor, num_embeddings: int) -> Tensor:
        return table.view_as(table)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[1])
        ctx.num_embeddings = inputs[2]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (index,) = ctx.saved_tensors
        num_models = index.shape[0]
        sorted_index = index.sort(dim=1).values  # (M, n): each model's indices sorted
        counts = torch.bincount(sorted_index.reshape(-1), minlength=grad.shape[0])
        rows = torch.unique_consecutive(sorted_index.reshape(-1))  # distinct rows, model by model
        model = rows.div(ctx.num_embeddings, rounding_mode="floor")
        groups = torch.bincount(model, minlength=num_models)
        rank = torch.arange(rows.numel(), device=rows.device) - (groups.cumsum(0) - groups)[model]
        scale = grad.new_zeros(grad.shape[0])
        scale[rows] = counts[sorted_index[model, rank]].to(grad.dtype).reciprocal()
        return grad * scale.unsqueeze(1), None, None


# Traced as opaque ops: torch.compile then sees the real (sparse) gradient reach _FlatTable's backward, and
# dynamo's own tracing of autograd.Function, which warns (DeprecationWarning) in this torch, is not used.
torch.compiler.allow_in_graph(_FlatTable)
torch.compiler.allow_in_graph(_PaddedLookup)
torch.compiler.allow_in_graph(_FrequencyScaledTable)


def _flat_indices(input: Tensor, num_models: int, num_embeddings: int) -> Tensor:
    """Model ``m``'s index ``i`` -> row ``m * num_embeddings + i`` of the flat ``(M * num, dim)`` table.

    An index outside ``[0, num_embeddings)`` would land in a neighbouring model's rows; it is sent past the end
    of the flat table instead, so the lookup's own bounds check raises (eager, compiled, any device).
    """
    offsets = torch.arange(num_models, device=input.device).mul_(num_embeddings)
    offsets = offsets.view(num_models, *([1] * (input.dim() - 1)))
    in_range = (input >= 0) & (input < num_embeddings)
    return torch.where(in_range, input + offsets, num_models * num_embeddings)


_INDEX_DTYPES = (torch.int64, torch.int32)


def check_index_range(name: str, input: Tensor, num_embeddings: int) -> None:
    """Raise an ``IndexError`` naming ``name``, the model and the index for an index outside ``[0, num_embeddings)``.

    The lookup itself can never read another model's rows; this only gives a clearer message where the check costs
    no device synchronisation and no graph break (CPU, eager).
    """
    if input.device.type != "cpu" or torch.compiler.is_compiling() or function_transform_active():
        return  # (under a torch.func transform the values cannot be read)
    out_of_range = (input < 0) | (input >= num_embeddings)
    if out_of_range.any():
        position = tuple(out_of_range.nonzero()[0].tolist())
        raise IndexError(
            f"{name}: index {input[position].item()} at position {position} (model {position[0]}) "
            f"is out of range: expected 0 <= index < num_embeddings={num_embeddings}"
        )


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """Look up model ``m``'s indices ``input[m]`` in model ``m``'s table ``weight[m]``, for every model at once.

    Same options as :func:`torch.nn.functional.embedding`, each applied per model: ``padding_idx`` rows get
    no gradient in any model, ``max_norm`` renormalises the looked-up rows of ``weight`` in place,
    ``scale_grad_by_freq`` counts frequencies per model, ``sparse`` gives a sparse COO gradient of
    ``weight``'s shape. An index outside ``[0, num_embeddings)`` raises ``IndexError``.

    Args:
        input: ``(M, *)`` integer indices (``torch.int64`` or ``torch.int32``); a shared batch may be a
            stride-0 expand.
        weight: ``(M, num_embeddings, embedding_dim)``.

    Returns:
        ``(M, *, embedding_dim)``.
    """
    function = "batchlayers.functional.embedding"
    num_models, num_embeddings, _ = check_weight(function, "weight", weight, 3, "(M, num_embeddings, embedding_dim)")
    check_call_input(function, input, num_models, min_ndim=1, what="indices", layout="(M, *)")
    if input.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{function}: expected integer indices (torch.int64 or torch.int32), got {input.dtype}")
    if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{function}: padding_idx must be within num_embeddings={num_embeddings} "
            f"(-{num_embeddings} <= padding_idx < {num_embeddings}), got {padding_idx}"
        )
    check_index_range(function, input, num_embeddings)
    return lookup(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


def lookup(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
) -> Tensor:
    """:func:`embedding` without its checks (the layer checks its input itself)."""
    num_models, num_embeddings, embedding_dim = weight.shape
    if padding_idx is not None and padding_idx < 0:
        padding_idx += num_embeddings
    flat_index = _flat_indices(input, num_models, num_embeddings)
    if max_norm is not None:
        if not weight.is_contiguous():
            raise ValueError("embedding: max_norm renormalises weight in place and needs a contiguous weight")
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach().view(-1, embedding_dim), flat_index, max_norm, norm_type)
    if padding_idx is not None and not no_function_transforms():
        # Under a torch.func transform or forward-mode AD (the Function below has no vmap or jvp rule, and cutting
        # the gradient with torch.where would cut the tangent too): model by model, torch's own padding.
        return torch.stack(
            [
                F.embedding(input[m], weight[m], padding_idx, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
                for m in range(num_models)
            ]
        )
    table_rows = num_models * num_embeddings
    if sparse or scale_grad_by_freq:
        # Frequencies of flat rows are frequencies per model, so torch's own kernel gets them right.
        table = _FlatTable.apply(weight) if sparse else weight.reshape(table_rows, embedding_dim)
        out = F.embedding(flat_index, table, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        if padding_idx is not None:
            # torch's kernel takes one padding row, the flat table has one per model: cut the gradient at the
            # padding positions instead; the values are unchanged.
            out = torch.where((input == padding_idx).unsqueeze(-1), out.detach(), out)
        return out
    # index_select's backward (index_add) measured 2-3.5x faster than F.embedding's on CPU for small tables.
    table = weight.reshape(table_rows, embedding_dim)
    flat_index = flat_index.reshape(-1)
    if padding_idx is None:
        out = table.index_select(0, flat_index)
    else:
        grad_index = torch.where(input.reshape(-1) == padding_idx, table_rows, flat_index)
        out = _PaddedLookup.apply(table, flat_index, grad_index)
    return out.view(*input.shape, embedding_dim)


_BAG_MODES = ("sum", "mean", "max")


def check_embedding_bag_arguments(
    name: str,
    weight: Tensor,
    input: object,
    offsets: object,
    per_sample_weights: object,
    mode: str,
    include_last_offset: bool,
) -> None:
    """Raise, naming ``name``, unless the arguments have the layouts :func:`embedding_bag` takes.

    On CPU in eager mode the offsets' values are checked as well (each model's first bag starts at 0, offsets
    never decrease, none exceeds the model's number of indices); elsewhere that would cost a synchronisation
    or a graph break, and :func:`embedding_bag` clamps them so that a bag never holds another model's indices.
    """
    num_models = weight.shape[0]
    if mode not in _BAG_MODES:
        raise ValueError(f"{name}: mode must be 'sum', 'mean' or 'max', got {mode!r}")
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: expected the indices to be a Tensor, got {type(input).__name__}")
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected integer indices (torch.int64 or torch.int32), got {input.dtype}")
    if offsets is None:
        if input.dim() != 3:
            hint = "; (M, N) indices (each model's bags laid end to end) need offsets" if input.dim() == 2 else ""
            raise ValueError(
                f"{name}: expected indices (M, B, bag) with M={num_models} (fixed-size bags), got {input.dim()}-D "
                f"shape {_fmt(input.shape)}{hint}"
            )
        if input.shape[2] == 0:
            raise ValueError(
                f"{name}: got bags of size 0 (indices of shape {_fmt(input.shape)}), which torch.nn.EmbeddingBag "
                "refuses as well; give empty bags with (M, N) indices and offsets"
            )
    else:
        if input.dim() == 3:
            raise ValueError(
                f"{name}: (M, B, bag) indices are fixed-size bags, so offsets must be None, as in "
                f"torch.nn.EmbeddingBag; got offsets of type {type(offsets).__name__}"
            )
        if input.dim() != 2:
            raise ValueError(
                f"{name}: expected indices (M, N) with M={num_models} and offsets (M, B), got {input.dim()}-D "
                f"shape {_fmt(input.shape)}"
            )
    if input.shape[0] != num_models:
        raise ValueError(
            f"{name}: expected indices with M={num_models} models on dimension 0, but dimension 0 (models) is "
            f"{input.shape[0]}, not {num_models}: shape {_fmt(input.shape)}"
        )
    if offsets is not None:
        _check_offsets(name, offsets, num_models, input.shape[1], include_last_offset)
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(
                f"{name}: per_sample_weights is only supported for mode='sum' (got mode={mode!r}), as in "
                "torch.nn.EmbeddingBag"
            )
        if not isinstance(per_sample_weights, Tensor):
            raise TypeError(
                f"{name}: expected per_sample_weights to be a Tensor, got {type(per_sample_weights).__name__}"
            )
        if per_sample_weights.shape != input.shape:
            raise ValueError(
                f"{name}: per_sample_weights must have the indices' shape {_fmt(input.shape)}, got "
                f"{_fmt(per_sample_weights.shape)}"
            )
        if per_sample_weights.dtype != weight.dtype:
            raise TypeError(
                f"{name}: per_sample_weights must have the weight's dtype {weight.dtype}, got "
                f"{per_sample_weights.dtype}"
            )


def _check_offsets(name: str, offsets: object, num_models: int, num_inputs: int, include_last_offset: bool) -> None:
    if not isinstance(offsets, Tensor):
        raise TypeError(f"{name}: expected offsets to be a Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected integer offsets (torch.int64 or torch.int32), got {offsets.dtype}")
    bags = "(M, B + 1) (include_last_offset=True)" if include_last_offset else "(M, B)"
    if offsets.dim() != 2 or offsets.shape[0] != num_models or (include_last_offset and offsets.shape[1] == 0):
        hint = ""
        if offsets.dim() != 2:
            hint = (
                "; in a model stacked by batchlayers, 1-D indices with offsets cannot be split among the models: "
                "use 2-D (B, bag) indices (fixed-size bags) there"
            )
        raise ValueError(
            f"{name}: expected offsets {bags} with M={num_models}, one row of bag starts per model, got shape "
            f"{_fmt(offsets.shape)}{hint}"
        )
    if offsets.device.type != "cpu" or torch.compiler.is_compiling() or offsets.numel() == 0:
        return
    first = offsets[:, 0]
    if (first != 0).any():
        m = int((first != 0).nonzero()[0, 0])
        raise ValueError(
            f"{name}: offsets[{m}, 0] is {int(first[m])}: each model's first bag must start at position 0 of its "
            "indices, as in torch.nn.EmbeddingBag"
        )
    decreasing = offsets[:, 1:] < offsets[:, :-1]
    if decreasing.any():
        m, j = (int(i) for i in decreasing.nonzero()[0])
        raise ValueError(
            f"{name}: offsets of model {m} decrease at position {j + 1}: {int(offsets[m, j])} then "
            f"{int(offsets[m, j + 1])}"
        )
    last = offsets[:, -1]
    if (last > num_inputs).any():
        m = int((last > num_inputs).nonzero()[0, 0])
        raise ValueError(
            f"{name}: offsets[{m}, -1] is {int(last[m])}, more than the model's number of indices N={num_inputs}"
        )


def embedding_bag(
    input: Tensor,
    weight: Tensor,
    offsets: Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> Tensor:
    """Sums, means or maxima of bags of model ``m``'s rows ``weight[m]``, for every model at once.

    Same arguments as :func:`torch.nn.functional.embedding_bag`, each applied per model: ``padding_idx``
    entries are left out of their bags (and of the count of a mean) in every model and its row gets no
    gradient, ``max_norm`` renormalises the looked-up rows of ``weight`` in place, ``scale_grad_by_freq``
    counts frequencies per model, ``sparse`` gives a sparse COO gradient of ``weight``'s shape. An empty bag
    gives zeros. All models' bags are computed by one :func:`torch.nn.functional.embedding_bag` over the
    tables laid end to end.

    Args:
        input: either ``(M, B, bag)`` integer indices, ``B`` bags of ``bag`` indices per model (``offsets``
            ``None``), or ``(M, N)``: each model's bags laid end to end, cut by ``offsets``. A shared batch
            may be a stride-0 expand.
        weight: ``(M, num_embeddings, embedding_dim)``.
        offsets: ``(M, B)`` start of each bag in the model's ``N`` indices (each row starting at 0), or
            ``(M, B + 1)`` with ``include_last_offset`` (the last at most ``N``; as in torch's kernels the
            last bag runs to the end of the model's indices whatever it is).
        per_sample_weights: shaped like ``input``, ``mode='sum'`` only.

    Returns:
        ``(M, B, embedding_dim)``.
    """
    function = "batchlayers.functional.embedding_bag"
    num_embeddings = check_weight(function, "weight", weight, 3, "(M, num_embeddings, embedding_dim)")[1]
    check_embedding_bag_arguments(function, weight, input, offsets, per_sample_weights, mode, include_last_offset)
    if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{function}: padding_idx must be within num_embeddings={num_embeddings} "
            f"(-{num_embeddings} <= padding_idx < {num_embeddings}), got {padding_idx}"
        )
    return _embedding_bag(
        input,
        weight,
        offsets,
        max_norm,
        norm_type,
        scale_grad_by_freq,
        mode,
        sparse,
        per_sample_weights,
        include_last_offset,
        padding_idx,
    )


def _embedding_bag(
    input: Tensor,
    weight: Tensor,
    offsets: Tensor | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    mode: str,
    sparse: bool,
    per_sample_weights: Tensor | None,
    include_last_offset: bool,
    padding_idx: int | None,
) -> Tensor:
    """:func:`embedding_bag` on arguments already checked."""
    num_models, num_embeddings, embedding_dim = weight.shape
    if padding_idx is not None and padding_idx < 0:
        padding_idx += num_embeddings
    flat_index = _flat_indices(input, num_models, num_embeddings)
    if max_norm is not None:
        # As torch.nn: every index given is renormalised, padding included.
        if not weight.is_contiguous():
            raise ValueError("embedding_bag: max_norm renormalises weight in place and needs a contiguous weight")
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach().view(-1, embedding_dim), flat_index, max_norm, norm_type)
    table = _FlatTable.apply(weight) if sparse else weight.reshape(num_models * num_embeddings, embedding_dim)
    if scale_grad_by_freq and weight.device.type == "cpu" and not sparse and mode != "max":
        # torch's CPU kernel scales the gradient of its i-th distinct index (in sorted order) by the frequency
        # of its i-th sorted index, not by its own: scaling in the kernel over all models at once would mix the
        # models' counts. The table's backward applies each model's own scaling instead. (Elsewhere the kernels
        # count each row's own frequency, and the rows of the flat table are per model; sparse and max raise
        # as in torch.nn.)
        table = _FrequencyScaledTable.apply(table, flat_index.reshape(num_models, -1), num_embeddings)
        scale_grad_by_freq = False
    if padding_idx is not None:
        # torch's kernel takes one padding row, the flat table has one per model: every model's padding entries
        # are pointed at model 0's padding row, which the kernel then leaves out of the bags (values, mean counts,
        # maxima) without reading it, and which gets no gradient. The other models' padding rows are never
        # looked up, so they get none either.
        flat_index = torch.where(input == padding_idx, padding_idx, flat_index)
    if offsets is None:
        _, batch, bag = input.shape
        rows = num_models * batch
        weights = None if per_sample_weights is None else per_sample_weights.reshape(rows, bag)
        out = F.embedding_bag(
            flat_index.reshape(rows, bag),
            table,
            scale_grad_by_freq=scale_grad_by_freq,
            mode=mode,
            sparse=sparse,
            per_sample_weights=weights,
            padding_idx=padding_idx,
        )
        return out.view(num_models, batch, embedding_dim)

    num_inputs = input.shape[1]
    # torch's kernels end the last bag at the end of the indices, whatever the last offset with
    # include_last_offset (which only has to be at most N): the last offset is not needed.
    num_bags = offsets.shape[1] - int(include_last_offset)
    bounds = offsets[:, :num_bags].to(torch.int64)
    if num_bags == 0:
        # The kernel needs a bag: one of all the model's indices, dropped from the output.
        bounds = bounds.new_zeros(num_models, 1)
    # Model m's bag starts, shifted by m * N into the concatenated indices: its last bag ends where model m + 1's
    # indices begin. Clamped, with each model's first bag starting at its first index: whatever the offsets, a
    # bag never holds another model's indices (on CPU in eager mode, bad offsets were refused before).
    bounds = torch.cat([bounds.new_zeros(num_models, 1), bounds[:, 1:].clamp(0, num_inputs)], dim=1)
    starts = torch.arange(num_models, device=bounds.device).mul_(num_inputs).unsqueeze(1)
    out = F.embedding_bag(
        flat_index.reshape(-1),
        table,
        (bounds + starts).reshape(-1),
        scale_grad_by_freq=scale_grad_by_freq,
        mode=mode,
        sparse=sparse,
        per_sample_weights=None if per_sample_weights is None else per_sample_weights.reshape(-1),
        padding_idx=padding_idx,
    )
    return out.view(num_models, bounds.shape[1], embedding_dim)[:, :num_bags]
