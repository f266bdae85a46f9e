"""Batched multi-layer RNN, LSTM and GRU: every model's recurrence in one batched multiply per time step.

A layer runs in two parts, as torch's own CPU kernels do. The input projection of all time steps, of both
directions and of all models is one GEMM, ``bmm`` over ``(M, T*B, I) x (M, I, D*G)``. The recurrence then
runs one GEMM per time step over ``(D*M, B, H_out) x (D*M, H_out, G)``: the reverse direction is just ``M``
more "models" that read the time-flipped projection, so a bidirectional layer costs no more Python steps
than a unidirectional one.

Measured on a shared 2-core CPU (torch 2.13, float32, interleaved medians of 9, forward + backward, three
runs), against a Python loop over ``M`` ``nn.LSTM`` modules (oneDNN kernels): 1-layer LSTM, hidden 64, T=16,
B=8, M=32: 2.1-2.4x faster (1.2-1.5x with one thread); 2-layer LSTM, hidden 256, T=32, B=64, M=8: 0.7-0.95x.
Large per-model GEMMs gain nothing from batching, and oneDNN's fused LSTM kernels beat the dozen elementwise
ops per step here. On the CPU the LSTM's and GRU's backward run each step's elementwise part in one pass of a C
kernel of batchlayers' own (``_recurrent_native.c``, the same arithmetic as the ops it replaces; see
:data:`NATIVE_MAX_UNITS`).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _native, _workspace
from .._utils import autocast_enabled, check_call_input, check_parameter, check_weight, is_shared
from ._linear import fusable_context

__all__ = ["rnn"]

GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


def rnn(
    mode: str,
    input: Tensor,
    hx: Tensor | tuple[Tensor, Tensor] | None,
    weights: Sequence[Tensor],
    *,
    num_layers: int,
    bias: bool,
    batch_first: bool,
    dropout: float,
    training: bool,
    bidirectional: bool,
    proj_size: int = 0,
    generator: torch.Generator | None = None,
    cell: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, tuple[Tensor, Tensor]]:
    r"""Run ``M`` multi-layer recurrent networks (torch's ``RNN``, ``LSTM`` or ``GRU``) at once.

    Model ``m`` computes exactly what ``torch.nn.{RNN,LSTM,GRU}`` computes with the weights
    ``[w[m] for w in weights]``: gates ``i, f, g, o`` for LSTM (with ``h = W_hr (o * tanh(c))`` when
    ``proj_size > 0``), ``r, z, n`` for GRU with ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``.

    Args:
        mode: ``"RNN_TANH"``, ``"RNN_RELU"``, ``"LSTM"`` or ``"GRU"``.
        input: ``(M, B, T, I)`` if ``batch_first`` else ``(M, T, B, I)``. A batch shared by all models may be a
            stride-0 expand; it is never copied.
        hx: the initial hidden state ``(M, L*D, B, H_out)``, for LSTM a tuple ``(h_0, c_0)`` with ``c_0``
            ``(M, L*D, B, H)``; ``None`` for zeros.
        weights: ``(M, *torch shape)`` tensors in torch's ``_flat_weights`` order: per layer, forward direction
            then reverse, ``w_ih, w_hh``, then ``b_ih, b_hh`` if ``bias``, then ``w_hr`` if ``proj_size > 0``.
        num_layers: ``L``, the number of stacked layers.
        bias: whether ``weights`` holds the biases.
        batch_first: the layout of ``input`` and of the output.
        dropout: probability of zeroing each output element of every layer but the last, in training mode;
            every model (and every element) draws its own mask.
        training: apply ``dropout`` only when ``True``.
        bidirectional: ``D = 2`` directions if ``True``, else ``D = 1``.
        proj_size: LSTM projection size (``H_out = proj_size`` if ``> 0``, else ``H_out = H``).
        generator: the random generator of the dropout masks (default: torch's global one).
        cell: the time steps are calls of torch's ``RNNCell``/``LSTMCell``/``GRUCell`` rather than of its
            ``RNN``/``LSTM``/``GRU``; this only changes the dtypes under autocast, where torch's kernels differ.

    Returns:
        ``(output, h_n)``, for LSTM ``(output, (h_n, c_n))``. ``output`` is ``(M, B, T, D*H_out)`` if
        ``batch_first`` else ``(M, T, B, D*H_out)``; ``h_n`` is ``(M, L*D, B, H_out)``, ``c_n``
        ``(M, L*D, B, H)``.

    Under autocast the dtypes are torch's: where torch's kernel casts every operand to one dtype (an LSTM on
    CPU through oneDNN, every network on CUDA through cuDNN, the cells on CUDA), everything is cast to it and
    the recurrence runs in it; elsewhere (e.g. GRU on CPU) the matrix multiplies run in the autocast dtype and
    the states keep the dtype the elementwise ops promote them to, as in torch's composite kernels.

    In eager mode the recurrence is an autograd Function with a hand-written backward, which does not support
    double backward (``create_graph=True`` through it raises); under ``torch.compile`` it is a composition of
    differentiable ops. An LSTM of a few models with large matrix multiplies (float32 on CPU, at most 8 models,
    ``B * H >= 4096``, no projection, no dropout in training) instead runs torch's own kernel once per model,
    the call ``torch.nn.LSTM`` makes (see ``_per_model_kernels``).
    """
    if mode not in GATES:
        raise ValueError(f"rnn: mode must be one of {tuple(GATES)}, got {mode!r}")
    if proj_size and mode != "LSTM":
        raise ValueError(f"rnn: proj_size is only supported for LSTM, got mode={mode!r}")
    num_directions = 2 if bidirectional else 1
    per_direction = 2 + 2 * bool(bias) + (proj_size > 0)
    if len(weights) != num_layers * num_directions * per_direction:
        raise ValueError(
            f"rnn: expected {num_layers * num_directions * per_direction} weights for {num_layers} layer(s), "
            f"{num_directions} direction(s), bias={bias}, proj_size={proj_size}; got {len(weights)}"
        )
    if isinstance(input, Tensor) and input.dim() == 4 and input.shape[2 if batch_first else 1] == 0:
        raise ValueError(f"rnn: expected a 4-D input with at least one time step, got shape {tuple(input.shape)}")
    _check_arguments(mode, input, hx, weights, num_layers, num_directions, bias, batch_first, proj_size)
    cast_to = _autocast_kernel_dtype(mode, input, proj_size, cell)
    if cast_to is not None:
        with torch.autocast(input.device.type, enabled=False):
            return rnn(
                mode,
                _autocast(input, cast_to),
                None
                if hx is None
                else cast("tuple[Tensor, Tensor]", tuple(_autocast(h, cast_to) for h in hx))
                if mode == "LSTM"
                else _autocast(cast(Tensor, hx), cast_to),
                [_autocast(w, cast_to) for w in weights],
                num_layers=num_layers,
                bias=bias,
                batch_first=batch_first,
                dropout=dropout,
                training=training,
                bidirectional=bidirectional,
                proj_size=proj_size,
                generator=generator,
                cell=cell,
            )
    num_models = input.shape[0]
    batch = input.shape[1] if batch_first else input.shape[2]
    hidden_size = weights[0].shape[1] // GATES[mode]
    out_size = proj_size if proj_size > 0 else hidden_size
    lstm = mode == "LSTM"
    per_model = lstm and not cell and not (dropout > 0 and training)
    if per_model and _per_model_kernels(input, batch, hidden_size, proj_size):
        return _per_model_lstm(
            input, hx, weights, num_layers, bias, batch_first, dropout, training, bidirectional, hidden_size, out_size
        )
    c0: list[Tensor] | None
    if hx is None:
        zeros = input.new_zeros(num_directions * num_models, batch, out_size)
        h0 = [zeros] * num_layers
        c0 = [zeros if proj_size == 0 else input.new_zeros(num_directions * num_models, batch, hidden_size)]
        c0 = c0 * num_layers
    elif lstm:
        h_all, c_all = cast("tuple[Tensor, Tensor]", hx)
        h0 = [_directions_to_models(h_all, layer, num_directions) for layer in range(num_layers)]
        c0 = [_directions_to_models(c_all, layer, num_directions) for layer in range(num_layers)]
    else:
        h0 = [_directions_to_models(cast(Tensor, hx), layer, num_directions) for layer in range(num_layers)]
        c0 = None

    time_dim = 2 if batch_first else 1
    layer_input, input_time_dim = input, time_dim
    h_n: list[Tensor] = []
    c_n: list[Tensor] = []
    for layer in range(num_layers):
        start = layer * num_directions * per_direction
        params = [weights[start + d * per_direction : start + (d + 1) * per_direction] for d in range(num_directions)]
        c0_layer = c0[layer] if lstm and c0 is not None else None
        # Between layers the output stays time-major, (M, T, B, H), as the steps write it: the next layer's
        # input projection reads its rows as they are. Only the last layer's output takes the input's layout.
        output_time_dim = time_dim if layer == num_layers - 1 else 1
        output, h_last, c_last = _layer(
            mode, layer_input, h0[layer], c0_layer, params, bias, proj_size, input_time_dim, output_time_dim
        )
        h_n.extend(h_last.view(num_directions, num_models, *h_last.shape[1:]).unbind(0))
        if lstm:
            c_last = cast(Tensor, c_last)  # (an LSTM layer returns its c)
            c_n.extend(c_last.view(num_directions, num_models, *c_last.shape[1:]).unbind(0))
        if dropout > 0 and training and layer < num_layers - 1:
            output = _dropout(output, dropout, generator)
        layer_input, input_time_dim = output, output_time_dim
    h_stacked = torch.stack(h_n, 1)
    return (layer_input, (h_stacked, torch.stack(c_n, 1))) if lstm else (layer_input, h_stacked)


def _check_arguments(mode, input, hx, weights, num_layers, num_directions, bias, batch_first, proj_size) -> None:
    """Refuse, naming the function and the offending weight or state, shapes that do not fit together; torch's
    messages would name the batched matrix multiplies'."""
    function = "batchlayers.functional.rnn"
    gates = GATES[mode]
    num_models, gate_size, input_size = check_weight(function, "weights[0] (w_ih_l0)", weights[0], 3, "(M, G*H, I)")
    if gate_size % gates:
        raise ValueError(
            f"{function}: weights[0] (w_ih_l0) is (M, G*H, I) with G={gates} gates for {mode}, but its dimension 1 "
            f"is {gate_size}: shape {tuple(weights[0].shape)}"
        )
    hidden_size = gate_size // gates
    out_size = proj_size if proj_size > 0 else hidden_size
    layout = "(M, B, T, input_size)" if batch_first else "(M, T, B, input_size)"
    check_call_input(function, input, num_models, trailing=[("input_size", input_size)], ndims=[4], layout=layout)
    per_direction = 2 + 2 * bool(bias) + (proj_size > 0)
    for layer in range(num_layers):
        layer_input = input_size if layer == 0 else out_size * num_directions
        for direction in range(num_directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            names = ["w_ih", "w_hh", *(["b_ih", "b_hh"] if bias else []), *(["w_hr"] if proj_size > 0 else [])]
            shapes = {
                "w_ih": ((gate_size, layer_input), "(M, G*H, I)"),
                "w_hh": ((gate_size, out_size), "(M, G*H, H_out)"),
                "b_ih": ((gate_size,), "(M, G*H)"),
                "b_hh": ((gate_size,), "(M, G*H)"),
                "w_hr": ((proj_size, hidden_size), "(M, proj_size, H)"),
            }
            start = (layer * num_directions + direction) * per_direction
            for k, name in enumerate(names):
                shape, layout_w = shapes[name]
                index = start + k
                w = weights[index]
                if w is None:
                    raise TypeError(f"{function}: weights[{index}] ({name}{suffix}) {layout_w} is None")
                check_parameter(function, f"weights[{index}] ({name}{suffix})", w, (num_models, *shape), layout_w)
    if hx is None:
        return
    batch = input.shape[1] if batch_first else input.shape[2]
    expected_h = (num_models, num_layers * num_directions, batch, out_size)
    if mode == "LSTM":
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"{function}: LSTM expects hx = (h_0, c_0) or None, got {type(hx).__name__}")
        check_parameter(function, "h_0", hx[0], expected_h, "(M, L*D, B, H_out)", input)
        check_parameter(function, "c_0", hx[1], (*expected_h[:3], hidden_size), "(M, L*D, B, H)", input)
    else:
        check_parameter(function, "h_0", hx, expected_h, "(M, L*D, B, H)", input)


# Under autocast, the dtype torch's own kernel casts every operand to before running the whole recurrence in
# it, as registered in torch 2.13 (torch._C._dispatch_dump): on CPU, mkldnn_rnn_layer (an LSTM without projections
# through oneDNN) is on autocast's lower-precision list; on CUDA, cuDNN's RNNs are cast to float16 whatever the
# autocast dtype (ATen/cudnn/AutocastRNN.cpp), and rnn_tanh_cell, lstm_cell and gru_cell are on the
# lower-precision list. Elsewhere torch's composite kernels run their matrix multiplies in the autocast dtype and
# the elementwise ops promote with the states: a CPU GRU, or LSTMCell's c, stays float32 for a float32 input.
# The CUDA rules are read from torch's source, not run here (no GPU).


def _autocast_kernel_dtype(mode: str, x: Tensor, proj_size: int, cell: bool) -> torch.dtype | None:
    device = x.device.type
    if not autocast_enabled(x) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None  # autocast leaves float64 alone
    if cell:
        return torch.get_autocast_dtype(device) if device == "cuda" else None
    if device == "cuda":
        return torch.float16 if torch.backends.cudnn.is_acceptable(x) else None
    if device == "cpu" and mode == "LSTM" and proj_size == 0 and _onednn_lstm(x):
        return torch.get_autocast_dtype(device)
    return None


def _onednn_lstm(x: Tensor) -> bool:
    """Whether torch's CPU LSTM takes ``x`` through oneDNN (``use_mkldnn`` in ATen's RNN.cpp)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled) or x.numel() == 0:
        return False
    if x.dtype == torch.float32:
        return True
    if x.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return not torch.is_grad_enabled() and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _per_model_kernels(x: Tensor, batch: int, hidden_size: int, proj_size: int) -> bool:
    """Whether an LSTM runs each model through torch's own kernel (oneDNN's fused LSTM on CPU), one call per
    model, rather than as one batched recurrence: where a model's matrix multiplies are large and the models
    few, oneDNN's per-model kernel beats the batched composition, and it is torch.nn.LSTM's own arithmetic.

    Measured (2-core Xeon, torch 2.13, float32, forward and backward, interleaved medians; (M, B, H, T, layers),
    batched vs per model, ms): (8, 64, 256, 32, 2) 693 vs 624; (4, 16, 256, 32, 1) 31 vs 26; (8, 128, 64, 32, 1)
    72 vs 47; (8, 32, 128, 32, 1) 45 vs 45; but (16, 64, 128, 32, 1) 156 vs 177, (16, 32, 64, 32, 2) 65 vs 72 and
    the RL policy's (32, 8, 64, 16, 1) 10 vs 29. Hence: at most 8 models and ``B * H >= 4096``. Not under
    ``torch.compile`` (which traces the batched recurrence), not with projections (torch's kernel then leaves
    oneDNN), not in training with dropout (the batched path draws every model's mask at once).
    """
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and proj_size == 0
        and x.shape[0] <= 8
        and batch * hidden_size >= 4096
        and not torch.compiler.is_compiling()
        and _onednn_lstm(x)
    )


def _per_model_lstm(
    x: Tensor,
    hx: Tensor | tuple[Tensor, Tensor] | None,
    weights: Sequence[Tensor],
    num_layers: int,
    bias: bool,
    batch_first: bool,
    dropout: float,
    training: bool,
    bidirectional: bool,
    hidden_size: int,
    out_size: int,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Each model's ``torch.lstm``, the call ``torch.nn.LSTM.forward`` makes, with its slice of every weight and
    state; the outputs and final states stacked along the model dimension (a shared stride-0 batch unbinds into
    M views of the batch itself: no copy). The stacked output, and in backward the stacked input and weight
    gradients, go into kept memory (``_workspace.stack``/``unbind``): allocated afresh they were most of the
    page faults of a training step (the benchmark's 2x256 LSTM, M=8: 94k a step, 28k kept; 0.84x -> 0.96x the
    loop's speed, three alternating fresh processes each)."""
    if hx is None:
        lead = (num_layers * (2 if bidirectional else 1), x.shape[1] if batch_first else x.shape[2])
        zeros = x.new_zeros(*lead, out_size), x.new_zeros(*lead, hidden_size)
        states = [zeros] * x.shape[0]
    else:
        h0, c0 = cast("tuple[Tensor, Tensor]", hx)
        states = list(zip(h0.unbind(0), c0.unbind(0)))
    # unbind, not indexing: the backward of M index views would write M full-size zero-filled gradients per
    # weight (2x256 LSTM, M=8, training step: 529 ms against the loop's 395); unbind's stacks them once.
    # (A weight gradient stacked into kept memory is a tensor of its own that autograd keeps as .grad: its
    # memory is reused only once that is dropped, see _workspace.returned.)
    per_model_weights = zip(*(_workspace.unbind(w) for w in weights))
    outputs, h_n, c_n = [], [], []
    for xm, state, params in zip(_workspace.unbind(x), states, per_model_weights):
        out, h, c = torch.lstm(xm, state, list(params), bias, num_layers, dropout, training, bidirectional, batch_first)
        outputs.append(out)
        h_n.append(h)
        c_n.append(c)
    return _workspace.stack(outputs), (torch.stack(h_n), torch.stack(c_n))


def _autocast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as autocast casts an operand: floating tensors but float64."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def _directions_to_models(state: Tensor, layer: int, num_directions: int) -> Tensor:
    """Layer ``layer``'s ``(M, D, B, H)`` slice of an ``(M, L*D, B, H)`` state as ``(D*M, B, H)``, direction-major."""
    if num_directions == 1:
        return state[:, layer]
    per_layer = state[:, layer * num_directions : (layer + 1) * num_directions]
    return per_layer.transpose(0, 1).reshape(-1, *state.shape[2:])


def _dropout(x: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    if generator is None:
        return F.dropout(x, p, training=True)
    if p == 1:
        return x * torch.zeros_like(x)
    mask = torch.empty_like(x).bernoulli_(1 - p, generator=generator)
    return x * mask * (1 / (1 - p))


def _cat_directions(tensors: list[Tensor], dim: int) -> Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def _layer(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    params: list[Sequence[Tensor]],
    bias: bool,
    proj_size: int,
    time_dim: int,
    output_time_dim: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer, all directions: ``x`` ``(M, T, B, I)`` (``time_dim`` 1) or ``(M, B, T, I)`` (``time_dim`` 2)
    -> the output, contiguous, in the layout ``output_time_dim`` names, and the final ``(D*M, B, H_out)`` states
    of the directions."""
    num_models, num_directions = x.shape[0], len(params)
    w_ih = [p[0] for p in params]
    gate_size = w_ih[0].shape[1]

    if time_dim == 2 and x.shape[-1] < num_directions * gate_size and _records_projection(x, params):
        # The steps write the gradient of the projected inputs time-major, (M, T, B, D*G): projecting
        # batch-first rows would copy that gradient into their order in backward. Copying the narrower input
        # into time-major rows once is cheaper (the RL policy's LSTM, (32, 8, 16, 16) inputs and 256 gates:
        # a 65k-element copy instead of a 1M-element one).
        x, time_dim = x.transpose(1, 2), 1

    # The input projection of every step, direction and model: one GEMM. A shared batch stays one batch (a
    # stride-0 expand of its rows, copied once at most).
    w_in = _cat_directions(w_ih, 1).transpose(1, 2)  # (M, I, D*G)
    x3 = _rows(x)
    b_rec = None
    if bias and mode == "GRU":
        # r multiplies W_hn h + b_hn, so b_hh stays in the recurrence and b_ih goes with the projection.
        b_rec = _cat_directions([p[3] for p in params], 0)
        projected = _project(x3, w_in, _cat_directions([p[2] for p in params], 1).unsqueeze(1))
    else:
        # RNN and LSTM add both biases before any nonlinearity: the recurrence adds b_ih + b_hh to each step's
        # projected input, which costs no extra op there and spares the projection a pass over its output
        # (one thread, (32, 128, 64) x (32, 64, 256): bmm 1.03 ms, baddbmm with the bias 1.55 ms).
        if bias:
            b_rec = _cat_directions([p[2] + p[3] for p in params], 0)  # (D*M, G)
        projected = _project(x3, w_in)
    projected = projected.view(*x.shape[:-1], num_directions, gate_size)
    if time_dim == 2:
        projected = projected.transpose(1, 2)  # (M, T, B, D, G)
    if num_directions == 1:
        inputs = projected.squeeze(3)
    else:  # the reverse direction reads time backwards: (D*M, T, B, G), direction-major
        inputs = torch.cat([projected[:, :, :, 0], projected[:, :, :, 1].flip(1)], 0)

    w_rec = _cat_directions([p[1] for p in params], 0)  # (D*M, G, H_out)
    w_proj = _cat_directions([p[-1] for p in params], 0) if proj_size > 0 else None  # (D*M, H_out, H)
    # Under autocast the plain steps: their matrix multiplies autocast and their elementwise ops promote with the
    # states as torch's composite cells do; the Functions write into buffers of one dtype.
    fused = _fused_steps(x)
    if mode == "LSTM":
        steps = _LSTMSteps.apply if fused else _lstm_steps
        hs, h_last, c_last = steps(inputs, b_rec, h0, cast(Tensor, c0), w_rec, w_proj)  # (an LSTM is given c0)
    elif mode == "GRU":
        steps = _GRUSteps.apply if fused else _gru_steps
        hs, h_last = steps(inputs, h0, w_rec, b_rec)
        c_last = None
    else:
        steps = _RNNSteps.apply if fused else _rnn_steps
        hs, h_last = steps(inputs, b_rec, h0, w_rec, mode == "RNN_RELU")
        c_last = None

    # hs: (D*M, T, B, H_out) in step order
    if num_directions == 1:
        output = hs if output_time_dim == 1 else hs.transpose(1, 2).contiguous()
    else:
        forward, backward = hs[:num_models], hs[num_models:].flip(1)
        output = torch.cat([forward.movedim(1, output_time_dim), backward.movedim(1, output_time_dim)], -1)
    return output, h_last, c_last


def _project(x3: Tensor, w_in: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x3 @ w_in`` (plus ``bias``, ``(M, 1, G)``); on the CPU from :data:`batchlayers._workspace.MMAP_BYTES` on,
    in a :func:`fusable_context`, in memory kept between calls (:func:`batchlayers._workspace.returned`): the
    steps use the projection up within the layer, so the next layer's and the next call's take the same pages
    instead of new ones from the OS."""
    shape = (x3.shape[0], x3.shape[1], w_in.shape[2])
    if not (_fused_steps(x3) and _workspace.applies(x3, *shape, min_bytes=_workspace.MMAP_BYTES)):
        return torch.bmm(x3, w_in) if bias is None else torch.baddbmm(bias, x3, w_in)
    if not _records_projection(x3, [[w_in, *([] if bias is None else [bias])]]):
        return _KeptProduct.forward(x3, w_in, bias)
    return _KeptProduct.apply(x3, w_in, bias)


class _KeptProduct(torch.autograd.Function):
    """``torch.bmm(a, b)``, or ``torch.baddbmm(bias, a, b)`` with an ``(M, 1, n)`` ``bias``, into memory kept
    between calls (:func:`batchlayers._workspace.returned`), with their backward (written with differentiable
    ops: a double backward differentiates it)."""

    @staticmethod
    def forward(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
        out = _workspace.returned(a, a.shape[0], a.shape[1], b.shape[2])
        return torch.bmm(a, b, out=out) if bias is None else torch.baddbmm(bias, a, b, out=out)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:2])

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        grad_a = torch.bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_b = torch.bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(1, keepdim=True) if ctx.needs_input_grad[2] else None
        return grad_a, grad_b, grad_bias


def _records_projection(x: Tensor, params: list[Sequence[Tensor]]) -> bool:
    """Whether autograd records the input projection, so that its backward computes the projected inputs'
    gradient."""
    return torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for p in params for t in p))


# The recurrences, written twice. The plain versions are compositions of differentiable ops: torch.compile
# traces them (and derives the backward itself), and they support double backward. The autograd Functions
# run the same math without an autograd node per op and write every step into preallocated buffers; their
# hand-written backward runs a few fused ops per step (aten's sigmoid/tanh backward kernels) and computes
# each weight gradient as one GEMM over all steps, instead of a small GEMM and an accumulation per step.
# Their outputs and gradients are model-major, (N, T, B, *), so that those GEMMs read them without a copy;
# per-step buffers written by a GEMM are step-major, (T, N, B, *), since a GEMM into a strided slice copies.
# Measured (2 cores, forward + backward, interleaved medians), Functions vs plain autograd: LSTM hidden 64,
# T=16, B=8, M=32: 1.30x; GRU, same sizes: 1.31x; 2-layer LSTM hidden 256, T=32, B=64, M=8: 1.14x. Each
# step's slices are made up front (one unbind per buffer), not by indexing inside the loop. A GEMM into
# ``out=`` then ``add_`` beat ``baddbmm`` (which first copies its input into the output): 101 vs 118 us on one
# thread for the small LSTM's (32, 8, 64) x (32, 64, 256) step.


def _fused_steps(x: Tensor) -> bool:
    # In a fusable_context: under torch.compile the compiler derives its own backward from the plain version
    # (and dynamo would have to trace the Functions' in-place writes into buffers); under autocast the plain
    # steps' ops autocast; under a torch.func transform or forward-mode AD the Functions have no rule (they
    # raised there).
    return fusable_context(x)


def _with_bias(inputs: Tensor, bias: Tensor | None) -> Tensor:
    return inputs if bias is None else inputs + bias[:, None, None]


def _rnn_steps(inputs: Tensor, bias: Tensor | None, h: Tensor, w_rec: Tensor, relu: bool) -> tuple[Tensor, Tensor]:
    inputs, w_rec_t = _with_bias(inputs, bias), w_rec.transpose(1, 2)
    hs = []
    for x_t in inputs.unbind(1):
        pre = torch.baddbmm(x_t, h, w_rec_t)
        h = pre.relu() if relu else pre.tanh()
        hs.append(h)
    return torch.stack(hs, 1), h


def _lstm_steps(
    inputs: Tensor, bias: Tensor | None, h: Tensor, c: Tensor, w_rec: Tensor, w_proj: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    inputs, w_rec_t = _with_bias(inputs, bias), w_rec.transpose(1, 2)
    hs = []
    for x_t in inputs.unbind(1):
        gates = torch.baddbmm(x_t, h, w_rec_t)
        i, f, g, o = gates.chunk(4, 2)
        c = torch.addcmul(f.sigmoid() * c, i.sigmoid(), g.tanh())
        h = o.sigmoid() * c.tanh()
        if w_proj is not None:
            h = torch.bmm(h, w_proj.transpose(1, 2))
        hs.append(h)
    return torch.stack(hs, 1), h, c


def _gru_steps(inputs: Tensor, h: Tensor, w_rec: Tensor, b_rec: Tensor | None) -> tuple[Tensor, Tensor]:
    w_rec_t = w_rec.transpose(1, 2)
    hs = []
    for x_t in inputs.unbind(1):
        gh = torch.bmm(h, w_rec_t) if b_rec is None else torch.baddbmm(b_rec.unsqueeze(1), h, w_rec_t)
        xr, xz, xn = x_t.chunk(3, 2)
        hr, hz, hn = gh.chunk(3, 2)
        r = (xr + hr).sigmoid()
        z = (xz + hz).sigmoid()
        n = torch.addcmul(xn, r, hn).tanh()
        h = torch.addcmul(n, z, h - n)
        hs.append(h)
    return torch.stack(hs, 1), h


_sigmoid_backward = torch.ops.aten.sigmoid_backward.grad_input
_tanh_backward = torch.ops.aten.tanh_backward.grad_input
_threshold_backward = torch.ops.aten.threshold_backward.grad_input


def _affine_step(out: Tensor, x: Tensor, b: Tensor | None, h: Tensor, w_rec_t: Tensor) -> Tensor:
    """``out = x + b + h @ w_rec_t``: with a bias, ``x + b`` first and the GEMM accumulating in place (no extra
    op for the bias); without, the GEMM first."""
    if b is None:
        return torch.bmm(h, w_rec_t, out=out).add_(x)
    return torch.add(x, b, out=out).baddbmm_(h, w_rec_t)


def _rows(steps: Tensor) -> Tensor:
    """``(N, T, B, K)`` (or ``(N, B, T, K)``) -> ``(N, T*B, K)``: every step's rows of each model, a view when the
    layout allows; a shared stride-0 batch is reshaped as one batch and expanded, never copied N times."""
    if is_shared(steps):
        return steps[0].reshape(-1, steps.shape[-1]).expand(steps.shape[0], -1, -1)
    return steps.reshape(steps.shape[0], -1, steps.shape[-1])


def _weight_grad(grad_pre: Tensor, h0: Tensor, hs: Tensor) -> Tensor:
    """``sum_t grad_pre_t^T h_{t-1}`` ``(N, G, K)``, in the weight's own layout, as two GEMMs over all steps."""
    grad = torch.bmm(grad_pre[:, 0].transpose(1, 2), h0)
    if grad_pre.shape[1] > 1:
        grad = torch.baddbmm(grad, _rows(grad_pre[:, 1:]).transpose(1, 2), _rows(hs[:, :-1]))
    return grad


class _RNNSteps(torch.autograd.Function):
    """``h_t = act(x_t + b + h_{t-1} W^T)`` for ``x`` ``(N, T, B, H)`` (the projected inputs), ``b`` ``(N, H)``
    (``b_ih + b_hh``) or ``None``, ``h0`` ``(N, B, H)``, ``w_rec`` ``(N, H, H)``. Returns every ``h_t``
    ``(N, T, B, H)`` and the last one."""

    @staticmethod
    def forward(ctx, inputs: Tensor, bias: Tensor | None, h0: Tensor, w_rec: Tensor, relu: bool):
        n, steps, batch, hidden = inputs.shape
        w_rec_t = w_rec.transpose(1, 2).contiguous()
        b = None if bias is None else bias.unsqueeze(1)
        pre = inputs.new_empty(n, batch, hidden)
        hs = inputs.new_empty(n, steps, batch, hidden)
        h = h0
        for x, h_out in zip(inputs.unbind(1), hs.unbind(1)):
            _affine_step(pre, x, b, h, w_rec_t)
            h = torch.clamp_min(pre, 0, out=h_out) if relu else torch.tanh(pre, out=h_out)
        ctx.relu = relu
        ctx.has_bias = bias is not None
        ctx.save_for_backward(h0, w_rec, hs)
        return hs, h.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hs: Tensor, grad_last: Tensor):
        h0, w_rec, hs = ctx.saved_tensors
        grad_pre = _workspace.empty(hs, *hs.shape)
        grad_h = grad_last
        for grad_h_t, h, d in reversed(list(zip(grad_hs.unbind(1), hs.unbind(1), grad_pre.unbind(1)))):
            grad = grad_h_t + grad_h
            if ctx.relu:
                _threshold_backward(grad, h, 0, grad_input=d)
            else:
                _tanh_backward(grad, h, grad_input=d)
            grad_h = torch.bmm(d, w_rec)
        grad_w = _weight_grad(grad_pre, h0, hs) if ctx.needs_input_grad[3] else None
        grad_b = grad_pre.sum((1, 2)) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_pre, grad_b, grad_h, grad_w, None


class _LSTMSteps(torch.autograd.Function):
    """The LSTM recurrence for ``x`` ``(N, T, B, 4H)`` (the projected inputs), ``b`` ``(N, 4H)`` (``b_ih + b_hh``)
    or ``None``, ``h0`` ``(N, B, P)``, ``c0`` ``(N, B, H)``, ``w_rec`` ``(N, 4H, P)``, ``w_proj`` ``(N, P, H)``
    or ``None`` (then ``P = H``). Returns every ``h_t`` ``(N, T, B, P)``, the last ``h`` and the last ``c``.

    The sigmoid runs over all four gates in one call (one contiguous pass), after ``tanh`` has read the
    cell gate ``g``'s pre-activation into its own buffer: one op less per step than three calls on strided
    slices, forward and backward alike.
    """

    @staticmethod
    def forward(ctx, inputs: Tensor, bias: Tensor | None, h0: Tensor, c0: Tensor, w_rec: Tensor, w_proj: Tensor | None):
        n, steps, batch, gates = inputs.shape
        hidden, out_size = gates // 4, h0.shape[-1]
        b = None if bias is None else bias.unsqueeze(1)
        w_rec_t = w_rec.transpose(1, 2).contiguous()
        w_proj_t = None if w_proj is None else w_proj.transpose(1, 2).contiguous()
        acts = _workspace.empty(inputs, steps, n, batch, gates)  # sigmoid of every gate pre-activation: i, f, (g), o
        g_acts = _workspace.empty(inputs, steps, n, batch, hidden)  # tanh of g's pre-activation
        cs = _workspace.empty(inputs, steps + 1, n, batch, hidden)  # cs[0] = c0, then every step's c
        tanh_cs = _workspace.empty(inputs, steps, n, batch, hidden)
        hs = inputs.new_empty(n, steps, batch, out_size)  # (returned: never a kept buffer)
        # o * tanh(c) before the projection, kept for the projection's gradient
        rs = _workspace.empty(inputs, n, steps, batch, hidden) if w_proj is not None else None
        cs[0] = c0
        # Every step's views, made up front: indexing inside the loop costs more than some of its ops.
        i_, f_, g_pre, o_ = acts.view(steps, n, batch, 4, hidden).unbind(3)
        views = zip(
            inputs.unbind(1), acts, g_pre, g_acts, i_, f_, o_, cs[:-1], cs[1:], tanh_cs, hs.unbind(1),
            rs.unbind(1) if rs is not None else [None] * steps,
        )  # fmt: skip
        h = h0
        for x, a, g_pre_t, g, i, f, o, c_prev, c, tanh_c, h_out, r in views:
            _affine_step(a, x, b, h, w_rec_t)
            torch.tanh(g_pre_t, out=g)
            a.sigmoid_()
            torch.mul(f, c_prev, out=c).addcmul_(i, g)
            torch.tanh(c, out=tanh_c)
            if w_proj_t is None:
                h = torch.mul(o, tanh_c, out=h_out)
            else:
                h = torch.bmm(torch.mul(o, tanh_c, out=r), w_proj_t)
                h_out.copy_(h)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(h0, w_rec, w_proj, acts, g_acts, cs, tanh_cs, hs, rs)
        return hs, h.clone(), cs[-1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hs: Tensor, grad_h_last: Tensor, grad_c_last: Tensor):
        h0, w_rec, w_proj, acts, g_acts, cs, tanh_cs, hs, rs = ctx.saved_tensors
        steps, n, batch, gates = acts.shape
        grad_pre = _workspace.empty(acts, n, steps, batch, gates)
        grad_out = _workspace.empty(acts, *hs.shape) if w_proj is not None else None  # of h_t, all paths
        grad_h, grad_c = _lstm_backward_steps(
            _backward_kernel("lstm", acts), grad_hs, grad_h_last, grad_c_last, acts, g_acts, cs, tanh_cs, grad_pre,
            grad_out, w_rec, w_proj,
        )  # fmt: skip
        grad_b = grad_pre.sum((1, 2)) if ctx.has_bias and ctx.needs_input_grad[1] else None
        grad_w_rec = _weight_grad(grad_pre, h0, hs) if ctx.needs_input_grad[4] else None
        grad_w_proj = None
        if w_proj is not None and ctx.needs_input_grad[5]:
            assert grad_out is not None  # (made when w_proj is given)
            grad_w_proj = torch.bmm(_rows(grad_out).transpose(1, 2), _rows(rs))
        return grad_pre, grad_b, grad_h, grad_c, grad_w_rec, grad_w_proj


def _lstm_backward_steps(
    kernel,
    grad_hs: Tensor,
    grad_h_last: Tensor,
    grad_c_last: Tensor,
    acts: Tensor,
    g_acts: Tensor,
    cs: Tensor,
    tanh_cs: Tensor,
    grad_pre: Tensor,
    grad_out: Tensor | None,
    w_rec: Tensor,
    w_proj: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:class:`_LSTMSteps`'s backward through every step: writes the pre-activations' gradient into
    ``grad_pre`` and, with a projection, ``grad_out``; returns the gradients by ``h0`` and ``c0``. Each step's
    elementwise part with torch's ops, or with ``kernel`` (:func:`_backward_kernel`) in one pass."""
    steps, n, batch, gates = acts.shape
    hidden = gates // 4
    if kernel is not None:
        return _lstm_native_steps(kernel, grad_hs, grad_h_last, grad_c_last, (acts, g_acts, cs, tanh_cs),
                                  grad_pre, grad_out, w_rec, w_proj)  # fmt: skip
    # The gradients of the activated i, f, (g), o: one sigmoid backward for all four slots; g's slot stays
    # zero and its result is overwritten by tanh's backward.
    grad_act = acts.new_zeros(n, batch, 4, hidden)
    scratch = acts.new_empty(n, batch, hidden)
    i_, f_, _, o_ = acts.view(steps, n, batch, 4, hidden).unbind(3)
    views = zip(
        grad_hs.unbind(1), acts, g_acts, i_, f_, o_, cs[:-1], tanh_cs, grad_pre.unbind(1),
        grad_pre.view(n, steps, batch, 4, hidden)[:, :, :, 2].unbind(1),
        grad_out.unbind(1) if grad_out is not None else [None] * steps,
    )  # fmt: skip
    grad_h, grad_c = grad_h_last, grad_c_last.clone()
    for grad_h_t, a, g, i, f, o, c_prev, tanh_c, d, d_g, grad_out_t in reversed(list(views)):
        if w_proj is None:
            grad_r = grad_h_t + grad_h  # of o * tanh(c)
        else:
            grad_r = torch.bmm(torch.add(grad_h_t, grad_h, out=grad_out_t), w_proj)
        torch.mul(grad_r, tanh_c, out=grad_act[:, :, 3])
        grad_c.add_(_tanh_backward(torch.mul(grad_r, o, out=scratch), tanh_c, grad_input=scratch))
        torch.mul(grad_c, g, out=grad_act[:, :, 0])
        torch.mul(grad_c, c_prev, out=grad_act[:, :, 1])
        _sigmoid_backward(grad_act.view(n, batch, gates), a, grad_input=d)
        _tanh_backward(torch.mul(grad_c, i, out=scratch), g, grad_input=d_g)
        grad_c.mul_(f)
        grad_h = torch.bmm(d, w_rec)
    return grad_h, grad_c


# Whether the LSTM and GRU backward's time steps may run batchlayers' C kernels (``_recurrent_native.c``), see
# ``batchlayers.backends.cpu.native_recurrent``.
native_kernel = True
# Up to this many units a step (models x samples x hidden units) the kernel, one thread, does a step's
# elementwise part; above, torch's ops on several threads. Measured on a 2-core CPU (2 threads, float32, an
# LSTM's backward of all steps, medians): 16k units (the benchmark's LSTM policy, 32 x 8 x 64) 3.70 -> 2.49 ms,
# 65k 10.3 -> 10.1 ms and 8.7 -> 5.6, 131k 15.2 -> 14.9 and 16.3 -> 15.8; 262k 41.2 -> 42.1 and 28.8 -> 30.6.
NATIVE_MAX_UNITS = 1 << 17


def _backward_kernel(mode: str, like: Tensor):
    """The C kernel of one ``mode`` (``"lstm"``, ``"gru"``) backward step for ``like`` (every step's gates,
    ``(T, N, B, G*H)``), or ``None``: off, another dtype than float32 and float64, not on the CPU, more than
    :data:`NATIVE_MAX_UNITS` units a step, or no library (see :mod:`batchlayers._native`)."""
    if (
        not native_kernel
        or like.device.type != "cpu"
        or type(like) is not Tensor
        or like[0].numel() // GATES[mode.upper()] > NATIVE_MAX_UNITS
    ):
        return None
    return _native.kernel(f"{mode}_backward_step", like.dtype)


def _gru_native_steps(
    kernel,
    grad_hs: Tensor,
    grad_last: Tensor,
    h0: Tensor,
    w_rec: Tensor,
    saved: tuple[Tensor, Tensor, Tensor, Tensor],
    grad_in: Tensor,
    grad_rec: Tensor,
) -> Tensor:
    """:class:`_GRUSteps`'s backward through every step, each step's elementwise part in the C kernel:
    writes ``grad_in`` and ``grad_rec``, returns the gradient by ``h0``. ``saved`` is ``(ghs, rzs, news, hs)``."""
    ghs, rzs, news, hs = saved
    steps, n, batch, gates = ghs.shape
    hidden = gates // 3
    size = ghs.element_size()
    # (a negative view's memory holds the values' negatives: the kernel reads memory)
    grad_hs, h0 = _units_contiguous(grad_hs.resolve_neg()), _units_contiguous(h0.resolve_neg())
    # Two buffers in turn for z times the gradient by h_t, onto which the product accumulates the gradient by
    # h_{t-1}: step t writes buffers[t % 2] and reads the other (the last step reads grad_last's copy).
    buffers = [ghs.new_empty(n, batch, hidden), ghs.new_empty(n, batch, hidden)]
    grad_h = buffers[steps % 2].copy_(grad_last)
    gh_n = ghs[..., 2 * hidden :]
    inputs, outputs = array.array("Q", [0] * 6), array.array("Q", [0] * 3)
    # (model, row) strides: grad_h_t, grad_h, rz, new, gh_n, h_prev, grad_in, grad_rec, grad_direct
    parts = (grad_hs[:, 0], grad_h, rzs[0], news[0], gh_n[0], hs[:, 0], grad_in[:, 0], grad_rec[:, 0], grad_h)
    strides = array.array("q", [s for t in parts for s in t.stride()[:2]])
    h0_strides = array.array("q", h0.stride()[:2])
    for t in reversed(range(steps)):
        grad_direct = buffers[t % 2]
        h_prev = h0 if t == 0 else hs[:, t - 1]
        if t == 0:
            strides[10:12] = h0_strides
        inputs[:] = array.array("Q", [
            grad_hs.data_ptr() + t * grad_hs.stride(1) * size, grad_h.data_ptr(), rzs[t].data_ptr(),
            news[t].data_ptr(), gh_n[t].data_ptr(), h_prev.data_ptr(),
        ])  # fmt: skip
        outputs[:] = array.array("Q", [grad_in[:, t].data_ptr(), grad_rec[:, t].data_ptr(), grad_direct.data_ptr()])
        kernel(n, batch, hidden, inputs.buffer_info()[0], outputs.buffer_info()[0], strides.buffer_info()[0])
        grad_h = grad_direct.baddbmm_(grad_rec[:, t], w_rec)
    return grad_h


def _units_contiguous(x: Tensor) -> Tensor:
    """``x`` with its last dimension contiguous, as the GRU kernel reads it (any other strides)."""
    return x if type(x) is Tensor and (x.stride(-1) == 1 or x.shape[-1] <= 1) else x.contiguous().as_subclass(Tensor)


def _rows_contiguous(x: Tensor) -> Tensor:
    """``x`` ``(N, [T,] B, K)`` where each model's (and step's) ``(B, K)`` block is contiguous, as the kernel
    reads it (any model and step strides); else a contiguous copy."""
    ok = type(x) is Tensor and x.stride(-1) == 1 and (x.shape[-2] <= 1 or x.stride(-2) == x.shape[-1])
    return x if ok else x.contiguous().as_subclass(Tensor)


def _lstm_native_steps(
    kernel,
    grad_hs: Tensor,
    grad_h_last: Tensor,
    grad_c_last: Tensor,
    saved: tuple[Tensor, Tensor, Tensor, Tensor],
    grad_pre: Tensor,
    grad_out: Tensor | None,
    w_rec: Tensor,
    w_proj: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`_lstm_backward_steps` with the C kernel; ``saved`` is ``(acts, g_acts, cs, tanh_cs)``."""
    acts, g_acts, cs, tanh_cs = saved
    steps, n, batch, gates = acts.shape
    hidden = gates // 4
    size = acts.element_size()
    # (a negative view's memory holds the values' negatives: the kernel reads memory; clone resolves it)
    grad_hs = _rows_contiguous(grad_hs.resolve_neg())
    grad_h = _rows_contiguous(grad_h_last.resolve_neg())
    grad_c = grad_c_last.clone(memory_format=torch.contiguous_format)
    # (acts, g_acts, cs, tanh_cs and grad_pre are this Function's own contiguous buffers)
    hs_ptr, acts_ptr, g_ptr = grad_hs.data_ptr(), acts.data_ptr(), g_acts.data_ptr()
    cs_ptr, tanh_ptr, pre_ptr = cs.data_ptr(), tanh_cs.data_ptr(), grad_pre.data_ptr()
    for t in reversed(range(steps)):
        if w_proj is None:
            first, first_stride = hs_ptr + t * grad_hs.stride(1) * size, grad_hs.stride(0)
            second, second_stride = grad_h.data_ptr(), grad_h.stride(0)
        else:
            assert grad_out is not None  # (made when w_proj is given)
            grad_r = torch.bmm(torch.add(grad_hs[:, t], grad_h, out=grad_out[:, t]), w_proj)
            first, first_stride, second, second_stride = grad_r.data_ptr(), grad_r.stride(0), None, 0
        kernel(
            n, batch, hidden, first, first_stride, second, second_stride,
            acts_ptr + t * acts.stride(0) * size, acts.stride(1),
            g_ptr + t * g_acts.stride(0) * size, g_acts.stride(1),
            cs_ptr + t * cs.stride(0) * size, cs.stride(1),  # c_{t-1}: cs[0] is c0
            tanh_ptr + t * tanh_cs.stride(0) * size, tanh_cs.stride(1),
            grad_c.data_ptr(), grad_c.stride(0),
            pre_ptr + t * grad_pre.stride(1) * size, grad_pre.stride(0),
        )  # fmt: skip
        grad_h = torch.bmm(grad_pre[:, t], w_rec)
    return grad_h, grad_c


class _GRUSteps(torch.autograd.Function):
    """The GRU recurrence for ``x`` ``(N, T, B, 3H)`` (the projected inputs with ``b_ih``), ``h0`` ``(N, B, H)``,
    ``w_rec`` ``(N, 3H, H)``, ``b_rec`` ``(N, 3H)`` or ``None``. Returns every ``h_t`` and the last one."""

    @staticmethod
    def forward(ctx, inputs: Tensor, h0: Tensor, w_rec: Tensor, b_rec: Tensor | None):
        n, steps, batch, gates = inputs.shape
        hidden = gates // 3
        w_rec_t = w_rec.transpose(1, 2).contiguous()
        b = None if b_rec is None else b_rec.unsqueeze(1)
        ghs = _workspace.empty(inputs, steps, n, batch, gates)  # h_{t-1} W_hh^T + b_hh
        rzs = _workspace.empty(inputs, steps, n, batch, 2 * hidden)  # the activated r, z
        news = _workspace.empty(inputs, steps, n, batch, hidden)  # n
        hs = inputs.new_empty(n, steps, batch, hidden)  # (returned: never a kept buffer)
        x_rz, x_n = inputs.split([2 * hidden, hidden], 3)
        gh_rz, gh_n = ghs.split([2 * hidden, hidden], 3)
        r_, z_ = rzs.split(hidden, 3)
        views = zip(x_rz.unbind(1), x_n.unbind(1), ghs, gh_rz, gh_n, rzs, r_, z_, news, hs.unbind(1))
        h = h0
        for x_rz_t, x_n_t, gh, gh_rz_t, gh_n_t, rz, r, z, new, h_out in views:
            if b is None:
                torch.bmm(h, w_rec_t, out=gh)
            else:
                gh.copy_(b).baddbmm_(h, w_rec_t)
            torch.add(x_rz_t, gh_rz_t, out=rz).sigmoid_()
            torch.addcmul(x_n_t, r, gh_n_t, out=new).tanh_()
            h = torch.lerp(new, h, z, out=h_out)  # n + z * (h - n)
        ctx.has_bias = b_rec is not None
        ctx.save_for_backward(h0, w_rec, ghs, rzs, news, hs)
        return hs, h.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hs: Tensor, grad_last: Tensor):
        h0, w_rec, ghs, rzs, news, hs = ctx.saved_tensors
        steps, n, batch, gates = ghs.shape
        hidden = gates // 3
        grad_in = _workspace.empty(ghs, n, steps, batch, gates)  # of x_t W_ih^T + b_ih: r, z, n
        grad_rec = _workspace.empty(ghs, n, steps, batch, gates)  # of h_{t-1} W_hh^T + b_hh: r, z, r * n
        grad_rz = ghs.new_empty(n, batch, 2 * hidden)  # of the activated r and z
        grad_in_rz, grad_in_n = grad_in.split([2 * hidden, hidden], 3)
        grad_rec_rz, grad_rec_n = grad_rec.split([2 * hidden, hidden], 3)
        r_, z_ = rzs.split(hidden, 3)
        views = zip(
            grad_hs.unbind(1), rzs, r_, z_, news, ghs[:, :, :, 2 * hidden :], [h0, *hs.unbind(1)[:-1]],
            grad_in_rz.unbind(1), grad_in_n.unbind(1), grad_rec.unbind(1), grad_rec_rz.unbind(1),
            grad_rec_n.unbind(1),
        )  # fmt: skip
        kernel = _backward_kernel("gru", ghs)
        if kernel is not None:
            grad_h = _gru_native_steps(kernel, grad_hs, grad_last, h0, w_rec, (ghs, rzs, news, hs), grad_in, grad_rec)
            views = zip()  # (the steps are done)
        else:
            grad_h = grad_last
        for grad_h_t, rz, r, z, new, gh_n, h_prev, d_in_rz, d_in_n, d_rec, d_rec_rz, d_rec_n in reversed(list(views)):
            grad = grad_h_t + grad_h
            grad_direct = grad * z
            grad_new = _tanh_backward(grad - grad_direct, new, grad_input=d_in_n)
            torch.mul(grad_new, gh_n, out=grad_rz[:, :, :hidden])
            torch.mul(grad, h_prev - new, out=grad_rz[:, :, hidden:])
            _sigmoid_backward(grad_rz, rz, grad_input=d_in_rz)
            d_rec_rz.copy_(d_in_rz)
            torch.mul(grad_new, r, out=d_rec_n)
            grad_h = grad_direct.baddbmm_(d_rec, w_rec)
        grad_w = _weight_grad(grad_rec, h0, hs) if ctx.needs_input_grad[2] else None
        grad_b = grad_rec.sum((1, 2)) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_in, grad_h, grad_w, grad_b
