"""Numbers read from the folded batch, and every number Python computes from them, marked.

Inside a stacked model's batched ``forward``, ``B = x.size(0)`` is ``M * B``: every model's samples. Each
original model reads its own ``B``. A number that differs between the two must never reach a tensor as if it
were each model's, so the number read and everything computed from it carry both values:

- :class:`FoldedSize` (an ``int``) counts the models' samples: ``M`` times each original's. Where torch takes it
  as the size of the samples' dimension (``x.view(B, -1)``, ``torch.zeros(B, T)``) it is right for every
  model; so are ``B * T``, ``B // k`` where each model's ``B`` divides, and ``B1 + B2``, which stay sizes.
- :class:`FoldedInt` and :class:`FoldedValue` (an ``int``, a ``float``) are anything else computed from one:
  ``B - 1``, ``-B``, ``B % 4``, ``B * 0.5``, ``1 / B``, ``B ** 0.5``. Each carries the value every original
  model computes (``own``); where the two are equal (``B1 / B2``, the same ratio in every model) it is each
  model's number.

Python's own operators, comparisons and ``round``/``abs``/``math.floor`` on these give marked numbers again, a
comparison whose answer differs from each original model's is refused (also with a plain number that equals
the folded one: ``B == h.shape[1]`` with ``h.shape[1] == M * B``), and ``int()``/``float()``, ``str()`` and
``format()`` (which Python makes plain whatever they return) are refused where they would lose a number that
differs. The tracker (``batchlayers._provenance``) gives an elementwise op each model's own number in its
place, and refuses a number that differs anywhere else torch would use it as a value.

What Python computes without asking the number cannot be followed: a ``float`` on the left of an operator
(``1.0 / B``, ``0.5 * B``: float's own operator reads the int directly), ``math.log(B)`` (which reads an int's
digits), ``math`` functions of a :class:`FoldedValue` (``math.sqrt(B / 2)`` reads the float itself),
``range(B)``, ``operator.index(B)`` and a list indexed by ``B`` (CPython takes an int subclass as it is),
``"%d" % B``. Those stay plain numbers (``batchlayers.verify`` against the original models finds them).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import operator
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, cast

__all__ = ["FoldedInt", "FoldedSize", "FoldedValue", "differs", "plain_number_message"]


def plain_number_message(how: str, of: str, value: object, where: str, own: object) -> str:
    """Why a read of a number that differs per model into a plain Python number is refused (``len(x)``,
    ``float(B)``, ``int(B - 1)``); ``where`` says what the number is made of."""
    return (
        f"batchlayers: {how} of {of} gives {value}, {where}, as a plain Python number that batchlayers cannot "
        f"follow, where each original model has its own ({own}). "
        "Read the size with x.size(0) or x.shape[0] and compute with it, which batchlayers follows (as a shape "
        "it works, in arithmetic with tensors it is each model's own), or stack with execution='model_by_model'"
    )


# Code that may write a marked number into a message (see _Marked._refuse_text): batchlayers' own and torch's.
_LIBRARIES = (
    os.path.dirname(__file__) + os.sep,
    os.path.dirname(importlib.util.find_spec("torch").origin) + os.sep,  # type: ignore[union-attr,arg-type]
)


def _parts(x: object) -> tuple[Any, Any] | None:
    """``(folded, own)``: a marked number's two values, a plain Python number's one twice; None otherwise."""
    if isinstance(x, _Marked):
        return x.folded(), x.own
    if type(x) in (int, float, bool):
        return x, x
    return None


# Torch's own code where a comparison of a folded size with a plain number (not the folded size itself, which
# may be a size read unmarked) whose answer differs per model takes one answer instead of being refused,
# (file suffix, function) -> which:
# - "own", each original model's: torch.distributions' check that a value's shape broadcasts with the
#   distribution's (every ``log_prob`` validating its arguments, the default). It only decides whether to
#   raise, nothing it computes is used afterwards, so the call raises, or returns, as each original model's.
# - "folded": ``torch.broadcast_shapes`` (MultivariateNormal's batch shape). It broadcasts the folded sizes,
#   whose result is the folded size of each model's result (``M * B`` with 1 where each model's ``B`` is 1),
#   or raises where folding makes sizes disagree (``M * 1`` with ``k``, where each model broadcasts 1 to ``k``).
_ANSWERED_BY = {
    ("torch/distributions/distribution.py", "_validate_sample"): "own",
    ("torch/_refs/__init__.py", "_broadcast_shapes"): "folded",
}


def _answered_by() -> str | None:
    """Which answer a comparison made by one of :data:`_ANSWERED_BY` itself (not by a function it calls, whose
    results it may use) takes; None elsewhere."""
    code = sys._getframe(2).f_code  # (0: here, 1: the comparison, 2: its caller; partialmethod adds no frame)
    for (suffix, name), answer in _ANSWERED_BY.items():
        if code.co_name == name and code.co_filename.replace(os.sep, "/").endswith(suffix):
            return answer
    return None


class Call:
    """The stacked call a marked number was read in: after it ends the number is a plain one (kept in a cache,
    ``self.last = B``, einops' recipe cache), compared and used as its folded value, refused nowhere."""

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = True


_ENDED = Call()
_ENDED.alive = False
_calls = threading.local()


def open_call() -> Call:
    """A stacked call begins on this thread: the sizes read from now on belong to it."""
    call = Call()
    _calls.__dict__.setdefault("stack", []).append(call)
    return call


def close_call(call: Call) -> None:
    call.alive = False
    stack = _calls.__dict__.get("stack", [])
    if call in stack:
        stack.remove(call)


def _current_call() -> Call:
    stack = _calls.__dict__.get("stack")
    return stack[-1] if stack else _ENDED


def _mark(folded: object, own: object, num_models: int, call: Call) -> Any:
    if isinstance(folded, int) and isinstance(own, int):
        return FoldedInt(folded, own, num_models, call)
    if isinstance(folded, (int, float)) and isinstance(own, (int, float)):
        return FoldedValue(folded, own, num_models, call)
    return folded  # (complex: not followed)


def _derive(op: Callable, a: object, b: object) -> Any:
    """``op(a, b)`` with one or both marked: both values computed, the result marked (never a size)."""
    pa, pb = _parts(a), _parts(b)
    if pa is None or pb is None:
        return NotImplemented  # a tensor, numpy's numbers: their own reflected operator
    marked = cast(_Marked, a if isinstance(a, _Marked) else b)
    return _mark(op(pa[0], pb[0]), op(pa[1], pb[1]), marked.num_models, marked.call)


class _Marked:
    """What :class:`FoldedSize`, :class:`FoldedInt` and :class:`FoldedValue` share: the number each original
    model has (``own``) beside the folded one, Python's operators on both, comparisons checked."""

    num_models: int
    own: Any
    call: Call
    made = "computed from"  # (FoldedSize: "read from", what it is: "a size")
    kind = "a number"

    def __new__(cls, value: Any, own: Any = None, num_models: Any = None, call: Call | None = None) -> Any:
        if own is None or num_models is None:  # type(B)(value), as statistics.mean does: a plain number
            return cls.__mro__[2](value)  # (int or float)
        number = super().__new__(cls, value)  # type: ignore[call-arg]  # int's or float's
        number.own, number.num_models = own, num_models
        number.call = _current_call() if call is None else call
        return number

    def folded(self) -> Any:
        raise NotImplementedError

    def where(self) -> str:
        """What the number is made of, for messages."""
        return f"{self.made} the size of a tensor that holds the models' samples ({self.num_models} models folded)"

    def _one(self, op: Callable) -> Any:
        return _mark(op(self.folded()), op(self.own), self.num_models, self.call)

    def _compare(self, other: object, op: Callable, symbol: str) -> Any:
        theirs = _parts(other)
        if theirs is None:
            return NotImplemented  # a tensor: its own comparison, where the tracker sees the number
        folded, own = op(self.folded(), theirs[0]), op(self.own, theirs[1])
        if own != folded and self.call.alive and (not isinstance(other, _Marked) or other.call.alive):
            answer = None if isinstance(other, _Marked) or theirs[0] == self.folded() else _answered_by()
            if answer is not None:
                return own if answer == "own" else folded
            raise ValueError(
                f"batchlayers: a stacked model's forward compares {self.folded()}, {self.where()}, with {other} "
                f"({symbol}): each original model compares its own ({self.own}) and gets {own}, the folded batch "
                f"{folded}. Stack with execution='model_by_model', which runs each model's forward on its own samples"
            )
        return folded

    def _refuse_plain(self, how: str) -> None:
        if differs(self):
            raise ValueError(plain_number_message(how, self.kind, self.folded(), self.where(), self.own))

    __lt__ = functools.partialmethod(_compare, op=operator.lt, symbol="<")
    __le__ = functools.partialmethod(_compare, op=operator.le, symbol="<=")
    __gt__ = functools.partialmethod(_compare, op=operator.gt, symbol=">")
    __ge__ = functools.partialmethod(_compare, op=operator.ge, symbol=">=")
    __eq__ = functools.partialmethod(_compare, op=operator.eq, symbol="==")
    __ne__ = functools.partialmethod(_compare, op=operator.ne, symbol="!=")

    def __bool__(self) -> bool:
        return bool(self._compare(0, operator.ne, "!="))

    def __int__(self) -> int:
        self._refuse_plain("int()")
        return int(self.folded())

    def __float__(self) -> float:
        self._refuse_plain("float()")
        return float(self.folded())

    def __str__(self) -> str:
        self._refuse_text("str()")
        return str(self.folded())

    def __format__(self, spec: str) -> str:
        self._refuse_text("format()")
        return format(self.folded(), spec)

    def _refuse_text(self, how: str) -> None:
        """Text is a plain string that batchlayers cannot follow (``int(f"{B}")``): refused where the number
        differs, unless batchlayers or torch write it (into a message; ``repr()`` is never refused)."""
        if differs(self) and not sys._getframe(2).f_code.co_filename.startswith(_LIBRARIES):
            raise ValueError(
                f"batchlayers: {how} of {self.kind} gives '{self.folded()}', {self.where()}, as text that batchlayers "
                f"cannot follow, where each original model has its own ({self.own}). Compute with the number "
                "itself, or stack with execution='model_by_model'"
            )

    @property
    def real(self) -> Any:
        return self

    @property
    def imag(self) -> Any:
        return type(self.folded())(0)

    def conjugate(self) -> Any:
        return self

    def as_integer_ratio(self) -> tuple:
        self._refuse_plain("as_integer_ratio()")
        return self.folded().as_integer_ratio()

    def __reduce__(self) -> tuple:
        return type(self.folded()), (self.folded(),)

    def __copy__(self) -> Any:
        return self if self.call.alive else self.folded()  # (copied in its call, it is still followed)

    def __deepcopy__(self, memo: dict) -> Any:
        return self.__copy__()

    def __neg__(self) -> Any:
        return self._one(operator.neg)

    def __pos__(self) -> Any:
        return self

    def __abs__(self) -> Any:
        return self._one(abs)

    def __round__(self, ndigits: Any = None) -> Any:
        return self._one(lambda v: round(v, ndigits))

    def __divmod__(self, other: object) -> Any:
        return self // other, self % other  # type: ignore[operator]

    def __rdivmod__(self, other: object) -> Any:
        return other // self, other % self  # type: ignore[operator]


def _binary(op: Callable) -> tuple[Callable, Callable]:
    """``__op__`` and ``__rop__`` that compute both values."""

    def forward(self: object, other: object) -> Any:
        return _derive(op, self, other)

    def reflected(self: object, other: object) -> Any:
        return _derive(op, other, self)

    return forward, reflected


_OPERATORS = {
    name: _binary(pow if name == "pow" else getattr(operator, name))
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and_", "or_", "xor")
}


for _name, (_forward, _reflected) in _OPERATORS.items():
    setattr(_Marked, f"__{_name.rstrip('_')}__", _forward)
    setattr(_Marked, f"__r{_name.rstrip('_')}__", _reflected)


class FoldedInt(_Marked, int):
    """An int computed from a :class:`FoldedSize` that is not a size of the models' samples (``B - 1``,
    ``B % 4``, ``-B``, ``B * B``); ``own`` is each original model's. Refused where torch would use it while it
    differs from ``own``. Copied or pickled, it is a plain int."""

    own: int
    num_models: int

    def folded(self) -> int:
        return int.__int__(self)

    def __invert__(self) -> Any:
        return self._one(operator.invert)

    @property
    def numerator(self) -> Any:
        return self

    def as_integer_ratio(self) -> tuple:
        return self, 1

    def bit_length(self) -> Any:
        return self._one(int.bit_length)

    def bit_count(self) -> Any:
        return self._one(int.bit_count)

    def to_bytes(self, *args: Any, **kwargs: Any) -> bytes:
        self._refuse_plain("to_bytes()")
        return self.folded().to_bytes(*args, **kwargs)

    def __index__(self) -> int:
        # Called only explicitly (B.__index__()): CPython takes an int subclass as it is for indexing and
        # range() (see the module docstring), so this refuses the one read it can see.
        self._refuse_plain("__index__()")
        return self.folded()

    def __trunc__(self) -> Any:
        return self

    __floor__ = __ceil__ = __trunc__
    __hash__ = int.__hash__


class FoldedValue(_Marked, float):
    """A float computed from a :class:`FoldedSize` (``B / 2``, ``1 / B``, ``B * 0.5``, ``B ** -0.5``);
    ``own`` is each original model's. Refused where torch would use it while it differs from ``own``. Copied
    or pickled, it is a plain float."""

    own: float
    num_models: int

    def folded(self) -> float:
        return float.__float__(self)

    def __trunc__(self) -> Any:
        return self._one(math.trunc)

    def is_integer(self) -> bool:
        return bool(self._compare(0, lambda v, _: float(v).is_integer(), "is_integer()"))

    def hex(self) -> str:
        self._refuse_plain("hex()")
        return self.folded().hex()

    def __floor__(self) -> Any:
        return self._one(math.floor)

    def __ceil__(self) -> Any:
        return self._one(math.ceil)

    __hash__ = float.__hash__


class FoldedSize(FoldedInt):
    """A size read from a tensor that holds the models' samples, along their dimension (``x.size(0)``,
    ``x.shape[0]``, ``x.numel()``): ``M`` times one model's. An ordinary int for shapes (``x.view(B, -1)``,
    ``torch.zeros(B, T)``), and what is computed from it stays marked where it still counts the samples
    (``B * T``, ``B // 2`` where each model's ``B`` divides, ``B1 + B2``, ``B1 - B2``), so a reshape can tell
    such a size from a literal (see ``batchlayers._provenance._reshape``); anything else computed from it is a
    :class:`FoldedInt` or :class:`FoldedValue`. Copied or pickled, it is a plain int."""

    made, kind = "read from", "a size"

    def __new__(cls, value: int, num_models: Any = None, call: Call | None = None) -> Any:
        if num_models is None:
            return int(value)
        return super().__new__(cls, value, value // num_models, num_models, call)

    def one_model(self) -> int:
        """Each model's own size: ``B`` of ``M * B``."""
        return self.own

    def where(self) -> str:
        m, own = self.num_models, self.own
        return f"{self.made} the size of a tensor that holds the models' samples (M * B = {m} * {own})"

    def _sized(self, out: object) -> Any:
        return FoldedSize(out.folded(), self.num_models, self.call) if isinstance(out, _Marked) else out

    def __mul__(self, other: object) -> Any:
        out = _derive(operator.mul, self, other)
        return self._sized(out) if type(other) is int else out

    __rmul__ = __mul__

    def __floordiv__(self, other: object) -> Any:
        out = _derive(operator.floordiv, self, other)
        divides = type(other) is int and other > 0 and self.one_model() % other == 0
        return self._sized(out) if divides else out

    def __add__(self, other: object) -> Any:
        out = _derive(operator.add, self, other)
        return self._sized(out) if isinstance(other, FoldedSize) else out

    __radd__ = __add__

    def __sub__(self, other: object) -> Any:
        out = _derive(operator.sub, self, other)
        return self._sized(out) if isinstance(other, FoldedSize) else out

    def __abs__(self) -> Any:
        return self

    def __round__(self, ndigits: Any = None) -> Any:
        return self

    __hash__ = int.__hash__


def differs(x: object) -> bool:
    """Whether ``x`` is a marked number whose folded value differs from each original model's."""
    return isinstance(x, _Marked) and x.num_models > 1 and x.own != x.folded() and x.call.alive
