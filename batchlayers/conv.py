"""Batched counterparts of ``torch.nn.Conv1d``, ``Conv2d``, ``Conv3d`` and ``ConvTranspose1d/2d/3d``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import init

from . import backends
from ._utils import _fmt, check_input, check_num_models, check_size, check_sizes, init_per_model_, layer_name
from .functional._conv import conv, conv_transpose, padding_for_pad

__all__ = [
    "BatchedConv1d",
    "BatchedConv2d",
    "BatchedConv3d",
    "BatchedConvTranspose1d",
    "BatchedConvTranspose2d",
    "BatchedConvTranspose3d",
]

_SPATIAL_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


class _BatchedConvNd(nn.Module):
    """What ``torch.nn.modules.conv._ConvNd`` does, for ``num_models`` models; subclasses fix the number of
    spatial dimensions (``_num_spatial``) and the torch.nn counterpart."""

    __constants__ = [
        "num_models",
        "stride",
        "padding",
        "dilation",
        "groups",
        "padding_mode",
        "in_channels",
        "out_channels",
        "kernel_size",
    ]
    _num_spatial: int
    torch_module: type[nn.Module]
    # As in torch: a transposed convolution's weight is (in, out // groups, *k), a convolution's (out, in // groups).
    transposed: bool = False
    _mixes_picked_rows: str | None = None  # each row computed alone (rows picked by a mask: see batchlayers._fold)

    def __init__(
        self,
        num_models: int,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        name = type(self).__name__
        self.num_models = check_num_models(num_models, type(self))
        check_size(name, "in_channels", in_channels)
        check_size(name, "out_channels", out_channels)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise ValueError(f"{name}: groups must be a positive integer, got {groups!r}")
        if in_channels % groups != 0:
            raise ValueError(f"{name}: in_channels ({in_channels}) must be divisible by groups ({groups})")
        if out_channels % groups != 0:
            raise ValueError(f"{name}: out_channels ({out_channels}) must be divisible by groups ({groups})")
        n = self._num_spatial
        # torch.nn.Conv*d keeps a kernel_size of the wrong length, or a stride of 0, and fails at the first call.
        kernel_size = check_sizes(name, "kernel_size", kernel_size, n, 1)
        stride, dilation = check_sizes(name, "stride", stride, n, 1), check_sizes(name, "dilation", dilation, n, 1)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{name}: invalid padding string {padding!r}, should be one of 'same', 'valid'")
            if padding == "same" and any(s != 1 for s in stride):
                raise ValueError(f"{name}: padding='same' is not supported for strided convolutions (stride={stride})")
        else:
            padding = check_sizes(name, "padding", padding, n, 0)
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"{name}: padding_mode must be one of {_PADDING_MODES}, but got {padding_mode!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        self.groups = groups
        self.padding_mode = padding_mode
        # torch's name for the F.pad argument of the non-zero padding modes (kept for code that reads it).
        self._reversed_padding_repeated_twice = padding_for_pad(padding, kernel_size, dilation)
        self._strategy = "auto"
        channels = (in_channels, out_channels // groups) if self.transposed else (out_channels, in_channels // groups)
        self.weight = nn.Parameter(torch.empty((num_models, *channels, *kernel_size), **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty((num_models, out_channels), **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @property
    def strategy(self) -> str:
        """How this layer computes: ``"auto"`` (default: defer to :data:`batchlayers.backends.conv`) or one of
        :data:`batchlayers.backends.CONV_STRATEGIES`. Every strategy computes the same result."""
        return self._strategy

    @strategy.setter
    def strategy(self, value: str) -> None:
        self._strategy = backends.check_conv_strategy(value, layer_name(self))

    def reset_parameters(self) -> None:
        # Same as torch.nn.Conv*d.reset_parameters, one model's slice at a time (fan-in of one slice): torch
        # computes the fan-in from the weight's dimension 1, in // groups, or out // groups when transposed.
        init_per_model_(self.weight, lambda w: init.kaiming_uniform_(w, a=math.sqrt(5)))
        if self.bias is not None:
            fan_in = self.weight.shape[2] * math.prod(self.kernel_size)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init_per_model_(self.bias, lambda b: init.uniform_(b, -bound, bound))

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        return conv(
            input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            padding_mode=self.padding_mode,
            strategy=self._strategy,
        )

    def _check_input(self, input: Tensor) -> None:
        spatial = _SPATIAL_NAMES[self._num_spatial]
        layout = f"(M, B, C_in, {', '.join(spatial)})"
        check_input(self, input, channels=("C_in", self.in_channels), ndims=[3 + self._num_spatial], layout=layout)
        # Per spatial dimension, left + right padding (F.pad order is last dimension first).
        pads = self._reversed_padding_repeated_twice
        total_padding = [pads[2 * j] + pads[2 * j + 1] for j in reversed(range(self._num_spatial))]
        for name, size, pad, k, d in zip(spatial, input.shape[3:], total_padding, self.kernel_size, self.dilation):
            if size + pad < d * (k - 1) + 1:
                raise ValueError(
                    f"{layer_name(self)}: input {name}={size} (padded: {size + pad}) is smaller than the kernel "
                    f"(kernel_size={k}, dilation={d}): shape {_fmt(input.shape)}"
                )

    def extra_repr(self) -> str:
        s = f"num_models={self.num_models}, {self.in_channels}, {self.out_channels}, "
        s += f"kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * self._num_spatial:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._num_spatial:
            s += f", dilation={self.dilation}"
        if self.transposed and self.output_padding != (0,) * self._num_spatial:
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


_DOC = r"""``num_models`` independent :class:`torch.nn.{torch_name}` layers, computed together.

    Model ``m`` convolves ``input[m]`` with ``weight[m]`` and adds ``bias[m]``, exactly as
    ``torch.nn.{torch_name}`` does, for every model at once. How (one grouped convolution, a loop of dense
    convolutions, channels-last or not) is chosen per device and shape, see :mod:`batchlayers.backends` and
    the ``strategy`` attribute; every strategy computes the same result.

    Args:
        num_models: number of models ``M``.
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode: as in
            :class:`torch.nn.{torch_name}`, with the same defaults and the same checks. ``padding`` may be an
            int, a tuple, ``'valid'`` or ``'same'`` (stride 1 only; an even effective kernel pads one more
            on the right, as in torch); ``padding_mode`` is ``'zeros'``, ``'reflect'``, ``'replicate'`` or
            ``'circular'``.

    Shape:
        - Input: ``(M, B, C_in, {spatial})``, exactly {ndim} dimensions. A batch shared by all models is passed
          as ``x.expand(M, *x.shape)`` and is never copied. Unbatched per-model inputs ``(C_in, {spatial})``
          are not supported: add a batch dimension of 1.
        - Output: ``(M, B, C_out, {spatial_out})``, sizes as in :class:`torch.nn.{torch_name}`.

    Attributes:
        weight: ``(M, out_channels, in_channels // groups, *kernel_size)``; each model's slice initialised
            like torch's: :math:`\mathcal{{U}}(-\sqrt{{k}}, \sqrt{{k}})`, :math:`k = 1 / \text{{fan\_in}}`,
            :math:`\text{{fan\_in}} = (C_\text{{in}} / \text{{groups}}) \prod \text{{kernel\_size}}` of one model.
        bias: ``(M, out_channels)``, same distribution (if ``bias=True``).
        strategy: ``"auto"`` (default) or one of :data:`batchlayers.backends.CONV_STRATEGIES`; settable,
            not a constructor argument, so the constructor stays torch's.

    Examples::

        >>> conv = {name}(8, 3, 16, 3, padding=1)
        >>> x = torch.randn(8, 32, 3, {example})          # a minibatch per model
        >>> conv(x).shape
        torch.Size([8, 32, 16, {example}])
        >>> shared = torch.randn(32, 3, {example})        # one minibatch for all models
        >>> conv(shared.expand(8, *shared.shape)).shape
        torch.Size([8, 32, 16, {example}])
    """


def _document(cls: type[_BatchedConvNd]) -> type[_BatchedConvNd]:
    spatial = _SPATIAL_NAMES[cls._num_spatial]
    cls.__doc__ = _DOC.format(
        name=cls.__name__,
        torch_name=cls.torch_module.__name__,
        spatial=", ".join(spatial),
        spatial_out=", ".join(f"{s}_out" for s in spatial),
        ndim=3 + cls._num_spatial,
        example=", ".join(["8"] * cls._num_spatial),
    )
    return cls


@_document
class BatchedConv1d(_BatchedConvNd):
    _num_spatial = 1
    torch_module = nn.Conv1d


@_document
class BatchedConv2d(_BatchedConvNd):
    _num_spatial = 2
    torch_module = nn.Conv2d


@_document
class BatchedConv3d(_BatchedConvNd):
    _num_spatial = 3
    torch_module = nn.Conv3d


class _BatchedConvTransposeNd(_BatchedConvNd):
    """What ``torch.nn.modules.conv._ConvTransposeNd`` does, for ``num_models`` models."""

    __constants__ = [*_BatchedConvNd.__constants__, "output_padding"]
    transposed = True

    def __init__(
        self,
        num_models: int,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        groups: int = 1,
        bias: bool = True,
        dilation=1,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ) -> None:
        name = type(self).__name__
        if padding_mode != "zeros":  # torch's first check, before any other
            raise ValueError(
                f'{name}: only "zeros" padding mode is supported for transposed convolutions (as in '
                f"torch.nn.{self.torch_module.__name__}), got padding_mode={padding_mode!r}"
            )
        if isinstance(padding, str):
            # torch.nn.ConvTranspose*d accepts a string here and fails at its first call.
            raise ValueError(f"{name}: padding must be an int or a tuple of ints, got {padding!r}")
        super().__init__(
            num_models,
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            bias=bias,
            padding_mode=padding_mode,
            device=device,
            dtype=dtype,
        )
        self.output_padding = check_sizes(name, "output_padding", output_padding, self._num_spatial, 0)

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        output_padding = self._output_padding(input, output_size)
        return conv_transpose(
            input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            output_padding,
            self.groups,
            self.dilation,
            strategy=self._strategy,
        )

    def _output_padding(self, input: Tensor, output_size: list[int] | None) -> tuple[int, ...]:
        """Check the input and return the output padding: the layer's own, or the one that gives
        ``output_size`` (as ``torch.nn.ConvTranspose*d._output_padding``)."""
        n = self._num_spatial
        spatial = _SPATIAL_NAMES[n]
        layout = f"(M, B, C_in, {', '.join(spatial)})"
        check_input(self, input, channels=("C_in", self.in_channels), ndims=[3 + n], layout=layout)
        in_sizes = input.shape[3:]
        min_sizes = [
            (size - 1) * s - 2 * p + d * (k - 1) + 1
            for size, s, p, k, d in zip(in_sizes, self.stride, self.padding, self.kernel_size, self.dilation)
        ]
        if output_size is None:
            output_padding = self.output_padding
            for j, (op, s, d) in enumerate(zip(output_padding, self.stride, self.dilation)):
                if op >= s and op >= d:
                    raise ValueError(
                        f"{layer_name(self)}: output_padding must be smaller than either stride or dilation, but "
                        f"got output_padding={output_padding}, stride={self.stride}, dilation={self.dilation} "
                        f"(dimension {spatial[j]})"
                    )
        else:
            # Like torch: the spatial sizes alone, or led by the dimensions before them. (B, C_out, *) is what
            # torch accepts for a batch and what a stacked model's code passes (its tensors are (M*B, C, *)
            # inside); (M, B, C_out, *) is this layer's whole output shape.
            output_size = list(output_size)
            if len(output_size) not in (n, n + 2, n + 3):
                raise ValueError(
                    f"{layer_name(self)}: output_size must have {n} elements ({', '.join(spatial)}), {n + 2} "
                    f"(B, C_out, ...) or {n + 3} (M, B, C_out, ...), got {len(output_size)}: {output_size}"
                )
            output_size = output_size[len(output_size) - n :]
            max_sizes = [size + s - 1 for size, s in zip(min_sizes, self.stride)]
            if any(not lo <= size <= hi for size, lo, hi in zip(output_size, min_sizes, max_sizes)):
                raise ValueError(
                    f"{layer_name(self)}: requested an output size of {output_size}, but valid sizes range from "
                    f"{min_sizes} to {max_sizes} (for an input of {_fmt(in_sizes)}, shape {_fmt(input.shape)})"
                )
            output_padding = tuple(size - lo for size, lo in zip(output_size, min_sizes))
        for name, size, lo, op in zip(spatial, in_sizes, min_sizes, output_padding):
            if lo + op < 1:
                raise ValueError(
                    f"{layer_name(self)}: input {name}={size} is too small: the output would have "
                    f"{name}_out={lo + op} (kernel_size={self.kernel_size}, stride={self.stride}, "
                    f"padding={self.padding}, dilation={self.dilation}): shape {_fmt(input.shape)}"
                )
        return output_padding


_TRANSPOSE_DOC = r"""``num_models`` independent :class:`torch.nn.{torch_name}` layers, computed together.

    Model ``m`` applies the transposed convolution of ``weight[m]`` to ``input[m]`` and adds ``bias[m]``,
    exactly as ``torch.nn.{torch_name}`` does, for every model at once: as one grouped transposed convolution
    over channel-packed models ``(B, M*C_in, *)`` with ``M * groups`` groups, or as a loop of dense ones,
    channels-last or not, chosen per device and shape as for :class:`BatchedConv{n}d` (see
    :mod:`batchlayers.backends`, :func:`batchlayers.functional._conv.heuristic_transpose_strategy` and the
    ``strategy`` attribute); every strategy computes the same result.

    Args:
        num_models: number of models ``M``.
        in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias, dilation,
            padding_mode: as in :class:`torch.nn.{torch_name}`, in its order, with its defaults and checks.
            ``padding`` is an int or a tuple; ``padding_mode`` can only be ``'zeros'``, as in torch.

    Shape:
        - Input: ``(M, B, C_in, {spatial})``, exactly {ndim} dimensions. A batch shared by all models is passed
          as ``x.expand(M, *x.shape)`` and is never copied. Unbatched per-model inputs ``(C_in, {spatial})``
          are not supported: add a batch dimension of 1.
        - Output: ``(M, B, C_out, {spatial_out})``, where, per spatial dimension,
          ``out = (in - 1) * stride - 2 * padding + dilation * (kernel_size - 1) + output_padding + 1``.
        - ``forward(input, output_size=None)``: as in torch, ``output_size`` (a list of ints) picks the
          output padding that gives that size, one of the ``stride`` sizes the input allows. It may hold the
          spatial sizes alone, or be led by ``(B, C_out)`` as torch accepts (e.g. ``skip.shape`` inside a
          stacked model) or by ``(M, B, C_out)`` (a batched tensor's ``shape``); leading entries are ignored.

    Attributes:
        weight: ``(M, in_channels, out_channels // groups, *kernel_size)``; each model's slice initialised
            like torch's: :math:`\mathcal{{U}}(-\sqrt{{k}}, \sqrt{{k}})`, :math:`k = 1 / \text{{fan\_in}}`,
            :math:`\text{{fan\_in}} = (C_\text{{out}} / \text{{groups}}) \prod \text{{kernel\_size}}` of one
            model (torch's fan-in of a transposed weight).
        bias: ``(M, out_channels)``, same distribution (if ``bias=True``).
        strategy: ``"auto"`` (default) or one of :data:`batchlayers.backends.CONV_STRATEGIES`; settable,
            not a constructor argument, so the constructor stays torch's.

    Examples::

        >>> up = {name}(8, 16, 4, 4, stride=2, padding=1)
        >>> x = torch.randn(8, 32, 16, {example})          # a minibatch per model
        >>> up(x).shape
        torch.Size([8, 32, 4, {example_out}])
        >>> up(x, output_size=[{example_size}]).shape
        torch.Size([8, 32, 4, {example_size}])
        >>> shared = torch.randn(32, 16, {example})        # one minibatch for all models
        >>> up(shared.expand(8, *shared.shape)).shape
        torch.Size([8, 32, 4, {example_out}])
    """


def _document_transpose(cls: type[_BatchedConvTransposeNd]) -> type[_BatchedConvTransposeNd]:
    n = cls._num_spatial
    spatial = _SPATIAL_NAMES[n]
    cls.__doc__ = _TRANSPOSE_DOC.format(
        name=cls.__name__,
        torch_name=cls.torch_module.__name__,
        n=n,
        spatial=", ".join(spatial),
        spatial_out=", ".join(f"{s}_out" for s in spatial),
        ndim=3 + n,
        example=", ".join(["8"] * n),
        example_out=", ".join(["16"] * n),
        example_size=", ".join(["17"] * n),
    )
    return cls


@_document_transpose
class BatchedConvTranspose1d(_BatchedConvTransposeNd):
    _num_spatial = 1
    torch_module = nn.ConvTranspose1d


@_document_transpose
class BatchedConvTranspose2d(_BatchedConvTransposeNd):
    _num_spatial = 2
    torch_module = nn.ConvTranspose2d


@_document_transpose
class BatchedConvTranspose3d(_BatchedConvTransposeNd):
    _num_spatial = 3
    torch_module = nn.ConvTranspose3d
