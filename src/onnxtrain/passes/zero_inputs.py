"""Remove graph inputs known to be all zeros, and simplify what they feed.

A backward graph takes one output gradient per differentiable output. When the loss is the only output
that reaches ``backward()`` (a Hugging Face model's ``loss`` beside its ``logits``), PyTorch would hand
the other gradients over as zero tensors: a language model's logits gradient is a [B, T, vocab] tensor
of zeros, and adding it into the loss's gradient is a full pass over it every step. This pass makes the
graph without those inputs: a zero propagates through ops that are linear in it (``Mul``, ``MatMul``,
``Reshape``...), and disappears into the sums that add it (``Add``, ``Sum``, ``Sub``).

If a zero would have to reach a node it cannot be simplified into, or a graph output, the pass raises
:class:`CannotPrune` and the caller keeps feeding zeros: the result is the same, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from onnxtrain.autodiff.stop_gradient import infer_shapes


class CannotPrune(ValueError):
    """A zero input reaches a place where it cannot be removed; feed zeros instead."""


# Output is zero when the data input (input 0) is zero; the other inputs are shapes, indices or factors.
_ZERO_IN_ZERO_OUT = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Slice", "Gather",
    "GatherElements", "GatherND", "Cast", "ReduceSum", "ReduceMean", "Neg", "Tile", "Div",
})
# Output is zero when any one input is zero.
_PRODUCTS = frozenset({"Mul", "MatMul", "Einsum"})
# (A Gemm is zero when A or B is, and it has no C or a zero one: alpha * A @ B + beta * C.)


def prune_zero_inputs(proto: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """``proto`` without the inputs ``names`` (all zeros), shapes inferred first so that sums can be
    shown not to broadcast. Raises :class:`CannotPrune`."""
    try:
        proto = infer_shapes(proto)
    except Exception:  # noqa: BLE001 - shapes only widen what can be pruned
        pass
    model = ir.from_proto(proto)
    PruneZeroInputsPass(names)(model)
    return ir.to_proto(model)


class PruneZeroInputsPass(ir.passes.InPlacePass):
    """Needs the shapes of the values that meet a zero in a sum (see :func:`prune_zero_inputs`)."""

    def __init__(self, names: Sequence[str]):
        super().__init__()
        self.names = list(names)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        by_name = {v.name: v for v in graph.inputs}
        missing = [n for n in self.names if n not in by_name]
        if missing:
            raise KeyError(f"no graph inputs named {missing}")
        zero: set[ir.Value] = {by_name[n] for n in self.names}
        for node in list(graph):
            if any(v in zero for v in node.inputs):
                _simplify(graph, node, zero)
        if any(v in zero for v in graph.outputs):
            name = next(v.name for v in graph.outputs if v in zero)
            raise CannotPrune(f"graph output {name!r} would be all zeros")
        for name in self.names:
            graph.inputs.remove(by_name[name])
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(self.names))


def _simplify(graph: ir.Graph, node: ir.Node, zero: set[ir.Value]) -> None:
    """Rewrite ``node`` (some of whose inputs are in ``zero``), or add its outputs to ``zero``."""
    op = node.op_type if node.domain in ("", "ai.onnx") else None
    inputs = list(node.inputs)
    live = [v for v in inputs if v is not None and v not in zero]
    if (op in _ZERO_IN_ZERO_OUT and inputs[0] in zero or op in _PRODUCTS
            or op == "Gemm" and (inputs[0] in zero or inputs[1] in zero) and (len(live) < 2 or inputs[2] in zero)
            or op == "Pad" and inputs[0] in zero and _pads_with_zeros(node, zero)):
        zero.update(node.outputs)
    elif op in ("Add", "Sum") or (op == "Sub" and inputs[1] in zero):
        if not live:
            zero.update(node.outputs)
        elif op == "Sum" and len(live) > 1:
            _replace(graph, node, "Sum", live)
        elif _same_shape_as_output(live[0], node):
            _replace(graph, node, "Identity", live[:1])
        else:
            raise CannotPrune(f"{node.op_type} node {node.name!r} broadcasts; dropping a zero changes its shape")
    elif op == "Sub":  # 0 - b
        if _same_shape_as_output(inputs[1], node):
            _replace(graph, node, "Neg", [inputs[1]])
        else:
            raise CannotPrune(f"Sub node {node.name!r} broadcasts; dropping a zero changes its shape")
    else:
        raise CannotPrune(f"{node.op_type} node {node.name!r} reads a zero input and has no simplification")


def _pads_with_zeros(node: ir.Node, zero: set[ir.Value]) -> bool:
    """Whether a Pad of zeros gives zeros: it adds zeros, or copies its input (edge, reflect, wrap)."""
    mode = node.attributes.get("mode")
    if mode is not None and mode.value != "constant":
        return True
    fill = node.inputs[2] if len(node.inputs) > 2 else None
    if fill is None or fill in zero:
        return True
    value = ir.convenience.get_const_tensor(fill)
    return value is not None and not value.numpy().any()


def _same_shape_as_output(value: ir.Value, node: ir.Node) -> bool:
    """Whether ``value`` alone already has the node's output shape (no broadcasting to undo)."""
    others = [v for v in node.inputs if v is not None and v is not value]
    if value.shape is None:
        return False
    if all(v.shape is not None and v.shape == value.shape for v in others):
        return True
    out = node.outputs[0].shape
    return out is not None and out == value.shape and all(isinstance(d, int) for d in out)


def _replace(graph: ir.Graph, node: ir.Node, op_type: str, inputs: list[ir.Value]) -> None:
    old = node.outputs[0]
    new_value = ir.Value(name=None, type=old.type, shape=old.shape)
    new = ir.Node("", op_type, inputs, outputs=[new_value], name=f"{node.name}/{op_type}")
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new], [old], [new_value])
