"""Sum a tensor over its leading axes with a ``MatMul`` by a row of ones instead of ``ReduceSum``.

Every bias, LayerNorm scale and LayerNorm shift gradient is such a sum: the output gradient
``[batch, seq, hidden]`` summed over ``batch`` and ``seq``. onnxruntime's CPU ``ReduceSum`` over leading
axes strides down columns; a ``MatMul`` of a ``[rows]`` vector of ones by the ``[rows, hidden]`` view of the
same memory runs as a GEMV. Measured here (2 threads, float32, ``[8, 128, n]`` summed to ``[n]``):
``n = 256``, 41 -> 20 us; ``n = 1024``, 279 -> 112 us. BERT-small's backward has about 50 of them.

``ReduceSum(x, axes=[0 .. k-1])`` becomes::

    rows = Flatten(x, axis=k)                          # [prod(leading), prod(trailing)], a view
    ones = ConstantOfShape(Shape(rows, end=1), 1)      # [prod(leading)]
    out = Reshape(MatMul(ones, rows), [1] * k + trailing if keepdims else trailing)

``Flatten(x, axis=k)`` is also what the MatMul rule makes of a linear layer's output gradient for its
weight gradient, so onnxruntime's common-subexpression elimination merges the two. Sums over the same
leading dims (known, fixed or symbolic) share one ``ones``, made once (a constant if the dims are fixed).
The output's shape is a constant where the trailing dims are known, else taken from ``Shape(x)``; the
final ``Reshape`` is left out where the ``MatMul``'s ``[prod(trailing)]`` is already the shape.

The order of the additions changes, so results differ from ``ReduceSum``'s in the last bits (float32
rounding). Only float32 and float64 sums over leading axes (and not over all axes) are rewritten.

``only_product_gradients=True`` rewrites only the sums whose ``x`` (or its ``Flatten``) a ``MatMul`` or ``Gemm``
also reads: a linear layer's output gradient, whose weight gradient is a product of the same rows. The others
(LayerNorm's scale and shift gradients) stay ``ReduceSum``: for graphs OpenVINO runs under its bfloat16 hint,
where a product rounds its rows and its result to bfloat16 and the ``ReduceSum`` runs in float32
(:func:`onnxtrain.runtime.openvino_float32.float32_sums`; docs/precision.md).

ORTModule applies it to each backward graph after the absent output gradients are pruned
(:mod:`onnxtrain.passes.zero_inputs`): a ``Shape`` of a value that is all zeros would keep that value
alive, so pruning could not remove it. The on-device training graph gets it after differentiation.
Measured (in one process, turns alternating): BERT-small's ORTModule backward 59.9 -> 57.6 ms (median of
40), GPT-2-small's 131.9 -> 129.4 ms; the on-device BERT-small training run 85.7 -> 83.9 ms, its peak RSS
392 -> 402 MB (onnxruntime plans the memory of the changed graph differently; the sums' own buffers
are the same size).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

_DTYPES = (ir.DataType.FLOAT, ir.DataType.DOUBLE)
MIN_OPSET = 15  # Shape's start/end attributes


class SumRowsByMatMulPass(ir.passes.InPlacePass):
    def __init__(self, only_product_gradients: bool = False):
        super().__init__()
        self.only_product_gradients = only_product_gradients

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0))
        if opset < MIN_OPSET:
            return ir.passes.PassResult(model, modified=False)
        shared: dict[tuple, ir.Value] = {}
        done = rewrite_each(graph, self._leading_axes, lambda graph, node, k: _rewrite(graph, node, k, shared))
        return ir.passes.PassResult(model, modified=bool(done))

    def _leading_axes(self, node: ir.Node) -> int | None:
        k = _leading_axes(node)
        if k is not None and (not self.only_product_gradients or _feeds_a_product(node.inputs[0], k)):
            return k
        return None


def sum_rows_by_matmul(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The pass on a ModelProto: ``proto`` itself when it has nothing to rewrite."""
    model = ir.from_proto(proto)
    return ir.to_proto(model) if SumRowsByMatMulPass()(model).modified else proto


