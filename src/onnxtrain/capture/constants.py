"""Literals in the translations of ``capture/``: one way to write them, shared by every translation file."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op


def scalar_like(value: float, like):
    """A 0-d constant ``value`` in ``like``'s element type (written as float32, then ``CastLike``)."""
    return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=np.float32))), like)


def int64(value):
    """An int64 constant: a scalar for an int, 1-D for a list."""
    return op.Constant(value=ir.tensor(value, dtype=ir.DataType.INT64))
