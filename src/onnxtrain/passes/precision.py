"""Mixed precision as a graph pass: the matmul-class ops run in bfloat16 or float16, everything else in float32.

The policy is an allow-list, as ``torch.autocast``'s: ``MatMul``, ``Gemm``, ``Conv``, ``ConvTranspose``,
``Einsum`` and onnxruntime's ``FusedMatMul`` (attention's products are MatMuls) take their float32 inputs cast
down and give float32 back; every other op (softmax, normalization and its statistics, reductions, losses,
exp/log, the optimizer) is untouched and so stays float32. Where torch's autocast lets the elementwise ops
after a matmul run in the low type, this pass casts the product back at once: never less accurate than
autocast, for one cast per product. Casts are placed once: each float32 value is cast down by one node, reused
by every matmul that reads it (a weight read by the forward and the backward product, a tied embedding), and a
product read by another matmul is read in its low type, with no cast up and down between.

Graph inputs and outputs keep their types, so parameters, optimizer state and the gradients the graph returns
stay float32 (master weights). Applied to a forward graph before differentiation, the ``Cast`` rule makes
each gradient float32 again where it leaves a cast; applied to a whole training graph, the backward's products
are lowered too. Only the top-level graph is rewritten (the bodies of ``If``/``Loop``/``Scan`` stay float32),
and only ops whose inputs' types are known and whose float inputs are all float32 (:func:`apply_precision` runs
ONNX's type inference first).

A ``keep`` predicate leaves chosen nodes float32 (ORTModule's attention under ``PRODUCTS_BF16``); a float32
``Transpose`` that only lowered products read is cast first and transposed in the low type (a backend folds it into
the product); a ``Gemm``'s bias is added after it in float32. :func:`float32_accumulations` computes the low-type
products whose contraction size is dynamic (weight gradients) in float32, for OpenVINO at its float32 hint.

Which runtime runs what: onnxruntime's CPU provider runs float16 products (through its own casts, slower than
float32) and no bfloat16 product at all; its CUDA provider runs both. On CPU, bfloat16 runs on OpenVINO
(:mod:`onnxtrain.runtime.openvino`), which also runs the float32 graph in bfloat16 by its precision hint.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

# (domain, op_type) of the ops that run in the low type; "" is the ONNX domain.
LOW_PRECISION_OPS = frozenset({
    ("", "MatMul"), ("", "Gemm"), ("", "Conv"), ("", "ConvTranspose"), ("", "Einsum"),
    ("com.microsoft", "FusedMatMul"),
})
LOW_TYPES = {"bf16": ir.DataType.BFLOAT16, "bfloat16": ir.DataType.BFLOAT16,
             "fp16": ir.DataType.FLOAT16, "float16": ir.DataType.FLOAT16}


def low_type(precision: str | ir.DataType) -> ir.DataType:
    """The ``ir.DataType`` of "bf16"/"bfloat16"/"fp16"/"float16" (or of a DataType given as is)."""
    if isinstance(precision, ir.DataType):
        if precision not in LOW_TYPES.values():
            raise ValueError(f"mixed precision runs in bfloat16 or float16, not {precision.name}")
        return precision
    try:
        return LOW_TYPES[str(precision).lower()]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; use one of {sorted(LOW_TYPES)}") from None


class PrecisionPass(ir.passes.InPlacePass):
    """Run the ops in ``ops`` (default :data:`LOW_PRECISION_OPS`) in ``precision`` ("bf16" or "fp16"); the nodes
    ``keep`` chooses stay float32 (attention that eager computes in float32: ORTModule's "bf16-products")."""

    def __init__(self, precision: str | ir.DataType, ops=LOW_PRECISION_OPS,
                 keep: Callable[[ir.Node], bool] | None = None):
        super().__init__()
        self.dtype = low_type(precision)
        self.ops = frozenset(ops)
        self.keep = keep

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        low: dict[ir.Value, ir.Value] = {}  # float32 value -> the same value in the low type
        done = rewrite_each(graph, self._lowers, lambda graph, node: self._lower(graph, node, low))
        for value in low:  # a float32 Transpose that only products read, now transposed in the low type
            node = value.producer()
            if node is not None and node.op_type == "Transpose" and not value.uses() and not value.is_graph_output():
                graph.remove(node, safe=True)
        return ir.passes.PassResult(model, modified=bool(done))

    def _lowers(self, node: ir.Node) -> bool:
        return ((_domain(node), node.op_type) in self.ops and _all_float32(node)
                and not (self.keep is not None and self.keep(node)))

    def _lower(self, graph: ir.Graph, node: ir.Node, low: dict) -> None:
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None \
                and node.attributes.get_float("beta", 1.0) == 1.0:
            node = _bias_apart(graph, node)
        for i, value in enumerate(node.inputs):
            if value is not None and value.dtype == ir.DataType.FLOAT:
                node.replace_input_with(i, self._cast_down(graph, node, value, low))
        for out in list(node.outputs):
            self._cast_up(graph, node, out, low)

    def _cast_down(self, graph: ir.Graph, node: ir.Node, value: ir.Value, low: dict) -> ir.Value:
        cast = low.get(value)
        if cast is None and self._transposed_for_products(value, node):
            # Cast, then transpose in the low type (a linear layer's weight): the plugin folds a Transpose that
            # a product reads into the product, and the gradient's Transpose into the product making it, where
            # a float32 Transpose between a Cast and the product ran on OpenVINO's reference kernel (BERT-small:
            # 53 of them, 8 ms of the fused call)
            transpose = value.producer()
            source = self._cast_down(graph, transpose, transpose.inputs[0], low)
            out = ir.Value(name=f"{value.name}_{self.dtype.name.lower()}", type=ir.TensorType(self.dtype),
                           shape=ir.Shape(value.shape) if value.shape is not None else None)
            graph.insert_before(node, ir.Node("", "Transpose", [source], attributes=list(transpose.attributes.values()),
                                              outputs=[out], name=f"{transpose.name}_{self.dtype.name.lower()}"))
            cast = low[value] = out
        if cast is None:
            cast_node = _cast(value, self.dtype, f"{value.name}_{self.dtype.name.lower()}")
            graph.insert_before(node, cast_node)
            cast = low[value] = cast_node.outputs[0]
        return cast

    def _transposed_for_products(self, value: ir.Value, node: ir.Node) -> bool:
        """``value`` is a float32 ``Transpose``'s output that only products this pass lowers read (``node``, being
        lowered, and others)."""
        producer = value.producer()
        return (producer is not None and producer.op_type == "Transpose" and _domain(producer) == ""
                and producer.inputs[0] is not None and producer.inputs[0].dtype == ir.DataType.FLOAT
                and not value.is_graph_output() and all(use.node is node or self._lowers(use.node) for use in value.uses()))

    def _cast_up(self, graph: ir.Graph, node: ir.Node, out: ir.Value, low: dict) -> None:
        """Make ``out`` the low-type product and give its readers a float32 copy under its old name."""
        name = out.name
        out.name = f"{name}_{self.dtype.name.lower()}" if name else None
        cast_node = _cast(out, ir.DataType.FLOAT, name)
        up = cast_node.outputs[0]
        out.dtype = self.dtype
        for i, graph_output in enumerate(graph.outputs):
            if graph_output is out:
                graph.outputs[i] = up
        out.replace_all_uses_with(up)
        cast_node.replace_input_with(0, out)  # replace_all_uses_with redirected the cast itself
        graph.insert_after(node, cast_node)
        low[up] = out


def apply_precision(proto: onnx.ModelProto, precision: str,
                    keep: Callable[[ir.Node], bool] | None = None) -> onnx.ModelProto:
    """The pass on a ModelProto: a new model, or ``proto`` itself when it has no float32 product to lower."""
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    return ir.to_proto(model) if PrecisionPass(precision, keep=keep)(model).modified else proto


_LAYOUT_OPS = frozenset({"Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze"})


def float32_accumulations(proto: onnx.ModelProto, dtype: ir.DataType = ir.DataType.BFLOAT16) -> onnx.ModelProto:
    """Each ``dtype`` product (``MatMul``, ``Gemm``) whose contraction size is not static (a weight gradient sums over
    the batch's rows) computed in float32 from the float32 values its inputs were cast from, its result cast to
    ``dtype``: a new model, or ``proto`` itself.

    OpenVINO's CPU plugin at its float32 hint (openvino 2026.4) runs such a bfloat16 product 2x further from the
    exact product of its inputs than one rounding (3.3e-3 against 1.65e-3, torch's and its own for a static size,
    a [512 rows, 256]^T x [512 rows, 512] weight gradient), also where its float32 inputs are cast from bfloat16
    (it fuses the casts): every weight gradient of ORTModule's ``PRODUCTS_BF16`` graphs was 1.6-1.9x further from
    float64 than eager autocast's. From the float32 values, accumulated in float32, it is closer than autocast's;
    where only layout nodes and a cast to float32 read it (a weight gradient leaving the graph) it stays float32,
    since a cast down right after it, the plugin fuses into the product, rounding as before."""
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    graph = model.graph
    done = rewrite_each(graph, lambda node: _dynamic_product(node, dtype) and _float32_sources(node), _in_float32)
    return ir.to_proto(model) if done else proto


def _dynamic_product(node: ir.Node, dtype: ir.DataType) -> bool:
    if _domain(node) != "" or node.op_type not in ("MatMul", "Gemm") or node.outputs[0].dtype != dtype:
        return False
    a, b = node.inputs[0], node.inputs[1]
    if node.op_type == "Gemm":
        sizes = [(a, 0 if node.attributes.get_int("transA", 0) else 1), (b, 1 if node.attributes.get_int("transB", 0) else 0)]
    else:
        sizes = [(a, -1), (b, -2 if b.shape is not None and len(b.shape) > 1 else 0)]
    return not any(v.shape is not None and len(v.shape) and isinstance(v.shape[axis], int) for v, axis in sizes)


def _float32_sources(node: ir.Node) -> list | None:
    """Per input, the chain of layout nodes back to a ``Cast`` from float32 and that float32 value; None where an
    input has no such source (then the product is left as it is)."""
    found = []
    for value in node.inputs[:2]:
        chain = []
        producer = value.producer() if value is not None else None
        while producer is not None and producer.op_type in _LAYOUT_OPS and _domain(producer) == "":
            chain.append(producer)
            producer = producer.inputs[0].producer()
        if producer is None or producer.op_type != "Cast" or producer.inputs[0].dtype != ir.DataType.FLOAT:
            return None
        found.append((producer.inputs[0], chain[::-1]))
    return found


def _layouts_on(graph: ir.Graph, chain: list[ir.Node], value: ir.Value, before: ir.Node) -> ir.Value:
    """The layout nodes of ``chain`` again, in order, on the float32 ``value`` (inserted before ``before``): the
    last one's float32 output."""
    for layout in chain:
        out = ir.Value(name=f"{layout.outputs[0].name}_float32", type=ir.TensorType(ir.DataType.FLOAT))
        graph.insert_before(before, ir.Node("", layout.op_type, [value, *layout.inputs[1:]],
                                            attributes=list(layout.attributes.values()), outputs=[out]))
        value = out
    return value


def _in_float32(graph: ir.Graph, node: ir.Node, sources: list) -> None:
    inputs = [_layouts_on(graph, chain, value, node) for value, chain in sources]
    out = node.outputs[0]
    product = ir.Value(name=f"{out.name}_float32" if out.name else None, type=ir.TensorType(ir.DataType.FLOAT))
    new = ir.Node("", node.op_type, [*inputs, *node.inputs[2:]], attributes=list(node.attributes.values()),
                  outputs=[product], name=f"{node.name}/float32" if node.name else None)
    sink = _float32_sink(out)
    if sink is None:
        down = _cast(product, out.dtype, None)
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new, down], [out], [down.outputs[0]])
        return
    # read in float32 (a weight gradient leaving the graph): the layout nodes again, on the float32 product, and
    # no cast down at all (a cast to bf16 after a float32 product, the plugin fused into it, rounding as before)
    graph.insert_after(node, new)
    cast = sink[-1]
    identity = ir.Node("", "Identity", [_layouts_on(graph, sink[:-1], product, cast)], outputs=[ir.Value()])
    ir.convenience.replace_nodes_and_values(graph, cast, [cast], [identity], [cast.outputs[0]], [identity.outputs[0]])
    graph.remove([node, *sink[:-1]], safe=True)


