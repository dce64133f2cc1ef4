"""``fmax``, ``fmin``, ``copysign`` and ``hypot``: ``torch.export`` lowers them to prims with no ONNX function.

Each is a ``Where`` over the same comparisons PyTorch's kernel and derivative formula make, so that
forward values, NaN handling and which input a tie's gradient goes to all match:

- ``fmax(a, b)`` is ``a`` where ``a >= b`` or ``b`` is NaN, else ``b`` (a NaN loses to a number; two NaNs give
  NaN); the gradient goes to the input picked. A tie's gradient goes to ``a`` in torch 2.13 and is split
  half and half from torch 2.15 on: the share is read once from the running torch (:func:`_tie_share`) and a
  tie computes ``s * a + (1 - s) * b`` (equal to both) so each input gets its share. ``fmin`` with ``<=``.
- ``copysign(a, b)`` is ``|a|`` or ``-|a|`` by the sign bit of ``b``, ``-0.0`` included (``1 / b < 0``); ``b``
  gets a zero gradient, ``a`` gets ``sign(a)`` times the sign chosen (0 at ``a = 0``), as in PyTorch. A NaN
  ``b`` counts as positive (ONNX cannot read a NaN's sign bit; PyTorch can).
- ``hypot(a, b)`` is ``m * sqrt(1 + (s / m)^2)`` with ``m`` the larger of ``|a|``, ``|b|`` and ``s`` the
  smaller (``sqrt(a^2 + b^2)`` would overflow to inf from about 1.8e19, where PyTorch's is finite); at
  ``a = b = 0`` it is ``sqrt(a^2 + b^2)``, whose gradient is NaN there as PyTorch's ``a / hypot(a, b)`` is.
"""

from __future__ import annotations

import functools

import torch
from onnxscript import opset18 as op

from onnxtrain.capture.constants import scalar_like as _scalar


@functools.cache
def _tie_share(name: str) -> float:
    """The share of a tie's gradient that this torch's ``fmax``/``fmin`` gives its first input (1.0 in torch
    2.13, 0.5 in 2.15): read from eager, so the graph's gradient is the one eager computes."""
    a, b = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    getattr(torch, name)(a, b).backward()
    return float(a.grad)


def _pick(self, other, first_wins, name: str):
    """``self`` where ``first_wins`` or ``other`` is NaN, else ``other``; ties shared as eager shares them."""
    share = _tie_share(name)
    if share == 1.0:
        return op.Where(op.Or(first_wins(self, other), op.IsNaN(other)), self, other)
    equal = op.Equal(self, other)
    strict = op.Or(op.Not(op.Or(equal, op.Not(first_wins(self, other)))), op.IsNaN(other))
    tie = op.Add(op.Mul(self, _scalar(share, self)), op.Mul(other, _scalar(1.0 - share, other)))
    return op.Where(strict, self, op.Where(equal, tie, other))


def fmax(self, other):
    """``fmax(Tensor self, Tensor other)``"""
    return _pick(self, other, op.GreaterOrEqual, "fmax")


def fmin(self, other):
    """``fmin(Tensor self, Tensor other)``"""
    return _pick(self, other, op.LessOrEqual, "fmin")


def copysign(self, other):
    """``copysign.Tensor(Tensor self, Tensor other)``"""
    zero = _scalar(0.0, other)
    negative = op.Or(op.Less(other, zero), op.And(op.Equal(other, zero), op.Less(op.Reciprocal(other), zero)))
    magnitude = op.Abs(self)
    return op.Where(negative, op.Neg(magnitude), magnitude)


def hypot(self, other):
    """``hypot(Tensor self, Tensor other)``"""
    # Expand broadcasts both ways: each input at the common shape first, so no intermediate value has a
    # broadcast shape that shape inference has to guess from two dynamic axes
    x, y = op.Expand(self, op.Shape(other)), op.Expand(other, op.Shape(self))
    a, b = op.Abs(x), op.Abs(y)
    a_larger = op.GreaterOrEqual(a, b)
    large, small = op.Where(a_larger, a, b), op.Where(a_larger, b, a)
    one = _scalar(1.0, large)
    zero = op.Equal(large, _scalar(0.0, large))
    ratio = op.Div(small, op.Add(large, op.CastLike(zero, large)))  # 0 / 1 where both are 0, not 0 / 0
    scaled = op.Mul(large, op.Sqrt(op.Add(one, op.Mul(ratio, ratio))))
    # where both are 0, sqrt(x^2 + y^2): 0, with PyTorch's gradient x / hypot = 0 / 0 = NaN; elsewhere that
    # branch reads 1s, so its (unused) gradient stays finite
    x0, y0 = op.Where(zero, x, op.CastLike(one, x)), op.Where(zero, y, op.CastLike(one, y))
    return op.Where(zero, op.Sqrt(op.Add(op.Mul(x0, x0), op.Mul(y0, y0))), scaled)
