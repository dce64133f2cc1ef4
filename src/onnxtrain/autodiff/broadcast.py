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
    agree). An axis whose input size is unknown (1 or the gradient's size, read at run time) is split
    in two by a Reshape, [x's size, the gradient's size / x's size], and the second part is summed
    away: its position is known when the graph is built, so no node has run-time axes (OpenVINO
    converts it) and no data moves (Reshape is a view). Before opset 14 (no Reshape ``allowzero``,
    needed for empty tensors) the axes are chosen at run time with Shape/Equal/NonZero.
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
    unknown: list[int] = []  # axes of x whose size is unknown there: 1 or the gradient's
    for i, d_in in enumerate(x.shape):
        d_out = grad_shape[lead + i]
        if same_dim(d_in, d_out) or (isinstance(d_in, int) and d_in != 1):
            continue
        if d_in == 1:
            reduce_axes.append(lead + i)  # a size-1 axis: reducing it is right whatever the other size
        else:
            unknown.append(i)
    if not reduce_axes and not unknown:
        return grad
    if not unknown:
        out = b.ReduceSum(grad, b.ints(reduce_axes), keepdims=1)
        return b.Squeeze(out, b.ints(list(range(lead)))) if lead else out
    if lead:
        grad = b.ReduceSum(grad, b.ints(list(range(lead))), keepdims=0)
    if b.opset < 14:
        differs = b.Not(b.Equal(b.Shape(x), b.Shape(grad)))
        axes = b.Reshape(b.NonZero(differs), b.ints([-1]))
        return b.ReduceSum(grad, axes, keepdims=1, noop_with_empty_axes=1)
    return _sum_split_axes(b, grad, x, [a - lead for a in reduce_axes[lead:]] + unknown)


def _sum_split_axes(b: GraphBuilder, grad: ir.Value, x: ir.Value, axes: list[int]) -> ir.Value:
    """Sum ``grad`` (of x's rank) to x's shape over ``axes``, where x's size is 1 or the gradient's."""
    rank = len(x.shape)
    x_shape = b.Shape(x)
    # [x's sizes..., the gradient's sizes / x's sizes...]; Max keeps an empty axis (0 / 0) from dividing by 0.
    sizes = b.Concat(x_shape, b.Div(b.Shape(grad), b.Max(x_shape, b.ints([1]))), axis=0)
    picks: list[int] = []
    summed: list[int] = []
    for i in range(rank):
        picks.append(i)
        if i in axes:
            summed.append(len(picks))
            picks.append(rank + i)
    split = b.Reshape(grad, b.Gather(sizes, b.ints(picks), axis=0), allowzero=1)
    return b.ReduceSum(split, b.ints(summed), keepdims=0)
