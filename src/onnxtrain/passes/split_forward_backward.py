"""Split a training graph (forward nodes + gradient nodes) into a forward graph and a backward graph.

The training graph takes ``[*forward inputs, *output gradients]`` and returns
``[*forward outputs, *gradients]``. The split gives

- **forward**: the forward inputs -> ``[*forward outputs, *stashed]``, where ``stashed`` are the
  intermediate values backward reads (activations, dropout masks, saved statistics);
- **backward**: ``[*output gradients, *stashed, *forward inputs backward reads]`` -> the gradients.

Nodes that the forward outputs need run in forward; every other node that the gradients need runs in
backward, so values that backward can compute from what it has (shapes, constants, ``1 - y*y``) are
computed there rather than kept in memory. Forward inputs that backward reads (parameters, inputs)
are not stashed: the caller passes the same tensors again. ``Shape``/``Size`` of forward values run in
forward, so a few integers are stashed instead of a tensor. What else to recompute rather than stash is
decided before the split, by :mod:`onnxtrain.passes.recompute` (its clones are backward nodes here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx
import onnx_ir as ir


@dataclass
class Split:
    forward: ir.Model
    backward: ir.Model
    stashed_outputs: list[int]  # backward input k (after the output gradients) = forward output i
    reused_inputs: list[int]  # then: backward input = forward graph input j

    @property
    def num_stashed(self) -> int:
        return len(self.stashed_outputs)


def ancestors(roots: Iterable[ir.Value]) -> set[ir.Node]:
    """The nodes that the values ``roots`` depend on."""
    seen: set[ir.Node] = set()
    stack = [v.producer() for v in roots if v is not None and v.producer() is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return seen


# Ops that read only their input's shape: run in forward, they stash a few integers instead of a tensor.
SHAPE_OPS = frozenset({"Shape", "Size"})


def _crossing(bwd_list, forward_nodes, fwd_input_index, seeds) -> list[ir.Value]:
    """The values backward reads from the forward side, in first-use order."""
    crossing: list[ir.Value] = []
    seen: set[ir.Value] = set()
    for node in bwd_list:
        for v in node.inputs:
            if v is None or v in seen or v in seeds:
                continue
            producer = v.producer()
            if (producer is not None and producer in forward_nodes) or v in fwd_input_index:
                crossing.append(v)
                seen.add(v)
    return crossing


def _is_onnx(node: ir.Node, ops: frozenset[str]) -> bool:
    return node.op_type in ops and node.domain in ("", "ai.onnx")


def _shapes_into_forward(bwd_list: list[ir.Node], forward_nodes: set[ir.Node]) -> list[ir.Node]:
    """Move backward ``Shape``/``Size`` nodes that read forward values into forward; the rest of backward."""
    moved = [n for n in bwd_list if _is_onnx(n, SHAPE_OPS) and n.inputs[0] is not None
             and n.inputs[0].producer() in forward_nodes]
    forward_nodes.update(moved)
    for node in moved:  # backward receives the result as an input: give it its type and static shape
        out = node.outputs[0]
        out.type = ir.TensorType(ir.DataType.INT64)
        if out.shape is None:
            out.shape = _shape_output_shape(node)
    return [n for n in bwd_list if n not in forward_nodes]


def _shape_output_shape(node: ir.Node) -> ir.Shape | None:
    """``Size``: a scalar. ``Shape``: one dimension, as long as the kept part of the input's rank."""
    if node.op_type == "Size":
        return ir.Shape([])
    rank = None if node.inputs[0].shape is None else len(node.inputs[0].shape)
    if rank is None:
        return None
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start, end = (max(0, min(rank, k + rank if k < 0 else k)) for k in (start, end))
    return ir.Shape([max(0, end - start)])


def _fresh_copy(value: ir.Value) -> ir.Value:
    return ir.Value(name=value.name, type=value.type, shape=value.shape, const_value=value.const_value)


