"""``aten.cumprod``, ``aten.cummax`` and ``aten.cummin``: scans the exporter cannot translate (``cumprod``
decomposes into a ``prims.prod`` with no ONNX function; ``cummax``/``cummin`` have none).

Each output position ``i`` along ``dim`` reduces the prefix ``x[..., :i+1, ...]``: ``x`` gets a new axis after
``dim`` holding every ``j``, masked where ``j > i`` by the reduction's identity, and is reduced over it. This
costs ``n`` times the input's memory for an axis of ``n`` (a scan, not a loop), and gives gradients the engine
already has:

- ``cumprod``: a ``ReduceProd``, whose gradient is exact with zeros, as PyTorch's ``cumprod`` backward.
- ``cummax``/``cummin``: the index is PyTorch's (the last of equal values in the prefix; a NaN wins, the last
  NaN), from ``ArgMax``/``ArgMin`` with ``select_last_index``; the values are a ``GatherElements`` at it, so the
  gradient goes to that index, as PyTorch's ``scatter_add`` of the gradient does.
"""

from __future__ import annotations

from onnxscript import opset18 as op

from onnxtrain.capture.refuse import Refused


def _rank(self, name: str) -> int:
    if self.shape is None:
        raise Refused(f"{name} of a tensor of unknown rank: it runs in PyTorch")
    return len(self.shape)


def _along(values, dim: int, rank: int, first: int = 1):
    """``values`` (``first`` axes: ``[n]`` or ``[n, n]``) with ones appended to lie on axis ``dim`` of a
    rank-``rank`` tensor (and on ``dim + 1`` for ``[n, n]``)."""
    trailing = rank - 1 - dim
    if trailing == 0:
        return values
    return op.Unsqueeze(values, op.Constant(value_ints=list(range(first, first + trailing))))


def _steps(self, dim: int):
    """``0, 1, ..., n - 1`` for the size ``n`` of axis ``dim``."""
    n = op.Squeeze(op.Gather(op.Shape(self), op.Constant(value_ints=[dim]), axis=0))
    return op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))


def _prefix(self, dim: int, rank: int, fill: float):
    """``self`` with a new axis ``dim + 1`` holding every ``j``, ``fill`` where ``j > i`` (``i`` is axis ``dim``)."""
    steps = _steps(self, dim)
    later = op.Greater(op.Unsqueeze(steps, op.Constant(value_ints=[0])),
                       op.Unsqueeze(steps, op.Constant(value_ints=[1])))  # [i, j]: j > i
    later = _along(later, dim, rank, first=2)
    rows = op.Unsqueeze(self, op.Constant(value_ints=[dim]))  # [..., 1, n (j), ...]
    return op.Where(later, op.CastLike(fill, self), rows)


def cumprod(self, dim: int, dtype: int = -1):
    """``cumprod(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor``"""
    rank = _rank(self, "cumprod")  # of self: a Cast's output has no shape yet
    if dtype is not None and dtype != -1:
        self = op.Cast(self, to=int(dtype))
    if rank == 0:
        return op.Identity(self)
    dim = dim % rank
    masked = _prefix(self, dim, rank, 1.0)
    return op.ReduceProd(masked, op.Constant(value_ints=[dim + 1]), keepdims=0)


def _cumulative_extreme(self, dim: int, largest: bool, name: str):
    rank = _rank(self, name)
    if rank == 0:
        return op.Identity(self), op.Constant(value_int=0)
    dim = dim % rank
    select = op.ArgMax if largest else op.ArgMin
    nan = op.IsNaN(self)
    worst = float("-inf") if largest else float("inf")
    values = _prefix(op.Where(nan, op.CastLike(worst, self), self), dim, rank, worst)
    axis = dim + 1
    # A prefix of only -inf (cummax) ties with its masked positions: the last index in the prefix wins.
    best = op.Min(select(values, axis=axis, keepdims=0, select_last_index=1), _along(_steps(self, dim), dim, rank))
    nans = _prefix(op.CastLike(nan, self), dim, rank, 0.0)  # 1 at NaNs
    last_nan = op.ArgMax(nans, axis=axis, keepdims=0, select_last_index=1)
    any_nan = op.Greater(op.ReduceMax(nans, op.Constant(value_ints=[axis]), keepdims=0), op.CastLike(0.0, self))
    index = op.Where(any_nan, last_nan, best)
    return op.GatherElements(self, index, axis=dim), index


def cummax(self, dim: int):
    """``cummax(Tensor self, int dim) -> (Tensor values, Tensor indices)``"""
    return _cumulative_extreme(self, dim, True, "cummax")


def cummin(self, dim: int):
    """``cummin(Tensor self, int dim) -> (Tensor values, Tensor indices)``"""
    return _cumulative_extreme(self, dim, False, "cummin")
