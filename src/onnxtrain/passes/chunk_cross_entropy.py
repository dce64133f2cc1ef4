"""A language model's last linear layer and its cross-entropy, in row blocks: the logits are never whole.

A language model's loss is ``cross_entropy(h @ Wt, target)`` over a large vocabulary: GPT-2-small's
logits at 4x its benchmark batch are 2048 x 50257 floats (412 MB), and so are their log-softmax (stashed
for backward) and their gradient. No recompute plan can drop them. This pass, run **before autodiff**,
replaces the loss with:

- one ``Loop`` over blocks of ``block_rows`` rows of ``h`` (padded to a whole number of blocks with
  ignored rows), which per block makes the block's logits ``z = h_k @ Wt``, its log-sum-exp and the
  target's logit (the loss), and the block's gradient ``(softmax(z) - onehot(target)) * coef`` (``coef``:
  1 / the mean's divisor on rows not ignored, 0 on ignored and padding rows), multiplied at once into the
  gradient of ``h_k`` (a scan output) and added into the gradient of ``Wt`` (a carried value). The loop's
  inputs go through ``StopGradient``: autodiff does not see it;
- a surrogate that gives the loss those gradients:
  ``loss = L + (S - StopGradient(S))`` with ``S = sum(h * G_h) + sum(Wt * G_Wt)`` and ``G_h``, ``G_Wt``
  (the loop's gradients) behind ``StopGradient``. ``S - S`` is exactly 0, so the value is ``L``; the
  gradient of the loss w.r.t. ``h`` is the incoming gradient times ``G_h`` (the ``Mul`` rule), the same for
  ``Wt``. As the loss is a scalar, scaling by the incoming gradient after the blocks is the same math as
  in each block.

So the forward holds one block's logits at a time and stashes ``G_h`` and ``G_Wt`` (the size of ``h`` and
of the weight: 2 MB + 51 MB for GPT-2-small at 4x, against 412 MB of log-softmax), backward holds no
vocabulary-sized value, and no matrix product is done twice (the forward does the three a block needs).

It applies to ``NegativeLogLikelihoodLoss(LogSoftmax(scores, axis=1))`` or ``SoftmaxCrossEntropyLoss
(scores)`` (its log-probability output unused) with reduction ``mean`` or ``sum``, no class weights,
2-D ``scores`` that are a ``MatMul(h, Wt)`` or ``Gemm(h, W, transB=1)`` without bias (the weight 2-D, its
dims static; ``Wt = Transpose(W)`` is read as ``W``), or a ``Reshape`` of one, at ai.onnx opset 18 or later. ``ignore_index`` and the mean's divisor are PyTorch's: the mean divides
by the count of targets not ignored (all ignored: NaN, with zero gradients, as PyTorch gives). If the
logits are also a graph output or read elsewhere (Hugging Face's ``GPT2LMHeadModel`` returns them), the
``MatMul`` stays for them, and the loss does not read it: the full logits are then made once, for the
output, and nothing else of vocabulary size is made or stashed.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as oh

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT

logger = logging.getLogger("onnxtrain.passes")

# Rows per block: as many as make BLOCK_BYTES of logits (GPT-2-small's 50257-word vocabulary: 166 rows).
BLOCK_BYTES = 32 * 2**20
_ONNX = ("", "ai.onnx")


class ChunkCrossEntropyPass(ir.passes.InPlacePass):
    """Before autodiff: each matching loss (see the module docstring) is computed in row blocks.
    ``block_bytes``: the size of one block's logits (default ``BLOCK_BYTES``). After the call,
    ``self.chunked`` has one entry per loss rewritten: its name, block rows, vocabulary size, and whether
    the full logits are still made (for an output or another reader)."""

    def __init__(self, block_bytes: int | None = None):
        super().__init__()
        self.block_bytes = block_bytes
        self.chunked: list[tuple[str, int, int, bool]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.chunked = []
        if _opset(graph) < 18:
            return ir.passes.PassResult(model, modified=False)
        for node in list(graph):
            match = _match(node)
            if match is not None:
                self.chunked.append(_rewrite(graph, node, *match, self.block_bytes or BLOCK_BYTES))
        for name, rows, vocab, kept in self.chunked:
            logger.info("chunked cross-entropy: loss %r and its gradient computed from its linear layer in blocks "
                        "of %d rows x %d classes; %s", name, rows, vocab,
                        "the full logits are still made, for an output that returns them" if kept else
                        "the full logits are never made")
        return ir.passes.PassResult(model, modified=bool(self.chunked))


def chunks_for(plan) -> bool:
    """Whether a recompute plan (:class:`onnxtrain.passes.recompute.Recompute`, or None) asks for this pass:
    a budget below the whole stash (a fraction under 1.0, or a number of bytes)."""
    budget = None if plan is None else plan.budget
    return budget is not None and (budget < 1 or (isinstance(budget, int) and budget > 1))


def _opset(graph: ir.Graph) -> int:
    return graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0))


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.domain in _ONNX and node.op_type == op_type


def _match(node: ir.Node):
    """(the logits' MatMul, h, Wt, target, reduction, ignore_index) when ``node`` is a loss this pass takes."""
    if _is(node, "NegativeLogLikelihoodLoss"):
        logp = node.inputs[0]
        softmax = logp.producer() if logp is not None else None
        if not _is(softmax, "LogSoftmax") or len(logp.uses()) != 1 or _axis(softmax, -1) not in (1, -1):
            return None
        scores = softmax.inputs[0]
    elif _is(node, "SoftmaxCrossEntropyLoss"):
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            return None
        scores = node.inputs[0]
    else:
        return None
    if len(node.inputs) > 2 and node.inputs[2] is not None:  # class weights
        return None
    reduction = node.attributes["reduction"].value if "reduction" in node.attributes else "mean"
    ignore_index = node.attributes["ignore_index"].value if "ignore_index" in node.attributes else None
    target = node.inputs[1]
    if reduction not in ("mean", "sum") or scores is None or scores.shape is None or len(scores.shape) != 2:
        return None
    if target is None or target.shape is None or len(target.shape) != 1:
        return None
    logits = scores
    if _is(scores.producer(), "Reshape"):
        logits = scores.producer().inputs[0]
    matmul = logits.producer()
    if _is(matmul, "MatMul"):
        h, w = matmul.inputs
        transposed = False
        if _is(w.producer(), "Transpose") and list(_attr(w.producer(), "perm", [1, 0])) == [1, 0]:
            w, transposed = w.producer().inputs[0], True  # h @ W^T: the weight as it is stored
    elif _is(matmul, "Gemm") and len(matmul.inputs) == 2 and _attr(matmul, "transA", 0) == 0 \
            and _attr(matmul, "alpha", 1.0) == 1.0:
        (h, w), transposed = matmul.inputs, bool(_attr(matmul, "transB", 0))
    else:
        return None
    if w is None or w.shape is None or len(w.shape) != 2 or not all(isinstance(d, int) for d in w.shape):
        return None
    hidden = w.shape[1] if transposed else w.shape[0]
    if h is None or h.shape is None or len(h.shape) < 2 or h.shape[-1] != hidden or h.dtype != w.dtype:
        return None
    if h.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        return None
    return matmul, h, w, transposed, target, reduction, ignore_index


def _attr(node: ir.Node, name: str, default):
    return node.attributes[name].value if name in node.attributes else default


def _axis(node: ir.Node, default: int) -> int:
    return _attr(node, "axis", default)


class _Nodes:
    """New nodes appended in order; ``op`` returns the (first) output."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes = prefix, []

    def op(self, op_type: str, *inputs, outputs: int = 1, domain: str = "", **attrs):
        node = ir.node(op_type, list(inputs), attributes=attrs, domain=domain, num_outputs=outputs,
                       name=f"{self.prefix}/{op_type}_{len(self.nodes)}")
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else list(node.outputs)

    def const(self, array: np.ndarray):
        return self.op("Constant", value=ir.tensor(array))

    def ints(self, values: list[int]):
        return self.const(np.array(values, dtype=np.int64))

    def stop(self, value: ir.Value) -> ir.Value:
        return _typed(self.op(STOP_GRADIENT, value, domain=ONNXTRAIN_DOMAIN), value.dtype, value.shape)


def _typed(value: ir.Value, dtype: ir.DataType, shape) -> ir.Value:
    """``value`` with its type and shape set (autodiff un-broadcasts by rank)."""
    value.type = ir.TensorType(dtype)
    value.shape = None if shape is None else ir.Shape(shape)
    return value


def _rewrite(graph: ir.Graph, loss_node: ir.Node, matmul: ir.Node, h, wt, transposed: bool, target, reduction: str, ignore_index,
             block_bytes: int) -> tuple[str, int, int, bool]:
    vocab, hidden = wt.shape if transposed else wt.shape[::-1]
    itemsize = h.dtype.itemsize
    rows = max(1, int(block_bytes // (vocab * itemsize)))
    dtype = h.dtype.numpy()
    b = _Nodes(f"{loss_node.name or 'loss'}/chunked")
    h2 = _typed(b.op("Reshape", h, b.ints([-1, hidden])), h.dtype, [target.shape[0], hidden])
    n = b.op("Shape", target, start=0, end=1)  # [1]: the rows
    step = b.op("Max", b.op("Min", n, b.ints([rows])), b.ints([1]))  # rows a block: no more than there are
    blocks = b.op("Div", b.op("Sub", b.op("Add", n, step), b.ints([1])), step)  # ceil(n / step)
    pad = b.op("Sub", b.op("Mul", blocks, step), n)
    target64 = target if target.dtype == ir.DataType.INT64 else b.op("Cast", target, to=ir.DataType.INT64)
    if ignore_index is not None:
        kept = b.op("Not", b.op("Equal", target64, b.ints([ignore_index])))
        safe = b.op("Where", kept, target64, b.ints([0]))
    else:
        kept = b.op("Equal", target64, target64)
        safe = target64
    weight = b.op("Cast", kept, to=h.dtype)  # 1 on rows whose target counts, else 0
    count = b.op("ReduceSum", weight, keepdims=0)
    if reduction == "mean":  # PyTorch: sum / count (NaN when all ignored); its gradient then 0
        divisor = count
        grad_divisor = b.op("Where", b.op("Equal", count, b.const(np.array(0, dtype))), b.const(np.array(1, dtype)),
                            count)
    else:
        divisor = grad_divisor = b.const(np.array(1, dtype))
    coef = b.op("Div", weight, grad_divisor)
    pads = b.op("Concat", b.ints([0]), pad, axis=0)
    zero_rows = b.op("Concat", b.ints([0, 0]), pad, b.ints([0]), axis=0)
    carried = [
        step,
        b.op("Pad", b.stop(h2), zero_rows),
        b.stop(wt),
        b.op("Pad", safe, pads),
        b.op("Pad", weight, pads),
        b.op("Pad", coef, pads),
    ]
    zero = b.const(np.array(0, dtype))
    grad_wt0 = b.op("ConstantOfShape", b.ints(list(wt.shape)), value=ir.tensor(np.zeros(1, dtype)))
    loop_outs = b.op("Loop", b.op("Squeeze", blocks, b.ints([0])), None, zero, grad_wt0, *carried,
                     body=ir.AttrGraph("body", _body(list(wt.shape), transposed, h.dtype)), outputs=2 + len(carried) + 1)
    loss_sum, grad_wt, grad_rows = loop_outs[0], loop_outs[1], loop_outs[-1]
    grad_h = b.op("Slice", b.op("Reshape", grad_rows, b.ints([-1, hidden])), b.ints([0]), n, b.ints([0]))
    _typed(grad_h, h.dtype, h2.shape)
    _typed(grad_wt, h.dtype, wt.shape)
    value = _typed(b.op("Div", loss_sum, divisor), h.dtype, [])
    terms = [_typed(b.op("Mul", x, b.stop(g)), h.dtype, x.shape) for x, g in ((h2, grad_h), (wt, grad_wt))]
    surrogate = _typed(b.op("Add", *[_typed(b.op("ReduceSum", x, keepdims=0), h.dtype, []) for x in terms]),
                       h.dtype, [])
    loss = _typed(b.op("Add", value, _typed(b.op("Sub", surrogate, b.stop(surrogate)), h.dtype, [])), h.dtype, [])
    old, first = loss_node.outputs[0], loss_node.inputs[0]
    loss.type, loss.shape = old.type, old.shape
    ir.convenience.replace_nodes_and_values(graph, loss_node, [loss_node], b.nodes, [old], [loss])
    _remove_unused_producers(graph, first)
    kept = matmul.graph is graph
    if ONNXTRAIN_DOMAIN not in graph.opset_imports:
        graph.opset_imports[ONNXTRAIN_DOMAIN] = 1
    return old.name or loss_node.name or "loss", rows, vocab, kept


def _remove_unused_producers(graph: ir.Graph, value: ir.Value) -> None:
    """Drop the loss's LogSoftmax, the scores' Reshape, the MatMul (or Gemm) and the weight's Transpose where
    nothing reads them any more (the logits not an output)."""
    stack = [value]
    while stack:
        node = stack.pop().producer()
        if node is None or node.graph is not graph or not any(_is(node, op) for op in ("Reshape", "MatMul", "Gemm", "Transpose", "LogSoftmax")):
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        stack.extend(inputs)


def _body(w_shape: list[int], transposed: bool, dtype: ir.DataType) -> ir.Graph:
    """One block: carried (loss sum, grad of the weight, rows a block, h, the weight (``[hidden, vocab]``,
    or ``[vocab, hidden]`` when ``transposed``), safe target, weight of each row, coef) -> the same, plus
    the block's rows of grad h as a scan output."""
    hidden = w_shape[1] if transposed else w_shape[0]
    t = int(dtype)
    i64 = TensorProto.INT64

    def c(name, values):
        return oh.make_node("Constant", [], [name], value=oh.make_tensor(name, i64, [len(values)], values))

    nodes = [
        c("axis0", [0]), c("axis1", [1]),
        oh.make_node("Unsqueeze", ["i", "axis0"], ["i1"]),
        oh.make_node("Mul", ["i1", "rows"], ["start"]),
        oh.make_node("Add", ["start", "rows"], ["end"]),
        oh.make_node("Slice", ["h", "start", "end", "axis0"], ["hk"]),
        oh.make_node("Slice", ["target", "start", "end", "axis0"], ["tk"]),
        oh.make_node("Slice", ["weight", "start", "end", "axis0"], ["wk"]),
        oh.make_node("Slice", ["coef", "start", "end", "axis0"], ["ck"]),
        oh.make_node("Gemm", ["hk", "wt"], ["z"], transB=int(transposed)),  # [rows, vocab]: the block's logits
        oh.make_node("ReduceLogSumExp", ["z", "axis1"], ["lse"], keepdims=1),
        oh.make_node("Unsqueeze", ["tk", "axis1"], ["tk1"]),
        oh.make_node("GatherElements", ["z", "tk1"], ["picked"], axis=1),
        oh.make_node("Sub", ["lse", "picked"], ["nll1"]),
        oh.make_node("Squeeze", ["nll1", "axis1"], ["nll"]),
        oh.make_node("Mul", ["nll", "wk"], ["nllw"]),
        oh.make_node("ReduceSum", ["nllw"], ["block_loss"], keepdims=0),
        oh.make_node("Add", ["loss_in", "block_loss"], ["loss_out"]),
        oh.make_node("Sub", ["z", "lse"], ["shifted"]),
        oh.make_node("Exp", ["shifted"], ["p"]),
        oh.make_node("Unsqueeze", ["ck", "axis1"], ["ck1"]),
        oh.make_node("Mul", ["p", "ck1"], ["pc"]),
        oh.make_node("Neg", ["ck1"], ["minus"]),
        oh.make_node("ScatterElements", ["pc", "tk1", "minus"], ["dz"], axis=1, reduction="add"),
        oh.make_node("Gemm", ["dz", "wt"], ["grad_hk"], transB=int(not transposed)),
        *([oh.make_node("Gemm", ["dz", "hk", "grad_wt_in"], ["grad_wt_out"], transA=1)] if transposed else
          [oh.make_node("Gemm", ["hk", "dz", "grad_wt_in"], ["grad_wt_out"], transA=1)]),
        oh.make_node("Identity", ["cond"], ["cond_out"]),
        *[oh.make_node("Identity", [name], [f"{name}_out"]) for name in ("rows", "h", "wt", "target", "weight", "coef")],
    ]
    inputs = [
        oh.make_tensor_value_info("i", i64, []),
        oh.make_tensor_value_info("cond", TensorProto.BOOL, []),
        oh.make_tensor_value_info("loss_in", t, []),
        oh.make_tensor_value_info("grad_wt_in", t, w_shape),
        oh.make_tensor_value_info("rows", i64, [1]),
        oh.make_tensor_value_info("h", t, ["padded", hidden]),
        oh.make_tensor_value_info("wt", t, w_shape),
        oh.make_tensor_value_info("target", i64, ["padded"]),
        oh.make_tensor_value_info("weight", t, ["padded"]),
        oh.make_tensor_value_info("coef", t, ["padded"]),
    ]
    outputs = [
        oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        oh.make_tensor_value_info("loss_out", t, []),
        oh.make_tensor_value_info("grad_wt_out", t, w_shape),
        oh.make_tensor_value_info("rows_out", i64, [1]),
        oh.make_tensor_value_info("h_out", t, ["padded", hidden]),
        oh.make_tensor_value_info("wt_out", t, w_shape),
        oh.make_tensor_value_info("target_out", i64, ["padded"]),
        oh.make_tensor_value_info("weight_out", t, ["padded"]),
        oh.make_tensor_value_info("coef_out", t, ["padded"]),
        oh.make_tensor_value_info("grad_hk", t, ["rows", hidden]),
    ]
    proto = oh.make_graph(nodes, "chunked_cross_entropy_block", inputs, outputs)
    return ir.serde.deserialize_graph(proto)


def chunk_cross_entropy(proto: onnx.ModelProto, block_bytes: int | None = None) -> onnx.ModelProto:
    """The pass on a ModelProto (for tests and tools)."""
    model = ir.from_proto(proto)
    ChunkCrossEntropyPass(block_bytes)(model)
    return ir.to_proto(model)
