"""Reductions: ``ReduceSum``, ``ReduceMean``, ``ReduceMax`` and the rest of the ``Reduce*`` family.

Every rule first brings ``dy`` (and, where needed, ``y``) back to the keepdims=1 form, then states the
derivative as a broadcasting expression against ``x``. The axes are reused as the forward node has them
(an attribute before opset 18, an input after; ReduceSum's is an input from opset 13), so dynamic axes
and dynamic shapes need no special case.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("reduce")
r = rules.register


# -- helpers -------------------------------------------------------------------------------------
def _axes(g: GradContext) -> ir.Value | None:
    """The reduced axes as an int64 value, or ``None`` when the node reduces every axis (or none)."""
    if g.has_input(1):
        axes = g.inputs[1]
        if axes.shape is not None and len(axes.shape) == 1 and axes.shape[0] == 0:
            return None  # an explicitly empty list means the same as no list
        return axes
    axes = g.attr("axes")
    return g.b.ints(axes) if axes else None


def _is_noop(g: GradContext) -> bool:
    return bool(g.attr("noop_with_empty_axes", 0)) and _axes(g) is None


def _keep(g: GradContext, value: ir.Value) -> ir.Value:
    """An output-shaped ``value`` in keepdims=1 form, so that it broadcasts against ``x``."""
    axes = _axes(g)
    if g.attr("keepdims", 1) or axes is None:
        return value  # already kept, or rank 0 (all axes reduced), or nothing reduced (noop)
    return g.b.Unsqueeze(value, axes)


def _sum_keep(g: GradContext, value: ir.Value) -> ir.Value:
    """``value`` (shaped like ``x``) summed over the node's axes, keepdims=1."""
    return g.b.ReduceSum(value, _axes(g), keepdims=1, noop_with_empty_axes=int(_is_noop(g)))


def _same_reduce_keep(g: GradContext, value: ir.Value) -> ir.Value:
    """``value`` reduced by the forward op itself, over the same axes, with keepdims=1."""
    attrs = {"keepdims": 1, "noop_with_empty_axes": g.attr("noop_with_empty_axes")}
    if not g.has_input(1) and g.attr("axes") is not None:
        attrs["axes"] = g.attr("axes")
    axes = g.inputs[1] if g.has_input(1) else None
    return g.b.op(g.node.op_type, value, axes, **attrs)


def _expand_dy(g: GradContext) -> ir.Value:
    x = g.inputs[0]
    return g.b.Expand(_keep(g, g.dy[0]), g.b.Shape(x))


# -- rules ---------------------------------------------------------------------------------------
@r("ReduceSum")
def grad_reduce_sum(g: GradContext):
    return _expand_dy(g), None


@r("ReduceMean")
def grad_reduce_mean(g: GradContext):
    """``dy / count``, with ``count = size(x) / size(y)`` taken at run time."""
    (x, *_), y, b = g.inputs, g.outputs[0], g.b
    count = b.Div(b.Cast(b.Size(x), to=x.dtype), b.Cast(b.Size(y), to=x.dtype))
    return b.Div(_expand_dy(g), count), None


@r("ReduceSumSquare")
def grad_reduce_sum_square(g: GradContext):
    x, b = g.inputs[0], g.b
    return b.Mul(b.Mul(_keep(g, g.dy[0]), x), b.scalar(2.0, x)), None


@r("ReduceL1")
def grad_reduce_l1(g: GradContext):
    x, b = g.inputs[0], g.b
    return b.Mul(_keep(g, g.dy[0]), b.Sign(x)), None


@r("ReduceL2")
def grad_reduce_l2(g: GradContext):
    """``dy * x / y``; where ``y == 0`` the subgradient 0 (as PyTorch's norm)."""
    x, b = g.inputs[0], g.b
    y = _keep(g, g.outputs[0])
    zero = b.scalar(0.0, x)
    is_zero = b.Equal(y, zero)
    safe_y = b.Where(is_zero, b.scalar(1.0, x), y)
    return b.Where(is_zero, zero, b.Mul(_keep(g, g.dy[0]), b.Div(x, safe_y))), None


@r("ReduceLogSumExp")
def grad_reduce_log_sum_exp(g: GradContext):
    """``dy * softmax(x)`` over the reduced axes: ``exp(x - y)``."""
    x, b = g.inputs[0], g.b
    return b.Mul(_keep(g, g.dy[0]), b.Exp(b.Sub(x, _keep(g, g.outputs[0])))), None


@r("ReduceLogSum")
def grad_reduce_log_sum(g: GradContext):
    """``y = log(sum(x))``: ``dx = dy / sum(x) = dy / exp(y)``."""
    x, b = g.inputs[0], g.b
    dx = b.Div(_keep(g, g.dy[0]), b.Exp(_keep(g, g.outputs[0])))
    return b.Expand(dx, b.Shape(x)), None


@r("ReduceMax", "ReduceMin")
def grad_reduce_max_min(g: GradContext):
    """The gradient goes to the elements equal to the result; ties share it equally (as torch.amax)."""
    x, b = g.inputs[0], g.b
    hit = b.Cast(b.Equal(x, _keep(g, g.outputs[0])), to=x.dtype)
    share = b.Div(_keep(g, g.dy[0]), _sum_keep(g, hit))
    return b.Mul(hit, share), None


@r("ReduceProd")
def grad_reduce_prod(g: GradContext):
    """``dx_i = dy * prod_{j != i} x_j``, exact with zeros: the product of the non-zero elements is
    the answer for a lone zero, ``0`` for everything else once a zero is present."""
    x, b = g.inputs[0], g.b
    zero, one = b.scalar(0.0, x), b.scalar(1.0, x)
    is_zero = b.Equal(x, zero)
    zeros = _sum_keep(g, b.Cast(is_zero, to=x.dtype))
    rest = _same_reduce_keep(g, b.Where(is_zero, one, x))  # product of the non-zero elements
    others = b.Where(
        is_zero,
        b.Where(b.Equal(zeros, one), rest, zero),
        b.Where(b.Equal(zeros, zero), b.Div(rest, b.Where(is_zero, one, x)), zero),
    )
    return b.Mul(_keep(g, g.dy[0]), others), None

