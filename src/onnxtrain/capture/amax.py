"""``aten.amax`` / ``aten.amin`` of a 0-d tensor: the tensor itself.

PyTorch accepts ``dim=0`` (or ``-1``) on a 0-d tensor and returns it; the exporter's ``ReduceMax`` over axis 0
of a rank-0 input is refused by onnxruntime's shape inference. Other ranks keep the exporter's translation
(``ReduceMax``/``ReduceMin`` over ``dim``, every axis when ``dim`` is empty).
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxscript import opset18 as op


def _reduce(reduce, self, dim: Sequence[int], keepdim: bool):
    if self.shape is not None and len(self.shape) == 0:
        return op.Identity(self)
    if not dim:
        return reduce(self, keepdims=int(keepdim))
    return reduce(self, op.Constant(value_ints=list(dim)), keepdims=int(keepdim))


def amax(self, dim: Sequence[int] = (), keepdim: bool = False):
    """``amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor``"""
    return _reduce(op.ReduceMax, self, dim, keepdim)


def amin(self, dim: Sequence[int] = (), keepdim: bool = False):
    """``amin(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor``"""
    return _reduce(op.ReduceMin, self, dim, keepdim)
