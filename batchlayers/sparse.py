"""Batched counterparts of ``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag``."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import init

from ._utils import _fmt, check_input, check_num_models, check_size, init_per_model_, layer_name
from .functional._embedding import _embedding_bag, check_embedding_bag_arguments, check_index_range, lookup

__all__ = ["BatchedEmbedding", "BatchedEmbeddingBag"]

_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_index_range(layer: BatchedEmbedding | BatchedEmbeddingBag, input: Tensor) -> None:
    check_index_range(layer_name(layer), input, layer.num_embeddings)


def _padding_idx_within(layer: nn.Module, padding_idx: int | None, num_embeddings: int) -> int | None:
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{type(layer).__name__}: padding_idx must be within num_embeddings={num_embeddings} "
            f"(-{num_embeddings} <= padding_idx < {num_embeddings}), got {padding_idx}"
        )
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


class _EmbeddingTable(nn.Module):
    """What both batched embedding layers hold: the ``(M, num_embeddings, embedding_dim)`` table, each model's
    initialised as torch's, with its padding row zeroed."""

    num_models: int
    num_embeddings: int
    embedding_dim: int
    padding_idx: int | None
    weight: nn.Parameter

    def _make_weight(self, _weight: Tensor | None, requires_grad: bool, factory_kwargs: dict) -> None:
        shape = (self.num_models, self.num_embeddings, self.embedding_dim)
        if _weight is None:
            self.weight = nn.Parameter(torch.empty(shape, **factory_kwargs), requires_grad=requires_grad)
            self.reset_parameters()
            return
        if not isinstance(_weight, Tensor) or _weight.shape != shape:
            got = _fmt(_weight.shape) if isinstance(_weight, Tensor) else type(_weight).__name__
            raise ValueError(
                f"{type(self).__name__}: expected _weight of shape (M, num_embeddings, embedding_dim) = "
                f"{_fmt(shape)}, got {got}"
            )
        self.weight = nn.Parameter(_weight, requires_grad=requires_grad)

    def reset_parameters(self) -> None:
        init_per_model_(self.weight, init.normal_)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[:, self.padding_idx].fill_(0)


