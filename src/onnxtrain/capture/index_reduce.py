"""``aten.index_reduce``: ``scatter_reduce`` with the 1-D ``index`` broadcast over ``source``.

``self.index_reduce(dim, index, source, reduce, include_self)`` reduces ``source[..., k, ...]`` into
``self[..., index[k], ...]``: the ``scatter_reduce`` of ``source`` with ``index`` reshaped to lie along ``dim`` and
expanded to ``source``'s shape, with the same reductions (``prod``, ``mean``, ``amax``, ``amin``) and the same
``include_self`` meaning. The exporter has no translation; this one is :mod:`.scatter_reduce`'s (``mean``) or
the exporter's ``scatter_reduce`` (the others, a ``ScatterElements`` the gradient engine differentiates as
PyTorch does: ``autodiff/rules/shape.py``).
"""

from __future__ import annotations

from onnxscript import opset18 as op

from onnxtrain.capture.refuse import Refused
from onnxtrain.capture.scatter_reduce import scatter_reduce


def index_reduce(self, dim: int, index, source, reduce: str, include_self: bool = True):
    """``index_reduce(Tensor self, int dim, Tensor index, Tensor source, str reduce, *, bool include_self=True)``"""
    if source.shape is None or self.shape is None:
        raise Refused("index_reduce of a tensor of unknown rank: it runs in PyTorch")
    rank = len(source.shape)
    if rank == 0:  # index can only be [0]: the reduction of self (if included) and source
        if not include_self:
            return op.Identity(source)
        if reduce == "mean":
            return op.Div(op.Add(self, source), op.CastLike(2.0, source))
        return {"prod": op.Mul, "amax": op.Max, "amin": op.Min}[reduce](self, source)
    dim = dim % rank
    along = op.Constant(value_ints=[-1 if axis == dim else 1 for axis in range(rank)])
    spread = op.Expand(op.Reshape(index, along), op.Shape(source))
    return scatter_reduce(self, dim, spread, source, reduce, include_self)
