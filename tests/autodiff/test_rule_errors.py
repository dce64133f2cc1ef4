"""Rules that cannot differentiate an attribute combination say so, naming the node and the attribute."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import gradient_model


def _one_node(node, inputs, inits=(), opset=20):
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_einsum_diagonal_is_rejected_by_name():
    node = helper.make_node("Einsum", ["x"], ["y"], equation="ii->i", name="diag_einsum")
    with pytest.raises(NotImplementedError, match="diag_einsum"):
        gradient_model(_one_node(node, [_f("x", [3, 3])]), wrt=["x"])


def test_gather_elements_before_opset_16_is_rejected():
    idx = numpy_helper.from_array(np.zeros((2, 2), np.int64), "idx")
    node = helper.make_node("GatherElements", ["x", "idx"], ["y"], axis=1, name="ge_node")
    with pytest.raises(Exception, match="ge_node") as info:
        gradient_model(_one_node(node, [_f("x", [2, 3])], [idx], opset=13), wrt=["x"])
    assert "16" in str(info.value)


def test_scatter_nd_mul_reduction_is_rejected():
    idx = numpy_helper.from_array(np.array([[0]], np.int64), "idx")
    node = helper.make_node("ScatterND", ["x", "idx", "u"], ["y"], reduction="mul", name="scatter_mul")
    with pytest.raises(Exception, match="scatter_mul") as info:
        gradient_model(_one_node(node, [_f("x", [2, 3]), _f("u", [1, 3])], [idx]), wrt=["x", "u"])
    assert "mul" in str(info.value)


def test_lstm_peepholes_are_rejected_by_attribute():
    hidden, inp = 2, 3
    node = helper.make_node("LSTM", ["x", "w", "r", "", "", "", "", "p"], ["y"], hidden_size=hidden, name="lstm_p")
    inputs = [_f("x", [4, 1, inp]), _f("w", [1, 4 * hidden, inp]), _f("r", [1, 4 * hidden, hidden]),
              _f("p", [1, 3 * hidden])]
    with pytest.raises(Exception, match="lstm_p") as info:
        gradient_model(_one_node(node, inputs), wrt=["w"])
    assert "P" in str(info.value) or "peephole" in str(info.value).lower()


@pytest.mark.parametrize("reduce_op", ["ReduceMax", "ReduceMin"])
def test_reduce_max_min_ties_share_the_gradient_like_torch(reduce_op):
    torch = pytest.importorskip("torch")
    import onnxruntime as ort

    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    if reduce_op == "ReduceMin":
        x = -x
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    node = helper.make_node(reduce_op, ["x", "axes"], ["y"], keepdims=0)
    grad = gradient_model(_one_node(node, [_f("x", [2, 3])], [axes], opset=18), wrt=["x"])
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x, "y_grad": np.ones(2, np.float32)})[1]
    t = torch.tensor(x, requires_grad=True)
    (torch.amax(t, dim=1) if reduce_op == "ReduceMax" else torch.amin(t, dim=1)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-6)
