"""ExpandCrossEntropyPass and PruneZeroInputsPass, each checked by onnxruntime before and after."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.passes import ExpandCrossEntropyPass
from onnxtrain.passes.zero_inputs import (
    CannotPrune,
    PruneZeroInputsPass,
    prune_zero_inputs,
)

RNG = np.random.default_rng(0)


def _run(model, feeds: dict) -> list[np.ndarray]:
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def _model(nodes, inputs, outputs, opset=18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


# -- ExpandCrossEntropyPass -----------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_on_2d_scores_becomes_log_softmax_and_nll(reduction):
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t", "w"], ["loss", "logp"], reduction=reduction,
                            ignore_index=-100)
    proto = _model([node], [_f("x", ["N", 7]), helper.make_tensor_value_info("t", TensorProto.INT64, ["N"]),
                            _f("w", [7])], [_f("loss", None), _f("logp", ["N", 7])])
    feeds = {"x": RNG.standard_normal((6, 7)).astype(np.float32), "t": np.array([1, 2, -100, 6, 0, 3]),
             "w": RNG.uniform(0.2, 2, 7).astype(np.float32)}
    model = ir.from_proto(proto)
    assert ExpandCrossEntropyPass()(model).modified
    assert [n.op_type for n in model.graph] == ["LogSoftmax", "NegativeLogLikelihoodLoss"]
    assert [v.name for v in model.graph.outputs] == ["loss", "logp"]
    for got, want in zip(_run(model, feeds), _run(proto, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_cross_entropy_on_higher_rank_scores_is_left_alone():
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss"])
    proto = _model([node], [_f("x", [2, 5, 3]), helper.make_tensor_value_info("t", TensorProto.INT64, [2, 3])],
                   [_f("loss", None)])
    model = ir.from_proto(proto)
    assert not ExpandCrossEntropyPass()(model).modified
    assert [n.op_type for n in model.graph] == ["SoftmaxCrossEntropyLoss"]


# -- PruneZeroInputsPass -------------------------------------------------------------------------
def _two_output_gradient() -> onnx.ModelProto:
    """Gradient of (loss = CE(x @ w), logits = x @ w) w.r.t. w: two seeds meet in a Sum."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    proto = _model(nodes, [_f("x", ["N", 4]), _f("w", [4, 5]), helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
                   [_f("loss", []), _f("logits", ["N", 5])])
    return gradient_model(proto, wrt=["w"], outputs=["loss", "logits"])


def test_pruning_an_absent_output_gradient_equals_feeding_zeros():
    proto = _two_output_gradient()
    seeds = [i.name for i in proto.graph.input if i.name.endswith("_grad")]
    assert len(seeds) == 2
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32), "w": RNG.standard_normal((4, 5)).astype(np.float32),
             "t": np.array([0, 4, 2]), seeds[0]: np.array(1.5, np.float32), seeds[1]: np.zeros((3, 5), np.float32)}
    want = _run(proto, feeds)
    model = ir.from_proto(prune_zero_inputs(proto, [seeds[1]]))
    assert seeds[1] not in [v.name for v in model.graph.inputs]
    assert "Sum" not in [n.op_type for n in model.graph] and "Add" not in [n.op_type for n in model.graph]
    for got, expected in zip(_run(model, feeds), want):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_zero_that_reaches_an_output_or_an_unknown_op_cannot_be_pruned():
    proto = _model([helper.make_node("Exp", ["a"], ["e"]), helper.make_node("Add", ["e", "b"], ["y"])],
                   [_f("a", [3]), _f("b", [3])], [_f("y", [3])])
    with pytest.raises(CannotPrune, match="Exp node"):
        PruneZeroInputsPass(["a"])(ir.from_proto(proto))  # exp(0) is not 0
    proto = _model([helper.make_node("Mul", ["a", "b"], ["y"])], [_f("a", [3]), _f("b", [3])], [_f("y", [3])])
    with pytest.raises(CannotPrune, match="graph output 'y'"):
        PruneZeroInputsPass(["a"])(ir.from_proto(proto))


def test_dropping_a_zero_that_broadcasts_is_refused():
    proto = _model([helper.make_node("Add", ["a", "b"], ["y"])], [_f("a", [2, 3]), _f("b", [3])], [_f("y", [2, 3])])
    with pytest.raises(CannotPrune, match="broadcasts"):
        PruneZeroInputsPass(["a"])(ir.from_proto(proto))
    model = ir.from_proto(proto)
    PruneZeroInputsPass(["b"])(model)  # a already has the output's shape
    a = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(_run(model, {"a": a})[0], a)


def test_a_zero_padded_with_zeros_is_pruned_and_one_padded_with_ones_is_not():
    """The gradient of a slice is a Pad of the slice's gradient (a model cache's k[:, -w:]): zero in, zero out."""
    def padded(fill):
        const = [helper.make_node("Constant", [], ["pads"], value=helper.make_tensor("p", TensorProto.INT64, [2],
                                                                                     [2, 1]))]
        inputs = ["a", "pads"]
        if fill is not None:
            const.append(helper.make_node("Constant", [], ["fill"], value=helper.make_tensor("f", TensorProto.FLOAT,
                                                                                             [], [fill])))
            inputs.append("fill")
        nodes = [*const, helper.make_node("Pad", inputs, ["p"]), helper.make_node("Add", ["p", "b"], ["y"])]
        return _model(nodes, [_f("a", [3]), _f("b", [6])], [_f("y", [6])])

    feeds = {"a": np.zeros(3, np.float32), "b": RNG.standard_normal(6).astype(np.float32)}
    for fill in (None, 0.0):
        proto = padded(fill)
        model = ir.from_proto(prune_zero_inputs(proto, ["a"]))
        assert "Pad" not in [n.op_type for n in model.graph]
        np.testing.assert_array_equal(_run(model, feeds)[0], _run(proto, feeds)[0])
    with pytest.raises(CannotPrune, match="Pad node"):
        prune_zero_inputs(padded(1.0), ["a"])


def test_a_zero_through_a_gemm_without_c_is_pruned_and_one_beside_a_c_is_not():
    """A linear layer's weight gradient is a Gemm of its input and its output gradient (the logits of a model
    that returns them beside a chunked loss): zero in, zero out, unless a C is added."""
    def gemm(with_c: bool):
        nodes = [helper.make_node("Gemm", ["x", "a"] + (["c"] if with_c else []), ["g"], transA=1),
                 helper.make_node("Add", ["g", "b"], ["y"])]
        return _model(nodes, [_f("x", [4, 2]), _f("a", [4, 3]), _f("c", [2, 3]), _f("b", [2, 3])], [_f("y", [2, 3])])

    feeds = {"x": RNG.standard_normal((4, 2)).astype(np.float32), "a": np.zeros((4, 3), np.float32),
             "c": RNG.standard_normal((2, 3)).astype(np.float32), "b": RNG.standard_normal((2, 3)).astype(np.float32)}
    proto = gemm(False)
    model = ir.from_proto(prune_zero_inputs(proto, ["a"]))
    assert "Gemm" not in [n.op_type for n in model.graph]
    np.testing.assert_array_equal(_run(model, feeds)[0], _run(proto, feeds)[0])
    with pytest.raises(CannotPrune, match="Gemm node"):
        prune_zero_inputs(gemm(True), ["a"])
