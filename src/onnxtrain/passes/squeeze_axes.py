"""A ``Squeeze`` without axes given the axes its declared output shape says it removes, for OpenVINO.

``torch.squeeze(x)`` (every axis of size 1; mBART's ``shift_tokens_right``) exports as ``Squeeze`` without an
axes input. OpenVINO cannot tell which axes of a dynamic size are 1, so its output has a dynamic rank, which
its CPU plugin refuses (2026.4: "CPU plug-in doesn't support Squeeze operation with dynamic rank"). The traced
graph knows: its output shape has the rank the trace saw (torch.export guards a dynamic size against 1, and
ORTModule runs a graph only on sizes in the traced ranges). Where the input has exactly as many axes of static
size 1 as the output has fewer axes, those are the axes: given as a constant input, the same op; where it has
none and the output has the input's rank (every axis of a dynamic size, which is never 1 there), the Squeeze
removes nothing and becomes an ``Identity``. Any other ``Squeeze`` is left alone (and a graph that keeps one of
dynamic rank is refused before it runs: :func:`onnxtrain.runtime.openvino.refusal`). Run only on graphs for OpenVINO (:mod:`onnxtrain.passes.pipeline`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

_DOMAINS = ("", "ai.onnx")


class SqueezeAxesPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = rewrite_each(model.graph, _axes, _give_axes)
        return ir.passes.PassResult(model, modified=bool(done))


def _give_axes(graph: ir.Graph, node: ir.Node, axes: list[int]) -> None:
    if axes == []:  # it removes no axis: the same values, as an Identity
        node.op_type = "Identity"
        return
    value = ir.AttrTensor("value", ir.tensor(np.array(axes, np.int64)))
    constant = ir.Node("", "Constant", [], attributes=[value], name=f"{node.name or 'Squeeze'}/axes")
    graph.insert_before(node, constant)
    node.resize_inputs(2)
    node.replace_input_with(1, constant.outputs[0])


def _axes(node: ir.Node) -> list[int] | None:
    if node.op_type != "Squeeze" or node.domain not in _DOMAINS:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:  # axes given
        return None
    source, out = node.inputs[0], node.outputs[0]
    if source is None or source.shape is None or out.shape is None:
        return None
    ones = [axis for axis, size in enumerate(source.shape) if size == 1]
    return ones if len(source.shape) - len(ones) == len(out.shape) else None
