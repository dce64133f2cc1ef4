"""The pass pipelines: their order, and the IR passes they wrap, checked by running onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT
from onnxtrain.passes import pipeline
from onnxtrain.passes.strip_stop_gradients import StripStopGradientsPass
from onnxtrain.passes.symbolic_shapes import SymbolicShapesPass


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid(ONNXTRAIN_DOMAIN, 1)])


def _run(model: ir.Model, feeds):
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_every_pipeline_names_its_steps_once_and_says_why():
    pipelines = [pipeline.ortmodule_prepare([]), pipeline.ortmodule_training(1), pipeline.ortmodule_backward(),
                 pipeline.ortmodule_inference(), pipeline.artifacts_forward(), pipeline.artifacts_eval(),
                 pipeline.artifacts_training(1), pipeline.artifacts_eval_export()]
    for p in pipelines:
        assert p.steps and len(set(p.names)) == len(p.names)
        assert all(s.why for s in p.steps), p
    prepare = pipeline.ortmodule_prepare([]).names
    assert prepare[0] == "initializers_to_inputs" and prepare[-1] == "symbolic_shapes"
    assert pipeline.artifacts_training(1).names[-1] == "strip_stop_gradients"
    assert pipeline.ortmodule_training(1).names[-1] == "recompute"
    assert not pipeline.ortmodule_backward().step("sum_rows_by_matmul").only_product_gradients
    assert pipeline.ortmodule_backward(float32_sums=True).step("sum_rows_by_matmul").only_product_gradients


def test_repeated_step_names_are_refused():
    step = pipeline.Step("a", StripStopGradientsPass(), "x")
    with pytest.raises(ValueError, match="repeat"):
        pipeline.Pipeline("p", [step, step])


def test_strip_pass_makes_identities_in_subgraphs_and_drops_the_domain():
    inner = helper.make_graph([helper.make_node(STOP_GRADIENT, ["x"], ["t"], domain=ONNXTRAIN_DOMAIN),
                               helper.make_node("Neg", ["t"], ["o"])], "then", [], [_f("o", [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [_f("e", [2])])
    nodes = [helper.make_node(STOP_GRADIENT, ["x"], ["sx"], domain=ONNXTRAIN_DOMAIN),
             helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=other),
             helper.make_node("Add", ["y", "sx"], ["z"])]
    model = ir.from_proto(_model(nodes, [_f("x", [2]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                                 [_f("z", [2])]))
    assert StripStopGradientsPass()(model).modified
    assert ONNXTRAIN_DOMAIN not in model.opset_imports
    assert not StripStopGradientsPass()(model).modified
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(_run(model, {"x": x, "c": np.array(True)})[0], -x + x)
    np.testing.assert_array_equal(_run(model, {"x": x, "c": np.array(False)})[0], x + x)


def test_symbolic_shapes_pass_names_dims_and_keeps_outputs():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    proto = _model(nodes, [_f("x", ["batch", 4]), _f("w", [4, 3])], [_f("y", None)])
    model = ir.from_proto(proto)
    feeds = {"x": np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32),
             "w": np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)}
    before = _run(model, feeds)[0]
    result = SymbolicShapesPass()(model)
    assert result.model is not model
    out = result.model.graph.outputs[0]
    assert out.shape is not None and str(out.shape[0]) == "batch" and out.shape[1] == 3
    np.testing.assert_array_equal(_run(result.model, feeds)[0], before)