def split_forward_backward(model: ir.Model, num_forward_outputs: int, num_output_grads: int) -> Split:
    """Split ``model`` (consumed: its nodes move into the two new models)."""
    graph = model.graph
    inputs = list(graph.inputs)
    fwd_inputs, seeds = inputs[: len(inputs) - num_output_grads], inputs[len(inputs) - num_output_grads:]
    fwd_outputs, grads = list(graph.outputs[:num_forward_outputs]), list(graph.outputs[num_forward_outputs:])

    forward_nodes = ancestors(fwd_outputs)
    backward_nodes = ancestors(grads) - forward_nodes
    ordered = list(graph)
    backward_nodes.update(n for n in ordered if n not in forward_nodes and any(o in grads for o in n.outputs))
    bwd_list = [n for n in ordered if n in backward_nodes]
    for node in bwd_list:
        for v in node.inputs:
            producer = None if v is None else v.producer()
            if producer is not None and producer not in forward_nodes and producer not in backward_nodes:
                raise AssertionError(f"split: {v.name} is produced outside both graphs")
    bwd_list = _shapes_into_forward(bwd_list, forward_nodes)
    backward_nodes -= forward_nodes
    fwd_list = [n for n in ordered if n in forward_nodes]

    initializers = dict(graph.initializers)
    graph.remove(ordered, safe=False)
    graph.inputs.clear()
    graph.outputs.clear()
    graph.initializers.clear()

    # What backward reads from the forward side.
    fwd_input_index = {v: i for i, v in enumerate(fwd_inputs)}
    crossing = _crossing(bwd_list, forward_nodes, fwd_input_index, seeds)

    stashed = [v for v in crossing if v not in fwd_input_index]
    reused = [v for v in crossing if v in fwd_input_index]
    fwd_out_all = list(fwd_outputs)
    stashed_outputs = []
    for v in stashed:
        if v not in fwd_out_all:
            fwd_out_all.append(v)
        stashed_outputs.append(fwd_out_all.index(v))

    # Backward sees copies of the crossing values; initializers it reads get their own copies too.
    replacements = {v: _fresh_copy(v) for v in crossing}
    bwd_inits = {}
    for node in bwd_list:
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            if v in replacements:
                node.replace_input_with(i, replacements[v])
            elif v.name in initializers and initializers[v.name] is v and v.producer() is None and v not in seeds:
                bwd_inits.setdefault(v.name, _fresh_copy(v))
                node.replace_input_with(i, bwd_inits[v.name])

    for g in grads:
        if g.producer() is None or g.producer() not in backward_nodes:
            raise ValueError(
                f"split: gradient {g.name!r} is not computed by a backward node (it is a forward value or an "
                "output gradient itself); give it an Identity node first"
            )

    opsets = dict(graph.opset_imports)
    fwd_inits = [v for name, v in initializers.items() if any(True for _ in v.uses())]
    fwd_graph = ir.Graph(fwd_inputs, fwd_out_all, nodes=fwd_list, initializers=fwd_inits,
                         opset_imports=opsets, name="forward")
    bwd_inputs = list(seeds) + [replacements[v] for v in stashed] + [replacements[v] for v in reused]
    bwd_graph = ir.Graph(bwd_inputs, grads, nodes=bwd_list, initializers=list(bwd_inits.values()),
                         opset_imports=opsets, name="backward")
    forward = ir.Model(fwd_graph, ir_version=model.ir_version, producer_name="onnxtrain")
    backward = ir.Model(bwd_graph, ir_version=model.ir_version, producer_name="onnxtrain")
    _fill_missing_types(forward, [replacements[v] for v in stashed], stashed_outputs)
    return Split(forward, backward, stashed_outputs, [fwd_input_index[v] for v in reused])


def _fill_missing_types(forward: ir.Model, backward_inputs: Sequence[ir.Value], indices: Sequence[int]) -> None:
    """Stashed values created by gradient rules (e.g. a Dropout mask) may lack a type; infer it."""
    if all(v.type is not None for v in backward_inputs):
        return
    proto = onnx.shape_inference.infer_shapes(ir.to_proto(forward))
    types = {vi.name: vi.type for vi in [*proto.graph.value_info, *proto.graph.output]}
    outputs = forward.graph.outputs
    for v, i in zip(backward_inputs, indices):
        if v.type is not None:
            continue
        inferred = types.get(outputs[i].name)
        if inferred is None or not inferred.HasField("tensor_type") or not inferred.tensor_type.elem_type:
            raise ValueError(f"split: cannot infer the type of the stashed value {v.name!r}")
        dtype = ir.DataType(inferred.tensor_type.elem_type)
        v.type = outputs[i].type = ir.TensorType(dtype)
