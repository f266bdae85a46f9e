"""A chain of batched linear layers with elementwise activations between them, computed as one autograd node.

Autograd runs one node per op of ``linear -> activation -> linear``: for a small MLP the per-node cost is
most of the step. :func:`fused_linear_chain` computes the same ops (``baddbmm``, or on CPU for small layers
``bmm`` and an in-place bias add, see :data:`PRODUCT_THEN_BIAS_MAX_OUTPUTS`; the activation in place on its
output) and writes the backward by hand: the activation's backward is torch's own kernel, from what autograd
would save (``threshold_backward`` and ``tanh_backward`` from the output, ``gelu_backward``, ``silu_backward``
and ``leaky_relu_backward`` from the input), written into the gradient it reads. On CPU every product is
computed with the long side of its result last where the other is short (:func:`_product`): a weight
gradient as ``grad^T @ input`` directly in the weight's ``(M, out, in)`` layout (autograd computes
``input^T @ grad`` and copies its transpose), or as that transpose and a copy where ``in`` is short and
``out`` longer; a layer with few outputs and more samples as the transposed product, a transposed view
between the layers (the gradients follow the hidden tensors' layout) and copied once with the bias at the
chain's end, so the output is contiguous as ``nn.Linear``'s. Results equal the
unfused layers up to that summation order and the bias's rounding (float64 to ~1e-15).

ReLU chains of small layers on the CPU run in batchlayers' own C kernels instead (``_mlp_native.c``,
:func:`_native_kernels`): the whole chain in one call forward and one backward.
"""

from __future__ import annotations

import array
import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _native, _workspace
from ._linear import _affine, fusable_context

__all__ = [
    "ACTIVATIONS",
    "CHAIN_MIN_MACS",
    "chain_fuses",
    "chain_fuses_natively",
    "chain_may_fuse_natively",
    "fusable_context",
    "fused_linear_chain",
]

# An activation is ``(name, argument)``: GELU's ``approximate``, LeakyReLU's ``negative_slope``, else None.
ACTIVATIONS = ("relu", "tanh", "gelu", "silu", "leaky_relu")
_FROM_OUTPUT = ("relu", "tanh")  # backward from the output: the forward may overwrite its input


# Below this many multiply-adds a call, the node's Python cost (apply and a Python backward) is about what it
# saves: measured on a 2-core CPU (forward, two-class loss and backward against nn.Sequential, alternating,
# medians of 15 rounds), a 10-20-2 MLP with 64 samples fused ran 0.95x at M=1 (15k multiply-adds), 0.93x at
# M=4, 0.95x at M=16 (246k) and 1.03-1.09x at M=64 (983k); unfused (below this) 0.96-0.97x. CUDA uses the
# same value, unmeasured (no GPU was available).
CHAIN_MIN_MACS = 1 << 19


def chain_fuses(macs: int) -> bool:
    """Whether a chain of ``macs`` multiply-adds runs without one op per layer, in a :func:`fusable_context`:
    as one autograd node while gradients are recorded (from :data:`CHAIN_MIN_MACS` on), in place without
    them; at any size where :func:`chain_fuses_natively`. Otherwise its layers run one by one."""
    return not torch.is_grad_enabled() or macs >= CHAIN_MIN_MACS


def chain_may_fuse_natively(x: Tensor, activations) -> bool:
    """Whether :func:`chain_fuses_natively` may hold for a chain with these activations and input (a check of
    a few attributes, before the layers' own)."""
    return native_kernel and x.is_cpu and all(name == "relu" for name, _ in activations)


def chain_fuses_natively(x: Tensor, weights, biases, activations) -> bool:
    """Whether batchlayers' own C kernels compute this chain (:func:`_native_kernels`): it then runs as one
    node at any size. Measured on a 2-core CPU (the benchmark's 10-20-2 MLP training step, 64 samples a model,
    alternating with the layers run one by one, medians of 30 rounds): 1.07x at M=1, 1.10x at M=4 and M=16."""
    return _native_kernels(x, weights, biases, activations) is not None


