"""StopGradient: no gradient flows through it (against PyTorch's detach), and it becomes an Identity for
onnxruntime, in subgraphs too."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT
from onnxtrain.autodiff.stop_gradient import strip_stop_gradients


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid(ONNXTRAIN_DOMAIN, 1)])


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_no_gradient_flows_through_stop_gradient():
    """y = sum(x * stop(x) + w * stop(w * x)): PyTorch's gradients of the same with detach()."""
    nodes = [helper.make_node(STOP_GRADIENT, ["x"], ["sx"], domain=ONNXTRAIN_DOMAIN),
             helper.make_node("Mul", ["x", "sx"], ["a"]),
             helper.make_node("Mul", ["w", "x"], ["wx"]),
             helper.make_node(STOP_GRADIENT, ["wx"], ["swx"], domain=ONNXTRAIN_DOMAIN),
             helper.make_node("Mul", ["w", "swx"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0)]
    proto = gradient_model(_model(nodes, [_f("x", [3]), _f("w", [3])], [_f("y", [])]), wrt=["x", "w"])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    session = ort.InferenceSession(strip_stop_gradients(proto).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    _, dx, dw = session.run(None, {"x": x, "w": w, "y_grad": np.array(1.0, np.float32)})
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (tx * tx.detach() + tw * (tw * tx).detach()).sum().backward()
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-6)


def test_strip_makes_identities_in_subgraphs_too_and_drops_the_domain():
    inner = helper.make_graph([helper.make_node(STOP_GRADIENT, ["x"], ["t"], domain=ONNXTRAIN_DOMAIN),
                               helper.make_node("Neg", ["t"], ["o"])], "then", [], [_f("o", [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [_f("e", [2])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=other)]
    proto = _model(nodes, [_f("x", [2]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [_f("y", [2])])
    stripped = strip_stop_gradients(proto)
    assert ONNXTRAIN_DOMAIN not in {o.domain for o in stripped.opset_import}
    branch = {a.name: a.g for a in stripped.graph.node[0].attribute}["then_branch"]
    assert [n.op_type for n in branch.node] == ["Identity", "Neg"]
    original = {a.name: a.g for a in proto.graph.node[0].attribute}["then_branch"]
    assert original.node[0].op_type == STOP_GRADIENT  # the input is left as it was
    session = ort.InferenceSession(stripped.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x, "c": np.array(True)})[0], -x)
    assert strip_stop_gradients(stripped) is stripped  # nothing to do: the same proto
