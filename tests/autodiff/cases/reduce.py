"""Finite-difference cases for rules/reduce.py.

Each op runs at opset 13 (axes as an attribute; ReduceSum's as an input) and opset 18+ (axes as an
input), with keepdims 0 and 1, negative axes, omitted axes (all) and noop_with_empty_axes.
"""

import numpy as np

from tests.autodiff.gradcheck import Case, F, I

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceLogSumExp",
              "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum"]


def _x(op):
    if op in ("ReduceL1",):
        return F(2, 3, 4, away_from=0.0)
    if op in ("ReduceLogSum", "ReduceProd"):
        return F(2, 3, 4, low=0.5, high=1.5)
    return F(2, 3, 4)


def _case(op, axes, keepdims, opset, **extra):
    attrs = {"keepdims": keepdims, **extra}
    inputs = [("x", _x(op))]
    axes_as_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes is not None:
        if axes_as_input:
            inputs.append(("axes", I(axes)))
        else:
            attrs["axes"] = axes
    tag = "all" if axes is None else "_".join(str(a) for a in axes)
    noop = "-noop" if extra.get("noop_with_empty_axes") else ""
    return Case(op, inputs, attrs, opset=opset, name=f"{op}-axes{tag}-keep{keepdims}-opset{opset}{noop}")


CASES = []
for _op in REDUCE_OPS:
    CASES += [
        _case(_op, [1], 0, 18),
        _case(_op, [0, -1], 1, 18),
        _case(_op, None, 0, 18),
        _case(_op, [-2], 0, 13),
        _case(_op, None, 1, 13),
    ]
CASES += [
    _case("ReduceSum", None, 0, 18, noop_with_empty_axes=1),
    _case("ReduceMean", None, 1, 18, noop_with_empty_axes=1),
    _case("ReduceMax", None, 0, 18, noop_with_empty_axes=1),
    # A zero in the product: exact gradient for the lone zero, zero elsewhere in its group.
    Case("ReduceProd", [("x", np.array([[0.0, 0.7, 1.3], [0.6, 0.9, 1.2]])), ("axes", I([1]))],
         {"keepdims": 1}, name="ReduceProd-with-zero"),
]
