"""Translations the dynamo exporter uses in place of its own, or in place of decomposing an op.

- ``aten._native_batch_norm_legit_functional``: training-mode BatchNorm (:mod:`.batchnorm`).
- ``aten.native_batch_norm`` (called directly): training mode normalizes with the batch statistics (:mod:`.batchnorm`).
- ``aten.to`` (dtype, device, dtype_layout), ``aten.__and__`` and ``aten.diff``: the training IR that
  ``torch.export`` produces keeps these, and the exporter has no translation for them, so it would
  re-trace the whole program to decompose them (``to`` into ``_to_copy``, ``__and__`` into
  ``bitwise_and``, ``diff`` into slices). Translated directly, a program made of translated ops needs no
  decomposition at all (:func:`onnxtrain.capture.export._exporter_shortcuts`).
- ``aten.scaled_dot_product_attention``: a training translation (attention dropout applied, fully
  masked rows zero as in PyTorch, no NaN guard; :mod:`.attention`).
- ``aten.avg_pool2d`` / ``aten.avg_pool3d``: ``divisor_override`` applied (:mod:`.pooling`).
- ``aten.pad`` with ``mode="replicate"`` / ``"circular"``: a ``Gather`` of clamped / wrapped positions, negative
  pads included (:mod:`.padding`).
- ``aten.adaptive_max_pool2d`` (and 1d through it), ``aten._adaptive_avg_pool3d``: window by window, unbatched
  inputs included (:mod:`.adaptive_pool`).
- ``aten.fmax``, ``aten.fmin``, ``aten.copysign``, ``aten.hypot``: ``Where`` over PyTorch's comparisons (the
  exporter lowers them to prims it cannot translate; :mod:`.elementwise`).
- ``aten.cross_entropy_loss`` with ``label_smoothing`` (the exporter dropped it) or probability targets
  (:mod:`.cross_entropy`).
- ``aten.lgamma``, ``aten.digamma``, ``aten.polygamma``, ``aten.mvlgamma``: recurrence, asymptotic series and
  reflection in ordinary ops, so their gradients are the family's next function (:mod:`.gamma`).
- ``aten.grid_sampler(_2d/_3d)`` (``grid_sample``), bilinear and nearest: gathers of the input's corners, weighted,
  so input and grid get gradients (the exporter's ``GridSample`` has no gradient rule; :mod:`.grid_sample`).
- ``aten._safe_softmax``: no NaN gradient from rows of only ``-inf`` (:mod:`.softmax`).
- ``aten.scatter_reduce.two`` with ``reduce="mean"``: the mean, not a plain scatter (:mod:`.scatter_reduce`).
- ``aten.index_reduce``: ``scatter_reduce`` of the index broadcast along ``dim`` (:mod:`.index_reduce`).
- ``aten.cumprod``, ``aten.cummax``, ``aten.cummin``: each prefix reduced over a masked new axis (:mod:`.scans`).
- ``aten.median``, ``aten.nanmedian``, ``aten.kthvalue``: an index of the sorted axis (:mod:`.order_stats`).
- ``aten.put``: a ``ScatterElements`` over the flattened tensor (:mod:`.put`).
- ``aten.diagonal_scatter``: a ``Where`` over the diagonal's cells (:mod:`.diagonal_scatter`).
- ``aten.atleast_1d/2d/3d.Sequence`` (``hstack``, ``vstack``, ``dstack``, ``column_stack``): one reshape per
  tensor, not an ONNX sequence that no gradient rule differentiates (:mod:`.sequences`).
- ``aten.divide.Tensor`` / ``aten.true_divide.Tensor`` of a float and an integer tensor: the integer one cast
  (torch.onnx's type promotion skips these aliases; :mod:`.divide`).
- ``aten.amax`` / ``aten.amin`` of a 0-d tensor: the tensor (onnxruntime refuses ``ReduceMax`` over axis 0
  of a rank-0 input; :mod:`.amax`).
- ``aten.special_log_ndtr``, ``aten.special_erfcx``: refused, so the module runs in PyTorch (:mod:`.refuse`).
- ``onnxtrain.stop_gradient`` (``detach()``, ``no_grad`` blocks): ``StopGradient`` in the ``onnxtrain``
  domain (:mod:`.stop_gradient`).
"""

from __future__ import annotations

import torch
from onnxscript import opset18 as op

from onnxtrain.capture.adaptive_pool import adaptive_avg_pool3d, adaptive_max_pool2d
from onnxtrain.capture.amax import amax, amin
from onnxtrain.capture.attention import scaled_dot_product_attention
from onnxtrain.capture.batchnorm import batch_norm_functional, native_batch_norm
from onnxtrain.capture.cross_entropy import cross_entropy_loss
from onnxtrain.capture.diagonal_scatter import diagonal_scatter
from onnxtrain.capture.divide import divide
from onnxtrain.capture.elementwise import copysign, fmax, fmin, hypot
from onnxtrain.capture.gamma import digamma, lgamma, mvlgamma, polygamma
from onnxtrain.capture.grid_sample import grid_sampler, grid_sampler_2d, grid_sampler_3d
from onnxtrain.capture.index_reduce import index_reduce
from onnxtrain.capture.order_stats import kthvalue, median, median_dim, nanmedian, nanmedian_dim
from onnxtrain.capture.padding import pad
from onnxtrain.capture.pooling import avg_pool2d, avg_pool3d
from onnxtrain.capture.put import put
from onnxtrain.capture.refuse import special_erfcx, special_log_ndtr
from onnxtrain.capture.scans import cummax, cummin, cumprod
from onnxtrain.capture.scatter_reduce import scatter_reduce
from onnxtrain.capture.sequences import atleast_1d_sequence, atleast_2d_sequence, atleast_3d_sequence
from onnxtrain.capture.softmax import safe_softmax
from onnxtrain.capture.stop_gradient import translate_stop_gradient


