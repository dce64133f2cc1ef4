"""``fmax``, ``fmin``, ``copysign`` and ``hypot``: ``torch.export`` lowers them to prims with no ONNX function.

Each is a ``Where`` over the same comparisons PyTorch's kernel and derivative formula make, so that
forward values, NaN handling and which input a tie's gradient goes to all match:

- ``fmax(a, b)`` is ``a`` where ``a >= b`` or ``b`` is NaN, else ``b`` (a NaN loses to a number; two NaNs give
  NaN); the gradient goes to the input picked, ties to ``a`` (PyTorch's ``fmax`` formula). ``fmin`` with ``<=``.
- ``copysign(a, b)`` is ``|a|`` or ``-|a|`` by the sign bit of ``b``, ``-0.0`` included (``1 / b < 0``); ``b``
  gets a zero gradient, ``a`` gets ``sign(a)`` times the sign chosen (0 at ``a = 0``), as in PyTorch. A NaN
  ``b`` counts as positive (ONNX cannot read a NaN's sign bit; PyTorch can).
- ``hypot(a, b)`` is ``m * sqrt(1 + (s / m)^2)`` with ``m`` the larger of ``|a|``, ``|b|`` and ``s`` the
  smaller (``sqrt(a^2 + b^2)`` would overflow to inf from about 1.8e19, where PyTorch's is finite).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op


def _scalar(value: float, like):
    return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=np.float32))), like)


def fmax(self, other):
    """``fmax(Tensor self, Tensor other)``"""
    return op.Where(op.Or(op.GreaterOrEqual(self, other), op.IsNaN(other)), self, other)


def fmin(self, other):
    """``fmin(Tensor self, Tensor other)``"""
    return op.Where(op.Or(op.LessOrEqual(self, other), op.IsNaN(other)), self, other)


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
    a, b = op.Abs(op.Expand(self, op.Shape(other))), op.Abs(op.Expand(other, op.Shape(self)))
    a_larger = op.GreaterOrEqual(a, b)
    large, small = op.Where(a_larger, a, b), op.Where(a_larger, b, a)
    one = _scalar(1.0, large)
    at_zero = op.CastLike(op.Equal(large, _scalar(0.0, large)), large)
    ratio = op.Div(small, op.Add(large, at_zero))  # 0 / 1 where both are 0: 0 / 0 is never computed
    return op.Mul(large, op.Sqrt(op.Add(one, op.Mul(ratio, ratio))))
