"""OrderBackwardPass: after it, every backward node but constants waits for the gradient's seed (so no
runtime may run it during the forward), and onnxruntime's outputs are the same as before it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxtrain.autodiff.engine import add_gradient_outputs, ir_version_for_onnxruntime
from onnxtrain.passes.order_backward import OrderBackwardPass
from onnxtrain.passes.split_forward_backward import ancestors


def _joint_graph(flatten: bool = False) -> tuple[ir.Model, ir.Value]:
    """loss = sum(tanh(x @ W)^2 * 0.5): the tanh gradient's 1 - h*h and x's transpose read only forward
    values and inputs, so a runtime may run them before the loss exists. ``flatten``: the product is
    reshaped to one axis before the tanh (its gradient reads the product's shape)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"], name="matmul"),
             helper.make_node("Tanh", ["z"], ["h"], name="tanh")]
    if flatten:
        nodes = [nodes[0],
                 helper.make_node("Constant", [], ["flat"],
                                  value=helper.make_tensor("flat", TensorProto.INT64, [1], [-1])),
                 helper.make_node("Reshape", ["z", "flat"], ["zf"], name="reshape"),
                 helper.make_node("Tanh", ["zf"], ["h"], name="tanh")]
    nodes += [
        helper.make_node("Mul", ["h", "h"], ["h2"], name="square"),
        helper.make_node("Constant", [], ["half"], value=helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])),
        helper.make_node("Mul", ["h2", "half"], ["s"], name="scale"),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                                           helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return _with_gradients(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), ["W"])


def _with_gradients(proto: onnx.ModelProto, names: list[str]) -> tuple[ir.Model, ir.Value]:
    """The joint graph: ``proto`` (shapes inferred) and the gradients of its inputs after the first (named
    ``names``) from a seed constant of 1, and that seed."""
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    seed_node = ir.node("Constant", [], attributes={"value": ir.tensor(np.ones((), np.float32))}, name="seed")
    seed = seed_node.outputs[0]
    seed.name, seed.type, seed.shape = "seed", ir.TensorType(ir.DataType.FLOAT), ir.Shape([])
    model.graph.append(seed_node)
    add_gradient_outputs(model, list(model.graph.inputs[1:]), [model.graph.outputs[0]], seeds=[seed], names=names)
    return model, seed


def _waiting(model: ir.Model, seed: ir.Value) -> list[str]:
    """The backward nodes that read something other than constants and do not depend on the seed (a
    ``Shape`` reads only its input's shape and makes a few integers: left out)."""
    graph = model.graph
    forward = ancestors(graph.outputs[:1])
    constants = set(graph.initializers.values())
    after_seed = {seed}
    free = []
    for node in graph:
        if node in forward or node.op_type == "Shape":
            continue
        if any(v in after_seed for v in node.inputs):
            after_seed.update(node.outputs)
        elif all(v is None or v in constants for v in node.inputs):
            constants.update(v for v in node.outputs if v not in after_seed)
        else:
            free.append(node.name)
    return free


def _run(model: ir.Model, x: np.ndarray, w: np.ndarray, order) -> list[np.ndarray]:
    proto = ir_version_for_onnxruntime(ir.to_proto(model))
    options = ort.SessionOptions()
    options.execution_order = order
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "W": w})


def _same_outputs_and_numpy_gradient(model: ir.Model, x: np.ndarray, w: np.ndarray, before) -> None:
    """``model``'s outputs equal ``before`` in both of onnxruntime's orders, and the gradient is numpy's:
    d/dW sum(tanh(xW)^2 / 2) = x^T (h (1 - h^2))."""
    h = np.tanh(x @ w)
    expected = x.T @ (h * (1 - h * h))
    for order in (ort.ExecutionOrder.DEFAULT, ort.ExecutionOrder.PRIORITY_BASED):
        after = _run(model, x, w, order)
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
        np.testing.assert_allclose(after[1], expected, rtol=1e-5, atol=1e-6)


