"""Batched counterparts of ``torch.nn.RNN``, ``LSTM``, ``GRU`` and their cells."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import init
from torch.nn.utils.rnn import PackedSequence

from ._utils import (
    autocast_enabled,
    check_device,
    check_input,
    check_num_models,
    check_size,
    init_per_model_,
    layer_name,
)
from .functional._recurrent import GATES, rnn

__all__ = ["BatchedRNN", "BatchedLSTM", "BatchedGRU", "BatchedRNNCell", "BatchedLSTMCell", "BatchedGRUCell"]


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _refuse_packed(module: nn.Module, input: object) -> None:
    if isinstance(input, PackedSequence):
        raise TypeError(
            f"{layer_name(module)}: PackedSequence input is not supported; pad the sequences "
            "(torch.nn.utils.rnn.pad_packed_sequence) and pass one padded (M, ...) tensor"
        )


def _refuse_unbatched(module: nn.Module, input: object, ndim: int, layout: str, batch_dim: int) -> None:
    if isinstance(input, Tensor) and input.dim() == ndim - 1:
        raise ValueError(
            f"{layer_name(module)}: expected a {ndim}-D input {layout} with M={module.num_models}, got "
            f"{input.dim()}-D shape {_shape(input.shape)}; unbatched inputs are not supported, pass a batch of "
            f"one (input.unsqueeze({batch_dim}))"
        )


def _check_state(module: nn.Module, state: object, expected: tuple[int, ...], what: str, input: Tensor) -> None:
    if not isinstance(state, Tensor):
        raise TypeError(f"{layer_name(module)}: expected {what} to be a Tensor, got {type(state).__name__}")
    if tuple(state.shape) != expected:
        raise ValueError(
            f"{layer_name(module)}: expected {what} of shape {_shape(expected)}, got {_shape(state.shape)}"
        )
    check_device(module, state, what)
    # Under autocast torch takes states of any floating dtype: a cell's c stays float32 while its h is the
    # autocast dtype, and each step's states come back in.
    if state.dtype != input.dtype and not autocast_enabled(input):
        raise ValueError(f"{layer_name(module)}: {what} dtype {state.dtype} does not match the input's {input.dtype}")


def _check_dtype(module: nn.Module, input: Tensor, weight: Tensor) -> None:
    # As torch.nn.RNNBase.check_input: any input dtype under autocast, which casts the matrix multiplies' operands.
    if input.dtype != weight.dtype and not autocast_enabled(input):
        raise ValueError(
            f"{layer_name(module)}: input dtype {input.dtype} does not match the weights' {weight.dtype}; "
            f"convert the input (input.to({weight.dtype})) or the layer (.to({input.dtype}))"
        )


class _BatchedRNNBase(nn.Module):
    """``num_models`` independent ``torch.nn.RNNBase`` networks: parameters, init, validation, forward."""

    __constants__ = [
        "num_models",
        "mode",
        "input_size",
        "hidden_size",
        "num_layers",
        "bias",
        "batch_first",
        "dropout",
        "bidirectional",
        "proj_size",
    ]
    weight_ih_l0: nn.Parameter  # (registered by __init__, as every layer's and direction's weights)

    def __init__(
        self,
        num_models: int,
        mode: str,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        name = type(self).__name__
        self.num_models = check_num_models(num_models, type(self))
        if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
            raise ValueError(f"{name}: dropout should be a number in [0, 1], got {dropout!r}")
        if dropout > 0 and num_layers == 1:
            warnings.warn(
                f"{name}: dropout adds dropout after all but the last recurrent layer, so non-zero dropout "
                f"expects num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}",
                stacklevel=3,
            )
        for arg, value in (("bias", bias), ("batch_first", batch_first), ("bidirectional", bidirectional)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: {arg} should be a bool, got {type(value).__name__}")
        for arg, size in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{name}: {arg} should be an int, got {type(size).__name__}")
            if size <= 0:
                raise ValueError(f"{name}: {arg} must be greater than zero, got {size}")
        if isinstance(proj_size, bool) or not isinstance(proj_size, int) or proj_size < 0:
            raise ValueError(
                f"{name}: proj_size should be a non-negative int (0 disables projections), got {proj_size!r}"
            )
        if proj_size >= hidden_size:
            raise ValueError(f"{name}: proj_size has to be smaller than hidden_size, got {proj_size} >= {hidden_size}")
        if mode not in GATES:
            raise ValueError(f"{name}: unknown mode {mode!r}, expected one of {tuple(GATES)}")
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size

        gate_size = GATES[mode] * hidden_size
        num_directions = 2 if bidirectional else 1
        out_size = proj_size if proj_size > 0 else hidden_size
        self._flat_weights_names: list[str] = []
        self._all_weights: list[list[str]] = []  # the names of each layer and direction, as torch's
        for layer in range(num_layers):
            layer_input_size = input_size if layer == 0 else out_size * num_directions
            for direction in range(num_directions):
                suffix = f"_l{layer}" + ("_reverse" if direction == 1 else "")
                shapes: dict[str, tuple[int, ...]] = {
                    "weight_ih": (gate_size, layer_input_size),
                    "weight_hh": (gate_size, out_size),
                }
                if bias:
                    shapes.update(bias_ih=(gate_size,), bias_hh=(gate_size,))
                if proj_size > 0:
                    shapes["weight_hr"] = (proj_size, hidden_size)
                for kind, shape in shapes.items():
                    param = nn.Parameter(torch.empty((num_models, *shape), **factory_kwargs))
                    self.register_parameter(kind + suffix, param)
                self._all_weights.append([kind + suffix for kind in shapes])
                self._flat_weights_names.extend(self._all_weights[-1])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same as torch.nn.RNNBase.reset_parameters, one model's slice at a time.
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            init_per_model_(weight, lambda w: init.uniform_(w, -stdv, stdv))

    @property
    def _flat_weights(self) -> list[Tensor]:
        return [getattr(self, name) for name in self._flat_weights_names]

    @property
    def all_weights(self) -> list[list[nn.Parameter]]:
        """The parameters of each layer and direction, in torch's order."""
        return [[getattr(self, name) for name in names] for names in self._all_weights]

    def flatten_parameters(self) -> None:
        """Does nothing: kept so that code written for ``torch.nn.RNNBase`` runs unchanged."""

    def _check_forward_args(self, input: Tensor, hx: object) -> None:
        _refuse_packed(self, input)
        layout = "(M, B, T, input_size)" if self.batch_first else "(M, T, B, input_size)"
        _refuse_unbatched(self, input, 4, layout, 1 if self.batch_first else 2)
        check_input(
            self, input, trailing=[("input_size", self.input_size)], ndims=(4,), layout=layout, check_dtype=False
        )
        _check_dtype(self, input, self.weight_ih_l0)
        if input.shape[2 if self.batch_first else 1] == 0:
            raise ValueError(
                f"{layer_name(self)}: expected input {layout} with at least one time step T, got shape "
                f"{_shape(input.shape)}"
            )
        if hx is None:
            return
        num_directions = 2 if self.bidirectional else 1
        batch = input.shape[1] if self.batch_first else input.shape[2]
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        expected_h = (self.num_models, self.num_layers * num_directions, batch, out_size)
        if self.mode == "LSTM":
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{layer_name(self)}: expected hx to be a tuple (h_0, c_0) or None")
            _check_state(self, hx[0], expected_h, "h_0 (M, L*D, B, H_out)", input)
            expected_c = (*expected_h[:3], self.hidden_size)
            _check_state(self, hx[1], expected_c, "c_0 (M, L*D, B, H)", input)
        else:
            _check_state(self, hx, expected_h, "h_0 (M, L*D, B, H)", input)

    def forward(self, input: Tensor, hx=None):
        self._check_forward_args(input, hx)
        return rnn(
            self.mode,
            input,
            hx,
            self._flat_weights,
            num_layers=self.num_layers,
            bias=self.bias,
            batch_first=self.batch_first,
            dropout=self.dropout,
            training=self.training,
            bidirectional=self.bidirectional,
            proj_size=self.proj_size,
        )

    def extra_repr(self) -> str:
        s = f"num_models={self.num_models}, {self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.mode == "RNN_RELU":
            s += ", nonlinearity='relu'"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if self.batch_first is not False:
            s += f", batch_first={self.batch_first}"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional is not False:
            s += f", bidirectional={self.bidirectional}"
        return s