class BatchedEmbedding(_EmbeddingTable):
    r"""``num_models`` independent :class:`torch.nn.Embedding` lookup tables, used together.

    Model ``m``'s indices look up rows of model ``m``'s table only; all models are served by one lookup in
    the tables laid end to end.

    Args:
        num_models: number of models ``M``.
        num_embeddings: size of each model's dictionary of embeddings.
        embedding_dim: size of each embedding vector ``H``.
        padding_idx: if given, row ``padding_idx`` of every model's table gets no gradient and starts as
            zeros. Negative values count from the end, as in torch.nn. Default: ``None``.
        max_norm: if given, every looked-up row whose ``norm_type``-norm exceeds ``max_norm`` is
            renormalised to ``max_norm`` in place in ``weight``, per model. Default: ``None``.
        norm_type: the p of the p-norm for ``max_norm``. Default: ``2.0``.
        scale_grad_by_freq: scale gradients by the inverse frequency of each index in the mini-batch,
            counted per model. Default: ``False``.
        sparse: if ``True``, ``weight.grad`` is a sparse COO tensor of shape ``(M, num_embeddings,
            embedding_dim)`` (2 sparse dims: model and row, 1 dense dim), usable like torch.nn.Embedding's
            by :class:`torch.optim.SGD`, :class:`torch.optim.SparseAdam` and :class:`torch.optim.Adagrad`.
            As in torch.nn, it cannot be combined with ``scale_grad_by_freq`` (backward raises).
            Default: ``False``.
        _weight: an ``(M, num_embeddings, embedding_dim)`` tensor to use as the weight, as in torch.nn
            (not initialised, not copied). Default: ``None``.
        _freeze: if ``True``, ``weight`` does not require grad. Default: ``False``.

    Shape:
        - Input: ``(M, B, *)``, ``torch.int64`` or ``torch.int32`` indices in ``[0, num_embeddings)``.
          A batch of indices shared by all models may be passed as ``idx.expand(M, *idx.shape)``.
        - Output: ``(M, B, *, H)`` with ``H = embedding_dim``.

    Attributes:
        weight: ``(M, num_embeddings, embedding_dim)``; each model's table initialised like
            ``torch.nn.Embedding``: :math:`\mathcal{N}(0, 1)`, with the ``padding_idx`` row zeroed.

    An index outside ``[0, num_embeddings)`` raises ``IndexError`` (naming the model and the index for CPU
    tensors in eager mode; elsewhere the lookup's own bounds check fires), never reading another model's
    rows. Constructor arguments out of range raise ``ValueError`` where torch.nn raises ``AssertionError``.

    Examples::

        >>> embedding = BatchedEmbedding(4, 10, 3)
        >>> idx = torch.randint(0, 10, (4, 2, 5))   # 4 models, a batch of 2 sequences of 5 indices each
        >>> embedding(idx).shape
        torch.Size([4, 2, 5, 3])
        >>> shared = torch.randint(0, 10, (2, 5))   # the same indices for every model
        >>> embedding(shared.expand(4, 2, 5)).shape
        torch.Size([4, 2, 5, 3])
    """

    __constants__ = [
        "num_models",
        "num_embeddings",
        "embedding_dim",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    ]
    torch_module = nn.Embedding
    _rowwise_trailing_dims = 0  # each index is looked up on its own (see BatchedLinear)

    @property
    def _mixes_picked_rows(self) -> str | None:
        """Why rows picked by a mask, padded with index 0 for the models that picked fewer, would change what
        the layer does (see batchlayers._fold), or None."""
        if self.max_norm is not None:
            return "with max_norm renormalises every table row it looks up, in place"
        if self.scale_grad_by_freq:
            return "with scale_grad_by_freq counts the lookups of all its rows"
        if self.sparse:
            return "with sparse gradients lists every table row it looks up"
        return None

    def __init__(
        self,
        num_models: int,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        self.num_embeddings = check_size(type(self).__name__, "num_embeddings", num_embeddings)
        self.embedding_dim = check_size(type(self).__name__, "embedding_dim", embedding_dim)
        self.padding_idx = _padding_idx_within(self, padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._make_weight(_weight, not _freeze, factory_kwargs)

    def forward(self, input: Tensor) -> Tensor:
        check_input(self, input, what="indices", check_dtype=False)
        if input.dtype not in _INDEX_DTYPES:
            raise TypeError(
                f"{layer_name(self)}: expected integer indices (torch.int64 or torch.int32), got {input.dtype}"
            )
        self._check_index_range(input)
        return lookup(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )

    def _check_index_range(self, input: Tensor) -> None:
        _check_index_range(self, input)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> BatchedEmbedding:
        """Create from ``(M, num_embeddings, embedding_dim)`` tables, like ``torch.nn.Embedding.from_pretrained``.

        The tensor becomes the weight as is (not copied); ``freeze=True`` makes it not require grad.
        """
        num_models, num_embeddings, embedding_dim = _pretrained_shape(cls, embeddings)
        return cls(
            num_models,
            num_embeddings,
            embedding_dim,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=embeddings,
            _freeze=freeze,
        )

    def extra_repr(self) -> str:
        s = f"num_models={self.num_models}, num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += f", scale_grad_by_freq={self.scale_grad_by_freq}"
        if self.sparse:
            s += ", sparse=True"
        return s


class BatchedEmbeddingBag(_EmbeddingTable):
    r"""``num_models`` independent :class:`torch.nn.EmbeddingBag` tables, used together.

    Model ``m``'s bags hold model ``m``'s indices and sum, average or take the maximum of rows of model ``m``'s
    table only; all models' bags are computed by one :func:`torch.nn.functional.embedding_bag` over the tables
    laid end to end.

    Args:
        num_models: number of models ``M``.
        num_embeddings: size of each model's dictionary of embeddings.
        embedding_dim: size of each embedding vector ``H``.
        max_norm: if given, every looked-up row whose ``norm_type``-norm exceeds ``max_norm`` is
            renormalised to ``max_norm`` in place in ``weight``, per model. Default: ``None``.
        norm_type: the p of the p-norm for ``max_norm``. Default: ``2.0``.
        scale_grad_by_freq: scale gradients by the inverse frequency of each index in the mini-batch,
            counted per model. Not with ``mode='max'``, as in torch.nn. Default: ``False``.
        mode: ``'sum'``, ``'mean'`` or ``'max'``: how each bag reduces its rows. Default: ``'mean'``.
        sparse: if ``True``, ``weight.grad`` is a sparse COO tensor of shape ``(M, num_embeddings,
            embedding_dim)``, as for :class:`BatchedEmbedding`. Not with ``mode='max'``, as in torch.nn.
            Default: ``False``.
        _weight: an ``(M, num_embeddings, embedding_dim)`` tensor to use as the weight, as in torch.nn
            (not initialised, not copied). Default: ``None``.
        include_last_offset: if ``True``, ``offsets`` has one more entry per model, the end of its last bag
            (CSR style), at most ``N``. As in torch's kernels, the last bag still runs to the end of the model's
            indices. Default: ``False``.
        padding_idx: if given, index ``padding_idx`` is left out of every bag (and of the count of a mean) in
            every model, and its row gets no gradient and starts as zeros. Negative values count from the end,
            as in torch.nn. Default: ``None``.

    Shape:
        - Input: ``torch.int64`` or ``torch.int32`` indices in ``[0, num_embeddings)``, either
          ``(M, B, bag)``: ``B`` bags of ``bag`` indices per model (``offsets`` is ``None``), or ``(M, N)``:
          each model's bags laid end to end, with ``offsets`` ``(M, B)`` (``(M, B + 1)`` with
          ``include_last_offset``): the start of each bag in the model's indices, each row starting at 0.
          Bags may be empty (they give zeros). A batch shared by all models may be passed as
          ``idx.expand(M, *idx.shape)`` (offsets and per-sample weights likewise).
        - per_sample_weights: shaped like the input, the weight of each index in its bag's sum
          (``mode='sum'`` only).
        - Output: ``(M, B, H)`` with ``H = embedding_dim``.

    Attributes:
        weight: ``(M, num_embeddings, embedding_dim)``; each model's table initialised like
            ``torch.nn.EmbeddingBag``: :math:`\mathcal{N}(0, 1)`, with the ``padding_idx`` row zeroed.

    On CPU in eager mode an index outside ``[0, num_embeddings)`` raises ``IndexError`` naming the model and
    the index, and bad offsets ``ValueError``; elsewhere the kernel's own bounds check fires for the indices,
    and offsets are clamped to the model's own indices: a bag never reads another model's rows. Constructor
    arguments out of range raise ``ValueError`` where torch.nn raises ``AssertionError``.

    In a model stacked by :func:`batchlayers.stack`, ``torch.nn.EmbeddingBag`` becomes this layer, for
    ``(B, bag)`` inputs: 1-D inputs with offsets cannot be split among the models (an error says so).

    Examples::

        >>> bag = BatchedEmbeddingBag(4, 10, 3, mode="sum")
        >>> idx = torch.randint(0, 10, (4, 2, 5))    # 4 models, 2 bags of 5 indices each
        >>> bag(idx).shape
        torch.Size([4, 2, 3])
        >>> flat = torch.randint(0, 10, (4, 7))      # 4 models, 7 indices each, in 3 bags (the first empty)
        >>> bag(flat, torch.tensor([0, 0, 4]).expand(4, 3)).shape
        torch.Size([4, 3, 3])
    """

    __constants__ = [
        "num_models",
        "num_embeddings",
        "embedding_dim",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "mode",
        "sparse",
        "include_last_offset",
        "padding_idx",
    ]
    torch_module = nn.EmbeddingBag

    def __init__(
        self,
        num_models: int,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"{type(self).__name__}: mode must be 'sum', 'mean' or 'max', got {mode!r}")
        self.num_embeddings = check_size(type(self).__name__, "num_embeddings", num_embeddings)
        self.embedding_dim = check_size(type(self).__name__, "embedding_dim", embedding_dim)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.padding_idx = _padding_idx_within(self, padding_idx, num_embeddings)
        self._make_weight(_weight, True, factory_kwargs)
        self.mode = mode
        self.sparse = sparse
        self.include_last_offset = include_last_offset

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        check_embedding_bag_arguments(
            layer_name(self), self.weight, input, offsets, per_sample_weights, self.mode, self.include_last_offset
        )
        _check_index_range(self, input)
        return _embedding_bag(
            input,
            self.weight,
            offsets,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.mode,
            self.sparse,
            per_sample_weights,
            self.include_last_offset,
            self.padding_idx,
        )

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
    ) -> BatchedEmbeddingBag:
        """Create from ``(M, num_embeddings, embedding_dim)`` tables, like ``torch.nn.EmbeddingBag.from_pretrained``.

        The tensor becomes the weight as is (not copied); ``freeze=True`` makes it not require grad.
        """
        num_models, num_embeddings, embedding_dim = _pretrained_shape(cls, embeddings)
        bag = cls(
            num_models,
            num_embeddings,
            embedding_dim,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            mode=mode,
            sparse=sparse,
            _weight=embeddings,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
        )
        bag.weight.requires_grad = not freeze
        return bag

    def extra_repr(self) -> str:
        s = f"num_models={self.num_models}, num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += f", scale_grad_by_freq={self.scale_grad_by_freq}"
        s += f", mode={self.mode!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


def _pretrained_shape(cls: type, embeddings: object) -> torch.Size:
    """``(M, num_embeddings, embedding_dim)`` of the tables given to ``cls.from_pretrained``, or a ValueError."""
    if not isinstance(embeddings, Tensor) or embeddings.dim() != 3:
        got = f"shape {_fmt(embeddings.shape)}" if isinstance(embeddings, Tensor) else type(embeddings).__name__
        raise ValueError(
            f"{cls.__name__}.from_pretrained: expected embeddings (M, num_embeddings, embedding_dim), got {got}"
        )
    return embeddings.shape
