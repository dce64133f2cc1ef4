"""Each pass is checked by running onnxruntime on the graph before and after it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.passes import (
    InitializersToInputsPass,
    OptimizePass,
    split_forward_backward,
)
from onnxtrain.passes.recompute import RecomputePass

RNG = np.random.default_rng(0)


def _run(model, feeds):
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    proto.ir_version = min(proto.ir_version, 10)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, feeds)) if isinstance(feeds, list) else feeds)


def _mlp(weights_as_initializers: bool) -> onnx.ModelProto:
    w1 = RNG.standard_normal((4, 8)).astype(np.float32)
    w2 = RNG.standard_normal((8, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("MatMul", ["t", "w2"], ["z"]),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    inits = [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2")]
    if not weights_as_initializers:
        inits = []
        inputs += [helper.make_tensor_value_info("w1", TensorProto.FLOAT, [4, 8]),
                   helper.make_tensor_value_info("w2", TensorProto.FLOAT, [8, 3])]
    graph = helper.make_graph(nodes, "mlp", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_initializers_to_inputs_keeps_outputs_and_feeds_weights():
    proto = _mlp(weights_as_initializers=True)
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    before = _run(proto, {"x": x})[0]
    model = ir.from_proto(proto)
    w1 = model.graph.initializers["w1"].const_value.numpy().copy()
    w2 = model.graph.initializers["w2"].const_value.numpy().copy()
    result = InitializersToInputsPass(["w1", "w2"])(model)
    assert result.modified and not model.graph.initializers
    assert [v.name for v in model.graph.inputs] == ["x", "w1", "w2"]
    np.testing.assert_allclose(_run(model, [x, w1, w2])[0], before, rtol=1e-6)
    np.testing.assert_allclose(_run(model, [x, 2 * w1, w2])[0], _run(_scaled(proto), {"x": x})[0], rtol=1e-5)


def _scaled(proto):
    scaled = onnx.ModelProto()
    scaled.CopyFrom(proto)
    w1 = scaled.graph.initializer[0]
    w1.CopyFrom(onnx.numpy_helper.from_array(2 * onnx.numpy_helper.to_array(w1), "w1"))
    return scaled


def test_optimize_folds_shape_computations_and_keeps_outputs():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.INT64, [1], [1])),
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.INT64, [1], [2])),
        helper.make_node("Slice", ["s", "one", "two"], ["d"]),
        helper.make_node("Concat", ["minus_one", "d"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 9
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    model = ir.from_proto(proto)
    OptimizePass()(model)
    assert "Shape" not in {n.op_type for n in model.graph}
    np.testing.assert_allclose(_run(model, {"x": x})[0], _run(proto, {"x": x})[0])


def _split_and_check(training: onnx.ModelProto, forward_inputs: list[np.ndarray], dy: np.ndarray):
    """Split ``training`` (one output, one output gradient); its two graphs must give what it gives."""
    want = _run(training, [*forward_inputs, dy])
    model = ir.from_proto(training)
    RecomputePass(num_forward_outputs=1)(model)  # the default plan, as ORTModule runs it before the split
    split = split_forward_backward(model, num_forward_outputs=1, num_output_grads=1)
    forward_outputs = _run(split.forward, forward_inputs)
    np.testing.assert_allclose(forward_outputs[0], want[0], rtol=1e-6)
    grads = _run(split.backward, [dy] + [forward_outputs[i] for i in split.stashed_outputs]
                 + [forward_inputs[j] for j in split.reused_inputs])
    assert len(grads) == len(want) - 1
    for got, expected in zip(grads, want[1:]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    return split


def test_split_forward_backward_matches_the_training_graph():
    training = gradient_model(_mlp(weights_as_initializers=False), wrt=["x", "w1", "w2"])
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    w1 = RNG.standard_normal((4, 8)).astype(np.float32)
    w2 = RNG.standard_normal((8, 3)).astype(np.float32)
    split = _split_and_check(training, [x, w1, w2], RNG.standard_normal((5, 3)).astype(np.float32))
    assert split.num_stashed >= 1  # tanh and softmax outputs are kept, not recomputed from x
    backward_ops = {n.op_type for n in split.backward.graph}
    assert "Tanh" not in backward_ops and "Softmax" not in backward_ops  # nothing forward is recomputed


def _attention_like() -> onnx.ModelProto:
    """x @ w1 -> reshape -> softmax p -> Where(IsNaN(p), 0, p) -> @ w2: a Reshape's gradient reads the
    shape of its input, and the Where's mask and result are cheap functions of p."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Reshape", ["h", "shape"], ["r"]),
        helper.make_node("Softmax", ["r"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["q"]),
        helper.make_node("MatMul", ["q", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("w1", TensorProto.FLOAT, [4, 6]),
         helper.make_tensor_value_info("w2", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 3]),
                     helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_split_stashes_shapes_not_tensors_and_redoes_cheap_ops_on_stashed_values():
    training = gradient_model(_attention_like(), wrt=["x", "w1", "w2"])
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    w1 = RNG.standard_normal((4, 6)).astype(np.float32)
    w2 = RNG.standard_normal((3, 5)).astype(np.float32)
    split = _split_and_check(training, [x, w1, w2], RNG.standard_normal((10, 5)).astype(np.float32))
    outputs = list(split.forward.graph.outputs)
    stashed = [outputs[i] for i in split.stashed_outputs]
    by_producer = {v.producer().op_type for v in stashed}
    # Softmax's output is what backward needs; h (read by Reshape's gradient for its shape only), the
    # IsNaN mask and the Where result are not stashed: a Shape is, and the mask and result are redone.
    assert "Softmax" in by_producer
    assert not by_producer & {"MatMul", "IsNaN", "Where"}, sorted(by_producer)
    assert "Shape" in by_producer
    # backward gets the shape as an input of known rank (a Scan body may need it to type its outputs)
    assert all(list(v.shape) == [2] for v in stashed if v.producer().op_type == "Shape")
    assert {"IsNaN", "Where"} <= {n.op_type for n in split.backward.graph}


def _slices_in_reverse_order() -> onnx.ModelProto:
    """``y = g[..., 1] - g[..., 0]``, the second piece sliced first: the rewriter turns both Slices into one
    ``Split``, which CSE keeps at the second Slice's place, after the first Squeeze that reads it."""
    def const(name, value):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [value]))

    nodes = [const("zero", 0), const("one", 1), const("two", 2),
             helper.make_node("Slice", ["g", "one", "two", "two"], ["s1"]),
             helper.make_node("Squeeze", ["s1", "two"], ["q1"]),
             helper.make_node("Slice", ["g", "zero", "one", "two"], ["s0"]),
             helper.make_node("Squeeze", ["s0", "two"], ["q0"]),
             helper.make_node("Sub", ["q1", "q0"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 5, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 9
    return proto


def test_optimize_leaves_the_nodes_in_topological_order_and_the_gradient_whole():
    from onnxtrain.autodiff.builder import GraphBuilder
    from onnxtrain.autodiff.engine import build_gradients

    model = ir.from_proto(_slices_in_reverse_order())
    OptimizePass()(model)
    assert "Split" in {n.op_type for n in model.graph}  # the rewrite this test is about still fires
    produced = set(model.graph.inputs)
    for node in model.graph:
        assert all(v is None or v.producer() is None or v in produced for v in node.inputs), node
        produced.update(node.outputs)
    g = RNG.standard_normal((2, 5, 2)).astype(np.float32)
    np.testing.assert_allclose(_run(model, {"g": g})[0], g[..., 1] - g[..., 0])
    # d(sum(y * dy))/dg: +dy for the second component, -dy for the first (before the sort, the first was 0)
    graph = model.graph
    dy = ir.Value(name="dy", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 5]))
    graph.inputs.append(dy)
    builder = GraphBuilder(taken_names={v.name for v in graph.inputs} | {"y"}, opset=18)
    (dg,) = build_gradients(graph, [graph.inputs[0]], [graph.outputs[0]], [dy], builder)
    for node in builder.nodes:
        graph.append(node)
    graph.outputs.append(dg)
    d = RNG.standard_normal((2, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(model, {"g": g, "dy": d})[1], np.stack([-d, d], axis=-1))


def test_gradients_of_a_graph_out_of_order_are_refused():
    from onnxtrain.autodiff.builder import GraphBuilder
    from onnxtrain.autodiff.engine import build_gradients

    model = ir.from_proto(_slices_in_reverse_order())
    graph = model.graph
    nodes = list(graph)
    graph.remove(nodes[-1])
    graph.insert_before(nodes[3], nodes[-1])  # the Sub first: it reads both Squeezes before they run
    dy = ir.Value(name="dy", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 5]))
    with pytest.raises(ValueError, match="not in topological order: node .* reads 'q1'"):
        build_gradients(graph, [graph.inputs[0]], [graph.outputs[0]], [dy], GraphBuilder(opset=18))
