"""A cross-entropy's log-softmax as a log-sum-exp per row, so that its [N, C] float32 tensors are made fewer times.

In a graph that holds a loss and its gradient (ORTModule's fused forward + backward call on OpenVINO), the
cross-entropy is ``NegativeLogLikelihoodLoss(LogSoftmax(x))`` and its gradient reads ``Exp`` of the same
log-softmax (:func:`onnxtrain.autodiff.rules.nn.grad_softmax_cross_entropy`). OpenVINO runs ``LogSoftmax`` as
max, subtract, exp, sum, log, subtract, and then the gradient's ``Exp``: four passes writing a [N, C] float32
tensor and two reading one, each over a language model's logits (GPT-2-small's [512, 50257]: 103 MB).
Rewritten, with ``x`` the [N, C] scores (classes on axis 1):

- ``m = ReduceMax(x)``, ``e = Exp(x - m)``, ``s = ReduceSum(e)``, ``lse = m + Log(s)`` per row: one pass
  writing ``e`` (its subtraction has no other reader, so OpenVINO fuses the two), two reading;
- each ``Exp(LogSoftmax(x))`` becomes ``e * (1 / s)``: the forward's exponentials reused, so the gradient's
  pass over the logits is a multiply (which OpenVINO fuses with the gradient's following multiply) and computes
  no exponential: on GPT-2-small's logits that pass took 14 ms instead of 21-27 at one thread, the exponential
  being the cost of the old one, not its memory traffic. ``1 / s`` is ``Exp(-lse + m)`` (``Exp`` and ``Add``,
  which the plugin keeps float32; it rewrites a ``Divide`` into nodes of its own that run bfloat16), made a node
  of its own by a ``ReduceMax`` over its size-1 axis: without it, the plugin fused the [N, 1] ``Add`` and
  ``Exp`` into the [N, C] multiply's kernel and computed that exponential once per element;
- each ``NegativeLogLikelihoodLoss(LogSoftmax(x), t)`` becomes the same op on ``[N, 1]`` scores,
  ``x[n, t[n]] - lse[n]``, with the target 0 (``ignore_index`` where ``t`` is ignored), so its reduction,
  ignored rows and the mean's divisor are the op's own.

``-lse`` is a ``ReduceMax`` over its size-1 axis of ``lse * -1`` (the same values): without that node, the
plugin fused the ``-1`` multiply at the head of the loss's chain as a node it made itself, which carried no
float32 marking, and the chain ran in bfloat16 (docs/precision.md). The float32 policy
(:mod:`onnxtrain.runtime.openvino_float32`) seeds on ``Exp(x - ReduceMax(x))`` as it does on ``LogSoftmax``.

The same math; float32 rounding differs by a few ulps (``exp(x - m) * exp(m - lse)`` against ``exp(x - m -
log s)``). ``e`` is then read by the gradient: it stays alive from the forward's sum to the gradient in place
of the float32 logits, which the old gradient read. Applied where the log-softmax has no reader but those (not
a graph output: a split forward stashes it for backward), on 2-D float scores at ai.onnx opset 18 or later, to
losses without class weights.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

logger = logging.getLogger("onnxtrain.passes")

_ONNX = ("", "ai.onnx")


class LogSumExpLossPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0)) < 18:
            return ir.passes.PassResult(model, modified=False)
        done = rewrite_each(graph, _applies, _rewrite)
        return ir.passes.PassResult(model, modified=bool(done))


def log_sum_exp_loss(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The pass on a ModelProto (for tests and tools)."""
    model = ir.from_proto(proto)
    LogSumExpLossPass()(model)
    return ir.to_proto(model)


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.domain in _ONNX and node.op_type == op_type


def _applies(node: ir.Node) -> bool:
    if not _is(node, "LogSoftmax") or node.attributes.get_int("axis", -1) not in (1, -1):
        return False
    x, logp = node.inputs[0], node.outputs[0]
    if x is None or x.shape is None or len(x.shape) != 2 or x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        return False
    if logp.is_graph_output():
        return False
    uses = [use.node for use in logp.uses()]
    return any(_is(u, "Exp") for u in uses) and all(
        _is(u, "Exp") or (_is(u, "NegativeLogLikelihoodLoss") and _plain_nll(u, logp)) for u in uses)


def _plain_nll(node: ir.Node, logp: ir.Value) -> bool:
    """A loss reading ``logp`` as its scores only, with a 1-D target and no class weights."""
    target = node.inputs[1] if len(node.inputs) > 1 else None
    return (node.inputs[0] is logp and (len(node.inputs) < 3 or node.inputs[2] is None) and target is not None
            and target is not logp and target.shape is not None and len(target.shape) == 1)


