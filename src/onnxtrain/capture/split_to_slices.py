"""Each ``SequenceAt(SplitToSequence(x, split), i)`` with a constant ``i`` and ``split`` becomes a ``Slice`` of ``x``.

``torch.split``, ``unsafe_split`` and ``unbind`` export as ``SplitToSequence`` followed by one ``SequenceAt``
per chunk used, and no gradient rule differentiates an ONNX sequence, so such modules fell back. (The
exporter's optimizer rewrites the pattern into ``Split`` only when the split axis has a static size; a batch
or sequence axis is exported dynamic.) Chunk ``i`` is a slice whose bounds follow from ``split`` and ``i``:

- ``split`` a scalar ``s``: ``x[i*s : (i+1)*s]`` along ``axis`` (``Slice`` clamps the last, shorter chunk);
- ``split`` a 1-D tensor of sizes: from the sum of the sizes before ``i`` to that plus ``split[i]``;
- no ``split``: ``x[i : i+1]``, squeezed on ``axis`` when ``keepdims=0``. (With a ``split``, ONNX ignores
  ``keepdims`` and onnxruntime does not; the exporter never writes that, and it is left as it is.)

How many chunks the forward returns depends on the size of the split axis, and torch.export does not always
bound that size (``split`` of a dynamic axis keeps it dynamic from 4 on). So a rewritten split axis is made
static: the graph input axis it comes from is set to the example's size, and another size exports a graph of
its own. A split axis whose size is neither static nor one input axis (``x.flatten()``'s) is left alone, as is
a ``SequenceAt`` whose index is not a constant non-negative integer, or a sequence used otherwise
(``ConcatFromSequence``, a graph output): that graph still has no gradient and falls back with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.rewrite import constant_ints

_END = 2**63 - 1


def _bounds(split: np.ndarray | None, has_split: bool, index: int) -> tuple[int, int] | None:
    """Start and end of chunk ``index`` along the split axis, or None when they are not known."""
    if not has_split:
        return index, index + 1
    if split is None:
        return None
    if split.ndim == 0:
        size = int(split)
        return (index * size, (index + 1) * size) if size > 0 else None
    if split.ndim == 1 and index < split.size:
        start = int(split[:index].sum())
        return start, start + int(split[index])
    return None


def _int64s(values: list[int], name: str) -> ir.Node:
    return ir.node("Constant", [], attributes={"value": ir.tensor(np.array(values, dtype=np.int64), name=name)},
                   name=name)


def _split_axis(node: ir.Node) -> tuple[int, object] | None:
    """The split axis of a ``SplitToSequence`` and its size (an int or a symbolic dim), if its rank is known."""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    axis = node.attributes.get_int("axis", 0)
    axis = axis + len(shape) if axis < 0 else axis
    return (axis, shape[axis]) if 0 <= axis < len(shape) else None


def split_to_slices(graph: ir.Graph, examples: Sequence[Sequence[int]]) -> bool:
    """Rewrite the ``SequenceAt``s of ``graph`` that it can; ``examples``: the shape of each graph input in the
    example the graph was exported with. Returns whether the graph changed."""
    input_axes: dict[str, list[tuple[int, int]]] = {}
    for i, value in enumerate(graph.inputs):
        for axis, dim in enumerate(value.shape or []):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                input_axes.setdefault(dim.value, []).append((i, axis))
    pins: set[str] = set()
    modified = False
    for node in list(graph):
        if node.op_type != "SequenceAt" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            continue
        split_node = node.inputs[0].producer()
        if split_node is None or split_node.op_type != "SplitToSequence" or split_node.graph is not graph:
            continue
        position = constant_ints(node.inputs[1])
        found = _split_axis(split_node)
        if position is None or position.size != 1 or int(position.reshape(())) < 0 or found is None:
            continue
        axis, size = found
        if not isinstance(size, int) and not (isinstance(size, ir.SymbolicDim) and size.value in input_axes):
            continue
        index = int(position.reshape(()))
        has_split = len(split_node.inputs) > 1 and split_node.inputs[1] is not None
        keepdims = split_node.attributes.get_int("keepdims", 1)
        if has_split and keepdims == 0:  # ONNX says ignored, onnxruntime squeezes or fails: left as it is
            continue
        bounds = _bounds(constant_ints(split_node.inputs[1]) if has_split else None, has_split, index)
        if bounds is None:
            continue
        if not isinstance(size, int):
            pins.add(size.value)
        prefix = f"{node.outputs[0].name}_slice"
        consts = [_int64s([bounds[0]], f"{prefix}_start"), _int64s([min(bounds[1], _END)], f"{prefix}_end"),
                  _int64s([axis], f"{prefix}_axis")]
        slice_ = ir.node("Slice", [split_node.inputs[0], *(c.outputs[0] for c in consts)], name=prefix)
        new_nodes = [*consts, slice_]
        if not has_split and keepdims == 0:
            new_nodes.append(ir.node("Squeeze", [slice_.outputs[0], consts[2].outputs[0]], name=f"{prefix}_squeeze"))
        ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, node.outputs,
                                                [new_nodes[-1].outputs[0]])
        modified = True
    for name in pins:  # the chunk count follows the example's size: only that size may reuse this graph
        for i, axis in input_axes[name]:
            dims = list(graph.inputs[i].shape)
            dims[axis] = int(examples[i][axis])
            graph.inputs[i].shape = ir.Shape(dims)
    if modified:
        for node in reversed(list(graph)):
            if node.op_type == "SplitToSequence" and not any(o.uses() or o.is_graph_output() for o in node.outputs):
                graph.remove(node, safe=True)
    return modified
