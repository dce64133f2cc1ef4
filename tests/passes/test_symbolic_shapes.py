"""Symbolic shape inference: it leaves nothing in the working directory, even when it cannot finish, and
its result is dropped when it contradicts the exporter's shapes."""

import os

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxtrain.passes.symbolic_shapes import infer_symbolic_shapes


def test_incomplete_inference_writes_nothing_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # A custom-domain op has no shape rule: inference is incomplete, which makes the tool save a model.
    node = helper.make_node("Mystery", ["x"], ["y"], domain="my.ops")
    graph = helper.make_graph([node, helper.make_node("Relu", ["y"], ["z"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 1)])
    result = infer_symbolic_shapes(model)
    assert [o.name for o in result.graph.output] == ["z"]
    assert os.listdir(tmp_path) == []
    assert os.getcwd() == str(tmp_path)


def _last_rows(exported_dim: str):
    """y = x[-3:] + 1 on x [s, 4]; the exporter writes y's first dim as an expression of s."""
    const = lambda name, v: helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [v]))
    nodes = [const("start", -3), const("end", 2**62), const("axis", 0),
             helper.make_node("Slice", ["x", "start", "end", "axis"], ["t"]),
             helper.make_node("Relu", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [exported_dim, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_inference_that_turns_an_exported_expression_into_a_number_is_dropped():
    model = _last_rows("Max(0, s - Max(0, s - 3))")
    result = infer_symbolic_shapes(model)
    dims = result.graph.output[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "Max(0, s - Max(0, s - 3))"  # not the tool's 3: s may be 2
    session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.ones((2, 4), np.float32)})[0].shape == (2, 4)


def test_inference_that_only_adds_shapes_is_kept():
    model = _last_rows("Max(0, s - Max(0, s - 3))")
    del model.graph.output[0].type.tensor_type.shape.dim[:]  # the exporter said nothing about y's dims
    model.graph.output[0].type.tensor_type.shape.dim.add()
    model.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 4
    result = infer_symbolic_shapes(model)
    assert any(v.name == "t" for v in result.graph.value_info)  # the tool's shapes are there
