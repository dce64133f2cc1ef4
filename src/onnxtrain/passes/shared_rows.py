"""A value read by a product as is and, flattened to rows, by a weight gradient's product: both read the rows.

The MatMul gradient rule gives a linear layer on ``x`` of rank 3 or more (``y = x W``) an input gradient
``MatMul(dy, W^T)`` that reads ``dy`` as it is and a weight gradient ``Gemm(Flatten(x), Flatten(dy), transA=1)``
that reads it flattened to rows. OpenVINO's CPU plugin, under its bf16 hint, converts a float32 operand to
bf16 on each edge into a product, so a float32 ``dy`` read both ways is converted twice: GPT-2-small's
loss gradient (``[4, 128, 50257]``, the float32 loss region's output) into its ``lm_head`` products, 30 and 15
ms of a 405 ms fused call at one thread, converted once (one Reorder of 66 ms, loaded, against 123 + 25 ms)
when both products read one value (docs/precision.md). Here every ``MatMul(v, W)`` with ``W`` of rank 2 and
``v`` of rank 3 or more that is also flattened to rows (``Flatten`` at its last axis) becomes
``Reshape(MatMul(rows, W), Shape(v)[:-1] + Shape(W)[1:])`` with ``rows`` one ``Flatten`` of ``v`` that the
old Flattens' readers read too. The same dot products: each output row is the same row times ``W``.

Only where ``v`` is float32 under the hint: in the loss region that OpenVINO is told to keep float32
(:func:`onnxtrain.runtime.openvino_float32.float32_region`, read here from the ONNX graph). Elsewhere the
plugin hands the products bf16 values already, and the rewrite only cost time (BERT-small's fused call, whose
loss region is a [8, 2] classifier: 1.014-1.023x, one thread, loaded). Left alone too: a ``v`` no Flatten reads
to rows, a Flatten whose output is a graph output, a ``MatMul`` whose right operand's rank is not known to be 2.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.runtime.openvino_float32 import float32_region

_DOMAINS = ("", "ai.onnx")
# ONNX op types as OpenVINO names them, where float32_region tells them apart (products, the log-sum-exp seed)
_OPENVINO_TYPE = {"Gemm": "MatMul", "Conv": "Convolution", "ConvTranspose": "ConvolutionBackpropData",
                  "Sub": "Subtract"}


class SharedRowsPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for value, flattens, products in _candidates(graph):
            rows = _one_flatten(graph, value, flattens)
            for node in products:
                _product_of_rows(graph, node, value, rows)
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _is(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in _DOMAINS


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _candidates(graph: ir.Graph) -> list[tuple[ir.Value, list[ir.Node], list[ir.Node]]]:
    """(value, its Flattens to rows, the MatMuls that read it against a rank-2 operand), where both exist."""
    found = []
    seen: set[int] = set()
    region = _loss_region(graph)
    for node in graph:
        for value in node.inputs:
            rank = _rank(value)
            if value is None or id(value) in seen or rank is None or rank < 3 or value.producer() not in region:
                continue
            seen.add(id(value))
            users = [user for user, _ in value.uses()]
            flattens = [u for u in users if _is(u, "Flatten") and u.inputs[0] is value
                        and u.attributes.get_int("axis", 1) in (rank - 1, -1)
                        and not u.outputs[0].is_graph_output()]
            products = [u for u in users if _is(u, "MatMul") and u.inputs[0] is value and u.inputs[1] is not value
                        and _rank(u.inputs[1]) == 2]
            if flattens and products:
                found.append((value, list(dict.fromkeys(flattens)), list(dict.fromkeys(products))))
    return found


def _loss_region(graph: ir.Graph) -> set[ir.Node]:
    """The nodes OpenVINO's bf16 sessions keep float32 (:func:`float32_region` on this graph)."""
    names = {id(node): f"n{k}" for k, node in enumerate(graph)}

    def source(value: ir.Value) -> str:
        producer = value.producer()
        return names[id(producer)] if producer is not None and id(producer) in names else "Parameter"

    nodes = [("Parameter", "Parameter", False, [])]
    for node in graph:
        float32 = bool(node.outputs) and all(v.dtype == ir.DataType.FLOAT for v in node.outputs)
        nodes.append((names[id(node)], _OPENVINO_TYPE.get(node.op_type, node.op_type), float32,
                      [source(v) for v in node.inputs if v is not None]))
    kept = float32_region(nodes)
    return {node for node in graph if names[id(node)] in kept}


def _one_flatten(graph: ir.Graph, value: ir.Value, flattens: list[ir.Node]) -> ir.Value:
    """One ``Flatten`` of ``value`` to rows, right after its producer, in place of ``flattens``."""
    rows = ir.Value(name=f"{value.name}/rows", type=value.type, shape=flattens[0].outputs[0].shape)
    flatten = ir.Node("", "Flatten", [value], attributes=[ir.AttrInt64("axis", len(value.shape) - 1)],
                      outputs=[rows], name=f"{value.name}/rows")
    producer = value.producer()
    if producer is not None and producer.graph is graph:
        graph.insert_after(producer, flatten)
    else:  # a graph input or initializer
        graph.insert_before(graph[0], flatten)
    for old in flattens:
        ir.convenience.replace_all_uses_with(old.outputs[0], rows)
        graph.remove(old, safe=True)
    return rows


def _product_of_rows(graph: ir.Graph, node: ir.Node, value: ir.Value, rows: ir.Value) -> None:
    """``MatMul(value, W)`` as ``Reshape(MatMul(rows, W), Shape(value)[:-1] + Shape(W)[1:])``."""
    weight, out = node.inputs[1], node.outputs[0]
    name = node.name or out.name

    def new(suffix: str, shape=None, type_=None) -> ir.Value:
        return ir.Value(name=f"{name}/{suffix}", shape=shape, type=type_)

    product = new("rows", ir.Shape([rows.shape[0] if rows.shape is not None else None, weight.shape[1]]), out.type)
    rank, int64 = len(value.shape), ir.TensorType(ir.DataType.INT64)
    lead, last, shape = new("lead", ir.Shape([rank - 1]), int64), new("last", ir.Shape([1]), int64), \
        new("shape", ir.Shape([rank]), int64)
    reshaped = ir.Value(name=None, type=out.type, shape=out.shape)
    nodes = [
        ir.Node("", "MatMul", [rows, weight], outputs=[product], name=f"{name}/rows"),
        ir.Node("", "Shape", [value], attributes=[ir.AttrInt64("end", -1)], outputs=[lead], name=f"{name}/lead"),
        ir.Node("", "Shape", [weight], attributes=[ir.AttrInt64("start", 1)], outputs=[last], name=f"{name}/last"),
        ir.Node("", "Concat", [lead, last], attributes=[ir.AttrInt64("axis", 0)], outputs=[shape],
                name=f"{name}/shape"),
        ir.Node("", "Reshape", [product, shape], outputs=[reshaped], name=f"{name}/reshape"),
    ]
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, [out], [reshaped])
