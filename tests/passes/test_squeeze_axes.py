"""passes/squeeze_axes.py: a Squeeze without axes given the axes its declared output shape removes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from onnxtrain.passes.squeeze_axes import SqueezeAxesPass
from onnxtrain.runtime import backends


def _model(out_shape) -> onnx.ModelProto:
    """``Squeeze(Gather(x, i, axis=1))`` over ``x[N, 3]`` (the gathered column ``[N, 1]``), as mBART's
    ``gather(...).squeeze()`` exports."""
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3]),
              helper.make_tensor_value_info("i", onnx.TensorProto.INT64, ["N", 1])]
    nodes = [helper.make_node("GatherElements", ["x", "i"], ["g"], axis=1),
             helper.make_node("Squeeze", ["g"], ["y"])]
    graph = helper.make_graph(nodes, "squeeze", inputs,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, out_shape)],
                              value_info=[helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, ["N", 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


FEEDS = {"x": np.arange(12, dtype=np.float32).reshape(4, 3), "i": np.array([[0], [2], [1], [2]], np.int64)}


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    assert SqueezeAxesPass()(graph).modified
    return ir.to_proto(graph)


def test_the_axes_of_size_one_become_the_squeeze_axes():
    model = _rewritten(_model(["N"]))
    (squeeze,) = [n for n in model.graph.node if n.op_type == "Squeeze"]
    assert len(squeeze.input) == 2
    want = ort.InferenceSession(_model(["N"]).SerializeToString()).run(None, FEEDS)[0]
    got = ort.InferenceSession(model.SerializeToString()).run(None, FEEDS)[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [0, 5, 7, 11])


@pytest.mark.skipif(not backends.openvino_installed(), reason="needs onnxtrain[openvino]")
def test_openvino_compiles_the_squeeze_with_axes_and_not_without():
    from onnxtrain.runtime.openvino import OpenVINOSession

    with pytest.raises(ValueError, match="dynamic rank"):
        OpenVINOSession(_model(["N"]).SerializeToString()).run(None, FEEDS)
    (got,) = OpenVINOSession(_rewritten(_model(["N"])).SerializeToString()).run(None, FEEDS)
    np.testing.assert_array_equal(got, [0, 5, 7, 11])


@pytest.mark.parametrize("out_shape", [None, ["N", 1]])
def test_a_squeeze_whose_output_rank_is_unknown_or_unchanged_is_left_alone(out_shape):
    model = _model(out_shape)
    if out_shape is None:
        model.graph.output[0].type.tensor_type.ClearField("shape")
    assert not SqueezeAxesPass()(ir.from_proto(model)).modified


def test_a_squeeze_that_removes_no_axis_becomes_an_identity():
    """Over ``x[N, M]`` (both sizes dynamic, never 1 where the traced graph runs) with an output of the same rank:
    the Squeeze removes nothing. OpenVINO gives it a dynamic rank (refused by its CPU plugin); as an Identity it
    computes the same values."""
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", "M"])]
    graph = helper.make_graph([helper.make_node("Squeeze", ["x"], ["y"])], "squeeze", inputs,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", "M"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    rewritten = _rewritten(model)
    assert [n.op_type for n in rewritten.graph.node] == ["Identity"]
    x = {"x": FEEDS["x"]}
    want = ort.InferenceSession(model.SerializeToString()).run(None, x)[0]
    np.testing.assert_array_equal(ort.InferenceSession(rewritten.SerializeToString()).run(None, x)[0], want)
    if backends.openvino_installed():
        from onnxtrain.runtime.openvino import OpenVINOSession

        np.testing.assert_array_equal(OpenVINOSession(rewritten.SerializeToString()).run(None, x)[0], want)
