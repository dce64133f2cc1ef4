"""SharedRowsPass: a loss-region value read by a product and, as rows, by a weight gradient's product is read
as one row view by both; checked against numpy float64 by onnxruntime, before and after."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.passes.shared_rows import SharedRowsPass

RNG = np.random.default_rng(0)


def _model(loss_region: bool = True, flatten_is_output: bool = False) -> onnx.ModelProto:
    """``v`` (``[B, S, 5]``, B and S symbolic): the probabilities of ``z`` (a loss region) or ``Relu(z)``;
    ``dx = MatMul(v, W)`` (``[B, S, 3]``), ``dW = Gemm(Flatten(v), Flatten(h), transA=1)`` (``[5, 4]``)."""
    first = ([helper.make_node("LogSoftmax", ["z"], ["logp"], axis=-1), helper.make_node("Exp", ["logp"], ["v"])]
             if loss_region else [helper.make_node("Relu", ["z"], ["v"])])
    nodes = [*first,
             helper.make_node("MatMul", ["v", "w"], ["dx"], name="input_gradient"),
             helper.make_node("Flatten", ["v"], ["v_rows"], axis=2),
             helper.make_node("Flatten", ["h"], ["h_rows"], axis=2),
             helper.make_node("Gemm", ["v_rows", "h_rows"], ["dw"], transA=1)]
    inputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", "S", 5]),
              helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", 4]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [5, 3])]
    outputs = [helper.make_tensor_value_info("dx", TensorProto.FLOAT, ["B", "S", 3]),
               helper.make_tensor_value_info("dw", TensorProto.FLOAT, [5, 4])]
    if flatten_is_output:
        outputs.append(helper.make_tensor_value_info("v_rows", TensorProto.FLOAT, [None, 5]))
    graph = helper.make_graph(nodes, "t", inputs, outputs,
                              value_info=[helper.make_tensor_value_info("v", TensorProto.FLOAT, ["B", "S", 5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(batch: int, seq: int) -> dict:
    return {"z": RNG.standard_normal([batch, seq, 5]).astype(np.float32),
            "h": RNG.standard_normal([batch, seq, 4]).astype(np.float32),
            "w": RNG.standard_normal([5, 3]).astype(np.float32)}


def _expected(feeds: dict) -> tuple[np.ndarray, np.ndarray]:
    z = feeds["z"].astype(np.float64)
    v = np.exp(z - z.max(-1, keepdims=True))
    v /= v.sum(-1, keepdims=True)
    return v @ feeds["w"].astype(np.float64), v.reshape(-1, 5).T @ feeds["h"].astype(np.float64).reshape(-1, 4)


@pytest.mark.parametrize("shape", [(2, 3), (1, 7)])
def test_both_products_read_one_row_view(shape):
    proto = _model()
    model = ir.from_proto(proto)
    assert SharedRowsPass()(model).modified
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    flattens = [n for n in out.graph.node if n.op_type == "Flatten" and n.input[0] == "v"]
    assert len(flattens) == 1
    rows = flattens[0].output[0]
    products = [n for n in out.graph.node if n.op_type in ("MatMul", "Gemm") and rows in n.input]
    assert sorted(n.op_type for n in products) == ["Gemm", "MatMul"]
    assert not any(n.op_type == "MatMul" and "v" in n.input for n in out.graph.node)
    feeds = _feeds(*shape)
    before, after = _run(proto, feeds), _run(out, feeds)
    for b, a, expected in zip(before, after, _expected(feeds)):
        assert a.shape == expected.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [{"loss_region": False}, {"flatten_is_output": True}])
def test_left_alone(case):
    """A value outside the loss region (the plugin gives the products bf16 already), or whose rows are a
    graph output, is not rewritten."""
    proto = _model(**case)
    model = ir.from_proto(proto)
    assert not SharedRowsPass()(model).modified
    assert [n.op_type for n in ir.to_proto(model).graph.node] == [n.op_type for n in proto.graph.node]
