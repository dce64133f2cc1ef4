"""Undoing broadcasting, done once for every rule (multidirectional and unidirectional alike)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder


def same_dim(a, b) -> bool:
    """Two dims are known equal: equal ints, or the same named symbolic dim."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a_val = getattr(a, "value", a)
    b_val = getattr(b, "value", b)
    return isinstance(a_val, str) and a_val == b_val


def sum_to_shape(b: GraphBuilder, grad: ir.Value, x: ir.Value, grad_shape: Sequence | None) -> ir.Value:
    """Reduce ``grad`` (whose shape is ``grad_shape``) to the shape of ``x``, which broadcast to it.

    Static shape facts decide as much as they can at build time (no node at all when the shapes
    agree); axes whose size is unknown are decided at run time with Shape/Equal/NonZero.
    """
    if x.shape is None or grad_shape is None:
        raise ValueError(
            f"cannot un-broadcast the gradient of {x.name!r}: its rank is unknown. "
            "Run onnx shape inference on the model first (gradient_model does this)."
        )
    r_in, r_out = len(x.shape), len(grad_shape)
    lead = r_out - r_in
    if lead < 0:
        raise ValueError(f"the gradient of {x.name!r} has a lower rank ({r_out}) than the value ({r_in})")
    reduce_axes: list[int] = list(range(lead))
    dynamic = False
    for i, d_in in enumerate(x.shape):
        d_out = grad_shape[lead + i]
        if same_dim(d_in, d_out) or (isinstance(d_in, int) and d_in != 1):
            continue
        if d_in == 1:
            reduce_axes.append(lead + i)  # a size-1 axis: reducing it is right whatever the other size
        else:
            dynamic = True  # the input's size is unknown here: decide at run time
    if not reduce_axes and not dynamic:
        return grad
    if not dynamic:
        out = b.ReduceSum(grad, b.ints(reduce_axes), keepdims=1)
        return b.Squeeze(out, b.ints(list(range(lead)))) if lead else out
    if lead:
        grad = b.ReduceSum(grad, b.ints(list(range(lead))), keepdims=0)
    differs = b.Not(b.Equal(b.Shape(x), b.Shape(grad)))
    axes = b.Reshape(b.NonZero(differs), b.ints([-1]))
    return b.ReduceSum(grad, axes, keepdims=1, noop_with_empty_axes=1)