def fused_linear_chain(
    x: Tensor, weights: list[Tensor], biases: list[Tensor | None], activations: tuple[tuple[str, object], ...]
) -> Tensor:
    """``linear(act_n(... act_1(linear(x, w0, b0)) ...), w_n, b_n)`` for ``(M, N, in)`` inputs in a
    :func:`fusable_context` where :func:`chain_fuses`, arguments checked by the caller (shapes chained, one
    device and dtype); ``activations[i]``, ``(name, argument)`` with a name of :data:`ACTIVATIONS`, follows
    linear ``i``.

    One autograd node while gradients are recorded (see the module docstring); without them, the same
    forward with each activation in place on its linear's output. Where :func:`_native_kernels` serve the
    chain, batchlayers' own C kernels compute it (one call forward, one backward)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (x, *weights, *biases) if t is not None):
        kernels = _native_kernels(x, weights, biases, activations)
        if kernels is not None:
            return _native_forward(kernels[0], x, weights, biases)[0]
        return _forward(x, weights, biases, activations, inplace=True, saves=False)[0]
    params = [t for pair in zip(weights, biases) for t in pair]
    return _LinearChain.apply(activations, x, *params)


def _forward(
    x: Tensor, weights, biases, activations, *, inplace: bool, saves: bool = True
) -> tuple[Tensor, list, list]:
    """The chain's output, the activations' outputs (each layer's input but the first) and the inputs of the
    activations whose backward reads them (None for the others). With ``inplace`` (nothing recorded) the
    products run with the long side last (:func:`_product`), so the hidden tensors may be transposed views;
    the output is contiguous, as ``nn.Linear``'s. Activations run in place on their linear's output
    where nothing reads that again: ReLU and Tanh (whose backward reads the output), and all of them
    without ``saves`` (nothing kept for a backward)."""
    hidden: list[Tensor] = []
    pre: list[Tensor | None] = []
    h = x
    last = len(weights) - 1
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = _unrecorded_affine(h, w, b, contiguous=i == last) if inplace else _affine(h, w, b)
        if i < len(activations):
            name, argument = activations[i]
            keeps_input = saves and name not in _FROM_OUTPUT
            pre.append(h if keeps_input else None)
            h = _activate(h, name, argument, inplace and not keeps_input)
            hidden.append(h)
    return h, hidden, pre


# A result side shorter than this is short: a CPU GEMM whose result has such a side last fills a fraction of
# its vector registers (see :func:`_product`).
SHORT_SIDE = 32


def _product(a: Tensor, b: Tensor, like: Tensor | None = None, *, kept: bool = False) -> Tensor:
    """``a @ b`` for ``(M, r, k)`` and ``(M, k, c)``, computed as ``(b^T @ a^T)^T`` when ``c`` is short
    (:data:`SHORT_SIDE`) and ``r`` longer: a CPU GEMM runs much faster with the long side of its result last.
    The result is then a transposed view.
    With ``like``, in ``like``'s layout instead (transposed where it is not contiguous): an elementwise kernel
    that reads both runs several times slower on two layouts (``gelu_backward`` on GPT-mini's 512 x 256
    hidden gradient, M=8: 1.3 -> 7.8 ms a call).

    Measured on a 2-core AMD EPYC (torch 2.13, float32, 2 threads, medians), ``(M, r, c)`` products of a
    10-20-2 MLP with 64 samples a model: its output layer's 64 x 2 products 92 -> 48 us at M=64 and
    1287 -> 476 us at M=1024; the first layer's 20 x 10 weight gradient 177 -> 56 us and 2510 -> 770 us;
    a 784-256-256-10 MLP's 128 x 10 output products (M=64) 1.73 -> 0.86 ms. Where ``r <= c`` the direct
    product was as fast or faster (the same MLP's 256 x 784 weight gradient 52 ms against 107 ms with its
    transpose copied), and so it was where both sides are long (GPT-mini's 256 x 64 weight gradients
    summed over 512 tokens, M=8: 1.55-1.59 ms either way, the copy of the transpose added). Other devices
    take the direct product (unmeasured: no GPU was available).

    With ``kept``, the result is written into a buffer kept between calls (``batchlayers._workspace``): for
    results that the chain holds itself (hidden activations, their gradients), never for one it returns."""
    if like is not None:
        transposed = not like.is_contiguous()
    else:
        transposed = SHORT_SIDE > b.shape[2] and a.shape[1] > b.shape[2] and a.device.type == "cpu"
    if transposed:
        if kept:
            return _kept_bmm(b.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2)
        return torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2)
    if _two_rows_transposed(a, b):
        a = a.contiguous()
    return _kept_bmm(a, b) if kept else torch.bmm(a, b)


def _weight_gradient(grad: Tensor, input: Tensor) -> Tensor:
    """``grad^T @ input``, contiguous (the weight's layout), as :func:`_product` computes it; where large, in
    memory kept between calls that autograd may keep as the weight's ``.grad``
    (:func:`batchlayers._workspace.returned`): once that is dropped (``zero_grad()``), the next backward writes
    into the same pages instead of faulting fresh ones."""
    a = grad.transpose(1, 2)
    shape = (a.shape[0], a.shape[1], input.shape[2])
    if not _workspace.applies(a, *shape):
        return _product(a, input).contiguous()
    out = _workspace.returned(a, *shape)
    if SHORT_SIDE > shape[2] and shape[1] > shape[2]:
        return out.copy_(_product(a, input))  # (a transposed view: the copy .contiguous() would make)
    return torch.bmm(a.contiguous() if _two_rows_transposed(a, input) else a, input, out=out)


def _kept_bmm(a: Tensor, b: Tensor) -> Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if not _workspace.applies(a, *shape):
        return torch.bmm(a, b)  # (allocating: out= costs more on small products)
    return torch.bmm(a, b, out=_workspace.take(a, *shape))


def _two_rows_transposed(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is the transpose of a contiguous ``(M, k, 2)`` tensor and ``b`` a transposed view, in
    float32 on CPU: torch 2.13's CPU batched GEMM multiplies that pair (both operands transposed, ``a``'s rows
    2 apart) 1.6-1.8x slower than with ``a`` copied first, copy included. It is a two-output layer's weight
    gradient ``grad^T @ hidden`` where the hidden tensor is held transposed (see :func:`_product`). Measured
    on a 2-core AMD EPYC (interleaved medians): ``(M, 2, 64) @ (M, 64, 20)`` at M=1024 302 -> 172 us with 2
    threads and 599 -> 327 us with 1, at M=4096 1258 -> 687 us; in the 10-20-2 MLP's training step
    (torch.profiler, copy included) 319-341 -> 186-220 us at M=1024, and within noise at M=64 (31-38 ->
    28-35 us). Copying did not pay with 1 or 4 rows instead of 2 (1.0x and 0.6-0.8x), with a contiguous ``b``
    (0.6x) or in float64 (0.7-1.05x)."""
    return (
        a.device.type == "cpu"
        and a.dtype == torch.float32
        and a.shape[1] == 2
        and a.stride(1) == 1
        and a.stride(2) == 2
        and b.stride(1) == 1
        and b.shape[2] > 1
    )


# On CPU, ``baddbmm`` adds the bias model by model (its per-batch path: about 0.7 us a model on 2 cores, M=64
# to 1024); below this many output elements a model, ``bmm`` and one in-place broadcast add of the biases are
# faster. Measured (interleaved medians, forward + two-class loss + backward + Adam, baddbmm -> this):
# 10-20-2 MLP at M=64 1.02-1.04x, M=1024 1.07-1.22x, M=4096 1.04x; inference 1.13-1.26x (M=64), 1.24x
# (M=1024). Above it (a 784-256-256-10 MLP's hidden layers, 32k outputs a model) the extra pass over the
# output cost 0.97-0.99x, so baddbmm stays.
PRODUCT_THEN_BIAS_MAX_OUTPUTS = 4096


def _unrecorded_affine(x: Tensor, w: Tensor, b: Tensor | None, *, contiguous: bool) -> Tensor:
    """:func:`_affine` where autograd records nothing, so the bias may be added in place, computed by
    :func:`_product`; ``contiguous`` asks for a contiguous result (the bias is then added in the copy)."""
    if x.device.type != "cpu" or x.shape[1] * w.shape[1] > PRODUCT_THEN_BIAS_MAX_OUTPUTS:
        return _affine(x, w, b)  # a new (b)addbmm result: contiguous
    y = _product(x, w.transpose(1, 2), kept=not contiguous)  # (a hidden layer's: the chain's own)
    if contiguous and not y.is_contiguous():
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        return torch.add(y, b.unsqueeze(1), out=out) if b is not None else out.copy_(y)
    return y if b is None else y.add_(b.unsqueeze(1))


def _activate(h: Tensor, name: str, argument, inplace: bool) -> Tensor:
    if name == "relu":
        return h.relu_() if inplace else F.relu(h)
    if name == "tanh":
        return h.tanh_() if inplace else torch.tanh(h)
    if name == "gelu":
        if inplace:
            return torch._C._nn.gelu_(h, approximate=argument)  # type: ignore[attr-defined]  # (no public gelu_)
        return F.gelu(h, approximate=argument)
    if name == "silu":
        return F.silu(h, inplace=inplace)
    return F.leaky_relu(h, argument, inplace=inplace)


def _activation_backward_(grad: Tensor, name: str, argument, output: Tensor, input: Tensor | None) -> None:
    """Overwrite ``grad`` (by the activation's output) with the gradient by its input: torch's own kernel."""
    aten = torch.ops.aten
    if name == "relu":
        aten.threshold_backward.grad_input(grad, output, 0, grad_input=grad)
    elif name == "tanh":
        aten.tanh_backward.grad_input(grad, output, grad_input=grad)
    elif name == "gelu":
        aten.gelu_backward.grad_input(grad, input, approximate=argument, grad_input=grad)
    elif name == "silu":
        aten.silu_backward.grad_input(grad, input, grad_input=grad)
    else:
        aten.leaky_relu_backward.grad_input(grad, input, argument, False, grad_input=grad)


class _LinearChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activations: tuple[tuple[str, object], ...], x: Tensor, *params: Tensor | None) -> Tensor:
        weights, biases = list(params[0::2]), list(params[1::2])
        ctx.kernels = _native_kernels(x, weights, biases, activations)
        if ctx.kernels is not None:
            # x feature-major and the ReLUs' outputs, (M, features, N): what the backward kernel reads
            y, kept = _native_forward(ctx.kernels[0], x, weights, biases)
        else:
            # Forward runs without gradient recording, so ReLU and Tanh may overwrite their linear's output.
            y, hidden, pre = _forward(x, weights, biases, activations, inplace=True)
            kept = [*hidden, *pre]
        ctx.activations = activations
        ctx.num_layers = len(weights)
        ctx.save_for_backward(x, *weights, *biases, *kept)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        n = ctx.num_layers
        saved = ctx.saved_tensors
        x, weights, biases = saved[0], saved[1 : 1 + n], saved[1 + n : 1 + 2 * n]
        needs = ctx.needs_input_grad  # (activations, x, w0, b0, w1, b1, ...)
        if torch.is_grad_enabled():
            # create_graph=True: the saved activations carry no history, so a gradient computed from them could
            # not be differentiated again. Recompute the chain with recorded ops and differentiate that.
            return _recorded_backward(ctx.activations, grad, x, weights, biases, needs)
        if ctx.kernels is not None:
            return (None, *_native_backward(ctx.kernels[1], grad, x, weights, biases, saved[1 + 2 * n :], needs))
        hidden, pre = saved[1 + 2 * n : 3 * n], saved[3 * n :]
        grads: list[Tensor | None] = [None] * (2 * n)
        inputs = (x, *hidden)
        grad_x = None
        for i in reversed(range(n)):
            if needs[2 + 2 * i]:
                grads[2 * i] = _weight_gradient(grad, inputs[i])
            if biases[i] is not None and needs[3 + 2 * i]:
                grads[2 * i + 1] = grad.sum(1)
            if i:
                # The activation's backward overwrites the product it reads: one buffer, not two.
                # in the layout of the activation's saved tensors, which its backward reads beside it
                grad = _product(grad, weights[i], like=hidden[i - 1], kept=True)
                name, argument = ctx.activations[i - 1]
                _activation_backward_(grad, name, argument, hidden[i - 1], pre[i - 1])
            elif needs[1]:
                grad_x = _product(grad, weights[0])
        return (None, grad_x, *grads)


def _recorded_backward(activations, grad: Tensor, x: Tensor, weights, biases, needs) -> tuple:
    inputs = [x, *(t for pair in zip(weights, biases) for t in pair)]
    wanted = [i for i, t in enumerate(inputs) if needs[1 + i] and t is not None]
    with torch.enable_grad():
        y = _forward(x, weights, biases, activations, inplace=False)[0]
        found = torch.autograd.grad(y, [inputs[i] for i in wanted], grad, create_graph=True, allow_unused=True)
    out: list[Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, found):
        out[i] = g
    return (None, *out)


# batchlayers' own C kernels (``_mlp_native.c``): the whole chain in one call forward and one backward, for
# ReLU chains of small layers (backends.cpu.native_chain).
native_kernel = True

# The kernels serve layers of at most this many multiply-adds a sample (in_features * out_features): they
# compute on one thread at about a third of the vector units' peak, torch's batched GEMM faster once the
# matrices grow, so what they save (a torch call per op, an autograd node per run) pays below it. Measured on a
# 2-core CPU (forward and backward of the chain, 2 threads, float32, alternating, medians of 11 rounds, against
# the same chain in torch's ops), M=64 and 64 samples unless said: 10-20-2 1.40x (1.61x at M=8, 1.11x at
# M=256, 1.27x with 512 samples), 10-24-2 1.40x, 10-32-2 1.22x, 4-64-1 1.36x, 10-20-20-2 1.15x; 16-32-2 (512)
# 1.23x with 16 samples, 1.05x with 64 and 0.89x with 512; 24-24-2 (576) 0.95x; a 32-32-2 MLP 0.73x,
# 64-64-2 0.53x.
NATIVE_MAX_LAYER_MACS = 400

_PLAIN = frozenset({Tensor, torch.nn.Parameter})


class _Chain(ctypes.Structure):
    """``_mlp_native.c``'s ``chain``: the sizes and tensors of one call."""

    _fields_ = [
        ("models", ctypes.c_int64),
        ("batch", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("dims", ctypes.c_void_p),
        ("input", ctypes.c_void_p),
        ("input_model_stride", ctypes.c_int64),
        ("input_row_stride", ctypes.c_int64),
        ("weights", ctypes.c_void_p),
        ("biases", ctypes.c_void_p),
        ("hidden", ctypes.c_void_p),
        ("input_t", ctypes.c_void_p),
        ("output", ctypes.c_void_p),
        ("weight_grads", ctypes.c_void_p),
        ("bias_grads", ctypes.c_void_p),
        ("work", ctypes.c_void_p),
    ]


def _native_kernels(x: Tensor, weights, biases, activations) -> tuple | None:
    """The C kernels ``(forward, backward)`` where they serve this chain, else None: ReLU between the layers,
    float32 or float64 on the CPU, plain dense tensors (no subclass or negative view, outside a
    ``torch.compile`` trace), ``(M, N, in)`` inputs whose rows are contiguous (any model stride: a shared
    input's 0 too), contiguous weights and biases, every size at least 1 and every layer at most
    :data:`NATIVE_MAX_LAYER_MACS` multiply-adds a sample."""
    if not chain_may_fuse_natively(x, activations):
        return None
    kernels = _KERNELS.get(x.dtype)
    if kernels is None:
        forward = _native.kernel("chain_forward", x.dtype)  # (None: another dtype, or no library)
        if forward is None:
            return None
        kernels = _KERNELS[x.dtype] = (forward, _native.kernel("chain_backward", x.dtype))
    if x.dim() != 3 or type(x) not in _PLAIN or x.layout != torch.strided or torch.compiler.is_compiling():
        return None
    if x.is_neg():  # (a negative view: its memory holds the values' negatives)
        return None
    num_models, batch, features = x.shape
    if not (num_models and batch and features) or (x.stride(2) != 1 and features != 1):
        return None
    for t in (*weights, *biases):
        if t is not None and (
            type(t) not in _PLAIN or t.layout != torch.strided or not t.is_contiguous() or t.is_neg()
        ):
            return None
    if not all(0 < w.shape[1] * w.shape[2] <= NATIVE_MAX_LAYER_MACS for w in weights):
        return None
    return kernels


# The compiled kernels by dtype, once found (where no library is built, the dtype is never added).
_KERNELS: dict[torch.dtype, tuple] = {}


def _pointers(tensors) -> list[int]:
    return [0 if t is None else t.data_ptr() for t in tensors]


def _run(kernel, models: int, batch: int, dims: list[int], input: Tensor, tables: list[list[int]], *args) -> None:
    """Call ``kernel`` on a :class:`_Chain` of these sizes and ``input``, its pointer tables (weights,
    biases or nothing, hidden, weight and bias gradients or nothing) from ``tables``, ``args`` the fields
    from ``input_t`` on. Called in the calling thread: split between two threads, the models ran slower in the
    10-20-2 MLP's training step at M=1024 (2-core CPU, after torch's own parallel ops) and 7% faster at M=4096."""
    table = array.array("q", dims)  # dims, then every table: one array, kept alive through the call
    offsets = []
    for pointers in tables:
        offsets.append(len(table))
        table.extend(pointers)
    base, size = table.buffer_info()[0], table.itemsize
    weights, biases, hidden, weight_grads, bias_grads = (base + size * offset for offset in offsets)
    chain = _Chain(models, batch, len(dims) - 1, base, input.data_ptr(), input.stride(0), input.stride(1))
    chain.weights, chain.biases, chain.hidden = weights, biases, hidden
    chain.input_t, chain.output, chain.work = args
    chain.weight_grads, chain.bias_grads = weight_grads, bias_grads
    kernel(ctypes.addressof(chain))


def _native_forward(kernel, x: Tensor, weights, biases) -> tuple[Tensor, list[Tensor]]:
    """The chain's output and what the backward kernel reads: x and the ReLUs' outputs, feature-major."""
    num_models, batch, features = x.shape
    dims = [features, *(w.shape[1] for w in weights)]
    # (x's first; in memory kept between calls where large: see _workspace)
    kept = [_workspace.empty(x, num_models, d, batch) for d in dims[:-1]]
    y = x.new_empty(num_models, batch, dims[-1])
    work = x.new_empty(batch * dims[-1])
    tables = [_pointers(weights), _pointers(biases), _pointers(kept[1:]), [], []]
    _run(kernel, num_models, batch, dims, x, tables, kept[0].data_ptr(), y.data_ptr(), work.data_ptr())
    return y, kept


def _native_backward(kernel, grad: Tensor, x: Tensor, weights, biases, kept, needs) -> list[Tensor | None]:
    """Every weight's and bias's gradient and x's (where ``needs`` it, else None), from the forward's ``kept``."""
    if grad.layout != torch.strided:
        grad = grad.to_dense()
    grad = grad.resolve_neg()  # (a negative view: the kernel reads memory)
    if grad.stride(2) != 1 and grad.shape[2] != 1:
        grad = grad.contiguous()
    num_models, batch, features = x.shape
    dims = [features, *(w.shape[1] for w in weights)]
    weight_grads = [_workspace.returned(grad, *w.shape) for w in weights]
    bias_grads = [None if b is None else torch.empty_like(b) for b in biases]
    grad_x = x.new_empty(x.shape) if needs[1] else None
    work = x.new_empty((2 * max(dims) + 1) * batch)
    tables = [_pointers(weights), [], _pointers(kept[1:]), _pointers(weight_grads), _pointers(bias_grads)]
    output = 0 if grad_x is None else grad_x.data_ptr()
    _run(kernel, num_models, batch, dims, grad, tables, kept[0].data_ptr(), output, work.data_ptr())
    grads: list[Tensor | None] = [grad_x]
    for i, (w, b) in enumerate(zip(weight_grads, bias_grads)):
        grads += [w if needs[2 + 2 * i] else None, b if needs[3 + 2 * i] else None]
    return grads
