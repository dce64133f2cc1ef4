"""The engine's contract: names, pruning, fan-in, zeros, errors, opset handling, the registry."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import UnsupportedOpError, gradient_model
from onnxtrain.autodiff.registry import DuplicateRuleError, Registry, RuleTable

FLOAT = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _vi(name, shape, elem=FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def _linear_model():
    """y = relu(x @ W + b) * x_scale, with W and b initializers named like torch parameters."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "fc1.weight")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "fc1.bias")
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h"]),
        helper.make_node("Add", ["h", "fc1.bias"], ["z"]),
        helper.make_node("Relu", ["z"], ["y"]),
    ]
    return _model(nodes, [_vi("x", ["batch", 4])], [_vi("y", ["batch", 3])], [w, b])


def test_contract_names_order_and_checker():
    grad = gradient_model(_linear_model(), wrt=["fc1.weight", "x"])
    onnx.checker.check_model(grad, full_check=True)
    assert [i.name for i in grad.graph.input] == ["x", "y_grad"]
    assert [o.name for o in grad.graph.output] == ["y", "fc1.weight_grad", "x_grad"]
    x = np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32)
    dy = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    out = _run(grad, {"x": x, "y_grad": dy})
    weights = {i.name: numpy_helper.to_array(i) for i in grad.graph.initializer}
    w, b = weights["fc1.weight"], weights["fc1.bias"]
    z = x @ w + b
    dz = dy * (z > 0)
    np.testing.assert_allclose(out["y"], np.maximum(z, 0), rtol=1e-5)
    np.testing.assert_allclose(out["fc1.weight_grad"], x.T @ dz, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["x_grad"], dz @ w.T, rtol=1e-4, atol=1e-5)


def test_dynamic_batch_runs_at_two_sizes():
    grad = gradient_model(_linear_model(), wrt=["fc1.bias"])
    for n in (2, 7):
        x = np.ones((n, 4), np.float32)
        out = _run(grad, {"x": x, "y_grad": np.ones((n, 3), np.float32)})
        assert out["fc1.bias_grad"].shape == (3,)


def test_fan_in_is_summed_and_unreached_wrt_gets_zeros():
    # y = x * x + x ; u is an input with no path to y
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Add", ["sq", "x"], ["y"])]
    model = _model(nodes, [_vi("x", [3]), _vi("u", [2])], [_vi("y", [3])])
    grad = gradient_model(model, wrt=["x", "u"])
    x = np.array([1.0, -2.0, 0.5], np.float32)
    out = _run(grad, {"x": x, "u": np.ones(2, np.float32), "y_grad": np.ones(3, np.float32)})
    np.testing.assert_allclose(out["x_grad"], 2 * x + 1)
    np.testing.assert_array_equal(out["u_grad"], np.zeros(2, np.float32))


def test_wrt_that_is_also_a_differentiated_output_is_a_clear_error():
    # x is an input and an output: its seed input and its gradient output would both be "x_grad".
    nodes = [helper.make_node("Neg", ["x"], ["y"])]
    model = _model(nodes, [_vi("x", [2])], [_vi("y", [2]), _vi("x", [2])])
    with pytest.raises(ValueError, match="'x_grad'.*both"):
        gradient_model(model, wrt=["x"], outputs=["y", "x"])
    grad = gradient_model(model, wrt=["x"], outputs=["y"])  # differentiating y alone is fine
    out = _run(grad, {"x": np.ones(2, np.float32), "y_grad": np.full(2, 3.0, np.float32)})
    np.testing.assert_array_equal(out["x_grad"], np.full(2, -3.0, np.float32))


def test_integer_paths_are_not_differentiated_and_int_wrt_rejected():
    # idx = Cast(x) (int) -> Gather; the integer path carries no gradient.
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((5, 2)).astype(np.float32), "table")
    nodes = [
        helper.make_node("Cast", ["x"], ["idx"], to=TensorProto.INT64),
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("Cast", ["idx"], ["idxf"], to=FLOAT),
        helper.make_node("Add", ["sq", "idxf"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [3])], [_vi("y", [3])], [table])
    grad = gradient_model(model, wrt=["x"])
    x = np.array([1.5, 2.5, 3.5], np.float32)
    out = _run(grad, {"x": x, "y_grad": np.ones(3, np.float32)})
    np.testing.assert_allclose(out["x_grad"], 2 * x)  # nothing through the integer Cast
    ids = _model([helper.make_node("Gather", ["table", "i"], ["y"])], [_vi("i", [2], TensorProto.INT64)],
                 [_vi("y", [2, 2])], [table])
    with pytest.raises(TypeError, match="only float tensors"):
        gradient_model(ids, wrt=["i"])


def _custom(op, inputs, outputs, name):
    return helper.make_node(op, inputs, outputs, domain="my.ops", name=name)


