"""Run SoftmaxCrossEntropyLoss on 2-D scores as LogSoftmax + NegativeLogLikelihoodLoss.

onnxruntime's standard CPU build has no SoftmaxCrossEntropyLoss kernel: it inlines the op's ONNX
function, which reshapes the scores to [N, C, 1], takes LogSoftmax over axis 1 (not the last axis,
so it transposes) and copies the log-probabilities for the second output. On a language model's
[512, 50257] logits that costs about 40 ms of a step. With [N, C] scores, LogSoftmax(axis=1) is over
the last axis and is the log-probability output itself.

Applied after differentiation (the SoftmaxCrossEntropyLoss rule builds a cheaper backward than the two
separate rules would); the graph's values, names and outputs are unchanged.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

_KEPT_ATTRIBUTES = ("reduction", "ignore_index")


class ExpandCrossEntropyPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0))
        # LogSoftmax's axis means one axis from 13 on (it coerced to 2-D before)
        done = rewrite_each(graph, _applies, _expand) if opset >= 13 else []
        return ir.passes.PassResult(model, modified=bool(done))


def expand_cross_entropy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The pass on a ModelProto: ``proto`` itself when it has nothing to expand."""
    model = ir.from_proto(proto)
    return ir.to_proto(model) if ExpandCrossEntropyPass()(model).modified else proto


def _applies(node: ir.Node) -> bool:
    if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
        return False
    scores = node.inputs[0]
    return scores is not None and scores.shape is not None and len(scores.shape) == 2


def _expand(graph: ir.Graph, node: ir.Node) -> None:
    scores, target = node.inputs[0], node.inputs[1]
    weight = node.inputs[2] if len(node.inputs) > 2 else None
    log_prob = ir.Value(name=None, type=scores.type, shape=scores.shape)
    softmax = ir.Node("", "LogSoftmax", [scores], attributes=[ir.AttrInt64("axis", 1)], outputs=[log_prob],
                      name=f"{node.name}/LogSoftmax")
    attributes = [node.attributes[k] for k in _KEPT_ATTRIBUTES if k in node.attributes]
    loss = ir.Value(name=None, type=node.outputs[0].type, shape=node.outputs[0].shape)
    nll = ir.Node("", "NegativeLogLikelihoodLoss", [log_prob, target, *([weight] if weight is not None else [])],
                  attributes=attributes, outputs=[loss], name=f"{node.name}/NegativeLogLikelihoodLoss")
    old_values, new_values = [node.outputs[0]], [loss]
    if len(node.outputs) > 1:
        old_values.append(node.outputs[1])
        new_values.append(log_prob)
    ir.convenience.replace_nodes_and_values(graph, node, [node], [softmax, nll], old_values, new_values)
