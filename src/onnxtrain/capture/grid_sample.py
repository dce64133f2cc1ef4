"""``grid_sampler_2d`` / ``grid_sampler_3d`` (``F.grid_sample``), bilinear or nearest, as gathers of the input.

The exporter translates them into ONNX ``GridSample``, which has no gradient rule (neither for the input nor
for the grid). Here the sampling is written out the way PyTorch's kernel computes it, so that the gradients
are those of ordinary ops:

- each grid coordinate is unnormalized to a source position along its axis (``x`` indexes the last spatial
  axis, ``y`` the one before, ``z`` the depth): ``(g + 1) / 2 * (size - 1)`` with ``align_corners``, else
  ``((g + 1) * size - 1) / 2``; then, for ``padding_mode="border"``, clipped to ``[0, size - 1]``, and for
  ``"reflection"`` reflected about the borders (``-0.5`` and ``size - 0.5`` without ``align_corners``) and
  clipped, both with PyTorch's gradient: zero where the clip holds a position at or past a border, the sign
  flipped by each reflection;
- bilinear (trilinear for 5-D inputs) reads the ``2^d`` corners around the position, each weighted by the
  product along the axes of ``position - low`` (upper corner) or ``low + 1 - position`` (lower corner);
  nearest reads the position rounded half to even (``nearbyint``), with no gradient for the grid;
- a corner outside the input reads zero (its weight is dropped by a ``Where``); the read is a
  ``GatherElements`` of the input flattened to ``[N, C, prod(sizes)]``. A NaN grid coordinate reads 0 here,
  where PyTorch's CPU kernel gives NaN (zeros padding) or crashes (border): not matched.

The input's gradient is ``GatherElements``' (a scatter-add of the weighted output gradient), the grid's
flows through the weights. ``mode="bicubic"`` stays the exporter's ``GridSample`` (no gradient: the module
falls back to PyTorch).
"""

from __future__ import annotations

import itertools

import onnx_ir as ir
from onnxscript import opset18 as op

from onnxtrain.capture.constants import int64 as _int
from onnxtrain.capture.constants import scalar_like as _like

