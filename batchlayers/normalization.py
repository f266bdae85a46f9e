"""Batched counterparts of ``torch.nn.LayerNorm``, ``RMSNorm``, ``GroupNorm`` and ``InstanceNorm1d/2d/3d``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import init

from ._utils import check_input, check_norm_dtypes, check_num_models, check_size, layer_name
from .functional._norm import group_norm, instance_norm, layer_norm, rms_norm

__all__ = [
    "BatchedGroupNorm",
    "BatchedInstanceNorm1d",
    "BatchedInstanceNorm2d",
    "BatchedInstanceNorm3d",
    "BatchedLayerNorm",
    "BatchedRMSNorm",
]


def check_values_per_statistic(module: nn.Module, x: Tensor, count: int) -> None:
    """Like torch.nn, refuse statistics over a single value (the variance would be 0 / 0)."""
    if count == 1:
        raise ValueError(
            f"{layer_name(module)}: expected more than 1 value per channel when training, got input shape "
            f"{tuple(x.shape)}"
        )


def register_affine(module: nn.Module, shape: tuple[int, ...], affine: bool, bias: bool, factory_kwargs: dict) -> None:
    """Register ``weight`` and ``bias`` of ``shape`` as torch.nn's norms do: ``None`` when not learned."""
    module.register_parameter("weight", nn.Parameter(torch.empty(shape, **factory_kwargs)) if affine else None)
    module.register_parameter("bias", nn.Parameter(torch.empty(shape, **factory_kwargs)) if affine and bias else None)


def reset_affine(module: nn.Module) -> None:
    """torch.nn's norm init: weight 1, bias 0."""
    weight, bias = cast("Tensor | None", module.weight), cast("Tensor | None", module.bias)  # (register_affine's)
    if weight is not None:
        init.ones_(weight)
    if bias is not None:
        init.zeros_(bias)


