"""ErfCdfPass: GELU's gradient's ``HardSigmoid`` of an ``Erf`` becomes ``Mul`` and ``Add``; checked against numpy
float64 (the normal CDF) by onnxruntime, before and after, and on GELU's real gradient graph."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.passes.erf_cdf import ErfCdfPass

RNG = np.random.default_rng(0)
_ERF = np.vectorize(math.erf)


def _model(source: str = "Erf", alpha: float = 0.5, beta: float = 0.5) -> onnx.ModelProto:
    nodes = [helper.make_node(source, ["x"], ["e"]),
             helper.make_node("HardSigmoid", ["e"], ["cdf"], alpha=alpha, beta=beta),
             helper.make_node("Mul", ["cdf", "x"], ["y"])]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("alpha,beta", [(0.5, 0.5), (0.25, 0.5)])
def test_hard_sigmoid_of_erf_becomes_mul_add(alpha, beta):
    proto = _model(alpha=alpha, beta=beta)
    model = ir.from_proto(proto)
    assert ErfCdfPass()(model).modified
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    assert "HardSigmoid" not in [n.op_type for n in out.graph.node]
    x = (3 * RNG.standard_normal([5, 6])).astype(np.float32)
    expected = (alpha * _ERF(x.astype(np.float64)) + beta) * x
    np.testing.assert_allclose(_run(out, x), _run(proto, x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_run(out, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [{"source": "Tanh"}, {"alpha": 0.6}, {"beta": 0.2}])
def test_left_alone_where_the_clamp_could_bite(case):
    """Another source than Erf (its range is not known here), or a line leaving [0, 1] on [-1, 1]."""
    proto = _model(**case)
    model = ir.from_proto(proto)
    assert not ErfCdfPass()(model).modified
    assert [n.op_type for n in ir.to_proto(model).graph.node] == [n.op_type for n in proto.graph.node]


def test_fused_gelu_step_matches_eager(monkeypatch):
    """ORTModule's fused OpenVINO call (float32) on a GELU network gets the pass and eager's loss and gradients."""
    import copy

    import torch

    from onnxtrain import ORTModule
    from onnxtrain.runtime import backends

    if not backends.openvino_installed():
        pytest.skip("onnxtrain[openvino] not installed")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

        def forward(self, x, labels):
            return torch.nn.functional.cross_entropy(self.out(torch.nn.functional.gelu(self.inp(x))), labels)

    results = []
    call = ErfCdfPass.call
    monkeypatch.setattr(ErfCdfPass, "call", lambda self, model: results.append(call(self, model)) or results[-1])
    torch.manual_seed(0)
    eager = Net()
    ort_model = ORTModule(copy.deepcopy(eager), backend="openvino")
    x, labels = 2 * torch.randn(32, 6), torch.randint(0, 3, (32,))
    losses = [m(x, labels) for m in (eager, ort_model)]
    for loss in losses:
        loss.backward()
    assert ort_model.fallback_reason is None
    assert any(result.modified for result in results)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), ort_model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