def _cast(self, dtype):
    """A Cast where the dtype changes, else the tensor itself (the session owns devices)."""
    if dtype is None or dtype == -1 or (self.dtype is not None and int(self.dtype) == int(dtype)):
        return op.Identity(self)
    return op.Cast(self, to=int(dtype))


# One function per overload: the exporter passes the schema's positional arguments by position.
def to_dtype(self, dtype: int = -1, non_blocking: bool = False, copy: bool = False, memory_format: str = ""):
    """``to.dtype(self, dtype, non_blocking, copy, memory_format)``"""
    return _cast(self, dtype)


def to_device(self, device: str = "", dtype: int = -1, non_blocking: bool = False, copy: bool = False,
              memory_format: str = ""):
    """``to.device(self, device, dtype, non_blocking, copy, memory_format)``"""
    return _cast(self, dtype)


def to_dtype_layout(self, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False,
                    non_blocking: bool = False, copy: bool = False, memory_format: str = ""):
    """``to.dtype_layout(self, *, dtype, layout, device, pin_memory, non_blocking, copy, memory_format)``"""
    return _cast(self, dtype)


def logical_and(self, other):
    """``a & b``: And on booleans, BitwiseAnd on integers."""
    dtype = self.dtype if self.dtype is not None else other.dtype
    if dtype is not None and dtype.is_integer():
        return op.BitwiseAnd(self, other)
    return op.And(self, other)


def diff(self, n: int = 1, dim: int = -1, prepend=None, append=None):
    """``torch.diff``: ``x[1:] - x[:-1]`` along ``dim``, ``n`` times (xor for booleans)."""
    parts = [t for t in (prepend, self, append) if t is not None]
    x = op.Concat(*parts, axis=dim) if len(parts) > 1 else self
    axes = op.Constant(value_ints=[dim])
    one, zero = op.Constant(value_ints=[1]), op.Constant(value_ints=[0])
    last, end = op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**63 - 1])
    boolean = self.dtype is not None and self.dtype == self.dtype.BOOL
    for _ in range(n):
        later, earlier = op.Slice(x, one, end, axes), op.Slice(x, zero, last, axes)
        x = op.Xor(later, earlier) if boolean else op.Sub(later, earlier)
    return x


TRANSLATIONS = {
    torch.ops.aten._native_batch_norm_legit_functional.default: batch_norm_functional,
    torch.ops.aten.to.dtype: to_dtype,
    torch.ops.aten.to.device: to_device,
    torch.ops.aten.to.dtype_layout: to_dtype_layout,
    torch.ops.aten.__and__.Tensor: logical_and,
    torch.ops.aten.diff.default: diff,
    torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
    torch.ops.aten.native_batch_norm.default: native_batch_norm,
    torch.ops.aten._safe_softmax.default: safe_softmax,
    torch.ops.aten.avg_pool2d.default: avg_pool2d,
    torch.ops.aten.avg_pool3d.default: avg_pool3d,
    torch.ops.aten.scatter_reduce.two: scatter_reduce,
    torch.ops.aten.index_reduce.default: index_reduce,
    torch.ops.aten.cumprod.default: cumprod,
    torch.ops.aten.cummax.default: cummax,
    torch.ops.aten.cummin.default: cummin,
    torch.ops.aten.median.default: median,
    torch.ops.aten.median.dim: median_dim,
    torch.ops.aten.nanmedian.default: nanmedian,
    torch.ops.aten.nanmedian.dim: nanmedian_dim,
    torch.ops.aten.kthvalue.default: kthvalue,
    torch.ops.aten.put.default: put,
    torch.ops.aten.diagonal_scatter.default: diagonal_scatter,
    torch.ops.aten.pad.default: pad,
    torch.ops.aten.fmax.default: fmax,
    torch.ops.aten.fmin.default: fmin,
    torch.ops.aten.copysign.Tensor: copysign,
    torch.ops.aten.hypot.default: hypot,
    torch.ops.aten.cross_entropy_loss.default: cross_entropy_loss,
    torch.ops.aten.lgamma.default: lgamma,
    torch.ops.aten.digamma.default: digamma,
    torch.ops.aten.polygamma.default: polygamma,
    torch.ops.aten.mvlgamma.default: mvlgamma,
    torch.ops.aten.grid_sampler.default: grid_sampler,
    torch.ops.aten.grid_sampler_2d.default: grid_sampler_2d,
    torch.ops.aten.grid_sampler_3d.default: grid_sampler_3d,
    torch.ops.aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
    torch.ops.aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    torch.ops.aten.atleast_1d.Sequence: atleast_1d_sequence,
    torch.ops.aten.atleast_2d.Sequence: atleast_2d_sequence,
    torch.ops.aten.atleast_3d.Sequence: atleast_3d_sequence,
    torch.ops.aten.amax.default: amax,
    torch.ops.aten.amin.default: amin,
    torch.ops.aten.divide.Tensor: divide,
    torch.ops.aten.true_divide.Tensor: divide,
    torch.ops.aten.special_log_ndtr.default: special_log_ndtr,
    torch.ops.aten.special_erfcx.default: special_erfcx,
    torch.ops.onnxtrain.stop_gradient.default: translate_stop_gradient,
}
