"""onnxtrain's ``StopGradient`` op: an Identity that no gradient flows through.

``StopGradient`` (domain ``onnxtrain``) marks a value that no gradient flows through: ORTModule emits it
for ``detach()`` and ``torch.no_grad()`` blocks, and a hand-written ONNX model may use it too. The
gradient engine gives it no gradient. onnxruntime and ONNX shape inference do not know it:
:func:`strip_stop_gradients` makes each one an ``Identity`` (every graph bound for a session goes
through it), and :func:`infer_shapes` infers shapes as if they were.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT


def strip_stop_gradients(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with each ``StopGradient`` an ``Identity`` (the same proto if it has none)."""
    if not any(is_stop_gradient(n) for n in _all_nodes(proto.graph)):
        return proto
    stripped = onnx.ModelProto()
    stripped.CopyFrom(proto)
    for node in _all_nodes(stripped.graph):
        if is_stop_gradient(node):
            node.op_type, node.domain = "Identity", ""
    if not any(n.domain == ONNXTRAIN_DOMAIN for n in _all_nodes(stripped.graph)):
        keep = [o for o in stripped.opset_import if o.domain != ONNXTRAIN_DOMAIN]
        del stripped.opset_import[:]
        stripped.opset_import.extend(keep)
    return stripped


def infer_shapes(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` on ``model``, seeing each StopGradient as an Identity."""
    return shapes_as_identity(model, lambda m: onnx.shape_inference.infer_shapes(m, **kwargs))


def shapes_as_identity(model: onnx.ModelProto,
                       infer: Callable[[onnx.ModelProto], onnx.ModelProto | None]) -> onnx.ModelProto | None:
    """``infer`` (a shape inference) run on ``model`` with each StopGradient an Identity: its result's
    shapes on ``model``'s nodes (an Identity's output keeps the StopGradient's name). None if ``infer``
    returns None."""
    stripped = strip_stop_gradients(model)
    inferred = infer(stripped)
    if stripped is model or inferred is None:
        return inferred
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for field in ("input", "output", "value_info"):
        del getattr(result.graph, field)[:]
        getattr(result.graph, field).extend(getattr(inferred.graph, field))
    return result


def is_stop_gradient(node) -> bool:
    """Whether ``node`` (an ``onnx.NodeProto`` or an ``onnx_ir.Node``) is a StopGradient."""
    return node.op_type == STOP_GRADIENT and node.domain == ONNXTRAIN_DOMAIN


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)
            for sub in attribute.graphs:
                yield from _all_nodes(sub)
