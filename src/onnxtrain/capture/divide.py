"""``aten.divide.Tensor`` and ``aten.true_divide.Tensor`` of a floating tensor and an integer one.

torch.onnx's type-promotion pass knows ``aten.div`` but not these aliases, so a float divided by an integer
count (``torch.masked.var``'s mean) became a ``Div`` of float and int64, which onnxruntime refuses. PyTorch's
result has the floating operand's dtype (its category wins, 0-d or not): the integer operand is cast to it.
Everything else is the exporter's own translation.
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core


def _floating(value) -> bool:
    return value.dtype is not None and value.dtype.is_floating_point()


def _integer(value) -> bool:
    return value.dtype is not None and (value.dtype.is_integer() or value.dtype == value.dtype.BOOL)


def divide(self, other):
    """``divide.Tensor(Tensor self, Tensor other) -> Tensor`` (and ``true_divide.Tensor``)"""
    if _floating(self) and _integer(other):
        return op.Div(self, op.CastLike(other, self))
    if _integer(self) and _floating(other):
        return op.Div(op.CastLike(self, other), other)
    return core.aten_div(self, other)
