"""``aten.median``, ``aten.nanmedian`` and ``aten.kthvalue``: the value at a position of the sorted axis.

The exporter has no translation for them. Here the axis is sorted (``TopK`` of every element, smallest first,
NaN keyed as ``+inf`` so it sorts last) and the index PyTorch picks is read at the position:

- ``kthvalue``: ``k - 1``;
- ``median``: ``(n - 1) // 2`` (the lower median), or, where the slice holds a NaN, the first NaN (PyTorch
  returns NaN there);
- ``nanmedian``: ``(m - 1) // 2`` for the ``m`` non-NaN elements of each slice.

The values are a ``GatherElements`` of the input at that index, so the gradient goes to it, as PyTorch's
backward does. Which of several equal elements is picked is unspecified in PyTorch (the OpInfo harness skips
such samples); a slice holding both NaN and ``+inf`` may pick a different one of them than eager for
``kthvalue``/``nanmedian``.
"""

from __future__ import annotations

from onnxscript import opset18 as op

from onnxtrain.capture.refuse import Refused


def _rank(self, name: str) -> int:
    if self.shape is None:
        raise Refused(f"{name} of a tensor of unknown rank: it runs in PyTorch")
    return len(self.shape)


def _order(self, dim: int, rank: int):
    """``self`` made at least 1-D, the axis, and the indices that sort it along the axis (NaN last)."""
    if rank == 0:
        self, rank = op.Reshape(self, op.Constant(value_ints=[1])), 1
    axis = dim % rank
    n = op.Gather(op.Shape(self), op.Constant(value_ints=[axis]), axis=0)
    key = op.Where(op.IsNaN(self), op.CastLike(float("inf"), self), self)
    _, order = op.TopK(key, n, axis=axis, largest=0, sorted=1)
    return self, axis, rank, n, order


def _pick(self, axis: int, order, position, keepdim: bool, squeeze_rank0: bool):
    """The values and indices at ``position`` (an int64 tensor with ``axis`` kept as 1) of the sorted axis."""
    index = op.GatherElements(order, position, axis=axis)
    values = op.GatherElements(self, index, axis=axis)
    if squeeze_rank0:
        scalar = op.Constant(value_ints=[])
        return op.Reshape(values, scalar), op.Reshape(index, scalar)
    if not keepdim:
        axes = op.Constant(value_ints=[axis])
        return op.Squeeze(values, axes), op.Squeeze(index, axes)
    return values, index


def _positions(self, axis: int, rank: int, position):
    """``position`` (a scalar) broadcast to ``self``'s shape with ``axis`` of size 1."""
    shape = op.ScatterElements(op.Shape(self), op.Constant(value_ints=[axis]), op.Constant(value_ints=[1]))
    return op.Expand(op.Reshape(position, op.Constant(value_ints=[1] * rank)), shape)


def kthvalue(self, k: int, dim: int = -1, keepdim: bool = False):
    """``kthvalue(Tensor self, int k, int dim=-1, bool keepdim=False) -> (Tensor values, Tensor indices)``"""
    rank0 = _rank(self, "kthvalue") == 0
    self, axis, rank, _, order = _order(self, dim, _rank(self, "kthvalue"))
    position = _positions(self, axis, rank, op.Constant(value_int=k - 1))
    return _pick(self, axis, order, position, keepdim, rank0)


def _median_dim(self, dim: int, keepdim: bool, ignore_nan: bool, rank: int):
    rank0 = rank == 0
    self, axis, rank, n, order = _order(self, dim, rank)
    axes = op.Constant(value_ints=[axis])
    nan = op.IsNaN(self)
    one = op.Constant(value_int=1)
    if ignore_nan:  # (m - 1) // 2 per slice, m the non-NaN count (0 where all are NaN)
        count = op.ReduceSum(op.Cast(op.Not(nan), to=7), axes, keepdims=1)
        position = op.Div(op.Max(op.Sub(count, one), op.Constant(value_int=0)), op.Constant(value_int=2))
    else:
        position = _positions(self, axis, rank, op.Div(op.Sub(op.Squeeze(n), one), op.Constant(value_int=2)))
        first_nan = op.ArgMax(op.Cast(nan, to=7), axis=axis, keepdims=1)
        has_nan = op.ReduceMax(op.Cast(nan, to=7), axes, keepdims=1)
        # The first NaN's position in the sorted order: where ``order`` holds its index.
        at = op.ArgMax(op.Cast(op.Equal(order, first_nan), to=7), axis=axis, keepdims=1)
        position = op.Where(op.Greater(has_nan, op.Constant(value_int=0)), at, position)
    return _pick(self, axis, order, position, keepdim, rank0)


def median_dim(self, dim: int, keepdim: bool = False):
    """``median.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)``"""
    return _median_dim(self, dim, keepdim, False, _rank(self, "median"))


def nanmedian_dim(self, dim: int, keepdim: bool = False):
    """``nanmedian.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)``"""
    return _median_dim(self, dim, keepdim, True, _rank(self, "nanmedian"))


def median(self):
    """``median(Tensor self) -> Tensor``: of every element."""
    _rank(self, "median")
    values, _ = _median_dim(op.Reshape(self, op.Constant(value_ints=[-1])), 0, False, False, 1)
    return values


def nanmedian(self):
    """``nanmedian(Tensor self) -> Tensor``: of every non-NaN element."""
    _rank(self, "nanmedian")
    values, _ = _median_dim(op.Reshape(self, op.Constant(value_ints=[-1])), 0, False, True, 1)
    return values
