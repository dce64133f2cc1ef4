"""The normalization backward shared by LayerNormalization, the RMS norms and the Skip* norms.

With ``xhat = (x - mean) * invstd`` over ``axes`` (or ``xhat = x * invrms`` for RMS norms) and
``dxhat = dy * scale``:
    dx = invstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))      (RMS: no mean(dxhat) term)
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext

_PRECISION = {ir.DataType.BFLOAT16: 0, ir.DataType.FLOAT16: 1, ir.DataType.FLOAT: 2, ir.DataType.DOUBLE: 3}


@dataclass
class Stats:
    xhat: ir.Value  # the normalized input, in the compute type
    invstd: ir.Value  # 1/sqrt(var + eps) (or 1/rms), broadcastable to xhat
    rms: bool
    dtype: ir.DataType  # the compute type


def cast(g: GradContext, value: ir.Value, dtype: ir.DataType) -> ir.Value:
    return value if value.dtype == dtype else g.b.Cast(value, to=dtype)


def onnx_opset(g: GradContext) -> int:
    """The ai.onnx opset of the graph: ``g.opset`` is that of the node's own domain (com.microsoft: 1)."""
    if g.node.domain in ("", "ai.onnx"):
        return g.opset
    graph = g.node.graph
    opsets = graph.opset_imports if graph is not None else {}
    return opsets.get("", opsets.get("ai.onnx", 13))


def reduce(g: GradContext, op_type: str, x: ir.Value, axes: list[int]) -> ir.Value:
    """``g.reduce`` (keepdims) in the form of the graph's ai.onnx opset, whatever the node's domain."""
    if op_type == "ReduceSum" or onnx_opset(g) >= 18:
        return g.b.op(op_type, x, g.b.ints(list(axes)), keepdims=1)
    return g.b.op(op_type, x, axes=list(axes), keepdims=1)


def moments(g: GradContext, x: ir.Value, axes: list[int], eps: float, rms: bool, dtype: ir.DataType):
    """(mean or None, invstd) of ``x`` over ``axes``, keeping dims."""
    b = g.b
    if rms:
        mean, centered = None, x
    else:
        mean = reduce(g, "ReduceMean", x, axes)
        centered = b.Sub(x, mean)
    var = reduce(g, "ReduceMean", b.Mul(centered, centered), axes)
    invstd = b.Reciprocal(b.Sqrt(b.Add(var, b.const(eps, dtype=dtype))))
    return mean, invstd


def forward_output(g: GradContext, i: int, dtype: ir.DataType, shape=None) -> ir.Value:
    """Forward output ``i`` for backward to reuse (added if the node omits it), typed when new."""
    out = g.output(i)
    for skipped in g.node.outputs[:i]:
        if skipped.name is None:  # outputs that resizing added before i stay omitted
            skipped.name = ""
    if out.dtype is None:
        out.dtype = dtype
    if out.shape is None and shape is not None:
        out.shape = shape
    return out


def saved_or_recomputed(g: GradContext, axes: list[int], *, mean_output: int | None,
                        invstd_output: int | None, rms: bool, x: ir.Value | None = None,
                        default_eps: float = 1e-5) -> Stats:
    """Normalize ``x`` (default: input 0) again, reusing the forward's saved statistics when the node
    can output them in at least ``x``'s precision (the stash type); otherwise recompute them."""
    x = g.inputs[0] if x is None else x
    eps = g.attr("epsilon", default_eps)
    stash = ir.DataType(g.attr("stash_type", 1))
    if invstd_output is not None and len(g.outputs) > invstd_output and g.outputs[invstd_output].dtype:
        stash = g.outputs[invstd_output].dtype
    if invstd_output is not None and _PRECISION.get(stash, 0) >= _PRECISION.get(x.dtype, 0):
        xc = cast(g, x, stash)
        invstd = forward_output(g, invstd_output, stash)
        centered = xc if rms else g.b.Sub(xc, forward_output(g, mean_output, stash))
        return Stats(g.b.Mul(centered, invstd), invstd, rms, stash)
    compute = x.dtype
    if _PRECISION.get(stash, 0) > _PRECISION.get(compute, 0):
        compute = stash  # RMSNormalization: no saved statistics, but computed in the stash type
    xc = cast(g, x, compute)
    mean, invstd = moments(g, xc, axes, eps, rms, compute)
    centered = xc if rms else g.b.Sub(xc, mean)
    return Stats(g.b.Mul(centered, invstd), invstd, rms, compute)


def normalize_backward(g: GradContext, stats: Stats, dxhat: ir.Value, axes: list[int]) -> ir.Value:
    b = g.b
    proj = reduce(g, "ReduceMean", b.Mul(dxhat, stats.xhat), axes)
    inner = b.Sub(dxhat, b.Mul(stats.xhat, proj))
    if not stats.rms:
        inner = b.Sub(inner, reduce(g, "ReduceMean", dxhat, axes))
    return b.Mul(stats.invstd, inner)


def affine_norm_backward(g: GradContext, stats: Stats, dy: ir.Value, axes: list[int], *,
                         scale_input: int, bias_input: int | None, x: ir.Value | None = None) -> list:
    """Gradients of ``y = xhat * scale [+ bias]``: a list indexed like the node's inputs, with the
    gradient of the normalized value (``x``, default input 0) at index 0."""
    x = g.inputs[0] if x is None else x
    compute = stats.dtype
    dyc = dy if g.outputs[0].dtype == compute else g.b.Cast(dy, to=compute)
    grads: list = [None] * len(g.inputs)
    scale = g.inputs[scale_input]
    dxhat = g.b.Mul(dyc, cast(g, scale, compute))
    grads[0] = cast(g, normalize_backward(g, stats, dxhat, axes), x.dtype)
    if g.needs[scale_input]:
        grads[scale_input] = cast(g, g.sum_to(g.b.Mul(dyc, stats.xhat), scale), scale.dtype)
    if bias_input is not None and g.has_input(bias_input) and g.needs[bias_input]:
        grads[bias_input] = g.sum_to(dy, g.inputs[bias_input])
    return grads
