"""Let the caller add an embedding's gradient rows: the graph returns the rows and their indices instead.

An embedding's weight gradient is zeros of the table's shape with the output gradient's rows added at
the token ids: ``ScatterElements(ConstantOfShape(shape), Expand(ids), rows, axis=0, reduction="add")``
(see the Gather rule in :mod:`onnxtrain.autodiff.rules.shape`). onnxruntime fills the zeros and then adds
element by element on one thread: 5.2 ms per step for BERT-small's 30522 x 256 word embeddings, against
1.4 ms for ``torch.zeros(...).index_add_(0, ids, rows)``. The zeros also take a table-sized block of the
session's arena at the end of every backward run.

This pass rewrites each such gradient output for a caller that can add rows itself (ORTModule, with
torch): the graph returns the ids (int64, 1-D) and the rows instead, and the caller adds the rows into
zeros of the parameter's shape. When the scatter is one term of a sum (a weight tied to the output
projection, GPT-2's ``wte``), the graph returns the other terms' sum, and the caller adds the rows into
it in place. Every scatter term of the sum is deferred (BART's table is looked up by its encoder and its
decoder and is its output projection): the caller then sees each lookup's ids, which is what PyTorch's
``padding_idx`` needs (:mod:`onnxtrain.ortmodule.function`). The on-device runtime adds the rows itself, with
numpy, in bf16 artifacts (:mod:`onnxtrain.ondevice.rows`: OpenVINO's scatter wrote a table of zeros each step);
other artifacts keep the scatter, as the conformance fixtures and onnxruntime-web run them.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common


@dataclass(frozen=True)
class RowScatter:
    """Gradient ``gradient`` (a position in the original outputs) gets ``index_add_(0, ids, rows)``:
    into the output at ``base`` (the sum's other terms), or, if None, into what the scatters before it
    in the list made of the same gradient, or into zeros of the parameter's shape. ``base``, ``ids`` and
    ``rows`` are positions in the rewritten graph's outputs."""

    gradient: int
    base: int | None
    ids: int
    rows: int


@dataclass
class RowScatters:
    """How the rewritten graph's outputs make the original ones: output k of the rewritten graph is
    original output ``kept[k]`` (for k < len(kept)); the ``scatters`` make the others. ``partial``:
    the gradients some of whose row scatters stay in the graph (their ids are not all seen)."""

    num_outputs: int
    kept: list[int]
    scatters: list[RowScatter]
    partial: set[int] = field(default_factory=set)


def defer_row_scatters(model: ir.Model, only: Container[int] | None = None) -> RowScatters:
    """Rewrite ``model``'s outputs made by a row scatter-add (in place); return how to finish them.
    ``only``: the positions of the outputs that may be rewritten (None: any).

    Outputs of any other form stay, in their order; ids and rows come after them.
    """
    graph = model.graph
    outputs = list(graph.outputs)
    kept: list[int] = []
    new_outputs: list[ir.Value] = []
    found: list[tuple[int, ir.Value | None, list[tuple[ir.Value, ir.Value]]]] = []
    for position, output in enumerate(outputs):
        rewrite = _rewrite(graph, output, outputs) if only is None or position in only else None
        if rewrite is None:
            kept.append(position)
            new_outputs.append(output)
            continue
        base, pairs = rewrite
        if base is not None:
            kept.append(position)
            new_outputs.append(base)
        found.append((position, base, pairs))
    scatters = []
    for position, base, pairs in found:
        for k, (ids, rows) in enumerate(pairs):
            new_outputs += [ids, rows]
            base_index = kept.index(position) if base is not None and k == 0 else None
            scatters.append(RowScatter(position, base_index, len(new_outputs) - 2, len(new_outputs) - 1))
    rewritten = {position for position, _, _ in found}
    partial = {position for position, base, _ in found if base is not None and _has_scatter_term(base)}
    partial |= {position for position, output in enumerate(outputs)
                if position not in rewritten and _has_scatter_term(output)}
    if found:
        graph.outputs.clear()
        graph.outputs.extend(new_outputs)
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return RowScatters(len(outputs), kept, scatters, partial)


# Ops whose output onnxruntime may place in its input's memory.
_ALIASING = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def _rewrite(graph: ir.Graph, output: ir.Value, outputs: list[ir.Value]):
    """(base or None, [(ids, rows), ...]) if ``output`` is a row scatter-add, or a sum (of Adds and
    Sums) with row scatter-adds among its terms."""
    node = output.producer()
    if node is None or output.uses() or outputs.count(output) != 1:
        return None
    scatter = _row_scatter(node)
    if scatter is not None:
        return None, [_ids_and_rows(graph, node, scatter)]
    if not _is_sum(node):
        return None
    scatters, rest = [], []
    for term in _terms(node):
        producer = term.producer() if term is not None else None
        scatter = _row_scatter(producer) if producer is not None and len(term.uses()) == 1 else None
        if scatter is None:
            rest.append(term)
        else:
            scatters.append((producer, scatter))
    if not scatters:
        return None
    if output.shape is None or any(v is None or v.shape != output.shape for v in rest):
        return None  # the other terms must have the gradient's shape already (no broadcasting)
    if len(rest) == 1 and not _owned(rest[0], outputs):
        return None
    base = None if not rest else rest[0] if len(rest) == 1 else _insert(graph, node, "Sum", rest, output)
    return base, [_ids_and_rows(graph, producer, scatter) for producer, scatter in scatters]


def _is_sum(node: ir.Node) -> bool:
    return node.op_type in ("Add", "Sum") and node.domain in ("", "ai.onnx")


def _terms(node: ir.Node) -> list[ir.Value]:
    """The leaves of the tree of Adds and Sums under ``node`` whose inner values have no other use."""
    terms = []
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and _is_sum(producer) and len(value.uses()) == 1:
            terms += _terms(producer)
        else:
            terms.append(value)
    return terms


def _has_scatter_term(value: ir.Value) -> bool:
    """Whether ``value`` is, or sums, a ScatterElements left in the graph."""
    node = value.producer()
    if node is None:
        return False
    if node.op_type == "ScatterElements":
        return True
    return _is_sum(node) and any(t is not None and t.producer() is not None
                                 and t.producer().op_type == "ScatterElements" for t in _terms(node))


def _owned(value: ir.Value, outputs: list[ir.Value]) -> bool:
    """Whether the caller may add into ``value`` in place: its memory is no graph input, constant or
    other graph output (following the ops that may share their input's memory)."""
    while True:
        if value.is_graph_input() or value.is_initializer() or value in outputs:
            return False
        node = value.producer()
        if node is None or node.op_type == "Constant":
            return False
        if node.op_type not in _ALIASING:
            return True
        value = node.inputs[0]


def _row_scatter(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """(ids, rows) if ``node`` adds ``rows[i]`` into row ``ids[i]`` of zeros, else None; ``ids`` is
    int64 of shape [N, 1, ..., 1] (one axis per axis of ``rows``)."""
    if node.op_type != "ScatterElements" or node.domain not in ("", "ai.onnx"):
        return None
    if node.attributes.get_string("reduction", "none") != "add" or node.attributes.get_int("axis", 0) != 0:
        return None
    data, indices, rows = node.inputs
    if not _is_zeros(data) or len(data.uses()) != 1:
        return None
    spread = indices.producer()  # Expand(Reshape(ids, [-1, 1, ..., 1]), Shape(rows))
    if spread is None or spread.op_type != "Expand":
        return None
    column, target = spread.inputs
    shape_of = target.producer()
    if shape_of is None or shape_of.op_type != "Shape" or shape_of.inputs[0] is not rows or shape_of.attributes:
        return None
    reshape = column.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return None
    view = ir.convenience.get_const_tensor(reshape.inputs[1])
    if view is None:
        return None
    view = view.numpy().tolist()
    if len(view) != _rank(node) or view[0] != -1 or any(d != 1 for d in view[1:]):
        return None  # (the ids must line up with the rows' first axis)
    if reshape.inputs[0].dtype != ir.DataType.INT64:
        return None
    return reshape.inputs[0], rows


def _rank(scatter: ir.Node) -> int | None:
    """The rank of the scatter's data, updates and indices (all equal), if known."""
    for value in (scatter.outputs[0], *scatter.inputs):
        if value.shape is not None:
            return len(value.shape)
    shape = scatter.inputs[0].producer().inputs[0].shape  # ConstantOfShape's shape input: [rank]
    return shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None


def _ids_and_rows(graph: ir.Graph, scatter: ir.Node, found: tuple[ir.Value, ir.Value]) -> tuple[ir.Value, ir.Value]:
    ids, rows = found
    flat = ir.node("Reshape", [ids, _const(graph, scatter, np.array([-1], dtype=np.int64))])
    graph.insert_before(scatter, flat)
    out = flat.outputs[0]
    out.name = f"{scatter.outputs[0].name}_ids"
    out.dtype = ir.DataType.INT64
    if rows.name is None:
        rows.name = f"{scatter.outputs[0].name}_rows"
    return out, rows


def _is_zeros(value: ir.Value) -> bool:
    node = value.producer()
    if node is None or node.op_type != "ConstantOfShape":
        return False
    fill = node.attributes.get("value")
    return fill is None or not np.any(fill.as_tensor().numpy())


def _const(graph: ir.Graph, before: ir.Node, array: np.ndarray) -> ir.Value:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array)})
    graph.insert_before(before, node)
    return node.outputs[0]


def _insert(graph: ir.Graph, before: ir.Node, op: str, inputs: list[ir.Value], like: ir.Value) -> ir.Value:
    node = ir.node(op, inputs)
    graph.insert_before(before, node)
    out = node.outputs[0]
    out.name = f"{like.name}_terms"
    out.dtype, out.shape = like.dtype, like.shape
    return out
