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

Which runtime runs what: onnxruntime's CPU provider runs float16 products (through its own casts, slower than
float32) and no bfloat16 product at all; its CUDA provider runs both. On CPU, bfloat16 runs on OpenVINO
(:mod:`onnxtrain.runtime.openvino`), which also runs the float32 graph in bfloat16 by its precision hint.
"""

from __future__ import annotations

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
    """Run the ops in ``ops`` (default :data:`LOW_PRECISION_OPS`) in ``precision`` ("bf16" or "fp16")."""

    def __init__(self, precision: str | ir.DataType, ops=LOW_PRECISION_OPS):
        super().__init__()
        self.dtype = low_type(precision)
        self.ops = frozenset(ops)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        low: dict[ir.Value, ir.Value] = {}  # float32 value -> the same value in the low type
        done = rewrite_each(graph, self._lowers, lambda graph, node: self._lower(graph, node, low))
        return ir.passes.PassResult(model, modified=bool(done))

    def _lowers(self, node: ir.Node) -> bool:
        return (_domain(node), node.op_type) in self.ops and _all_float32(node)

    def _lower(self, graph: ir.Graph, node: ir.Node, low: dict) -> None:
        for i, value in enumerate(node.inputs):
            if value is not None and value.dtype == ir.DataType.FLOAT:
                node.replace_input_with(i, self._cast_down(graph, node, value, low))
        for out in list(node.outputs):
            self._cast_up(graph, node, out, low)

    def _cast_down(self, graph: ir.Graph, node: ir.Node, value: ir.Value, low: dict) -> ir.Value:
        cast = low.get(value)
        if cast is None:
            cast_node = _cast(value, self.dtype, f"{value.name}_{self.dtype.name.lower()}")
            graph.insert_before(node, cast_node)
            cast = low[value] = cast_node.outputs[0]
        return cast

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


def apply_precision(proto: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The pass on a ModelProto: a new model, or ``proto`` itself when it has no float32 product."""
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    return ir.to_proto(model) if PrecisionPass(precision)(model).modified else proto


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
