"""passes/split_sizes.py: a Split by ``num_outputs`` given its chunk sizes (ONNX's: ``ceil(d / n)``, the last
smaller), which OpenVINO splits only equally."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from onnxtrain.passes.split_sizes import SplitSizesPass
from onnxtrain.runtime import backends


def _model(rows, n: int, axis: int = 0) -> onnx.ModelProto:
    """``Split(x, num_outputs=n, axis)`` over ``x[rows, 5]``."""
    outputs = [f"y{k}" for k in range(n)]
    graph = helper.make_graph(
        [helper.make_node("Split", ["x"], outputs, num_outputs=n, axis=axis)], "split",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 5])],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    assert SplitSizesPass()(graph).modified
    return ir.to_proto(graph)


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("rows,n,axis,sizes", [(5, 2, 0, [5]), ("N", 2, 0, [5, 7, 8]), ("N", 3, 0, [5, 7, 9]),
                                                (5, 3, -1, [5]), ("N", 4, 0, [7, 8])])
def test_the_sizes_are_onnx_chunks(rows, n, axis, sizes):
    """The same outputs as the Split by num_outputs on onnxruntime, for a static and a dynamic axis (sizes whose
    last chunk is not negative: onnxruntime refuses those, as torch.chunk never exports them)."""
    model = _model(rows, n, axis)
    rewritten = _rewritten(model)
    (split,) = [node for node in rewritten.graph.node if node.op_type == "Split"]
    assert len(split.input) == 2 and not any(a.name == "num_outputs" for a in split.attribute)
    for size in sizes:
        x = np.arange(size * 5, dtype=np.float32).reshape(size, 5)
        for got, want in zip(_run(rewritten, x), _run(model, x)):
            np.testing.assert_array_equal(got, want)


def test_a_split_with_sizes_is_left_alone():
    graph = ir.from_proto(_rewritten(_model(5, 2)))
    assert not SplitSizesPass()(graph).modified


@pytest.mark.skipif(not backends.openvino_installed(), reason="needs openvino")
def test_openvino_splits_unequally_after_the_pass():
    """OpenVINO's own reading of the Split by num_outputs needs equal chunks (5 in 2 failed or came out empty)."""
    from onnxtrain.runtime.openvino import OpenVINOSession

    x = np.arange(25, dtype=np.float32).reshape(5, 5)
    session = OpenVINOSession(_rewritten(_model("N", 2)).SerializeToString())
    got = session.run(None, {"x": x})
    assert [g.shape for g in got] == [(3, 5), (2, 5)]
    np.testing.assert_array_equal(np.concatenate(got), x)