def _leading_axes(node: ir.Node) -> int | None:
    """k if ``node`` is a float ReduceSum over axes 0 .. k-1 of a tensor of rank above k, else None."""
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return None
    x = node.inputs[0]
    if x is None or x.dtype not in _DTYPES:
        return None
    axes = _axes(node)
    rank = len(x.shape) if x.shape is not None else None
    if not axes or (rank is None and min(axes) < 0):
        return None
    axes = sorted({a + rank if a < 0 else a for a in axes}) if rank is not None else sorted(set(axes))
    k = len(axes)
    if axes != list(range(k)) or (rank is not None and k >= rank):
        return None
    return k


def _feeds_a_product(x: ir.Value, k: int) -> bool:
    """Whether ``x``, or its ``Flatten(x, axis=k)``, is read by a ``MatMul`` or ``Gemm``: a linear layer's output
    gradient, whose weight gradient is a product of the same rows."""
    for node, _ in x.uses():
        if node.op_type in ("MatMul", "Gemm"):
            return True
        if node.op_type == "Flatten" and node.attributes.get_int("axis", 1) == k:
            if any(use.op_type in ("MatMul", "Gemm") for use, _ in node.outputs[0].uses()):
                return True
    return False


def _axes(node: ir.Node) -> list[int] | None:
    """The constant axes of a ReduceSum (an input from opset 13), or None."""
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return None  # no axes: every axis (or none, with noop_with_empty_axes)
    tensor = ir.convenience.get_const_tensor(node.inputs[1])
    return None if tensor is None else [int(a) for a in tensor.numpy().reshape(-1)]


def _dims(x: ir.Value, start: int, stop: int | None = None) -> tuple | None:
    """Dims ``start:stop`` of ``x`` if each is known (an int or a named symbol), else None."""
    if x.shape is None:
        return None
    dims = []
    for d in list(x.shape)[start:stop]:
        if isinstance(d, int):
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value is not None:
            dims.append(d.value)
        else:
            return None
    return tuple(dims)


def _rewrite(graph: ir.Graph, node: ir.Node, k: int, shared: dict[tuple, ir.Value]) -> None:
    x, old = node.inputs[0], node.outputs[0]
    keepdims = bool(node.attributes.get_int("keepdims", 1))
    leading, trailing = _dims(x, 0, k), _dims(x, k)
    static = trailing is not None and all(isinstance(d, int) for d in trailing)
    width = math.prod(trailing) if static else None
    new: list[ir.Node] = []

    def emit(op_type: str, inputs: list[ir.Value], shape: list | None, suffix: str,
             dtype: ir.DataType | None = None, **attributes) -> ir.Value:
        out = ir.Value(name=None, type=ir.TensorType(dtype or x.dtype),
                       shape=ir.Shape(shape) if shape is not None else None)
        # A node without a name gives its new nodes none: the graph names them.
        new.append(ir.Node("", op_type, inputs, attributes=ir.convenience.convert_attributes(attributes),
                           outputs=[out], name=f"{node.name}/{suffix}" if node.name else None))
        return out

    def ints(values: list[int], suffix: str) -> ir.Value:
        return emit("Constant", [], [len(values)], suffix, ir.DataType.INT64,
                    value=ir.tensor(np.array(values, np.int64)))

    rows = emit("Flatten", [x], [None, width], "rows", axis=k)
    ones = shared.get((x.dtype, leading)) if leading is not None else None
    if ones is None:
        if leading is not None and all(isinstance(d, int) for d in leading):
            size = math.prod(leading)
            ones = emit("Constant", [], [size], "ones", value=ir.tensor(np.ones(size, x.dtype.numpy())))
        else:
            count = emit("Shape", [rows], [1], "count", ir.DataType.INT64, start=0, end=1)
            ones = emit("ConstantOfShape", [count], [None], "ones", value=ir.tensor(np.ones(1, x.dtype.numpy())))
        if leading is not None:
            shared[(x.dtype, leading)] = ones
    out = emit("MatMul", [ones, rows], [width], "MatMul")
    if static:
        final = [1] * k + list(trailing) if keepdims else list(trailing)
        if final != [width]:
            out = emit("Reshape", [out, ints(final, "shape")], final, "out")
    else:
        shape = emit("Shape", [x], None, "trailing", ir.DataType.INT64, start=k)
        if keepdims:
            shape = emit("Concat", [ints([1] * k, "kept"), shape], None, "shape", ir.DataType.INT64, axis=0)
        out = emit("Reshape", [out, shape], None, "out")
    ir.convenience.replace_nodes_and_values(graph, node, [node], new, [old], [out])
