"""TransposedGemmPass: a Transpose of a Gemm's product becomes one Gemm, checked against numpy by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.passes.transposed_gemm import TransposedGemmPass

RNG = np.random.default_rng(0)


def _model(trans_a: int, trans_b: int, alpha: float = 1.0, perm=(1, 0), with_c: bool = False,
           product_is_output: bool = False) -> onnx.ModelProto:
    a_shape, b_shape = ([5, 3] if trans_a else [3, 5]), ([4, 5] if trans_b else [5, 4])  # product [3, 4]
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape)]
    gemm_inputs = ["a", "b"]
    if with_c:
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, 4]))
        gemm_inputs.append("c")
    nodes = [helper.make_node("Gemm", gemm_inputs, ["p"], name="g", alpha=alpha, transA=trans_a, transB=trans_b),
             helper.make_node("Transpose", ["p"], ["y"], **({"perm": list(perm)} if perm is not None else {})),
             helper.make_node("Relu", ["y"], ["r"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3]),
               helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 3])]
    if product_is_output:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [3, 4]))
    graph = helper.make_graph(nodes, "t", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(proto: onnx.ModelProto) -> dict:
    return {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in proto.graph.input}


def _expected(feeds: dict, trans_a: int, trans_b: int, alpha: float) -> np.ndarray:
    a = feeds["a"].T if trans_a else feeds["a"]
    b = feeds["b"].T if trans_b else feeds["b"]
    return (alpha * (a @ b) + feeds.get("c", 0)).T


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("perm", [(1, 0), None])
def test_transpose_of_gemm_becomes_one_gemm(trans_a, trans_b, perm):
    proto = _model(trans_a, trans_b, alpha=0.5, perm=perm)
    feeds = _feeds(proto)
    model = ir.from_proto(proto)
    assert TransposedGemmPass()(model).modified
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.graph.node] == ["Gemm", "Relu"]
    expected = _expected(feeds, trans_a, trans_b, 0.5)
    for before, after in zip(_run(proto, feeds), _run(out, feeds)):
        np.testing.assert_allclose(before, after, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_run(out, feeds)[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [{"with_c": True}, {"product_is_output": True}])
def test_left_alone(case):
    """A Gemm with C, or whose product is used elsewhere too (here: a graph output), is not rewritten."""
    proto = _model(1, 0, **case)
    model = ir.from_proto(proto)
    assert not TransposedGemmPass()(model).modified
    assert [n.op_type for n in ir.to_proto(model).graph.node] == ["Gemm", "Transpose", "Relu"]
