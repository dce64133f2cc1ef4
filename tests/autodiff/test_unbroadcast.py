"""Un-broadcasting a gradient when a broadcast input's size is unknown when the graph is built.

``Add(a, b)`` with ``a: [n, m]`` and ``b: [p, q]`` (all symbolic): at run time each of b's axes is 1 or
a's size there, and only then is it known which axes b's gradient sums over. The gradient graph is built
once and run at sizes that take every case (b broadcast on no axis, one, both; an empty axis), and
compared with PyTorch autograd. From opset 14 the graph has no run-time reduction axes (OpenVINO cannot
convert those): every ``ReduceSum``'s axes are a constant.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model

SHAPES = [  # (a's shape, b's shape)
    ((3, 4), (3, 4)), ((3, 4), (1, 4)), ((3, 4), (3, 1)), ((3, 4), (1, 1)), ((1, 4), (1, 4)),
    ((0, 4), (1, 4)), ((0, 4), (0, 1)), ((3, 0), (1, 0)), ((3, 0), (3, 1)),
]


def _model(opset: int, lead: bool) -> onnx.ModelProto:
    a_dims = ["l", "n", "m"] if lead else ["n", "m"]
    nodes = [helper.make_node("Add", ["a", "b"], ["y"]), helper.make_node("Mul", ["y", "y"], ["z"])]
    graph = helper.make_graph(
        nodes, "unbroadcast",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["p", "q"])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("lead", [False, True], ids=["same-rank", "lead-axis"])
@pytest.mark.parametrize("opset", [13, 17])
def test_unknown_broadcast_axes_match_torch(opset, lead):
    grad = gradient_model(_model(opset, lead), wrt=["a", "b"])
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for a_shape, b_shape in SHAPES:
        a_shape = ((2,) if lead else ()) + a_shape
        a = rng.standard_normal(a_shape).astype(np.float32)
        b = rng.standard_normal(b_shape).astype(np.float32)
        ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
        z = (ta + tb) * (ta + tb)
        seed = rng.standard_normal(tuple(z.shape)).astype(np.float32)
        ga, gb = torch.autograd.grad(z, [ta, tb], torch.from_numpy(seed))
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"a": a, "b": b, "z_grad": seed})))
        for name, expected in (("a_grad", ga), ("b_grad", gb)):
            assert got[name].shape == tuple(expected.shape), (name, a_shape, b_shape)
            np.testing.assert_allclose(got[name], expected.numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} for a {a_shape}, b {b_shape}")
    if opset >= 14:
        consts = {i.name for i in grad.graph.initializer} | {
            o for n in grad.graph.node if n.op_type == "Constant" for o in n.output}
        reduces = [n for n in grad.graph.node if n.op_type == "ReduceSum"]
        assert reduces and all(len(n.input) > 1 and n.input[1] in consts for n in reduces)
        assert not any(n.op_type == "NonZero" for n in grad.graph.node)
