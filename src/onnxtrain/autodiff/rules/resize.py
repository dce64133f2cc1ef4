"""Resize (upsampling and downsampling of the trailing spatial axes).

Resize is linear in its input and separable: along each resized axis, output ``o`` is
``sum_j R[o, j] * x[j]``, with weights that depend only on the axis' input and output sizes, the scale,
the mode and the coordinate mapping. So the rule builds ``R`` by resizing an identity matrix with the
node's own attributes along that one axis (which reproduces every mode — nearest with any
``nearest_mode``, linear, cubic, antialias — and every ``coordinate_transformation_mode`` exactly), and
backpropagates with ``dx = R^T dy`` per axis as one MatMul each (an axis before the last two, as the
depth of a rank-5 input, flattens the axes after it into one for its MatMul and unflattens after).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("resize")
r = rules.register

X, ROI, SCALES, SIZES = 0, 1, 2, 3


def _unsupported(g: GradContext, what: str) -> ValueError:
    return ValueError(f"Resize node {g.node.name!r}: no gradient for {what}; export the model with plain "
                      "scales or sizes over the spatial axes (e.g. torch.nn.functional.interpolate)")


def _axis_matrix_t(g: GradContext, x: ir.Value, y: ir.Value, axis: int, rank: int, use_sizes: bool,
                   scales: ir.Value | None) -> ir.Value:
    """``R^T`` of ``axis``, shape ``[n_in, n_out]``: the identity, resized along ``axis`` only."""
    b = g.b
    n_in = b.Slice(b.Shape(x), b.ints([axis]), b.ints([axis + 1]))
    eye = b.EyeLike(b.ConstantOfShape(b.Concat(n_in, n_in, axis=0),
                                      value=ir.tensor(np.zeros(1, dtype=x.dtype.numpy()))))
    # [1, n_in(j), 1, ..., n_in at `axis`, ..., 1]: axis 1 indexes the identity's columns.
    shape = [1] * rank
    shape[1] = -1
    shape[axis] = -1
    layout = b.Reshape(eye, b.Concat(*[b.ints([d]) if d != -1 else n_in for d in shape], axis=0))
    attrs = {k: a.value for k, a in g.node.attributes.items()}
    if use_sizes:
        n_out = b.Slice(b.Shape(y), b.ints([axis]), b.ints([axis + 1]))
        sizes = b.Concat(*[n_out if i == axis else (n_in if i == 1 else b.ints([1])) for i in range(rank)], axis=0)
        resized = b.op("Resize", layout, None, None, sizes, **attrs)
    else:
        one = b.const(np.ones(1, dtype=np.float32))
        s = b.Slice(scales, b.ints([axis]), b.ints([axis + 1]))
        scales_e = b.Concat(*[s if i == axis else one for i in range(rank)], axis=0)
        resized = b.op("Resize", layout, None, scales_e, **attrs)
    # [1, n_in, 1.., n_out, ..1] -> [n_in, n_out]
    return b.Reshape(resized, b.Concat(n_in, b.ints([-1]), axis=0))


@r("Resize", since=11)
def grad_resize(g: GradContext):
    x, y, dy = g.inputs[X], g.outputs[0], g.dy[0]
    rank = g.rank(x)
    if rank not in (3, 4, 5):
        raise _unsupported(g, f"inputs of rank {rank} (ranks 3 to 5 are supported)")
    if g.attr("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        raise _unsupported(g, "coordinate_transformation_mode='tf_crop_and_resize'")
    if g.attr("axes") is not None:
        raise _unsupported(g, "the 'axes' attribute")
    if g.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise _unsupported(g, f"keep_aspect_ratio_policy={g.attr('keep_aspect_ratio_policy')!r}")
    use_sizes = g.has_input(SIZES)
    scales = None if use_sizes else g.inputs[SCALES]
    if scales is None and not use_sizes:
        raise _unsupported(g, "a node with neither scales nor sizes")
    constant_scales = g.const_input(SCALES) if not use_sizes else None
    if constant_scales is not None and constant_scales.size and np.any(constant_scales[:2] != 1):
        raise _unsupported(g, "resizing the batch or channel axis")

    b, dx = g.b, dy
    for axis in range(2, rank):
        if constant_scales is not None and constant_scales.size and constant_scales[axis] == 1:
            continue  # an axis left as it is
        rt = _axis_matrix_t(g, x, y, axis, rank, use_sizes, scales)  # [n_in, n_out]
        if axis == rank - 1:
            dx = b.MatMul(dx, b.Transpose(rt, perm=[1, 0]))  # [..., n_out] @ [n_out, n_in]
        elif axis == rank - 2:
            dx = b.MatMul(rt, dx)  # [n_in, n_out] @ [..., n_out, W]
        else:  # the axes after `axis` as one: [..., n_out, H * W], then back to [..., n_in, H, W]
            shape = b.Shape(dx)
            lead, trail = b.Slice(shape, b.ints([0]), b.ints([axis])), b.Slice(shape, b.ints([axis + 1]),
                                                                              b.ints([rank]))
            n_out = b.Slice(shape, b.ints([axis]), b.ints([axis + 1]))
            flat = b.MatMul(rt, b.Reshape(dx, b.Concat(lead, n_out, b.ints([-1]), axis=0)))
            dx = b.Reshape(flat, b.Concat(lead, b.ints([-1]), trail, axis=0))
    return (dx,)
