"""Finite-difference cases for rules/shape.py."""

import numpy as np

from tests.autodiff.gradcheck import Case, F, I

BIG = np.iinfo(np.int64).max

CASES = [
    # -- pure reshapes
    Case("Reshape", [("x", F(2, 3, 4)), ("shape", I([4, -1]))]),
    Case("Flatten", [("x", F(2, 3, 4))], {"axis": 2}),
    Case("Squeeze", [("x", F(2, 1, 3, 1)), ("axes", I([-1, 1]))]),
    Case("Squeeze", [("x", F(2, 1, 3))], name="Squeeze-no-axes"),
    Case("Unsqueeze", [("x", F(2, 3)), ("axes", I([0, -1]))]),
    Case("Transpose", [("x", F(2, 3, 4))], {"perm": [1, 2, 0]}),
    Case("Transpose", [("x", F(2, 3, 4))], name="Transpose-default-perm"),
    # -- joins and splits
    Case("Concat", [("a", F(2, 3)), ("b", F(2, 1)), ("c", F(2, 2))], {"axis": -1}),
    Case("Concat", [("a", F(1, 3)), ("b", F(2, 3))], {"axis": 0}, const=("a",), name="Concat-one-constant"),
    Case("Split", [("x", F(2, 6)), ("split", I([1, 3, 2]))], {"axis": 1}, num_outputs=3),
    Case("Split", [("x", F(6, 2))], {"axis": 0, "num_outputs": 3}, opset=18, num_outputs=3,
         name="Split-num-outputs"),
    Case("Split", [("x", F(5, 2)), ("split", I([2, 3]))], {"axis": -2}, num_outputs=2, diff_outputs=[1],
         name="Split-only-second-output"),
    Case("Tile", [("x", F(2, 3)), ("repeats", I([3, 2]))]),
    Case("Tile", [("x", F(2, 1, 3)), ("repeats", I([1, 4, 1]))], name="Tile-3d"),
    # -- slicing
    Case("Slice", [("x", F(4, 5)), ("starts", I([1])), ("ends", I([3])), ("axes", I([1]))]),
    Case("Slice", [("x", F(4, 5)), ("starts", I([-3, 0])), ("ends", I([BIG, -1]))],
         name="Slice-negative-axes-omitted"),
    Case("Slice", [("x", F(4, 5)), ("starts", I([-10])), ("ends", I([10])), ("axes", I([-1]))],
         name="Slice-out-of-range"),
    Case("Slice", [("x", F(3, 7)), ("starts", I([1])), ("ends", I([7])), ("axes", I([1])),
                   ("steps", I([2]))], name="Slice-step-2"),
    Case("Slice", [("x", F(4, 6)), ("starts", I([-1, 4])), ("ends", I([-BIG, 0])), ("axes", I([0, 1])),
                   ("steps", I([-1, -2]))], name="Slice-negative-steps"),
    Case("Slice", [("x", F(2, 4, 3)), ("starts", I([0, 1])), ("ends", I([2, 2])), ("axes", I([2, 1])),
                   ("steps", I([1, 1]))], name="Slice-unit-steps-given"),
    # -- gathers
    Case("Gather", [("x", F(5, 3)), ("i", I([[0, 4], [4, -1]]))], name="Gather-repeated-negative"),
    Case("Gather", [("x", F(2, 5, 3)), ("i", I([1, 1, -2]))], {"axis": 1}, name="Gather-axis1"),
    Case("Gather", [("x", F(2, 3, 4)), ("i", I(2))], {"axis": -1}, name="Gather-scalar-index"),
    Case("Gather", [("x", F(5, 3)), ("i", I([0, 2, 0]))], opset=13, name="Gather-opset13"),
    Case("Gather", [("x", F(3, 4)), ("i", I([[3], [0]]))], {"axis": 1}, opset=13,
         name="Gather-opset13-axis1"),
    Case("GatherElements", [("x", F(2, 4)), ("i", I([[0, 2, 2], [1, -1, 0]]))], {"axis": 1}),
    Case("GatherElements", [("x", F(3, 2)), ("i", I([[0, 2], [0, 0], [1, 2], [2, 2]]))], {"axis": 0},
         name="GatherElements-axis0-more-indices"),
    # Indices smaller than the data off the axis (onnx.reference rejects that; onnxruntime takes it).
    Case("GatherElements", [("x", F(3, 4)), ("i", I([[0, 2, 2], [1, -1, 0]]))], {"axis": 1}, evaluator="ort",
         name="GatherElements-smaller-indices"),
    Case("GatherND", [("x", F(3, 4, 2)), ("i", I([[0, 1], [2, 3], [0, 1]]))], name="GatherND-repeated"),
    Case("GatherND", [("x", F(3, 4)), ("i", I([[-1], [0], [2]]))], name="GatherND-negative"),
    Case("GatherND", [("x", F(2, 3, 4)), ("i", I([[[1], [0]], [[2], [2]]]))], {"batch_dims": 1},
         name="GatherND-batch-dims-1"),
    Case("GatherND", [("x", F(2, 2, 3, 2)), ("i", I([1, 0, 2, 1, 0, 0, 0, 0]).reshape(2, 2, 1, 2))],
         {"batch_dims": 2}, name="GatherND-batch-dims-2"),
    # -- scatters (indices distinct: duplicates are undefined for reduction none)
    Case("ScatterND", [("d", F(4, 3)), ("i", I([[2], [0]])), ("u", F(2, 3))]),
    Case("ScatterND", [("d", F(4, 3)), ("i", I([[2], [2]])), ("u", F(2, 3))], {"reduction": "add"},
         name="ScatterND-add"),
    Case("ScatterElements", [("d", F(2, 4)), ("i", I([[1, 3], [0, 2]])), ("u", F(2, 2))], {"axis": 1}),
    Case("ScatterElements", [("d", F(3, 2)), ("i", I([[1, 1], [0, 1]])), ("u", F(2, 2))],
         {"axis": 0, "reduction": "add"}, name="ScatterElements-add"),
    Case("ScatterElements", [("d", F(3, 2)), ("i", I([[1, 1], [0, 1], [1, 1]])), ("u", F(3, 2))],
         {"axis": 0, "reduction": "mul"}, name="ScatterElements-mul"),
    Case("TopK", [("x", F(3, 5)), ("k", I([2]))], {"axis": 1}, num_outputs=2),
    Case("TopK", [("x", F(4, 3)), ("k", I([3]))], {"axis": 0, "largest": 0}, num_outputs=2,
         name="TopK-smallest"),
    # Unsorted order is the kernel's choice: check it on one kernel (onnxruntime, float64) only.
    Case("TopK", [("x", F(2, 5)), ("k", I([3]))], {"sorted": 0}, num_outputs=2, evaluator="ort",
         f64_only=True, name="TopK-unsorted"),
    # -- pads
    Case("Pad", [("x", F(2, 3)), ("pads", I([1, 0, 2, 1]))], name="Pad-constant"),
    Case("Pad", [("x", F(3, 4)), ("pads", I([-1, 2, 1, -2])), ("v", F())], evaluator="ort",
         name="Pad-negative-and-value"),  # onnx.reference cannot pad by negative amounts
    Case("Pad", [("x", F(3, 4)), ("pads", I([1, 0, 0, 2])), ("v", F())], name="Pad-value"),
    Case("Pad", [("x", F(2, 3, 4)), ("pads", I([1, 2])), ("v", None), ("axes", I([-1]))], opset=18,
         name="Pad-axes"),
    Case("Pad", [("x", F(3, 4)), ("pads", I([2, 1, 1, 3]))], {"mode": "reflect"}, name="Pad-reflect"),
    Case("Pad", [("x", F(3, 4)), ("pads", I([1, 0, 2, 3]))], {"mode": "edge"}, name="Pad-edge"),
    Case("Pad", [("x", F(3, 4)), ("pads", I([2, 3, 1, 2]))], {"mode": "wrap"}, opset=19, name="Pad-wrap"),
    Case("Pad", [("x", F(2, 3, 4)), ("pads", I([0, 2, 0, 1])), ("v", None), ("axes", I([0, 2]))],
         {"mode": "reflect"}, opset=18, name="Pad-reflect-axes"),
    # -- other rearrangements
    Case("Trilu", [("x", F(4, 4)), ("k", I(1))]),
    Case("Trilu", [("x", F(2, 3, 4))], {"upper": 0}, name="Trilu-lower"),
    Case("CumSum", [("x", F(3, 4)), ("axis", I(1))]),
    Case("CumSum", [("x", F(3, 4)), ("axis", I(-2))], {"exclusive": 1, "reverse": 1},
         name="CumSum-exclusive-reverse"),
    Case("DepthToSpace", [("x", F(1, 8, 2, 3))], {"blocksize": 2}),
    Case("DepthToSpace", [("x", F(2, 8, 2, 2))], {"blocksize": 2, "mode": "CRD"}, name="DepthToSpace-CRD"),
    Case("SpaceToDepth", [("x", F(1, 2, 4, 6))], {"blocksize": 2}),
]