class BatchedRNN(_BatchedRNNBase):
    r"""``num_models`` independent :class:`torch.nn.RNN` networks (Elman, tanh or ReLU), computed together.

    Each layer projects the inputs of all time steps for all models in one batched multiply, then runs one
    batched multiply per time step for all models and both directions
    (:func:`batchlayers.functional._recurrent.rnn`).

    Args:
        num_models: number of models ``M``.
        input_size, hidden_size, num_layers, nonlinearity, bias, batch_first, dropout, bidirectional: as for
            :class:`torch.nn.RNN`. Dropout draws an independent mask for every model.

    Shape:
        ``M`` models, ``B`` batch, ``T`` time steps, ``L = num_layers``, ``D = 2`` if ``bidirectional`` else 1,
        ``H = hidden_size``.

        - Input: ``(M, T, B, input_size)``, or ``(M, B, T, input_size)`` if ``batch_first``: the model
          dimension first, then torch's own layout. A batch shared by all models is passed as
          ``x.expand(M, *x.shape)`` and is never copied. Unbatched ``(M, T, input_size)`` inputs and
          ``PackedSequence`` are refused: pad the sequences into one tensor.
        - h_0: ``(M, L*D, B, H)``; zeros if not given.
        - Output: ``(M, T, B, D*H)``, or ``(M, B, T, D*H)`` if ``batch_first``; h_n ``(M, L*D, B, H)``.

    Attributes:
        weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k} (and ``_reverse``): torch's parameters with
            a leading model dimension, e.g. ``weight_ih_l0`` is ``(M, hidden_size, input_size)``; each model's
            slice is drawn like torch's, :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`, :math:`k = 1/\text{hidden\_size}`.

    Examples::

        >>> rnn = BatchedRNN(4, 10, 20, num_layers=2)
        >>> x = torch.randn(5, 3, 10)                  # (T, B, input_size), shared by the 4 models
        >>> output, h_n = rnn(x.expand(4, *x.shape))
        >>> output.shape, h_n.shape
        (torch.Size([4, 5, 3, 20]), torch.Size([4, 2, 3, 20]))
    """

    torch_module = nn.RNN
    __constants__ = [*_BatchedRNNBase.__constants__, "nonlinearity"]

    def __init__(
        self,
        num_models: int,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        modes = {"tanh": "RNN_TANH", "relu": "RNN_RELU"}
        if nonlinearity not in modes:
            raise ValueError(f"BatchedRNN: unknown nonlinearity {nonlinearity!r}, select 'tanh' or 'relu'")
        self.nonlinearity = nonlinearity
        super().__init__(
            num_models,
            modes[nonlinearity],
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            device=device,
            dtype=dtype,
        )


class BatchedLSTM(_BatchedRNNBase):
    r"""``num_models`` independent :class:`torch.nn.LSTM` networks, computed together.

    Gates ``i, f, g, o`` as torch; with ``proj_size > 0`` the hidden state is projected by ``weight_hr``.
    Each layer projects the inputs of all time steps for all models in one batched multiply, then runs one
    batched multiply per time step for all models and both directions.

    Args:
        num_models: number of models ``M``.
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size: as for
            :class:`torch.nn.LSTM`. Dropout draws an independent mask for every model.

    Shape:
        ``M`` models, ``B`` batch, ``T`` time steps, ``L = num_layers``, ``D = 2`` if ``bidirectional`` else 1,
        ``H = hidden_size``, ``H_out = proj_size`` if ``proj_size > 0`` else ``H``.

        - Input: ``(M, T, B, input_size)``, or ``(M, B, T, input_size)`` if ``batch_first``: the model
          dimension first, then torch's own layout. A batch shared by all models is passed as
          ``x.expand(M, *x.shape)`` and is never copied. Unbatched ``(M, T, input_size)`` inputs and
          ``PackedSequence`` are refused: pad the sequences into one tensor.
        - hx: a tuple ``(h_0, c_0)``, h_0 ``(M, L*D, B, H_out)``, c_0 ``(M, L*D, B, H)``; zeros if not given.
        - Output: ``(M, T, B, D*H_out)``, or ``(M, B, T, D*H_out)`` if ``batch_first``; ``(h_n, c_n)``
          shaped like ``(h_0, c_0)``.

    Attributes:
        weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}, weight_hr_l{k} (and ``_reverse``): torch's
            parameters with a leading model dimension, e.g. ``weight_ih_l0`` is ``(M, 4*hidden_size,
            input_size)``; each model's slice is drawn like torch's, :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`,
            :math:`k = 1/\text{hidden\_size}`.

    Examples::

        >>> lstm = BatchedLSTM(4, 10, 20, batch_first=True)
        >>> x = torch.randn(4, 3, 5, 10)               # (M, B, T, input_size): a batch per model
        >>> output, (h_n, c_n) = lstm(x)
        >>> output.shape, h_n.shape, c_n.shape
        (torch.Size([4, 3, 5, 20]), torch.Size([4, 1, 3, 20]), torch.Size([4, 1, 3, 20]))
    """

    torch_module = nn.LSTM

    def __init__(
        self,
        num_models: int,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            num_models,
            "LSTM",
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            proj_size,
            device=device,
            dtype=dtype,
        )


class BatchedGRU(_BatchedRNNBase):
    r"""``num_models`` independent :class:`torch.nn.GRU` networks, computed together.

    Gates ``r, z, n`` as torch, with ``r`` applied to ``W_hn h + b_hn``. Each layer projects the inputs of all
    time steps for all models in one batched multiply, then runs one batched multiply per time step for all
    models and both directions.

    Args:
        num_models: number of models ``M``.
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional: as for
            :class:`torch.nn.GRU`. Dropout draws an independent mask for every model.

    Shape:
        ``M`` models, ``B`` batch, ``T`` time steps, ``L = num_layers``, ``D = 2`` if ``bidirectional`` else 1,
        ``H = hidden_size``.

        - Input: ``(M, T, B, input_size)``, or ``(M, B, T, input_size)`` if ``batch_first``: the model
          dimension first, then torch's own layout. A batch shared by all models is passed as
          ``x.expand(M, *x.shape)`` and is never copied. Unbatched ``(M, T, input_size)`` inputs and
          ``PackedSequence`` are refused: pad the sequences into one tensor.
        - h_0: ``(M, L*D, B, H)``; zeros if not given.
        - Output: ``(M, T, B, D*H)``, or ``(M, B, T, D*H)`` if ``batch_first``; h_n ``(M, L*D, B, H)``.

    Attributes:
        weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k} (and ``_reverse``): torch's parameters with
            a leading model dimension, e.g. ``weight_ih_l0`` is ``(M, 3*hidden_size, input_size)``; each
            model's slice is drawn like torch's, :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`,
            :math:`k = 1/\text{hidden\_size}`.

    Examples::

        >>> gru = BatchedGRU(4, 10, 20, bidirectional=True)
        >>> output, h_n = gru(torch.randn(4, 5, 3, 10))
        >>> output.shape, h_n.shape
        (torch.Size([4, 5, 3, 40]), torch.Size([4, 2, 3, 20]))
    """

    torch_module = nn.GRU

    def __init__(
        self,
        num_models: int,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            num_models,
            "GRU",
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            device=device,
            dtype=dtype,
        )


class _BatchedRNNCellBase(nn.Module):
    """``num_models`` independent ``torch.nn.RNNCellBase`` cells: one time step of a one-layer network."""

    __constants__ = ["num_models", "input_size", "hidden_size", "bias"]
    _mode = "RNN_TANH"

    def __init__(self, num_models: int, input_size: int, hidden_size: int, bias: bool, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.num_models = check_num_models(num_models, type(self))
        self.input_size = check_size(type(self).__name__, "input_size", input_size, 1)
        self.hidden_size = check_size(type(self).__name__, "hidden_size", hidden_size, 1)
        self.bias = bias
        gate_size = GATES[self._mode] * hidden_size
        self.weight_ih = nn.Parameter(torch.empty((num_models, gate_size, input_size), **factory_kwargs))
        self.weight_hh = nn.Parameter(torch.empty((num_models, gate_size, hidden_size), **factory_kwargs))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty((num_models, gate_size), **factory_kwargs))
            self.bias_hh = nn.Parameter(torch.empty((num_models, gate_size), **factory_kwargs))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same as torch.nn.RNNCellBase.reset_parameters, one model's slice at a time.
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            init_per_model_(weight, lambda w: init.uniform_(w, -stdv, stdv))

    def _step(self, mode: str, input: Tensor, hx):
        _refuse_packed(self, input)
        _refuse_unbatched(self, input, 3, "(M, B, input_size)", 1)
        check_input(
            self,
            input,
            trailing=[("input_size", self.input_size)],
            ndims=(3,),
            layout="(M, B, input_size)",
            check_dtype=False,
        )
        _check_dtype(self, input, self.weight_ih)
        expected = (self.num_models, input.shape[1], self.hidden_size)
        if hx is not None:
            states = hx if mode == "LSTM" else (hx,)
            if mode == "LSTM" and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
                raise TypeError(f"{layer_name(self)}: expected hx to be a tuple (h, c) or None")
            for what, state in zip(("h (M, B, H)", "c (M, B, H)"), states):
                _check_state(self, state, expected, what, input)
            hx = tuple(s.unsqueeze(1) for s in states) if mode == "LSTM" else hx.unsqueeze(1)
        weights = [self.weight_ih, self.weight_hh]
        if self.bias:
            weights += [self.bias_ih, self.bias_hh]
        _, state = rnn(
            mode,
            input.unsqueeze(1),
            hx,
            weights,
            num_layers=1,
            bias=self.bias,
            batch_first=False,
            dropout=0.0,
            training=False,
            bidirectional=False,
            cell=True,
        )
        return (state[0][:, 0], state[1][:, 0]) if mode == "LSTM" else cast(Tensor, state)[:, 0]

    def forward(self, input: Tensor, hx=None):
        return self._step(self._mode, input, hx)

    def extra_repr(self) -> str:
        s = f"num_models={self.num_models}, {self.input_size}, {self.hidden_size}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity!r}"
        return s


class BatchedRNNCell(_BatchedRNNCellBase):
    r"""``num_models`` independent :class:`torch.nn.RNNCell` cells (tanh or ReLU), computed together.

    Args:
        num_models: number of models ``M``.
        input_size, hidden_size, bias, nonlinearity: as for :class:`torch.nn.RNNCell`.

    Shape:
        - Input: ``(M, B, input_size)``; a batch shared by all models may be ``x.expand(M, *x.shape)``.
          Unbatched ``(M, input_size)`` inputs are refused.
        - hx: ``(M, B, hidden_size)``; zeros if not given.
        - Output: h' ``(M, B, hidden_size)``.

    Attributes:
        weight_ih: ``(M, hidden_size, input_size)``; weight_hh: ``(M, hidden_size, hidden_size)``;
            bias_ih, bias_hh: ``(M, hidden_size)``. Each model's slice is drawn like torch's,
            :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`, :math:`k = 1/\text{hidden\_size}`.

    Examples::

        >>> cell = BatchedRNNCell(4, 10, 20)
        >>> cell(torch.randn(4, 3, 10)).shape
        torch.Size([4, 3, 20])
    """

    torch_module = nn.RNNCell
    __constants__ = [*_BatchedRNNCellBase.__constants__, "nonlinearity"]

    def __init__(
        self,
        num_models: int,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        device=None,
        dtype=None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"BatchedRNNCell: unknown nonlinearity {nonlinearity!r}, select 'tanh' or 'relu'")
        super().__init__(num_models, input_size, hidden_size, bias, device=device, dtype=dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        return self._step("RNN_TANH" if self.nonlinearity == "tanh" else "RNN_RELU", input, hx)


class BatchedLSTMCell(_BatchedRNNCellBase):
    r"""``num_models`` independent :class:`torch.nn.LSTMCell` cells, computed together.

    Args:
        num_models: number of models ``M``.
        input_size, hidden_size, bias: as for :class:`torch.nn.LSTMCell`.

    Shape:
        - Input: ``(M, B, input_size)``; a batch shared by all models may be ``x.expand(M, *x.shape)``.
          Unbatched ``(M, input_size)`` inputs are refused.
        - hx: a tuple ``(h, c)``, each ``(M, B, hidden_size)``; zeros if not given.
        - Output: ``(h', c')``, each ``(M, B, hidden_size)``.

    Attributes:
        weight_ih: ``(M, 4*hidden_size, input_size)``; weight_hh: ``(M, 4*hidden_size, hidden_size)``;
            bias_ih, bias_hh: ``(M, 4*hidden_size)``. Each model's slice is drawn like torch's,
            :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`, :math:`k = 1/\text{hidden\_size}`.

    Examples::

        >>> cell = BatchedLSTMCell(4, 10, 20)
        >>> h, c = cell(torch.randn(4, 3, 10))
        >>> h.shape, c.shape
        (torch.Size([4, 3, 20]), torch.Size([4, 3, 20]))
    """

    torch_module = nn.LSTMCell
    _mode = "LSTM"

    def __init__(
        self, num_models: int, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__(num_models, input_size, hidden_size, bias, device=device, dtype=dtype)


class BatchedGRUCell(_BatchedRNNCellBase):
    r"""``num_models`` independent :class:`torch.nn.GRUCell` cells, computed together.

    Args:
        num_models: number of models ``M``.
        input_size, hidden_size, bias: as for :class:`torch.nn.GRUCell`.

    Shape:
        - Input: ``(M, B, input_size)``; a batch shared by all models may be ``x.expand(M, *x.shape)``.
          Unbatched ``(M, input_size)`` inputs are refused.
        - hx: ``(M, B, hidden_size)``; zeros if not given.
        - Output: h' ``(M, B, hidden_size)``.

    Attributes:
        weight_ih: ``(M, 3*hidden_size, input_size)``; weight_hh: ``(M, 3*hidden_size, hidden_size)``;
            bias_ih, bias_hh: ``(M, 3*hidden_size)``. Each model's slice is drawn like torch's,
            :math:`\mathcal{U}(-\sqrt{k}, \sqrt{k})`, :math:`k = 1/\text{hidden\_size}`.

    Examples::

        >>> cell = BatchedGRUCell(4, 10, 20)
        >>> cell(torch.randn(4, 3, 10)).shape
        torch.Size([4, 3, 20])
    """

    torch_module = nn.GRUCell
    _mode = "GRU"

    def __init__(
        self, num_models: int, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__(num_models, input_size, hidden_size, bias, device=device, dtype=dtype)
