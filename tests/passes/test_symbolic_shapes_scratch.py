"""Symbolic shape inference leaves nothing in the working directory, even when it cannot finish."""

import os

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