class _Nodes:
    """New nodes in order; ``op`` returns the output, typed as ``like`` with ``shape`` where given."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes = prefix, []

    def op(self, op_type: str, *inputs, like: ir.Value | None = None, shape=None, **attrs) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs, name=f"{self.prefix}/{op_type}_{len(self.nodes)}")
        self.nodes.append(node)
        out = node.outputs[0]
        if like is not None:
            out.type = ir.TensorType(like.dtype)
            out.shape = None if shape is None else ir.Shape(shape)
        return out

    def const(self, array: np.ndarray) -> ir.Value:
        return self.op("Constant", value=ir.tensor(array))


def _rewrite(graph: ir.Graph, softmax: ir.Node) -> None:
    x, logp = softmax.inputs[0], softmax.outputs[0]
    row = [x.shape[0], 1]
    prefix = softmax.name or "log_softmax"
    b = _Nodes(prefix)
    axis = b.const(np.array([1], dtype=np.int64))
    peak = b.op("ReduceMax", x, axis, keepdims=1, like=x, shape=row)
    exp = b.op("Exp", b.op("Sub", x, peak, like=x, shape=x.shape), like=x, shape=x.shape)
    total = b.op("ReduceSum", exp, axis, keepdims=1, like=x, shape=row)
    lse = b.op("Add", peak, b.op("Log", total, like=x, shape=row), like=x, shape=row)
    flipped = b.op("Mul", lse, b.const(np.array(-1, dtype=x.dtype.numpy())), like=x, shape=row)
    negative = b.op("ReduceMax", flipped, axis, keepdims=1, like=x, shape=row)  # -lse, a node of its own (above)
    # 1 / s = exp(m - lse), a node of its own (above): the gradient's probabilities are e / s
    inverse = b.op("ReduceMax", b.op("Exp", b.op("Add", negative, peak, like=x, shape=row), like=x, shape=row),
                   axis, keepdims=1, like=x, shape=row)
    graph.insert_after(softmax, b.nodes)
    for k, node in enumerate([use.node for use in logp.uses()]):
        nodes = _Nodes(f"{prefix}/use_{k}")
        if _is(node, "Exp"):
            out = _probabilities(nodes, x, exp, inverse, negative)
        else:
            out = _nll(nodes, node, x, negative)
        old = node.outputs[0]
        ir.convenience.replace_nodes_and_values(graph, node, [node], nodes.nodes, [old], [out])
    graph.remove(softmax, safe=True)
    logger.info("log-sum-exp loss: %r's log-softmax over %s is not made", softmax.name, list(x.shape))


def _probabilities(b: _Nodes, x: ir.Value, exp: ir.Value, inverse: ir.Value, negative: ir.Value) -> ir.Value:
    """The softmax of ``x`` that the gradient reads: the forward's ``exp`` (``Exp(x - m)``) times ``inverse``
    (``1 / s``). ``negative`` (``-lse``) is not read here (benchmarks/bf16_fused_passes.py puts the former
    ``Exp(x + negative)`` in this place to compare)."""
    return b.op("Mul", exp, inverse, like=x, shape=x.shape)


def _nll(b: _Nodes, node: ir.Node, x: ir.Value, negative: ir.Value) -> ir.Value:
    """``node`` (NegativeLogLikelihoodLoss over the log-softmax of ``x``) on ``[N, 1]`` scores: ``x[n, t[n]]``
    plus ``negative`` (``-lse``), the target 0 where it counts and ``ignore_index`` where it is ignored."""
    target = node.inputs[1]
    kind = target.dtype.numpy()
    index = target if target.dtype == ir.DataType.INT64 else b.op("Cast", target, to=ir.DataType.INT64)
    zero = b.const(np.zeros((), dtype=kind))
    ignore = node.attributes.get_int("ignore_index")
    if ignore is not None:  # ignored rows gather class 0, and the op leaves them out as before
        ignored = b.op("Equal", target, b.const(np.array(ignore, dtype=kind)))
        index = b.op("Where", ignored, b.const(np.zeros((), dtype=np.int64)), index)
        new_target = b.op("Where", ignored, b.const(np.array(ignore, dtype=kind)), zero)
    else:
        new_target = b.op("Mul", target, zero)
    column = b.op("Unsqueeze", index, b.const(np.array([1], dtype=np.int64)))
    picked = b.op("GatherElements", x, column, axis=1, like=x, shape=[x.shape[0], 1])
    scores = b.op("Add", picked, negative, like=x, shape=[x.shape[0], 1])
    attrs = {k: node.attributes[k].value for k in ("reduction", "ignore_index") if k in node.attributes}
    return b.op("NegativeLogLikelihoodLoss", scores, new_target, **attrs)
