"""Keep a one-session training graph's backward work in its planned place, on any ONNX runtime.

The on-device training graph (forward, then the gradient nodes) runs as one onnxruntime session, and a
session picks its own execution order: any node whose inputs exist may run. Backward work that reads only
forward values (a recomputed clone, the part of GELU's gradient that does not depend on the incoming
gradient, a weight's transpose) can then run long before the gradient node that needs it, even during the
forward, and its output stays alive from there: measured on BERT-small at 4x batch, onnxruntime's default
order ran the GELU gradient's factors and recomputed products of all four layers before the first layer's
backward (a modelled 360 MiB peak at budget 0 against the plan's 118), and its priority-based order ran
recomputed clones up to 522 nodes before their readers (the graph optimizer gives the nodes it fuses new
indices, last in that order). ONNX has no control edges, so this pass adds a data dependency instead:

- a backward node is *seeded* when it reads the gradient's seed (the loss's incoming gradient) or a seeded
  value; the others are *free*;
- each free node whose inputs are all forward values, graph inputs or constants (a *root* of the free
  work; a node that reads only constants is a constant, left for constant folding) gets one of its
  non-constant inputs through a gate:
  ``Reshape(x, Concat(Shape(x), Cast(Slice(Reshape(g, [-1]), [0], [0]), INT64)))``, where ``g`` is the
  latest-made seeded input of the first seeded node its free work feeds (its *anchor*). The gate's value is
  ``x`` (the shape it is reshaped to is its own; the slice of ``g`` is empty), no byte is copied
  (onnxruntime's ``Reshape`` aliases its input), and no constant folding removes it (the slice reads
  ``g``'s values), but the root cannot run before ``g`` exists: just before the anchor could run;
- a ``Shape`` or ``Size`` that reads a forward value is not free work but metadata: it moves right after
  its input's producer, ungated (its readers become roots instead). Gated, it kept its whole input alive
  until backward for a few integers: on BERT-small at 4x batch 37 of the 98 gates held the inputs of the
  ``Reshape`` gradients' ``Shape`` (the query, key and value projections of every layer, each in up to
  three layouts), and activation memory fell 374 -> 294 MB at budget 0.5 and 334 -> 262 MB at 0 without;
- the graph is then sorted again, stably (``ir.Graph.sort``): a root moves after its anchor's input;
- where a backward node that reads free work's value ``f`` also reads a gradient ``g`` made by a product
  from smaller gradients only (each with fewer elements: GELU's incoming gradient ``dy = dout @ W^T`` is 4x
  its ``dout`` in a transformer's MLP, attention's probabilities' gradient ``dctx @ v^T`` 2x its ``dctx``),
  and that product is read by nothing else, the product waits: for ``f``, and for the backward nodes
  between it and its reader (in graph order) that read free work's values and make values smaller than
  ``g`` (attention's value gradient, ``probs^T @ dctx``, the last reader of the recomputed probabilities); it
  moves to just before its reader. Free work gated on that reader waits for the product's input instead.
  So the free work runs, and the values it made are read for the last time, before the wide gradient
  exists. On BERT-small at 4x batch the step peaked at a layer's GELU gradient, the slope's temporaries
  beside ``dy``, then at the attention's ``Where`` gradient (onnxruntime's ``Where`` kernel allocates two
  temporaries of its output's size) beside the recomputed probabilities, which the fused value-gradient
  product (a new node index, run last among the ready ones) kept alive: activation memory at budget 0
  112 -> 104 MB (docs/memory.md). Skipped where the free work itself waits for something the product makes,
  or makes the product's input.

Gradients are unchanged (a gate is an identity on values; autodiff ran before). Where an anchor is not found
(free work that reads nothing seeded down to a graph output), its roots are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.peak import SHAPE_OPS
from onnxtrain.passes.split_forward_backward import ancestors


class OrderBackwardPass(ir.passes.InPlacePass):
    """Gate the roots of the free backward work on their anchors' inputs (see the module docstring).

    ``num_forward_outputs``: the graph's first outputs are the forward's; the rest are gradients.
    ``seeds``: the values autodiff started backward from (the loss's incoming gradient). ``when``: the pass
    runs only where it answers True (the artifacts: where the recompute plan recomputes something). After
    the call, ``self.gated`` is the number of gates added, ``self.hoisted`` the ``Shape``/``Size`` nodes moved,
    ``self.products_delayed`` the products made to wait for the free work (see the module docstring)."""

    def __init__(self, num_forward_outputs: int, seeds: Sequence[ir.Value], when: Callable[[], bool] | None = None):
        super().__init__()
        self.num_forward_outputs = num_forward_outputs
        self.seeds = list(seeds)
        self.when = when
        self.gated = 0
        self.hoisted = 0
        self.products_delayed = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if self.when is not None and not self.when():
            return ir.passes.PassResult(model, modified=False)
        fwd_outputs = list(graph.outputs[: self.num_forward_outputs])
        forward = ancestors(fwd_outputs)
        nodes = list(graph)
        if not self.seeds or not forward or len(forward) == len(nodes):
            return ir.passes.PassResult(model, modified=False)
        position = {node: k for k, node in enumerate(nodes)}
        constants = set(graph.initializers.values())
        seeded: set[ir.Value] = set(self.seeds)
        free: list[ir.Node] = []
        shapes: list[ir.Node] = []
        for node in nodes:
            if node in forward:
                continue
            if any(v in seeded for v in node.inputs if v is not None):
                seeded.update(node.outputs)
            elif all(v is None or v in constants for v in node.inputs):
                constants.update(v for v in node.outputs if v not in seeded)  # constant folding's
            elif _onnx(node) and node.op_type in SHAPE_OPS:
                shapes.append(node)  # reads only its input's shape: runs early, see _hoist
            else:
                free.append(node)
        is_free = set(free)
        anchors = _anchors(free, is_free, position)
        roots: dict[ir.Node, tuple[ir.Value, ir.Value]] = {}  # root -> (its input to gate, the value it waits for)
        for node in free:
            if any(v is not None and v.producer() in is_free for v in node.inputs):
                continue  # not a root: it runs after the free nodes it reads
            anchor = anchors.get(node)
            x = next((v for v in node.inputs if v is not None and v not in constants), None)
            if anchor is None or x is None:
                continue
            after = [v for v in anchor.inputs if v in seeded]
            if not after:
                continue
            roots[node] = (x, max(after, key=lambda v: position.get(v.producer(), -1)))
        waits = _before_widening_products(nodes, roots, anchors, is_free, seeded, set(self.seeds), position)
        gates: dict[ir.Value, ir.Value] = {}  # value waited for -> its empty INT64 tensor
        for node, (x, g) in roots.items():
            if g not in gates:
                gates[g] = _empty_from(graph, node, g)
            node.replace_input_with(list(node.inputs).index(x), _gate(graph, node, x, [gates[g]], self.gated))
            self.gated += 1
        self.hoisted = _hoist(graph, shapes)
        if not self.gated and not self.hoisted and not waits:
            return ir.passes.PassResult(model, modified=False)
        graph.sort()
        for wait in waits:  # after the sort, which would move more than the product
            product = wait.product
            graph.remove(product)
            graph.insert_before(wait.reader, product)
            empties = [_empty_from(graph, product, v) for v in wait.until]
            index = list(product.inputs).index(wait.small)
            product.replace_input_with(index, _gate(graph, product, wait.small, empties, self.gated))
            self.gated += 1
        self.products_delayed = len(waits)
        return ir.passes.PassResult(model, modified=True)


def _before_widening_products(nodes: list[ir.Node], roots: dict[ir.Node, tuple[ir.Value, ir.Value]],
                              anchors: dict[ir.Node, ir.Node], is_free: set[ir.Node], seeded: set[ir.Value],
                              seeds: set[ir.Value], position: dict[ir.Node, int]) -> list[_Wait]:
    """The products that wait (see the module docstring), per backward node ``reader`` that reads a free value
    and a gradient made by a product from smaller gradients only. Changes ``roots`` in place: the reader's own
    free work waits for the product's input instead of its output."""
    waits: list[_Wait] = []
    delayed: set[ir.Node] = set()
    planned = {root: [g] for root, (_, g) in roots.items()}  # node -> the values its gate will wait for
    for reader in nodes:
        if reader in is_free or not any(v in seeded for v in reader.inputs if v is not None):
            continue
        made = [v for v in reader.inputs if v is not None and v.producer() in is_free]
        if not made:
            continue
        g = max((v for v in reader.inputs if v in seeded), key=lambda v: position.get(v.producer(), -1))
        product = g.producer()
        if g in seeds or product is None or product in delayed or product not in position:
            continue
        if any(r is not reader for out in product.outputs for r, _ in out.uses()):
            continue  # moved to just before its reader, it must be read by nothing else
        smaller = [v for v in product.inputs if v in seeded]
        if not smaller or not all(_fewer_elements(v, g) for v in smaller):
            continue
        earlier = max(smaller, key=lambda v: position.get(v.producer(), -1))
        later = _descendants(product) | {product}
        # the backward nodes between the product and its reader that read free values (a recomputed value's
        # last reader, e.g. attention's value gradient reading the recomputed probabilities): they run first,
        # so that what they read is freed before the product makes its output
        between = [n for n in nodes[position[product] + 1:position[reader]]
                   if n not in is_free and n not in later and any(v in seeded for v in n.inputs if v is not None)
                   and any(v is not None and v.producer() in is_free for v in n.inputs)
                   and all(_fewer_elements(o, g) for o in n.outputs)]
        f = max(made, key=lambda v: position.get(v.producer(), -1))
        until = [f, *(n.outputs[0] for n in between)]
        own = [r for r, a in anchors.items() if a is reader and r in roots]
        # no cycle, with the gates planned so far: the product's input must not be made from the reader's own
        # free work, and nothing the product waits for may depend on the product
        if any(_depends(earlier.producer(), r, planned) for r in own):
            continue
        trial = {**planned, **{r: [earlier] for r in own}, product: until}
        if any(_depends(v.producer(), product, trial) for v in until):
            continue
        planned = trial
        for root in own:
            roots[root] = (roots[root][0], earlier)
        waits.append(_Wait(product, earlier, until, reader))
        delayed.add(product)
    return waits


def _depends(node: ir.Node | None, target: ir.Node, planned: dict[ir.Node, list[ir.Value]]) -> bool:
    """Whether ``node`` is made from ``target``'s outputs, counting the gates planned (``planned``: node ->
    the values it will wait for)."""
    seen: set[ir.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        if n is target:
            return True
        seen.add(n)
        stack.extend(v.producer() for v in (*n.inputs, *planned.get(n, ())) if v is not None)
    return False


@dataclass
class _Wait:
    """``product`` waits for the values ``until`` (its input ``small`` gated) and moves to just before
    ``reader``, the one node that reads it."""

    product: ir.Node
    small: ir.Value
    until: list[ir.Value]
    reader: ir.Node


def _descendants(node: ir.Node) -> set[ir.Node]:
    """The nodes that read ``node``'s outputs, directly or not."""
    found: set[ir.Node] = set()
    stack = [node]
    while stack:
        for out in stack.pop().outputs:
            for reader, _ in out.uses():
                if reader not in found:
                    found.add(reader)
                    stack.append(reader)
    return found


def _fewer_elements(small: ir.Value, large: ir.Value) -> bool:
    """Whether ``small`` surely holds fewer elements than ``large``: both shapes known, the same symbolic
    dims (``batch``...), and a smaller product of the fixed ones."""
    if small.shape is None or large.shape is None:
        return False
    fixed, names = [], []
    for shape in (small.shape, large.shape):
        count, symbols = 1, []
        for d in shape:
            if isinstance(d, int):
                count *= d
            elif d.value is None:
                return False
            else:
                symbols.append(str(d.value))
        fixed.append(count)
        names.append(sorted(symbols))
    return names[0] == names[1] and fixed[0] < fixed[1]


def _hoist(graph: ir.Graph, shapes: list[ir.Node]) -> int:
    """Move each ``Shape``/``Size`` node right after the node that makes its input (the graph's start for
    a graph input): the number moved. It reads only the shape, so its input can then be freed after its
    last forward reader instead of staying alive until backward (onnxruntime's priority-based order also
    runs these two ops as soon as their input exists)."""
    moved = 0
    for node in shapes:
        x = node.inputs[0]
        producer = x.producer() if x is not None else None
        graph.remove(node)
        if producer is not None:
            graph.insert_after(producer, node)
        else:
            graph.insert_before(next(iter(graph)), node)
        moved += 1
    return moved


def _onnx(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _anchors(free: list[ir.Node], is_free: set[ir.Node], position: dict[ir.Node, int]) -> dict[ir.Node, ir.Node]:
    """Free node -> the first seeded node (in graph order) that its free work feeds."""
    anchor: dict[ir.Node, ir.Node] = {}
    for node in reversed(free):  # readers come later in graph order
        best = None
        for out in node.outputs:
            for reader, _ in out.uses():
                where = anchor.get(reader) if reader in is_free else reader
                if where is not None and where in position and (best is None or position[where] < position[best]):
                    best = where
        if best is not None:
            anchor[node] = best
    return anchor


def _const(graph: ir.Graph, before: ir.Node, name: str, array: np.ndarray) -> ir.Value:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array)}, name=f"{name}/const")
    out = node.outputs[0]
    out.name, out.type, out.shape = f"{name}/const", ir.TensorType(ir.DataType.INT64), ir.Shape(list(array.shape))
    graph.insert_before(before, node)
    return out


