"""passes/rewrite.py: the match-and-rewrite loop and the readings the passes share."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.rewrite import constant_ints, rewrite_each, static_shape


def _graph() -> ir.Graph:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, "n"]))
    a = ir.node("Relu", [x], name="a")
    b = ir.node("Neg", [a.outputs[0]], name="b")
    c = ir.node("Relu", [b.outputs[0]], name="c")
    return ir.Graph([x], [c.outputs[0]], nodes=[a, b, c], opset_imports={"": 18})


def test_rewrite_each_hands_the_finding_and_may_replace_nodes():
    graph = _graph()
    findings = {"a": 0, "b": None, "c": []}  # 0 and [] are findings; None leaves the node alone
    calls = []

    def rewrite(graph, node, found):
        calls.append((node.name, found))
        node.op_type = "Identity"
        return node.name

    assert rewrite_each(graph, lambda node: findings[node.name], rewrite) == ["a", "c"]
    assert calls == [("a", 0), ("c", [])]
    assert [n.op_type for n in graph] == ["Identity", "Neg", "Identity"]


def test_rewrite_each_true_calls_without_a_finding_and_false_skips():
    graph = _graph()
    removed = []

    def drop(graph, node):  # removing the node being visited: the loop walks a copy of the list
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
        removed.append(node.name)

    assert rewrite_each(graph, lambda node: node.op_type == "Relu" and node.name == "a", drop) == [None]
    assert removed == ["a"] and [n.name for n in graph] == ["b", "c"]
    assert rewrite_each(graph, lambda node: False, drop) == []


def test_static_shape_and_constant_ints():
    assert static_shape(ir.Shape([2, 3])) and not static_shape(ir.Shape([2, "n"])) and not static_shape(None)
    assert static_shape(ir.Shape(["n", 3]), start=1)
    ints = ir.Value(name="i", const_value=ir.tensor(np.array([[1, 2]], np.int32)))
    floats = ir.Value(name="f", const_value=ir.tensor(np.array([1.0], np.float32)))
    assert constant_ints(ints).dtype == np.int64 and constant_ints(ints).tolist() == [[1, 2]]
    assert constant_ints(floats) is None and constant_ints(None) is None
    assert constant_ints(ir.Value(name="v")) is None