def test_backward_work_waits_for_the_seed_and_outputs_do_not_change():
    model, seed = _joint_graph()
    free = _waiting(model, seed)
    assert free, "the test graph should have backward work that reads only forward values"
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    before = _run(model, x, w, ort.ExecutionOrder.DEFAULT)

    step = OrderBackwardPass(1, [seed])
    result = step(model)

    assert result.modified and step.gated >= 1
    assert _waiting(result.model, seed) == []
    _same_outputs_and_numpy_gradient(result.model, x, w, before)


def test_the_pass_does_nothing_when_told_not_to_run():
    model, seed = _joint_graph()
    count = len(list(model.graph))
    result = OrderBackwardPass(1, [seed], when=lambda: False)(model)
    assert not result.modified and len(list(result.model.graph)) == count


def test_a_shape_read_by_backward_is_taken_in_forward_not_gated():
    """A ``Shape`` reads only its input's shape: gated, it kept the whole input alive until backward (on
    BERT-small at 4x batch, 37 of the 98 gates did so, for the ``Reshape`` gradients). It is moved right
    after its input's producer instead, ungated, so that the input can be freed after its forward readers."""
    model, seed = _joint_graph(flatten=True)
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    before = _run(model, x, w, ort.ExecutionOrder.DEFAULT)
    shapes = [n for n in model.graph if n.op_type == "Shape" and n.inputs[0].name == "z"]
    assert len(shapes) == 1, "the Reshape gradient should read the product's shape"

    step = OrderBackwardPass(1, [seed])
    result = step(model)

    assert result.modified and step.hoisted >= 1
    nodes = list(result.model.graph)
    shape = shapes[0]
    assert shape.inputs[0].name == "z", "the Shape must read the forward value itself, not a gate"
    assert nodes.index(shape) == nodes.index(shape.inputs[0].producer()) + 1
    assert _waiting(result.model, seed) == []
    _same_outputs_and_numpy_gradient(result.model, x, w, before)


def _mlp_graph(width: int, batched_second: bool = False) -> tuple[ir.Model, ir.Value]:
    """loss = sum(y * y), y = Gelu(x @ W1) @ W2 with x: [batch, 4], W1: [4, width], W2: [width, 4]. Backward
    makes the GELU's incoming gradient ``dy = dout @ W2^T`` ([batch, width], from the [batch, 4] ``dout``) and
    its slope, which reads only the forward value ``x @ W1``. ``batched_second``: x is [batch, 4, 4] and the
    second operand ``V`` a batch of [width, 2] matrices, whose gradient ``Gelu(...)^T @ dout`` reads the
    forward value and is smaller than ``dy``."""
    f = TensorProto.FLOAT
    second = "V" if batched_second else "W2"
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["z"], name="up"),
             helper.make_node("Gelu", ["z"], ["a"], name="gelu"),
             helper.make_node("MatMul", ["a", second], ["y"], name="down"),
             helper.make_node("Mul", ["y", "y"], ["y2"], name="square"),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0, name="sum")]
    shapes = ([["batch", 4, 4], [4, width], ["batch", width, 2]] if batched_second
              else [["batch", 4], [4, width], [width, 4]])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, f, shape)
                                           for name, shape in zip(["x", "W1", second], shapes)],
                              [helper.make_tensor_value_info("loss", f, [])])
    return _with_gradients(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), ["W1", second])


def _gelu_gradient(model: ir.Model) -> tuple[ir.Node, ir.Node]:
    """(the product that makes the GELU's incoming gradient, the last node of its slope)."""
    def made_by_a_gradient_product(v: ir.Value) -> bool:
        return v.producer() is not None and v.producer().op_type == "MatMul" and "_Grad" in v.producer().name

    (mul,) = [n for n in model.graph if n.op_type == "Mul" and n.name.startswith("gelu_Grad")
              and any(made_by_a_gradient_product(v) for v in n.inputs)]
    product, slope = (v.producer() for v in sorted(mul.inputs, key=lambda v: not made_by_a_gradient_product(v)))
    return product, slope


