"""``adaptive_max_pool2d`` (also behind ``adaptive_max_pool1d``) and ``_adaptive_avg_pool3d``, window by window.

The dynamo exporter has no translation for either; the TorchScript exporter, tried next, translated an
unbatched ``adaptive_max_pool2d`` (``[C, H, W]``) as if it were a batched 1-D pool (output ``[4, 4, 2]``
where PyTorch's is ``[4, 2, 3]``: a wrong result, not a failure).

PyTorch's window ``i`` of ``out`` along an axis of size ``n`` covers ``[floor(i * n / out), ceil((i + 1) * n
/ out))``; windows differ in size and may overlap, so no ONNX pool fits. A box max (mean) is a max (mean)
over each axis in turn, and each axis is ``out`` ``Slice``s of the window, each reduced and concatenated:
``out_1 + out_2 (+ out_3)`` windows, with bounds computed from the input's shape at run time (so a dynamic
axis works). The mean of means is the box mean because every window of an axis covers the same positions
of the other axes. The gradients are those of ``Slice``, ``Concat`` and ``ReduceMax`` / ``ReduceMean``.

The max pool's indices (flat positions in the input's spatial plane, as PyTorch returns them) come from
``ArgMax`` of each window, carried through the axes: the index so far is gathered at the next axis's
argmax, times that axis's size, plus the position along it.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxscript import opset18 as op

from onnxtrain.capture.constants import int64 as _int


def adaptive_max_pool2d(self, output_size: Sequence[int]):
    """``adaptive_max_pool2d(Tensor self, int[2] output_size) -> (Tensor, Tensor)``"""
    return _adaptive_pool(self, list(output_size), with_indices=True)


def adaptive_avg_pool3d(self, output_size: Sequence[int]):
    """``_adaptive_avg_pool3d(Tensor self, SymInt[3] output_size) -> Tensor``"""
    return _adaptive_pool(self, list(output_size), with_indices=False)


def _adaptive_pool(x, output_size: list[int], with_indices: bool):
    if not all(isinstance(size, int) for size in output_size):
        raise ValueError(f"adaptive pooling: output size {output_size} is known only at run time (None in "
                         "output_size on a dynamic axis); each window is a node, so it must be static")
    n = len(output_size)
    first = len(x.shape) - n  # the first spatial axis (unbatched inputs have one leading axis less)
    index = None
    for k, out in enumerate(output_size):
        axis = first + k
        size = op.Shape(x, start=axis, end=axis + 1)
        values, positions = [], []
        for i in range(out):
            start = op.Div(op.Mul(size, _int([i])), _int([out]))  # floor(i * n / out)
            end = op.Div(op.Add(op.Mul(size, _int([i + 1])), _int([out - 1])), _int([out]))  # ceil
            window = op.Slice(x, start, end, _int([axis]))
            if not with_indices:
                values.append(op.ReduceMean(window, _int([axis]), keepdims=1))
                continue
            values.append(op.ReduceMax(window, _int([axis]), keepdims=1))
            local = op.ArgMax(window, axis=axis, keepdims=1, select_last_index=0)
            position = op.Add(local, start)
            if index is not None:  # the flat index over the earlier axes, where this axis's max is
                earlier = op.GatherElements(op.Slice(index, start, end, _int([axis])), local, axis=axis)
                position = op.Add(op.Mul(earlier, size), position)
            positions.append(position)
        x = op.Concat(*values, axis=axis)
        if with_indices:
            index = op.Concat(*positions, axis=axis)
    return (x, index) if with_indices else x
