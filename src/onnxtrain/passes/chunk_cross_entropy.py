"""A language model's last linear layer and its cross-entropy, in row blocks: the logits are never whole.

A language model's loss is ``cross_entropy(h @ Wt, target)`` over a large vocabulary: GPT-2-small's
logits at 4x its benchmark batch are 2048 x 50257 floats (412 MB), and so are their log-softmax (stashed
for backward) and their gradient. No recompute plan can drop them. This pass, run **before autodiff**,
replaces the loss with:

- one ``Loop`` over blocks of ``block_rows`` rows of ``h`` (the last block shorter), which per block
  makes the block's logits ``z = h_k @ Wt``, their softmax and the target's log-probability (the loss),
  and multiplies the softmax part of the block's gradient ``(softmax(z) - onehot(target)) * coef``
  (``coef``: 1 / the mean's divisor on rows not ignored, 0 on ignored rows) at once into the gradients of
  ``h_k`` and ``Wt`` (carried values); the one-hot part is added from ``[rows, hidden]`` values outside
  the blocks. Two vocabulary-sized values a block (``z`` and its softmax), each a fresh buffer every
  block where onnxruntime runs without its arena. The carried weight gradient starts as a ``[1, 1]`` zero
  that the first block's ``Gemm`` broadcasts (at least one block runs, even with no rows): zeros of the
  weight's shape were folded by onnxruntime into an initializer its session held for good (GPT-2-small:
  51.8 MB), and made at run time they stayed alive as the ``Loop``'s input until it ended. The loop's inputs
  go through ``StopGradient``: autodiff does not see it;
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

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT
from onnxtrain.passes.recompute import Saved
from onnxtrain.passes.rewrite import rewrite_each

logger = logging.getLogger("onnxtrain.passes")

# Rows per block: as many as make BLOCK_BYTES of logits (GPT-2-small's 50257-word vocabulary: 166 rows).
BLOCK_BYTES = 32 * 2**20
_ONNX = ("", "ai.onnx")


class ChunkCrossEntropyPass(ir.passes.InPlacePass):
    """Before autodiff: each matching loss (see the module docstring) is computed in row blocks.
    ``block_bytes``: the size of one block's logits (default ``BLOCK_BYTES``). After the call,
    ``self.chunked`` has one entry per loss rewritten: its name, block rows, vocabulary size, and whether
    the full logits are still made (for an output or another reader); ``self.saved`` one
    :class:`~onnxtrain.passes.recompute.Saved` per loss: the log-softmax that backward no longer stashes,
    and the two gradients it stashes instead (a line of the recompute plan's table)."""

    def __init__(self, block_bytes: int | None = None):
        super().__init__()
        self.block_bytes = block_bytes
        self.chunked: list[tuple[str, int, int, bool]] = []
        self.saved: list[Saved] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.chunked, self.saved = [], []
        if _opset(graph) < 18:
            return ir.passes.PassResult(model, modified=False)
        done = rewrite_each(graph, _match,
                            lambda graph, node, match: _rewrite(graph, node, *match, self.block_bytes or BLOCK_BYTES))
        self.chunked, self.saved = [chunked for chunked, _ in done], [saved for _, saved in done]
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
        if not _is(softmax, "LogSoftmax") or len(logp.uses()) != 1 or softmax.attributes.get_int("axis", -1) not in (1, -1):
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
    reduction = node.attributes.get_string("reduction", "mean")
    ignore_index = node.attributes.get_int("ignore_index")
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
        if _is(w.producer(), "Transpose") and list(w.producer().attributes.get_ints("perm", [1, 0])) == [1, 0]:
            w, transposed = w.producer().inputs[0], True  # h @ W^T: the weight as it is stored
    elif _is(matmul, "Gemm") and len(matmul.inputs) == 2 and matmul.attributes.get_int("transA", 0) == 0 \
            and matmul.attributes.get_float("alpha", 1.0) == 1.0:
        (h, w), transposed = matmul.inputs, bool(matmul.attributes.get_int("transB", 0))
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


class _Nodes:
    """New nodes appended in order; ``op`` returns the (first) output."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes = prefix, []

    def op(self, op_type: str, *inputs, outputs: int = 1, domain: str = "", **attrs):
        name = f"{self.prefix}/{op_type}_{len(self.nodes)}"
        node = ir.node(op_type, list(inputs), attributes=attrs, domain=domain, num_outputs=outputs, name=name)
        for k, value in enumerate(node.outputs):  # named: the loop body's values must not take outer names
            value.name = f"{name}_{k}"
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


def _rewrite(graph: ir.Graph, loss_node: ir.Node, matmul: ir.Node, h, w, transposed: bool, target, reduction: str,
             ignore_index, block_bytes: int) -> tuple[tuple[str, int, int, bool], Saved]:
    vocab, hidden = w.shape if transposed else w.shape[::-1]
    rows = max(1, int(block_bytes // (vocab * h.dtype.itemsize)))
    dtype = h.dtype.numpy()
    chain = {loss_node}  # the nodes from the logits to the loss, which the blocks replace
    scores = loss_node.inputs[0]
    if loss_node.op_type == "NegativeLogLikelihoodLoss":
        chain.add(scores.producer())
        scores = scores.producer().inputs[0]
    logits = matmul.outputs[0]
    if scores is not logits:
        chain.add(scores.producer())
    # The logits are made anyway where an output or another node reads them: the blocks slice them (the one of
    # the two read outside the loss, so that its producer stays in the forward; the body's reads are unseen).
    read = [v for v in (logits, scores) if v.is_graph_output() or any(u.node not in chain for u in v.uses())]
    needed = bool(read)
    b = _Nodes(f"{loss_node.name or 'loss'}/chunked")
    h2 = _typed(b.op("Reshape", h, b.ints([-1, hidden])), h.dtype, [target.shape[0], hidden])
    n = b.op("Shape", target, start=0, end=1)  # [1]: the rows
    step = b.op("Max", b.op("Min", n, b.ints([rows])), b.ints([1]))  # rows a block: no more than there are
    # ceil(n / step), at least 1: the carried weight gradient starts as a [1, 1] zero that the first block's
    # Gemm broadcasts, so a block must run (with no rows, its Gemm sums nothing: zeros of the weight's shape)
    blocks = b.op("Max", b.op("Div", b.op("Sub", b.op("Add", n, step), b.ints([1])), step), b.ints([1]))
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
    add_one_hot, grad_h0 = _one_hot_terms(b, h2, w, transposed, safe, coef)
    body = _body(b.nodes[-1].name, h2, w, transposed, read[0] if read else None)
    loss_sum, softmax_grad_w, grad_h, *_ = b.op(
        "Loop", b.op("Squeeze", blocks, b.ints([0])), None, b.const(np.array(0, dtype)),
        b.const(np.zeros((1, 1), dtype)), grad_h0,
        step, safe, weight, coef, body=ir.AttrGraph("body", body), outputs=7)
    grad_w = add_one_hot(softmax_grad_w)
    _typed(grad_h, h.dtype, h2.shape)
    _typed(grad_w, h.dtype, w.shape)
    value = _typed(b.op("Div", loss_sum, divisor), h.dtype, [])
    stopped = [(x, b.stop(g)) for x, g in ((h2, grad_h), (w, grad_w))]
    terms = [_typed(b.op("Mul", x, g), h.dtype, x.shape) for x, g in stopped]
    surrogate = _typed(b.op("Add", *[_typed(b.op("ReduceSum", x, keepdims=0), h.dtype, []) for x in terms]),
                       h.dtype, [])
    loss = _typed(b.op("Add", value, _typed(b.op("Sub", surrogate, b.stop(surrogate)), h.dtype, [])), h.dtype, [])
    old, first = loss_node.outputs[0], loss_node.inputs[0]
    loss.type, loss.shape = old.type, old.shape
    ir.convenience.replace_nodes_and_values(graph, loss_node, [loss_node], b.nodes, [old], [loss])
    _remove_unused_producers(graph, first)
    if ONNXTRAIN_DOMAIN not in graph.opset_imports:
        graph.opset_imports[ONNXTRAIN_DOMAIN] = 1
    name = old.name or loss_node.name or "loss"
    # Without the blocks, backward would stash the [rows, vocab] log-softmax; it stashes the gradients instead.
    log_softmax = _typed(ir.Value(name=f"{name}/log_softmax"), h.dtype, [target.shape[0], vocab])
    saved = Saved(f"chunked cross-entropy {name!r}", (log_softmax,), tuple(g for _, g in stopped))
    return (name, rows, vocab, needed), saved


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


def _one_hot_terms(b: _Nodes, h2, w, transposed: bool, target, coef) -> tuple[ir.Value, ir.Value]:
    """The gradients' one-hot part, ``-coef * onehot(target)`` multiplied into the weight's and ``h2``'s
    gradients, from ``[rows, hidden]`` values (no vocabulary-sized block is made for it): ``h2``'s start,
    ``-coef *`` the target's row (column when not ``transposed``) of the weight, is the loop's initial
    carried value; the weight's, ``-coef * h2`` row ``i`` added at the target's row (column), a function that
    adds it to the loop's result, in place of that result where onnxruntime can (zeros of the weight's
    shape made for it would be one more weight-sized buffer, which onnxruntime's reuse plan then holds
    through the loop for the loop's output)."""
    minus_coef = b.op("Unsqueeze", b.op("Neg", coef), b.ints([1]))  # [rows, 1]
    updates = b.op("Mul", b.stop(h2), minus_coef)  # [rows, hidden]; autodiff sees the loop's inputs stopped
    if transposed:  # w: [vocab, hidden]
        rows = b.stop(_typed(b.op("Gather", w, target, axis=0), h2.dtype, h2.shape))
        index = b.op("Unsqueeze", target, b.ints([1]))

        def add_to(grad_w):
            return b.op("ScatterND", grad_w, index, updates, reduction="add")
    else:  # w: [hidden, vocab]
        rows = b.stop(_typed(b.op("Transpose", b.op("Gather", w, target, axis=1)), h2.dtype, h2.shape))
        columns = b.op("Transpose", updates)
        index = b.op("Expand", b.op("Unsqueeze", target, b.ints([0])), b.op("Shape", columns))

        def add_to(grad_w):
            return b.op("ScatterElements", grad_w, index, columns, axis=1, reduction="add")
    return add_to, b.op("Mul", rows, minus_coef)


def _body(name: str, h2, w, transposed: bool, scores) -> ir.Graph:
    """One block of rows ``[i * step, (i + 1) * step)`` (the last one shorter): carried (loss sum, grad of
    the weight, grad of ``h2``, and unchanged: ``step``, the safe target, each row's weight and coef) -> the
    same. ``h2``, the weight (``[hidden, vocab]``, or ``[vocab, hidden]`` when ``transposed``) and ``scores``
    (the full logits, where they are made anyway; else the block's are made here) are read from the outer
    graph, so that nothing large is copied into the loop: the forward's other nodes read them too (the
    surrogate, an output), so every pass keeps their producers in the forward. Autodiff does not see the
    loop.

    Two vocabulary-sized values a block, the logits ``z`` and ``p = softmax(z)`` (each one a fresh buffer
    of the block's size: without onnxruntime's arena, pages mapped afresh, so their count is the pass's
    cost): the log-sum-exp comes from ``p``'s row maximum, ``max(z) - log(max(p))`` (``max(p)`` is at least
    1 / vocab: no underflow), the loss reads ``z[target] - lse``, and ``coef`` scales the ``[rows, hidden]``
    sides of the products, not ``p``; the one-hot part is in the carried gradients' start
    (:func:`_one_hot_terms`)."""
    dtype = h2.dtype
    i = ir.Value(name="i", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(name="cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    loss_in = _typed(ir.Value(name="loss_in"), dtype, [])
    grad_w_in = _typed(ir.Value(name="grad_w_in"), dtype, [None, None])  # [1, 1] in the first block
    grad_h_in = _typed(ir.Value(name="grad_h_in"), dtype, h2.shape)
    step = _typed(ir.Value(name="step"), ir.DataType.INT64, [1])
    target = _typed(ir.Value(name="target"), ir.DataType.INT64, [h2.shape[0]])
    weight, coef = (_typed(ir.Value(name=k), dtype, [h2.shape[0]]) for k in ("weight", "coef"))
    b = _Nodes(f"{name}/block")
    start = b.op("Mul", b.op("Unsqueeze", i, b.ints([0])), step)
    end = b.op("Add", start, step)
    axis0, axis1 = b.ints([0]), b.ints([1])

    def rows(x):
        return b.op("Slice", x, start, end, axis0)

    hk, tk, wk, ck = rows(h2), rows(target), rows(weight), rows(coef)
    if scores is not None:
        vocab = w.shape[0] if transposed else w.shape[1]
        z = rows(scores if len(scores.shape) == 2 else b.op("Reshape", scores, b.ints([-1, vocab])))
    else:
        z = b.op("Gemm", hk, w, transB=int(transposed))  # [rows, vocab]
    p = b.op("Softmax", z, axis=1)
    lse = b.op("Sub", b.op("ReduceMax", z, axis1), b.op("Log", b.op("ReduceMax", p, axis1)))  # [rows, 1]
    tk1 = b.op("Unsqueeze", tk, axis1)
    picked = b.op("Squeeze", b.op("Sub", b.op("GatherElements", z, tk1, axis=1), lse), axis1)  # log p(target)
    loss_out = b.op("Sub", loss_in, b.op("ReduceSum", b.op("Mul", picked, wk), keepdims=0))
    ck1 = b.op("Unsqueeze", ck, axis1)
    grad_hk = b.op("Mul", b.op("Gemm", p, w, transB=int(not transposed)), ck1)  # [rows, hidden]
    hck = b.op("Mul", hk, ck1)
    grad_w_out = (b.op("Gemm", p, hck, grad_w_in, transA=1) if transposed
                  else b.op("Gemm", hck, p, grad_w_in, transA=1))
    first = b.op("Squeeze", start, axis0)
    index = b.op("Unsqueeze", b.op("Range", first, b.op("Add", first, b.op("Squeeze", b.op("Shape", hk, start=0, end=1),
                                                                          axis0)), b.const(np.array(1, np.int64))),
                 axis1)
    grad_h_out = b.op("ScatterND", grad_h_in, index, grad_hk, reduction="add")
    cond_out = b.op("Identity", cond)
    for v in (loss_out, grad_w_out, grad_h_out):
        _typed(v, dtype, None)
    same = [b.op("Identity", v) for v in (step, target, weight, coef)]
    return ir.Graph([i, cond, loss_in, grad_w_in, grad_h_in, step, target, weight, coef],
                    [cond_out, loss_out, grad_w_out, grad_h_out, *same], nodes=b.nodes, name="chunked_cross_entropy_block")


def chunk_cross_entropy(proto: onnx.ModelProto, block_bytes: int | None = None) -> onnx.ModelProto:
    """The pass on a ModelProto (for tests and tools)."""
    model = ir.from_proto(proto)
    ChunkCrossEntropyPass(block_bytes)(model)
    return ir.to_proto(model)