def _add(graph: ir.Graph, before: ir.Node, name: str, op: str, inputs, dtype: ir.DataType, shape,
         **attributes) -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes, name=name)
    out = node.outputs[0]
    out.name, out.type, out.shape = name, ir.TensorType(dtype), ir.Shape(shape) if shape is not None else None
    graph.insert_before(before, node)
    return out


def _empty_from(graph: ir.Graph, root: ir.Node, g: ir.Value) -> ir.Value:
    """An empty INT64 tensor ``[0]`` that is made from ``g``'s values (so only once ``g`` exists)."""
    name = f"{g.name or 'value'}/order_gate"
    flat = _add(graph, root, f"{name}/flat", "Reshape", [g, _const(graph, root, f"{name}/minus_one", np.array([-1], np.int64))],
                g.dtype, [None])
    zero = _const(graph, root, f"{name}/zero", np.array([0], np.int64))
    empty = _add(graph, root, f"{name}/empty", "Slice", [flat, zero, zero, zero], g.dtype, [0])
    return _add(graph, root, name, "Cast", [empty], ir.DataType.INT64, [0], to=ir.DataType.INT64)


def _gate(graph: ir.Graph, root: ir.Node, x: ir.Value, empties: Sequence[ir.Value], k: int) -> ir.Value:
    """``x`` again, made only once each of ``empties`` is (see the module docstring); ``k`` numbers the gates."""
    name = f"{x.name or 'value'}/gate_{k}"
    rank = None if x.shape is None else len(x.shape)
    shape = _add(graph, root, f"{name}/shape", "Shape", [x], ir.DataType.INT64, [rank])
    target = _add(graph, root, f"{name}/target", "Concat", [shape, *empties], ir.DataType.INT64, [rank], axis=0)
    gated = _add(graph, root, name, "Reshape", [x, target], x.dtype, None)
    gated.shape = x.shape
    return gated