class _BatchedTrailingNorm(nn.Module):
    """Shared by LayerNorm and RMSNorm: statistics and ``(M, *normalized_shape)`` affine over trailing dims."""

    __constants__ = ["num_models", "normalized_shape", "eps", "elementwise_affine"]
    _default_eps: float | None
    _bias_option: bool  # whether the torch.nn layer has a ``bias`` argument
    _mixes_picked_rows: str | None = None  # each row computed alone (rows picked by a mask: see batchlayers._fold)
    weight: nn.Parameter | None  # (registered by register_affine)
    bias: nn.Parameter | None

    def __init__(
        self,
        num_models: int,
        normalized_shape: int | Sequence[int],
        eps: float | None,
        elementwise_affine: bool,
        bias: bool,
        factory_kwargs: dict,
    ) -> None:
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (cast(int, normalized_shape),)
        if not isinstance(normalized_shape, Sequence):
            raise TypeError(
                f"{type(self).__name__}: normalized_shape must be an int or a sequence of ints, got "
                f"{type(normalized_shape).__name__} {normalized_shape!r}"
            )
        self.normalized_shape = tuple(check_size(type(self).__name__, "normalized_shape", n) for n in normalized_shape)
        # each row is normalised on its own over the trailing dimensions (see BatchedLinear)
        self._rowwise_trailing_dims = len(self.normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        register_affine(self, (num_models, *self.normalized_shape), elementwise_affine, bias, factory_kwargs)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def _check_input(self, input: Tensor) -> None:
        shape = self.normalized_shape
        names = ["normalized_shape"] if len(shape) == 1 else [f"normalized_shape[{i}]" for i in range(len(shape))]
        check_input(
            self, input, trailing=list(zip(names, shape)), layout="(M, *, *normalized_shape)", check_dtype=False
        )

    def extra_repr(self) -> str:
        parts = [f"num_models={self.num_models}", str(self.normalized_shape)]
        if self.eps != self._default_eps:
            parts.append(f"eps={self.eps}")
        if not self.elementwise_affine:
            parts.append("elementwise_affine=False")
        elif self._bias_option and self.bias is None:
            parts.append("bias=False")
        return ", ".join(parts)


class BatchedLayerNorm(_BatchedTrailingNorm):
    r"""``num_models`` independent :class:`torch.nn.LayerNorm` layers, computed together.

    Every model normalises its own input over the trailing ``normalized_shape`` dimensions with one
    ``F.layer_norm`` for all models; then model ``m``'s ``weight[m]`` and ``bias[m]`` apply.

    Args:
        num_models: number of models ``M``.
        normalized_shape: the trailing shape normalised over, an int or a sequence of ints.
        eps: added to the variance for numerical stability. Default: ``1e-5``.
        elementwise_affine: if ``True``, every model learns a per-element ``weight`` (and ``bias``).
            Default: ``True``.
        bias: if ``False``, no ``bias`` is learned (only with ``elementwise_affine``). Default: ``True``.

    Shape:
        - Input: ``(M, *, *normalized_shape)``, usually ``(M, B, *, *normalized_shape)``. A shared batch
          (``x.expand(M, *x.shape)``) is normalised once and never copied M times.
        - Output: same shape as the input.

    Attributes:
        weight: ``(M, *normalized_shape)``, initialised to 1, as in ``torch.nn.LayerNorm``.
        bias: ``(M, *normalized_shape)``, initialised to 0.

    Examples::

        >>> layer = BatchedLayerNorm(4, 16)
        >>> layer(torch.randn(4, 8, 10, 16)).shape
        torch.Size([4, 8, 10, 16])
    """

    torch_module = nn.LayerNorm
    _default_eps = 1e-5
    _bias_option = True
    eps: float

    def __init__(
        self,
        num_models: int,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_models, normalized_shape, eps, elementwise_affine, bias, factory_kwargs)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        check_norm_dtypes(self, input, (self.weight, self.bias))
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class BatchedRMSNorm(_BatchedTrailingNorm):
    r"""``num_models`` independent :class:`torch.nn.RMSNorm` layers, computed together.

    Every model divides its input by the root mean square over the trailing ``normalized_shape``
    dimensions (one ``F.rms_norm`` for all models), then scales by its own ``weight[m]``.

    Args:
        num_models: number of models ``M``.
        normalized_shape: the trailing shape normalised over, an int or a sequence of ints.
        eps: added to the mean square; ``None`` uses ``torch.finfo(input.dtype).eps``. Default: ``None``.
        elementwise_affine: if ``True``, every model learns a per-element ``weight``. Default: ``True``.

    Shape:
        - Input: ``(M, *, *normalized_shape)``, usually ``(M, B, *, *normalized_shape)``. A shared batch
          (``x.expand(M, *x.shape)``) is normalised once and never copied M times.
        - Output: same shape as the input.

    Attributes:
        weight: ``(M, *normalized_shape)``, initialised to 1, as in ``torch.nn.RMSNorm``.

    Examples::

        >>> layer = BatchedRMSNorm(4, 16)
        >>> layer(torch.randn(4, 8, 16)).shape
        torch.Size([4, 8, 16])
    """

    torch_module = nn.RMSNorm
    _default_eps = None
    _bias_option = False

    def __init__(
        self,
        num_models: int,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_models, normalized_shape, eps, elementwise_affine, False, factory_kwargs)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


class BatchedGroupNorm(nn.Module):
    r"""``num_models`` independent :class:`torch.nn.GroupNorm` layers, computed together.

    Every sample's channels are split into ``num_groups`` groups normalised on their own; then model
    ``m``'s per-channel ``weight[m]`` and ``bias[m]`` apply. All models run in one ``F.group_norm``.

    Args:
        num_models: number of models ``M``.
        num_groups: number of groups to separate the channels into.
        num_channels: number of channels ``C``; must be divisible by ``num_groups``.
        eps: added to the variance for numerical stability. Default: ``1e-5``.
        affine: if ``True``, every model learns per-channel ``weight`` and ``bias``. Default: ``True``.
        bias: keyword only; if ``False``, no ``bias`` is learned (only with ``affine``). Default: ``True``.

    Shape:
        - Input: ``(M, B, C, *)``. A shared batch (``x.expand(M, *x.shape)``) is normalised once and never
          copied M times; the transposed view of a packed ``(B, M*C, *)`` tensor (what a batched
          convolution returns) is normalised without a copy.
        - Output: same shape as the input.

    Attributes:
        weight: ``(M, C)``, initialised to 1, as in ``torch.nn.GroupNorm``.
        bias: ``(M, C)``, initialised to 0.

    Examples::

        >>> layer = BatchedGroupNorm(4, 2, 6)
        >>> layer(torch.randn(4, 8, 6, 10, 10)).shape
        torch.Size([4, 8, 6, 10, 10])
    """

    __constants__ = ["num_models", "num_groups", "num_channels", "eps", "affine"]
    torch_module = nn.GroupNorm
    _mixes_picked_rows: str | None = None  # each row computed alone (rows picked by a mask: see batchlayers._fold)
    weight: nn.Parameter | None  # (registered by register_affine)
    bias: nn.Parameter | None

    def __init__(
        self,
        num_models: int,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        check_size(type(self).__name__, "num_groups", num_groups, 1)
        check_size(type(self).__name__, "num_channels", num_channels)
        if num_channels % num_groups != 0:
            raise ValueError(
                f"{type(self).__name__}: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})"
            )
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        register_affine(self, (num_models, num_channels), affine, bias, factory_kwargs)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:
        check_input(self, input, channels=("C", self.num_channels), layout="(M, B, C, *)", check_dtype=False)
        check_norm_dtypes(self, input, (self.weight, self.bias))
        # torch.nn checks this per sample group in both modes: batch size times channels per group.
        values = input.shape[1] * (self.num_channels // self.num_groups) * math.prod(input.shape[3:])
        check_values_per_statistic(self, input, values)
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        parts = [f"num_models={self.num_models}", str(self.num_groups), str(self.num_channels)]
        if self.eps != 1e-5:
            parts.append(f"eps={self.eps}")
        if not self.affine:
            parts.append("affine=False")
        elif self.bias is None:
            parts.append("bias=False")
        return ", ".join(parts)


class BatchedNormBase(nn.Module):
    """The parameters and running statistics of BatchNorm and InstanceNorm, as torch.nn's ``_NormBase``: per-model
    affine ``(M, C)`` and, when tracked, ``running_mean``/``running_var`` ``(M, C)`` and ``num_batches_tracked``
    ``(M,)``. Subclasses give torch's defaults of ``affine`` and ``track_running_stats``."""

    __constants__ = ["num_models", "num_features", "eps", "momentum", "affine", "track_running_stats"]
    _input_ndims: tuple[int, ...]
    _layout: str
    _default_affine: bool
    _default_track_running_stats: bool
    weight: nn.Parameter | None  # (registered by register_affine)
    bias: nn.Parameter | None
    running_mean: Tensor | None  # (registered as None without track_running_stats)
    running_var: Tensor | None
    num_batches_tracked: Tensor | None

    def __init__(
        self,
        num_models: int,
        num_features: int,
        eps: float,
        momentum: float | None,
        affine: bool,
        track_running_stats: bool,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        self.num_features = check_size(type(self).__name__, "num_features", num_features)
        self.eps = eps
        # (cast: to mypy a float is no numbers.Real, which would leave momentum None below)
        if momentum is not None and not isinstance(cast(object, momentum), numbers.Real):
            what = f"a tensor of shape {tuple(momentum.shape)}" if isinstance(momentum, Tensor) else repr(momentum)
            raise TypeError(
                f"{type(self).__name__}: momentum must be a float or None (as in torch.nn), got {what}; for "
                "per-model factors call batchlayers.functional.batch_norm with an (M,) momentum"
            )
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        register_affine(self, (num_models, num_features), affine, bias, factory_kwargs)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros((num_models, num_features), **factory_kwargs))
            self.register_buffer("running_var", torch.ones((num_models, num_features), **factory_kwargs))
            self.register_buffer(
                "num_batches_tracked", torch.zeros(num_models, dtype=torch.long, device=factory_kwargs["device"])
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:  # (registered as tensors then)
            cast(Tensor, self.running_mean).zero_()
            cast(Tensor, self.running_var).fill_(1)
            cast(Tensor, self.num_batches_tracked).zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        reset_affine(self)

    def _check_input(self, input: Tensor) -> None:
        """``(M, B, C, *)`` with this layer's models, channels and number of dimensions (any float dtype: the
        subclasses check dtypes as their torch counterparts do)."""
        check_input(
            self,
            input,
            channels=("C", self.num_features),
            ndims=self._input_ndims,
            layout=self._layout,
            check_dtype=False,
        )

    def extra_repr(self) -> str:
        parts = [f"num_models={self.num_models}", str(self.num_features)]
        if self.eps != 1e-5:
            parts.append(f"eps={self.eps}")
        if self.momentum != 0.1:
            parts.append(f"momentum={self.momentum}")
        if self.affine != self._default_affine:
            parts.append(f"affine={self.affine}")
        if self.affine and self.bias is None:
            parts.append("bias=False")
        if self.track_running_stats != self._default_track_running_stats:
            parts.append(f"track_running_stats={self.track_running_stats}")
        return ", ".join(parts)


class _BatchedInstanceNorm(BatchedNormBase):
    """Everything of InstanceNorm1d/2d/3d but the accepted input dimensions, as torch.nn's ``_InstanceNorm``."""

    _default_affine = False
    _default_track_running_stats = False

    def __init__(
        self,
        num_models: int,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_models, num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)

    @property
    def _mixes_picked_rows(self) -> str | None:
        """Each sample is normalised alone; in training the running statistics average over all rows (see
        batchlayers._fold)."""
        if self.training and self.track_running_stats:
            return "in training with track_running_stats averages its running statistics over all its rows"
        return None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        check_norm_dtypes(self, input, (self.weight, self.bias))  # the running statistics may have any dtype
        use_input_stats = self.training or not self.track_running_stats
        if use_input_stats and math.prod(input.shape[3:]) == 1:
            raise ValueError(
                f"{layer_name(self)}: expected more than 1 spatial element per channel when normalising with the "
                f"input's statistics, got input shape {tuple(input.shape)}"
            )
        # As torch.nn: running statistics (when tracked) are updated in training mode and used in eval mode;
        # momentum None means 0 (torch's InstanceNorm never counts num_batches_tracked up, so no cumulative
        # average: the running statistics stay as they are).
        return instance_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            use_input_stats,
            0.0 if self.momentum is None else self.momentum,
            self.eps,
        )


_INSTANCE_DOC = r"""``num_models`` independent :class:`torch.nn.{name}` layers, computed together.

    Every model normalises each channel of each sample by that channel's own mean and variance over the
    spatial dimensions; then model ``m``'s per-channel ``weight[m]`` and ``bias[m]`` apply (with ``affine``).
    With ``track_running_stats`` every model keeps its own running statistics, updated in training mode (the
    batch average of the samples' statistics, the variance unbiased) and used in eval mode, as torch.nn does.
    With the input's statistics all models run in one ``F.batch_norm`` over ``M*B*C`` channels (a shared
    batch: ``B*C``, once); with running statistics, in one per-model scale and shift.

    Args:
        num_models: number of models ``M``.
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability. Default: ``1e-5``.
        momentum: weight of the new statistics in the running statistics; ``None`` leaves them unchanged,
            as in torch.nn (``InstanceNorm`` does not count batches). Default: ``0.1``.
        affine: if ``True``, every model learns per-channel ``weight`` and ``bias``. Default: ``False``.
        track_running_stats: if ``True``, every model keeps running statistics and uses them in eval mode.
            Default: ``False``.
        bias: keyword only; if ``False``, no ``bias`` is learned (only with ``affine``). Default: ``True``.

    Shape:
        - Input: ``{shape}``. A shared batch (``x.expand(M, *x.shape)``) is normalised once and never copied
          M times; the transposed view of a packed ``(B, M*C, *)`` tensor (what a batched convolution
          returns) is normalised without a copy.
        - Output: same shape as the input.

    Attributes:
        weight: ``(M, C)``, initialised to 1, as in ``torch.nn.{name}``.
        bias: ``(M, C)``, initialised to 0.
        running_mean: ``(M, C)`` buffer, initialised to 0 (with ``track_running_stats``).
        running_var: ``(M, C)`` buffer, initialised to 1.
        num_batches_tracked: ``(M,)`` long buffer, 0 (torch.nn's InstanceNorm keeps it at 0).

    Examples::

        >>> layer = Batched{name}(4, 6, affine=True)
        >>> layer(torch.randn({example})).shape
        torch.Size([{example}])
    """


class BatchedInstanceNorm1d(_BatchedInstanceNorm):
    __doc__ = _INSTANCE_DOC.format(name="InstanceNorm1d", shape="(M, B, C, L)", example="4, 8, 6, 10")
    torch_module = nn.InstanceNorm1d
    _input_ndims = (4,)
    _layout = "(M, B, C, L)"


class BatchedInstanceNorm2d(_BatchedInstanceNorm):
    __doc__ = _INSTANCE_DOC.format(name="InstanceNorm2d", shape="(M, B, C, H, W)", example="4, 8, 6, 5, 5")
    torch_module = nn.InstanceNorm2d
    _input_ndims = (5,)
    _layout = "(M, B, C, H, W)"


class BatchedInstanceNorm3d(_BatchedInstanceNorm):
    __doc__ = _INSTANCE_DOC.format(name="InstanceNorm3d", shape="(M, B, C, D, H, W)", example="4, 8, 6, 3, 5, 5")
    torch_module = nn.InstanceNorm3d
    _input_ndims = (6,)
    _layout = "(M, B, C, D, H, W)"
