"""The value ranges of a model's integer inputs, recorded in the artifacts' metadata (``input_checks``)
so that the runtime can refuse an out-of-range label or token id by name before onnxruntime runs.

Two sources: the loss block's declared bounds (class labels), and ``Gather`` nodes that index a table
(a parameter or constant) with a model input, possibly through shape-only ops (token ids).
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.blocks.loss import Loss

_PASS_THROUGH = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"}


def _source_input(value: ir.Value | None) -> ir.Value | None:
    """The graph input that ``value`` is, or is a reshaping of."""
    while value is not None and not value.is_graph_input():
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _PASS_THROUGH:
            return None
        value = node.inputs[0]
    return value


def _gather_ranges(graph: ir.Graph, user_inputs: set[str]) -> dict[str, dict]:
    ranges: dict[str, dict] = {}
    for node in graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        table, indices = node.inputs[0], _source_input(node.inputs[1])
        if table is None or indices is None or indices.name not in user_inputs or table.shape is None:
            continue
        if not (table.is_graph_input() or table.is_initializer()):
            continue
        attr = node.attributes.get("axis")
        axis = attr.as_int() if attr is not None else 0
        rows = table.shape[axis]
        if not isinstance(rows, int):
            continue
        spec = {"low": -rows, "high": rows, "what": f"indices into {table.name!r} ({rows} rows, Gather)"}
        previous = ranges.get(indices.name)
        if previous is None or rows < previous["high"]:  # the tightest table wins
            ranges[indices.name] = spec
    return ranges


def input_ranges(graph: ir.Graph, loss: Loss | None, sources: list[ir.Value], user_inputs: list[str]) -> dict:
    """``{input name: {"low", "high", "ignore"?, "what"}}`` for the inputs with a known valid range."""
    ranges = _gather_ranges(graph, set(user_inputs))
    if loss is not None:
        for spec in loss.inputs(*sources):
            if spec.bounds is not None and spec.name in user_inputs:
                entry = {"low": int(spec.bounds[0]), "high": int(spec.bounds[1]), "what": spec.what}
                if spec.ignore is not None:
                    entry["ignore"] = int(spec.ignore)
                ranges[spec.name] = entry
    return ranges
