"""onnxtrain's ``StopGradient`` op: an Identity that no gradient flows through.

``StopGradient`` (domain ``onnxtrain``) marks a value that no gradient flows through: ORTModule emits it
for ``detach()`` and ``torch.no_grad()`` blocks, and a hand-written ONNX model may use it too. The
gradient engine gives it no gradient. onnxruntime and ONNX shape inference do not know it:
:func:`strip_stop_gradients` makes each one an ``Identity`` (every graph bound for a session goes
through it), and :func:`infer_shapes` infers shapes as if they were.
"""

from __future__ import annotations

import onnx

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT


def strip_stop_gradients(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with each ``StopGradient`` an ``Identity`` (the same proto if it has none)."""
    if not any(_is_stop(n) for n in _all_nodes(proto.graph)):
        return proto
    stripped = onnx.ModelProto()
    stripped.CopyFrom(proto)
    for node in _all_nodes(stripped.graph):
        if _is_stop(node):
            node.op_type, node.domain = "Identity", ""
    if not any(n.domain == ONNXTRAIN_DOMAIN for n in _all_nodes(stripped.graph)):
        keep = [o for o in stripped.opset_import if o.domain != ONNXTRAIN_DOMAIN]
        del stripped.opset_import[:]
        stripped.opset_import.extend(keep)
    return stripped


def infer_shapes(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` on ``model``, seeing each StopGradient as an Identity."""
    stripped = strip_stop_gradients(model)
    inferred = onnx.shape_inference.infer_shapes(stripped, **kwargs)
    if stripped is model:
        return inferred
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for field in ("value_info", "output"):
        del getattr(result.graph, field)[:]
        getattr(result.graph, field).extend(getattr(inferred.graph, field))
    return result


def _is_stop(node: onnx.NodeProto) -> bool:
    return node.op_type == STOP_GRADIENT and node.domain == ONNXTRAIN_DOMAIN


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)
            for sub in attribute.graphs:
                yield from _all_nodes(sub)