def test_the_gelu_slope_is_made_before_the_wider_gradient_it_multiplies():
    """The on-device peak at budget 0 (BERT-small, 4x batch) was a layer's GELU gradient: its slope's
    temporaries (they read only the forward value) beside the incoming gradient, which the product from the
    4x narrower gradient had just made. The slope now waits for that narrower gradient instead, and the
    product waits for the slope: the wider gradient is made after the slope, in any order a runtime picks
    (112.5 -> 96.5 MiB modelled, docs/memory.md). Values and gradients are unchanged."""
    import torch

    model, seed = _mlp_graph(width=16)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    w1, w2 = rng.standard_normal((4, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    proto = ir_version_for_onnxruntime(ir.to_proto(model))
    feeds = {"x": x, "W1": w1, "W2": w2}
    before = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    step = OrderBackwardPass(1, [seed])
    result = step(model)

    assert step.products_delayed == 1
    product, slope = _gelu_gradient(result.model)
    assert slope in ancestors(product.outputs), "the product must wait for the GELU's slope"
    assert _waiting(result.model, seed) == []
    proto = ir_version_for_onnxruntime(ir.to_proto(result.model))
    tw1, tw2 = torch.tensor(w1, dtype=torch.float64, requires_grad=True), torch.tensor(w2, dtype=torch.float64,
                                                                                       requires_grad=True)
    y = torch.nn.functional.gelu(torch.tensor(x, dtype=torch.float64) @ tw1) @ tw2
    (y * y).sum().backward()
    for order in (ort.ExecutionOrder.DEFAULT, ort.ExecutionOrder.PRIORITY_BASED):
        options = ort.SessionOptions()
        options.execution_order = order
        after = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, feeds)
        for a, b in zip(after, before):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(after[1], tw1.grad.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(after[2], tw2.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_a_product_that_does_not_widen_the_gradient_is_not_delayed():
    """Where the incoming gradient is no larger than what its product reads, the slope made first would hold
    the narrower input alive beside it for nothing: the order stays as it was."""
    model, seed = _mlp_graph(width=4)
    step = OrderBackwardPass(1, [seed])
    result = step(model)
    assert step.gated >= 1 and step.products_delayed == 0
    product, slope = _gelu_gradient(result.model)
    assert slope not in ancestors(product.outputs)


def test_a_product_also_waits_for_the_gradients_between_it_and_its_reader_that_read_forward_values():
    """y = Gelu(x @ W1) @ V with V a batch of [16, 2] matrices: the gradient of V, ``Gelu(...)^T @ dout``,
    reads the forward value and is 2x smaller than the GELU's incoming gradient. It runs before the product
    too (on BERT-small at budget 0, attention's value gradient was the last reader of the recomputed
    probabilities, which stayed alive beside the wider gradient of the probabilities while onnxruntime ran
    the fused product last: 112 -> 104 MB measured, docs/memory.md)."""
    import torch

    model, seed = _mlp_graph(width=16, batched_second=True)
    (value_gradient,) = [o.producer() for o in model.graph.outputs if o.name == "V_grad"]

    step = OrderBackwardPass(1, [seed])
    result = step(model)

    assert step.products_delayed == 1
    product, slope = _gelu_gradient(result.model)
    before_product = ancestors(product.outputs)
    assert slope in before_product and value_gradient in before_product
    rng = np.random.default_rng(4)
    x, w1 = rng.standard_normal((3, 4, 4)).astype(np.float32), rng.standard_normal((4, 16)).astype(np.float32)
    v = rng.standard_normal((3, 16, 2)).astype(np.float32)
    tw1, tv = (torch.tensor(t, dtype=torch.float64, requires_grad=True) for t in (w1, v))
    y = torch.nn.functional.gelu(torch.tensor(x, dtype=torch.float64) @ tw1) @ tv
    (y * y).sum().backward()
    options = ort.SessionOptions()
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    proto = ir_version_for_onnxruntime(ir.to_proto(result.model))
    got = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "W1": w1, "V": v})
    np.testing.assert_allclose(got[1], tw1.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[2], tv.grad.numpy(), rtol=1e-4, atol=1e-5)