_BILINEAR, _NEAREST = 0, 1
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def grid_sampler(input, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    """``grid_sampler(Tensor input, Tensor grid, int interpolation_mode, int padding_mode, bool align_corners)``"""
    sampler = grid_sampler_2d if len(input.shape) == 4 else grid_sampler_3d
    return sampler(input, grid, interpolation_mode, padding_mode, align_corners)


def grid_sampler_2d(input, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    """``grid_sampler_2d(Tensor input, Tensor grid, int interpolation_mode, int padding_mode, bool align_corners)``"""
    if interpolation_mode not in (_BILINEAR, _NEAREST):
        from onnxscript.function_libs.torch_lib.ops.core import aten_grid_sampler_2d

        return aten_grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners)
    return _grid_sample(input, grid, 2, interpolation_mode, padding_mode, align_corners)


def grid_sampler_3d(input, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    """``grid_sampler_3d(Tensor input, Tensor grid, int interpolation_mode, int padding_mode, bool align_corners)``"""
    if interpolation_mode not in (_BILINEAR, _NEAREST):
        from onnxscript.function_libs.torch_lib.ops.core import aten_grid_sampler_3d

        return aten_grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners)
    return _grid_sample(input, grid, 3, interpolation_mode, padding_mode, align_corners)


def _grid_sample(x, grid, dims: int, mode: int, padding: int, align_corners: bool):
    n_c = op.Shape(x, start=0, end=2)
    sizes = [op.Shape(x, start=2 + k, end=3 + k) for k in range(dims)]  # spatial sizes, depth first
    flat = op.Reshape(x, op.Concat(n_c, _int([-1]), axis=0))  # [N, C, prod(sizes)]
    points = op.Reshape(grid, op.Concat(op.Shape(grid, start=0, end=1), _int([-1, dims]), axis=0))  # [N, P, d]
    positions = []  # per spatial axis, [N, P]; grid component d - 1 - k indexes spatial axis k
    for k in range(dims):
        coord = op.Squeeze(op.Slice(points, _int([dims - 1 - k]), _int([dims - k]), _int([2])), _int([2]))
        positions.append(_source_position(coord, op.CastLike(sizes[k], coord), padding, align_corners))

    if mode == _NEAREST:
        corners = [([op.Round(p) for p in positions], None)]
    else:
        lows = [op.Floor(p) for p in positions]
        corners = []
        for bits in itertools.product((0, 1), repeat=dims):
            index = [op.Add(low, _like(float(b), low)) for low, b in zip(lows, bits)]
            weight = None
            for p, low, b in zip(positions, lows, bits):
                w = op.Sub(p, low) if b else op.Sub(op.Add(low, _like(1.0, low)), p)  # as PyTorch's weights
                weight = w if weight is None else op.Mul(weight, w)
            corners.append((index, weight))

    out = None
    expand_to = op.Concat(n_c, op.Shape(points, start=1, end=2), axis=0)  # [N, C, P]
    for index, weight in corners:
        inside = None
        for i, size in zip(index, sizes):
            last = op.Sub(op.CastLike(size, i), _like(1.0, i))
            ok = op.And(op.GreaterOrEqual(i, _like(0.0, i)), op.LessOrEqual(i, last))
            inside = ok if inside is None else op.And(inside, ok)
        linear = None  # the flat position, depth-major, of the corner (0 where it is outside)
        for i, size in zip(index, sizes):
            axis_index = op.Cast(op.Where(inside, i, _like(0.0, i)), to=ir.DataType.INT64)
            linear = axis_index if linear is None else op.Add(op.Mul(linear, size), axis_index)
        read = op.GatherElements(flat, op.Expand(op.Unsqueeze(linear, _int([1])), expand_to), axis=2)
        kept = op.CastLike(inside, read) if weight is None else op.Where(inside, weight, _like(0.0, weight))
        term = op.Mul(read, op.Unsqueeze(kept, _int([1])))
        out = term if out is None else op.Add(out, term)
    return op.Reshape(out, op.Concat(n_c, op.Shape(grid, start=1, end=1 + dims), axis=0))


def _source_position(coord, size, padding: int, align_corners: bool):
    """PyTorch's ``grid_sampler_compute_source_index``: the grid coordinate as a position along its axis."""
    one, two = _like(1.0, coord), _like(2.0, coord)
    if align_corners:
        position = op.Mul(op.Div(op.Add(coord, one), two), op.Sub(size, one))
    else:
        position = op.Div(op.Sub(op.Mul(op.Add(coord, one), size), one), two)
    if padding == _ZEROS:
        return position
    if padding == _REFLECTION:
        if align_corners:
            position = _reflect(position, _like(0.0, coord), op.Sub(size, one))
        else:
            half = _like(0.5, coord)
            position = _reflect(position, op.Neg(half), op.Sub(size, half))
    return _clip(position, op.Sub(size, one))


def _clip(position, last):
    """``position`` clipped to ``[0, last]``; the gradient is zero at and past both ends, as in PyTorch's
    ``clip_coordinates_set_grad`` (borders count as out of bounds)."""
    zero = _like(0.0, position)
    return op.Where(op.LessOrEqual(position, zero), zero,
                    op.Where(op.GreaterOrEqual(position, last), last, position))


def _reflect(position, low, high):
    """PyTorch's ``reflect_coordinates``: ``position`` folded into ``[low, high]`` by reflecting at both ends
    (0 where ``low == high``); each reflection flips the gradient's sign."""
    span = op.Sub(high, low)
    distance = op.Abs(op.Sub(position, low))
    flips = op.Floor(op.Div(distance, span))
    extra = op.Sub(distance, op.Mul(span, flips))  # fmod(distance, span), distance >= 0
    even = op.Equal(op.Sub(flips, op.Mul(_like(2.0, flips), op.Floor(op.Div(flips, _like(2.0, flips))))),
                    _like(0.0, flips))
    folded = op.Where(even, op.Add(extra, low), op.Sub(high, extra))
    return op.Where(op.Equal(span, _like(0.0, span)), _like(0.0, span), folded)
