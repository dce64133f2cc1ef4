"""``aten.diagonal_scatter``: ``self`` with its diagonal (``offset``, between ``dim1`` and ``dim2``) replaced by
``src``. The exporter decomposes it into an in-place copy that ``torch.export`` refuses in a training graph.

Here the two axes are moved last, each cell ``(i, j)`` with ``j - i == offset`` takes ``src`` at ``i - max(-offset,
0)`` (a ``Gather`` along ``src``'s last axis, which holds the diagonal), the rest keeps ``self``, and the axes go
back. ``src`` is padded by one element so the gather is valid for an empty diagonal too.
"""

from __future__ import annotations

from onnxscript import opset18 as op

from onnxtrain.capture.refuse import Refused


def _size(shape, axis: int):
    return op.Squeeze(op.Gather(shape, op.Constant(value_ints=[axis]), axis=0))


def diagonal_scatter(self, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """``diagonal_scatter(Tensor self, Tensor src, int offset=0, int dim1=0, int dim2=1) -> Tensor``"""
    if self.shape is None:
        raise Refused("diagonal_scatter of a tensor of unknown rank: it runs in PyTorch")
    rank = len(self.shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    perm = [axis for axis in range(rank) if axis not in (dim1, dim2)] + [dim1, dim2]
    back = [perm.index(axis) for axis in range(rank)]
    x = op.Transpose(self, perm=perm)  # [..., n1, n2]
    shape = op.Shape(x)
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Range(zero, _size(shape, rank - 2), one)
    cols = op.Range(zero, _size(shape, rank - 1), one)
    on_diagonal = op.Equal(op.Sub(op.Unsqueeze(cols, op.Constant(value_ints=[0])),
                                  op.Unsqueeze(rows, op.Constant(value_ints=[1]))), op.Constant(value_int=offset))
    length = _size(op.Shape(src), -1)
    padded = op.Pad(src, op.Constant(value_ints=[0] * (2 * (rank - 1) - 1) + [1]))  # one more at the end
    where = op.Clip(op.Sub(rows, op.Constant(value_int=max(-offset, 0))), zero, length)
    values = op.Unsqueeze(op.Gather(padded, where, axis=rank - 2), op.Constant(value_ints=[-1]))  # [..., n1, 1]
    return op.Transpose(op.Where(on_diagonal, values, x), perm=back)