def _float32_sink(value: ir.Value) -> list | None:
    """The layout nodes from ``value`` to the one ``Cast`` to float32 that alone reads it (that Cast last), or None."""
    chain = []
    while len(value.uses()) == 1 and not value.is_graph_output():
        reader = value.uses()[0].node
        chain.append(reader)
        if reader.op_type == "Cast" and reader.attributes.get_int("to") == ir.DataType.FLOAT:
            return chain
        if reader.op_type not in _LAYOUT_OPS or _domain(reader) != "" or value is not reader.inputs[0]:
            return None
        value = reader.outputs[0]
    return None


def _bias_apart(graph: ir.Graph, gemm: ir.Node) -> ir.Node:
    """``Gemm(A, B, C)`` as ``Add(Gemm(A, B), C)``, the product's node returned: the bias is added in float32, as
    every elementwise op after a product, and its gradient (the output gradient's sum) is a float32 sum. In the
    low type the bias rounded to it and its gradient summed in it: BERT's classifier bias, whose float64 gradient
    nearly cancels over the batch, was 3.1x further from float64 than eager autocast's (which sums in bf16 too)."""
    out = gemm.outputs[0]
    product = ir.Value(name=f"{out.name}_product" if out.name else None, type=ir.TensorType(out.dtype),
                       shape=ir.Shape(out.shape) if out.shape is not None else None)
    new = ir.Node("", "Gemm", gemm.inputs[:2], attributes=list(gemm.attributes.values()), outputs=[product],
                  name=gemm.name)
    add = ir.Node("", "Add", [product, gemm.inputs[2]], outputs=[ir.Value()],
                  name=f"{gemm.name}/bias" if gemm.name else None)
    ir.convenience.replace_nodes_and_values(graph, gemm, [gemm], [new, add], [out], [add.outputs[0]])
    return new


def _domain(node: ir.Node) -> str:
    return "" if node.domain == "ai.onnx" else node.domain


def _all_float32(node: ir.Node) -> bool:
    """Every input's type is known, and the float ones are all float32."""
    dtypes = [v.dtype for v in node.inputs if v is not None]
    if any(d is None for d in dtypes):
        return False  # unknown: left as it is (apply_precision infers the types first)
    floats = [d for d in dtypes if d.is_floating_point()]
    return bool(floats) and all(d == ir.DataType.FLOAT for d in floats)


def _cast(value: ir.Value, to: ir.DataType, name: str | None) -> ir.Node:
    out = ir.Value(name=name, type=ir.TensorType(to),
                   shape=ir.Shape(value.shape) if value.shape is not None else None)
    return ir.Node("", "Cast", [value], attributes=[ir.AttrInt64("to", to)], outputs=[out],
                   name=f"{name}/Cast" if name else None)
