"""``aten.scatter_reduce.two`` with ``reduce="mean"``, which the exporter translated as a plain scatter.

PyTorch's mean at a position that ``index`` reaches is ``(self + sum of src) / (count + 1)`` with
``include_self=True``, and ``sum of src / count`` without; positions it does not reach keep ``self``. Sums and
counts are ScatterElements with ``reduction="add"`` into zeros, so the gradient engine differentiates them as it
does any scatter-add. The other reductions use the exporter's own translation.
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core

from onnxtrain.capture.refuse import Refused


def scatter_reduce(self, dim: int, index, src, reduce: str, include_self: bool = True):
    """``scatter_reduce.two(self, dim, index, src, reduce, *, include_self)``"""
    if reduce != "mean":
        return core.aten_scatter_reduce(self, dim, index, src, reduce, include_self)
    dtype = src.dtype or self.dtype
    if dtype is None or not dtype.is_floating_point():
        raise Refused(f"scatter_reduce(reduce='mean') on {dtype}: PyTorch rounds the integer mean down; it runs "
                      "in PyTorch")
    zeros = op.Sub(self, self)
    sums = op.ScatterElements(zeros, index, src, axis=dim, reduction="add")
    counts = op.ScatterElements(zeros, index, op.Add(op.Sub(src, src), op.CastLike(1.0, src)), axis=dim,
                                reduction="add")
    one = op.CastLike(1.0, self)
    if include_self:
        return op.Div(op.Add(self, sums), op.Add(counts, one))
    return op.Where(op.Greater(counts, op.CastLike(0.0, self)), op.Div(sums, op.Max(counts, one)), self)
