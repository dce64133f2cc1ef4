"""``avg_pool2d`` / ``avg_pool3d`` with ``divisor_override``, which the exporter's translation drops.

onnxscript's torchlib emits a plain ``AveragePool`` whatever ``divisor_override`` is (a TODO in its
source), so ``F.avg_pool2d(x, 3, divisor_override=2)`` came out 4.5 times too small. PyTorch divides each
window's sum by the divisor, padding counting as zeros. Here the window sums are a ``Conv`` of every
channel (folded into the batch) with a kernel of ones, on the input zero-padded as PyTorch pads it; with
``ceil_mode=True`` the last windows may reach past the padding, so the end is padded further (zeros add
nothing to a sum). Without ``divisor_override`` it is onnxruntime's ``AveragePool``, as the exporter has it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op


def _expand(value, n: int) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    return value * n if len(value) == 1 else value


def _avg_pool(n: int, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
              divisor_override):
    kernel = _expand(kernel_size, n)
    strides = _expand(stride, n) if stride else kernel
    pads = _expand(padding, n)
    unbatched = len(self.shape) == n + 1
    x = op.Unsqueeze(self, op.Constant(value_ints=[0])) if unbatched else self
    if divisor_override is None:
        y = op.AveragePool(x, kernel_shape=kernel, strides=strides, pads=pads + pads,
                           ceil_mode=int(bool(ceil_mode)), count_include_pad=int(bool(count_include_pad)))
    else:
        y = _window_sums(x, self.dtype, kernel, strides, pads, ceil_mode)
        y = op.Div(y, op.Constant(value=ir.tensor(np.array(divisor_override, dtype=self.dtype.numpy()))))
    return op.Squeeze(y, op.Constant(value_ints=[0])) if unbatched else y


def _window_sums(x, dtype: ir.DataType, kernel: list[int], strides: list[int], pads: list[int], ceil_mode: bool):
    """The sum of every pooling window of ``x`` ``[N, C, *spatial]``, as PyTorch places the windows."""
    n = len(kernel)
    ends = [_ints([p]) for p in pads]
    if ceil_mode:
        ends = [_ceil_end(op.Shape(x, start=2 + i, end=3 + i), k, s, p)
                for i, (k, s, p) in enumerate(zip(kernel, strides, pads))]
    folded = op.Reshape(x, op.Concat(_ints([-1, 1]), op.Shape(x, start=2), axis=0))
    padded = op.Pad(folded, op.Concat(_ints([0, 0, *pads, 0, 0]), *ends, axis=0))
    ones = op.Constant(value=ir.tensor(np.ones([1, 1, *kernel], dtype=dtype.numpy())))
    sums = op.Conv(padded, ones, kernel_shape=kernel, strides=strides)
    return op.Reshape(sums, op.Concat(op.Shape(x, start=0, end=2), op.Shape(sums, start=2, end=2 + n), axis=0))


def _ints(values: list[int]):
    return op.Constant(value_ints=values)


def _ceil_end(size, kernel: int, stride: int, pad: int):
    """The padding at the end of an axis of ``size`` (a 1-element int64 value) that PyTorch's last
    ``ceil_mode`` window needs: at least ``pad``, more where that window reaches past it."""
    padded = op.Add(size, _ints([2 * pad]))
    out = op.Add(op.Div(op.Sub(padded, _ints([kernel - stride + 1])), _ints([stride])), _ints([1]))  # ceil, + 1
    # The last window must start inside the input or its left padding.
    late = op.GreaterOrEqual(op.Mul(op.Sub(out, _ints([1])), _ints([stride])), op.Add(size, _ints([pad])))
    out = op.Sub(out, op.Cast(late, to=ir.DataType.INT64))
    reach = op.Add(op.Mul(op.Sub(out, _ints([1])), _ints([stride])), _ints([kernel]))
    return op.Add(op.Max(op.Sub(reach, padded), _ints([0])), _ints([pad]))


def avg_pool2d(self, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0, 0),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None):
    """``avg_pool2d(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)``"""
    return _avg_pool(2, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def avg_pool3d(self, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0, 0, 0),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None):
    """``avg_pool3d(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)``"""
    return _avg_pool(3, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)
