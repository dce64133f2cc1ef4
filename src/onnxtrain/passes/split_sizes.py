"""A ``Split`` by ``num_outputs`` given its chunk sizes, for OpenVINO.

``torch.chunk`` exports as ``Split(num_outputs=n)`` (opset 18): chunks of ``ceil(d / n)``, the last one smaller
where ``n`` does not divide the axis's size ``d``. OpenVINO's ONNX reader makes it an equal split, which needs
``n`` to divide ``d``: on one thread its CPU plugin returned empty outputs for ``chunk`` of 5 rows in 2 (shapes
``(0, 0, 5)`` where eager gives ``(3, 5, 5)`` and ``(2, 5, 5)``; the OpInfo sweep under autocast bf16, and
``backend="openvino"`` in float32), on several it raised. Here the sizes are the ``split`` input, as ONNX defines
them: constants where the axis's size is static, else computed from the input's shape at run time. Run only on
graphs for OpenVINO (:mod:`onnxtrain.passes.pipeline`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

_DOMAINS = ("", "ai.onnx")


class SplitSizesPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = rewrite_each(model.graph, _chunks, _give_sizes)
        return ir.passes.PassResult(model, modified=bool(done))


def _chunks(node: ir.Node) -> tuple[int, int] | None:
    """(axis, number of chunks) of a Split by ``num_outputs`` without sizes, else None."""
    if node.op_type != "Split" or node.domain not in _DOMAINS or "num_outputs" not in node.attributes:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return None
    source = node.inputs[0]
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    if axis < 0:
        if source is None or source.shape is None:
            return None
        axis += len(source.shape)
    return axis, node.attributes["num_outputs"].as_int()


def _const(graph: ir.Graph, before: ir.Node, name: str, values) -> ir.Value:
    node = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(np.array(values, np.int64)))],
                   name=name)
    graph.insert_before(before, node)
    return node.outputs[0]


def _op(graph: ir.Graph, before: ir.Node, op_type: str, inputs, name: str, **attrs) -> ir.Value:
    node = ir.Node("", op_type, inputs, attributes=[ir.AttrInt64(k, v) for k, v in attrs.items()], name=name)
    graph.insert_before(before, node)
    return node.outputs[0]


def _give_sizes(graph: ir.Graph, node: ir.Node, chunks: tuple[int, int]) -> None:
    axis, n = chunks
    source = node.inputs[0]
    prefix = f"{node.name or 'Split'}/sizes"
    size = source.shape[axis] if source.shape is not None and axis < len(source.shape) else None
    if isinstance(size, int):
        chunk = -(-size // n)
        sizes = _const(graph, node, prefix, [chunk] * (n - 1) + [size - chunk * (n - 1)])
    else:
        d = _op(graph, node, "Shape", [source], f"{prefix}/size", start=axis, end=axis + 1)
        chunk = _op(graph, node, "Div", [_op(graph, node, "Add", [d, _const(graph, node, f"{prefix}/n-1", [n - 1])],
                                              f"{prefix}/add"),
                                          _const(graph, node, f"{prefix}/n", [n])], f"{prefix}/chunk")
        last = _op(graph, node, "Sub", [d, _op(graph, node, "Mul", [chunk, _const(graph, node, f"{prefix}/k", [n - 1])],
                                               f"{prefix}/mul")], f"{prefix}/last")
        sizes = _op(graph, node, "Concat", [chunk] * (n - 1) + [last], prefix, axis=0)
    del node.attributes["num_outputs"]
    node.resize_inputs(2)
    node.replace_input_with(1, sizes)
