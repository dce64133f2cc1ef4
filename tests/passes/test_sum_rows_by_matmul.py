"""SumRowsByMatMulPass: sums over leading axes become a MatMul by ones, checked against numpy's sums."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.passes.sum_rows_by_matmul import SumRowsByMatMulPass

RNG = np.random.default_rng(0)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _sum_model(x_shape, axes, keepdims, dtype=TensorProto.FLOAT, opset=18) -> onnx.ModelProto:
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=keepdims, name="sum")
    inits = [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, x_shape)],
                              [helper.make_tensor_value_info("y", dtype, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _rewrite(proto: onnx.ModelProto, forget_shapes: bool = False) -> tuple[bool, onnx.ModelProto]:
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    if forget_shapes:  # of the values inside the graph, as for those the gradient builder makes
        for node in model.graph:
            for value in node.outputs:
                if value not in model.graph.outputs:
                    value.shape = None
    modified = SumRowsByMatMulPass()(model).modified
    out = ir.to_proto(model)
    if modified:
        onnx.checker.check_model(out, full_check=True)
    return modified, out


@pytest.mark.parametrize(("shape", "dims", "axes", "keepdims"), [
    ((8, 16, 6), [8, 16, 6], [0, 1], 0),                  # a bias gradient, fixed dims
    ((8, 16, 6), ["b", "s", 6], [0, 1], 1),               # symbolic leading dims, kept
    ((8, 16, 6), ["b", "s", 6], [-3, -2], 0),             # negative axes
    ((5, 3, 4, 2), ["b", 3, "h", 2], [0], 0),             # symbolic trailing dims: shape from Shape(x)
    ((5, 3, 4, 2), ["b", 3, "h", 2], [0, 1], 1),
    ((7, 3), ["n", 3], [0], 1),
])
def test_leading_sums_match_numpy(shape, dims, axes, keepdims):
    proto = _sum_model(dims, axes, keepdims)
    modified, out = _rewrite(proto)
    assert modified
    ops = [n.op_type for n in out.graph.node]
    assert "ReduceSum" not in ops and "MatMul" in ops
    x = RNG.standard_normal(shape).astype(np.float32)
    want = x.astype(np.float64).sum(axis=tuple(axes), keepdims=bool(keepdims))
    (got,) = _run(out, {"x": x})
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_unknown_shape_in_double(keepdims):
    nodes = [helper.make_node("Mul", ["x", "x"], ["xx"]),
             helper.make_node("ReduceSum", ["xx", "axes"], ["y"], keepdims=keepdims)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["b", "s", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
                              [helper.make_tensor("axes", TensorProto.INT64, [2], [0, 1])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    modified, out = _rewrite(proto, forget_shapes=True)  # rank unknown: Flatten and Shape(x) still work
    assert modified
    x = RNG.standard_normal((3, 5, 4))
    (got,) = _run(out, {"x": x})
    np.testing.assert_allclose(got, (x * x).sum(axis=(0, 1), keepdims=bool(keepdims)), rtol=1e-12)


def test_opset_15_is_enough():
    modified, out = _rewrite(_sum_model(["b", "s", 4], [0, 1], 0, opset=15))
    assert modified
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(out, {"x": x})[0], x.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)


def test_sums_over_the_same_leading_dims_share_their_ones():
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0, name="s1"),
             helper.make_node("Mul", ["x", "x"], ["xx"], name="square"),
             helper.make_node("ReduceSum", ["xx", "axes"], ["z"], keepdims=0, name="s2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 4])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "yz"],
                              [helper.make_tensor("axes", TensorProto.INT64, [2], [0, 1])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    modified, out = _rewrite(proto)
    assert modified
    assert [n.op_type for n in out.graph.node].count("ConstantOfShape") == 1
    x = RNG.standard_normal((2, 9, 4)).astype(np.float32)
    y, z = _run(out, {"x": x})
    np.testing.assert_allclose(y, x.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(z, (x * x).sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)


def test_fixed_leading_dims_use_a_constant_row_of_ones():
    modified, out = _rewrite(_sum_model([4, 8, 3], [0, 1], 0))
    assert modified
    ops = [n.op_type for n in out.graph.node]
    assert "Shape" not in ops and "ConstantOfShape" not in ops


@pytest.mark.parametrize(("dims", "axes", "kwargs"), [
    (["b", "s", 4], [1], {}),                                  # not a leading axis
    (["b", "s", 4], [0, 2], {}),                               # not contiguous from 0
    (["b", "s", 4], [0, 1, 2], {}),                            # every axis: nothing to keep
    (["b", "s", 4], [0, 1], {"dtype": TensorProto.INT64}),     # integers: MatMul of ints is not float-exact the same
    (["b", "s", 4], [0, 1], {"opset": 14}),                    # Shape has no start/end before opset 15
])
def test_other_sums_are_left_alone(dims, axes, kwargs):
    modified, out = _rewrite(_sum_model(dims, axes, 0, **kwargs))
    assert not modified
    assert [n.op_type for n in out.graph.node] == ["ReduceSum"]


def test_axes_computed_at_run_time_are_left_alone():
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
                                            helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert not _rewrite(proto)[0]


def test_bias_gradient_of_a_linear_layer_matches_pytorch():
    torch = pytest.importorskip("torch")
    from onnxtrain.autodiff import gradient_model

    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "s", 5]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [5, 3]),
                                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "s", 3])])
    proto = gradient_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
                           wrt=["w", "b"], outputs=["y"])
    modified, out = _rewrite(proto)
    assert modified
    x, w, b = (RNG.standard_normal(s).astype(np.float32) for s in ((4, 6, 5), (5, 3), (3,)))
    dy = RNG.standard_normal((4, 6, 3)).astype(np.float32)
    seed = "y_grad"
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x, "w": w, "b": b, seed: dy})))
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    (torch.tensor(x) @ tw + tb).backward(torch.tensor(dy))
    np.testing.assert_allclose(got["w_grad"], tw.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["b_grad"], tb.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_only_product_gradients_keeps_the_layer_norm_sums():
    """``only_product_gradients`` (OpenVINO bf16): the linear layer's bias sum, whose rows its weight gradient's
    product also reads, becomes a product; LayerNorm's scale and shift sums stay ReduceSum. Values as PyTorch's."""
    torch = pytest.importorskip("torch")
    from onnxtrain.autodiff import gradient_model

    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "s", 5]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [5, 3]),
                                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3]),
                                           helper.make_tensor_value_info("g", TensorProto.FLOAT, [3]),
                                           helper.make_tensor_value_info("beta", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "s", 3])])
    proto = gradient_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
                           wrt=["w", "b", "g", "beta"], outputs=["y"])
    sums = sum(n.op_type == "ReduceSum" for n in proto.graph.node)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    assert SumRowsByMatMulPass(only_product_gradients=True)(model).modified
    out = ir.to_proto(model)
    assert sum(n.op_type == "ReduceSum" for n in out.graph.node) == sums - 1 == 2
    x, w, b, g, beta = (RNG.standard_normal(s).astype(np.float32) for s in ((4, 6, 5), (5, 3), (3,), (3,), (3,)))
    dy = RNG.standard_normal((4, 6, 3)).astype(np.float32)
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {"x": x, "w": w, "b": b, "g": g, "beta": beta, "y_grad": dy})))
    params = [torch.tensor(a, requires_grad=True) for a in (w, b, g, beta)]
    h = torch.tensor(x) @ params[0] + params[1]
    torch.nn.functional.layer_norm(h, (3,), params[2], params[3], 1e-5).backward(torch.tensor(dy))
    for name, p in zip(("w", "b", "g", "beta"), params):
        np.testing.assert_allclose(got[f"{name}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-5)
