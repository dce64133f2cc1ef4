"""Finite-difference cases for rules/resize.py (the modes PyTorch's interpolate exports, and more)."""

import numpy as np

from tests.autodiff.gradcheck import Case, F, I


def _scales(*s):
    return np.asarray(s, dtype=np.float32)


def _resize(name, x, attrs, scales=None, sizes=None, opset=20):
    inputs = [("x", x), ("roi", None), ("scales", _scales(*scales) if scales else None)]
    if sizes is not None:
        inputs.append(("sizes", I(sizes)))
    return Case("Resize", inputs, attrs, opset=opset, name=f"Resize-{name}")


CASES = [
    _resize("nearest-asymmetric-floor", F(1, 2, 3, 4),
            {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
            scales=(1, 1, 2, 2)),
    _resize("nearest-half-pixel", F(2, 1, 3, 4), {"mode": "nearest"}, scales=(1, 1, 2, 1.5)),
    _resize("linear-half-pixel", F(1, 2, 3, 4), {"mode": "linear"}, scales=(1, 1, 2, 2)),
    _resize("linear-align-corners-sizes", F(1, 2, 3, 4),
            {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, sizes=[1, 2, 5, 7]),
    _resize("linear-downsample", F(1, 1, 6, 6),
            {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, scales=(1, 1, 0.5, 0.5)),
    _resize("linear-antialias", F(1, 1, 6, 8), {"mode": "linear", "antialias": 1}, scales=(1, 1, 0.5, 0.5)),
    _resize("cubic", F(1, 1, 3, 3), {"mode": "cubic", "cubic_coeff_a": -0.75}, scales=(1, 1, 2, 2)),
    _resize("rank3-linear", F(2, 2, 5), {"mode": "linear"}, scales=(1, 1, 2)),
    _resize("one-axis", F(1, 2, 3, 4), {"mode": "linear"}, scales=(1, 1, 1, 2)),
    _resize("rank5-linear", F(1, 2, 3, 2, 3), {"mode": "linear"}, scales=(1, 1, 2, 1.5, 2)),
    _resize("rank5-linear-align-corners-sizes", F(2, 1, 3, 4, 2),
            {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, sizes=[2, 1, 2, 5, 3]),
    _resize("rank5-nearest-depth-only", F(1, 2, 3, 2, 2), {"mode": "nearest"}, scales=(1, 1, 2, 1, 1)),
]