def test_unsupported_ops_are_all_listed_with_domain_and_node():
    nodes = [
        _custom("Mystery", ["x"], ["a"], "mystery_1"),
        helper.make_node("Relu", ["a"], ["b"]),
        _custom("Enigma", ["b"], ["c"], "enigma_7"),
        helper.make_node("Add", ["c", "w"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [2])], [_vi("y", [2])],
                   [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    with pytest.raises(UnsupportedOpError) as info:
        gradient_model(model, wrt=["x", "w"])
    msg = str(info.value)
    assert "Mystery (domain my.ops), node 'mystery_1'" in msg
    assert "Enigma (domain my.ops), node 'enigma_7'" in msg
    assert "on the path to 'x'" in msg
    assert {(d, op) for d, op, _, _ in info.value.missing} == {("my.ops", "Mystery"), ("my.ops", "Enigma")}
    # Only the ops between w and y matter for w: nothing unsupported there.
    grad = gradient_model(model, wrt=["w"])
    assert grad.graph.output[-1].name == "w_grad"


def test_ops_off_the_gradient_path_never_block():
    # A mask computed by an op with no rule, from an input that is not differentiated.
    nodes = [
        _custom("MakeMask", ["ids"], ["mask"], "mask_op"),
        helper.make_node("Mul", ["x", "mask"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [3]), _vi("ids", [3])], [_vi("y", [3])])
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    grad = gradient_model(model, wrt=["x"])
    mul_grad = [n for n in grad.graph.node if n.op_type == "Mul" and "mask" in n.input and "y_grad" in n.input]
    assert mul_grad, "x_grad must be y_grad * mask"


def test_bad_names_give_clear_errors():
    model = _linear_model()
    with pytest.raises(KeyError, match="'nope' is not a graph input or initializer"):
        gradient_model(model, wrt=["nope"])
    with pytest.raises(KeyError, match="not graph outputs"):
        gradient_model(model, wrt=["x"], outputs=["z"])
    with pytest.raises(ValueError, match="repeat"):
        gradient_model(model, wrt=["x", "x"])


def test_name_clash_with_internal_value_is_renamed():
    nodes = [helper.make_node("Mul", ["x", "x"], ["x_grad"]), helper.make_node("Relu", ["x_grad"], ["y"])]
    model = _model(nodes, [_vi("x", [3])], [_vi("y", [3])])
    grad = gradient_model(model, wrt=["x"])
    onnx.checker.check_model(grad, full_check=True)
    x = np.array([1.0, -2.0, 3.0], np.float32)
    out = _run(grad, {"x": x, "y_grad": np.ones(3, np.float32)})
    np.testing.assert_allclose(out["x_grad"], 2 * x)


def test_old_opset_is_converted(tmp_path):
    # Opset 11 (Unsqueeze with an axes attribute) is converted to 13 and differentiated.
    nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]), helper.make_node("Tanh", ["u"], ["y"])]
    model = _model(nodes, [_vi("x", [3])], [_vi("y", [1, 3])], opset=11)
    path = tmp_path / "old.onnx"
    onnx.save(model, path)
    grad = gradient_model(str(path), wrt=["x"])
    opset = {o.domain: o.version for o in grad.opset_import}[""]
    assert opset >= 13
    x = np.array([0.1, 0.2, -0.3], np.float32)
    out = _run(grad, {"x": x, "y_grad": np.ones((1, 3), np.float32)})
    np.testing.assert_allclose(out["x_grad"], 1 - np.tanh(x) ** 2, rtol=1e-5)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="ONNX model not found"):
        gradient_model(tmp_path / "absent.onnx", wrt=["x"])
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        gradient_model(bad, wrt=["x"])


def test_registry_rejects_duplicates_and_respects_opset_ranges():
    a, b = RuleTable("a"), RuleTable("b")
    a.register("Foo", since=1, until=12)(lambda g: ())
    b.register("Foo", since=13)(lambda g: ())
    registry = Registry(a, b)
    assert registry.lookup("", "Foo", 11).until == 12
    assert registry.lookup("ai.onnx", "Foo", 18).since == 13
    c = RuleTable("c")
    c.register("Foo", since=10)(lambda g: ())
    with pytest.raises(DuplicateRuleError, match="Foo"):
        Registry(a, c)


def test_cli_grad_and_version(tmp_path, capsys):
    from onnxtrain.cli import main

    src = tmp_path / "m.onnx"
    onnx.save(_linear_model(), src)
    out = tmp_path / "g.onnx"
    assert main(["grad", str(src), "--wrt", "fc1.weight", "-o", str(out)]) == 0
    assert [o.name for o in onnx.load(out).graph.output] == ["y", "fc1.weight_grad"]
    assert main(["grad", str(tmp_path / "absent.onnx"), "--wrt", "w", "-o", str(out)]) == 1
    assert "ONNX model not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "onnxtrain 0.1.0" in capsys.readouterr().out
