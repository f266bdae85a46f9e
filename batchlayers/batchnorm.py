"""Batched counterparts of ``torch.nn.BatchNorm1d``, ``BatchNorm2d`` and ``BatchNorm3d``."""

from __future__ import annotations

import math
from typing import cast

from torch import Tensor, nn

from ._utils import check_norm_dtypes
from .functional._batchnorm import batch_norm
from .normalization import BatchedNormBase, check_values_per_statistic

__all__ = ["BatchedBatchNorm1d", "BatchedBatchNorm2d", "BatchedBatchNorm3d"]


class _BatchedBatchNorm(BatchedNormBase):
    """Everything of BatchNorm1d/2d/3d but the accepted input dimensions, as torch.nn's ``_BatchNorm``."""

    _default_affine = True
    _default_track_running_stats = True

    def __init__(
        self,
        num_models: int,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_models, num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)

    @property
    def _mixes_picked_rows(self) -> str | None:
        """Rows picked by a mask (see batchlayers._fold) are each normalised alone by running statistics only."""
        if self.training:
            return "in training computes its statistics over all its rows"
        if self.running_mean is None:
            return "without running statistics computes its statistics over all its rows"
        return None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        # As torch.nn: running statistics are used in eval mode when present, updated in training mode
        # only when tracked.
        track = not self.training or self.track_running_stats
        running_mean, running_var = (self.running_mean, self.running_var) if track else (None, None)
        check_norm_dtypes(self, input, (self.weight, self.bias, running_mean, running_var))
        use_batch_stats = self.training or self.running_mean is None
        if use_batch_stats:
            check_values_per_statistic(self, input, input.shape[1] * math.prod(input.shape[3:]))

        momentum: float | Tensor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                # Cumulative average, each model by its own count (checkpoints may have seen different numbers
                # of batches); a tensor, so no data-dependent Python value and no graph break.
                dtype = cast(Tensor, self.running_mean).dtype  # (registered with num_batches_tracked)
                momentum = self.num_batches_tracked.to(dtype).reciprocal()
        return batch_norm(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            use_batch_stats,
            momentum,
            self.eps,
        )


_DOC = r"""``num_models`` independent :class:`torch.nn.{name}` layers, computed together.

    In training mode every model normalises each channel with the statistics of its own batch and updates
    its own running statistics (``running_var`` with the unbiased batch variance); in eval mode it uses its
    running statistics. All models run in one ``F.batch_norm`` over ``M*C`` packed channels.

    Args:
        num_models: number of models ``M``.
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability. Default: ``1e-5``.
        momentum: weight of the new batch in the running statistics; ``None`` is the cumulative average,
            which follows each model's own ``num_batches_tracked``. Default: ``0.1``.
        affine: if ``True``, every model learns per-channel ``weight`` and ``bias``. Default: ``True``.
        track_running_stats: if ``False``, no running statistics are kept and batch statistics are used
            in eval mode too. Default: ``True``.
        bias: keyword only; if ``False``, no ``bias`` is learned (only with ``affine``). Default: ``True``.

    Shape:
        - Input: ``{shape}``. A shared batch (``x.expand(M, *x.shape)``) is normalised once and never
          copied M times; the transposed view of a packed ``(B, M*C, *)`` tensor (what a batched
          convolution returns) is normalised without a copy.
        - Output: same shape as the input; for a per-model input, the transposed view of the packed result.

    Attributes:
        weight: ``(M, C)``, initialised to 1, as in ``torch.nn.{name}``.
        bias: ``(M, C)``, initialised to 0.
        running_mean: ``(M, C)`` buffer, initialised to 0.
        running_var: ``(M, C)`` buffer, initialised to 1.
        num_batches_tracked: ``(M,)`` long buffer, initialised to 0.

    Examples::

        >>> layer = Batched{name}(4, 6)
        >>> layer(torch.randn({example})).shape
        torch.Size([{example}])
    """


class BatchedBatchNorm1d(_BatchedBatchNorm):
    __doc__ = _DOC.format(name="BatchNorm1d", shape="(M, B, C)`` or ``(M, B, C, L)", example="4, 8, 6, 10")
    torch_module = nn.BatchNorm1d
    _input_ndims = (3, 4)
    _layout = "(M, B, C) or (M, B, C, L)"


class BatchedBatchNorm2d(_BatchedBatchNorm):
    __doc__ = _DOC.format(name="BatchNorm2d", shape="(M, B, C, H, W)", example="4, 8, 6, 5, 5")
    torch_module = nn.BatchNorm2d
    _input_ndims = (5,)
    _layout = "(M, B, C, H, W)"


class BatchedBatchNorm3d(_BatchedBatchNorm):
    __doc__ = _DOC.format(name="BatchNorm3d", shape="(M, B, C, D, H, W)", example="4, 8, 6, 3, 5, 5")
    torch_module = nn.BatchNorm3d
    _input_ndims = (6,)
    _layout = "(M, B, C, D, H, W)"
