"""``aten._safe_softmax``: softmax whose rows of only ``-inf`` give zeros (SDPA uses it for masked rows).

The exporter translates it as ``Where(row is all -inf, 0, Softmax(x))``: the forward is right, but the
masked rows' Softmax is NaN, and its gradient, ``y * (dy - sum(dy * y))`` with ``dy = 0`` there, stays NaN
(NaN * 0), so every input of such a row got a NaN gradient where PyTorch has zeros. Here ``-inf`` is
raised to half the dtype's lowest finite value before the Softmax (a masked row becomes uniform, finite)
and the output is multiplied by a per-row 0/1 factor (0 for a row of only ``-inf``:
:func:`.attention.finite_rows`, which OpenVINO computes right too), as the attention translation does. Inputs below
that floor add nothing to a row whose largest value is above it (``exp`` underflows to 0 either way), and get a zero gradient there as in PyTorch.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from onnxtrain.capture.attention import finite_rows


def safe_softmax(self, dim: int, dtype: int | None = None):
    """``_safe_softmax(self, dim, dtype=None)``"""
    x = self if dtype is None or self.dtype is None or int(self.dtype) == int(dtype) else op.Cast(self, to=int(dtype))
    kind = ir.DataType(int(dtype)) if dtype is not None else self.dtype
    numpy_type = kind.numpy()
    floor = op.Constant(value=ir.tensor(np.array(np.finfo(numpy_type).min / 2, dtype=numpy_type)))
    row_valid = finite_rows(x, op.Constant(value_ints=[dim]), kind)
    return op.Mul(op.Softmax(op.Max(x, floor), axis=dim), row_valid)
