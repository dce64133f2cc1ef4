"""Cut a graph into stages that run one after another, so that inputs can be freed between them.

onnxruntime keeps every input of a run alive until the run ends. For a backward graph that means the
whole forward stash (activations, attention weights, masks) stays in memory while backward works down
the layers, where PyTorch frees each saved tensor once its layer's gradient is done. Run as stages, a
stash value is dropped after the last stage that reads it, and onnxruntime's arena hands its memory to
the stages after it (BERT-small: the backward run's peak falls by 44 MB of its 73 MB stash with 4 stages).

The cuts follow the inputs' sizes: stage ``j`` ends where ``j/k`` of the bytes of the releasable inputs
have had their last read, so each stage frees about the same amount.

Layout ops that read only graph inputs and constants (a weight's ``Transpose`` before ``MatMul``) are
copied into every stage that uses them rather than passed between stages: a copy costs nothing, since
onnxruntime fuses it into the ``MatMul``. Other nodes that read only graph inputs (ops redone from the
stash) run in the stage of their first reader, not at the front.

The graphs are ONNX protos, named values: this is the session boundary, and stages are sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

from onnxtrain.autodiff.stop_gradient import infer_shapes
from onnxtrain.passes.liveness import Step, crossing, proto_sizes, steps_of

logger = logging.getLogger("onnxtrain.passes")

# Layout ops copied into each stage that reads them, when they read only graph inputs and constants.
COPIED_OPS = frozenset({"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "Identity",
                        "Constant", "Shape", "Size"})


class CannotStage(ValueError):
    """The graph cannot be cut (control flow, values of unknown type); run it whole."""


@dataclass
class Stage:
    model: onnx.ModelProto
    inputs: list[str]  # graph inputs and earlier stages' outputs, in this stage's input order
    outputs: list[str]  # graph outputs and values later stages read
    release: list[str]  # names read for the last time in this stage: drop them after it


@dataclass
class StagedGraph:
    stages: list[Stage]
    inputs: list[str]  # the original graph's inputs, in order
    outputs: list[str]  # the original graph's outputs, in order


def stage_graph(model: onnx.ModelProto, input_bytes: Sequence[int], num_stages: int,
                min_stage_bytes: int = 0, dims: Mapping[str, int] | None = None) -> StagedGraph:
    """Cut ``model`` into at most ``num_stages`` stages that each free about the same share of the bytes
    of ``input_bytes`` (one per graph input; 0 for inputs that stay alive anyway, like parameters).
    Fewer stages where each would free less than ``min_stage_bytes``. With ``dims`` (sizes of the graph's
    symbolic dims), each cut moves to where the fewest bytes of internal values cross it, between the
    cuts next to it (see :func:`_settle`). Raises :class:`CannotStage`."""
    graph = model.graph
    inputs = [v.name for v in graph.input]
    if len(input_bytes) != len(inputs):
        raise ValueError(f"input_bytes has {len(input_bytes)} entries for {len(inputs)} graph inputs")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        raise CannotStage("the graph has control flow (subgraphs read outer values implicitly)")
    nodes = list(graph.node)
    leaves = set(inputs) | {t.name for t in graph.initializer}
    outputs = [v.name for v in graph.output]
    copied = _copied_nodes(nodes, leaves, set(outputs))
    main = [k for k in range(len(nodes)) if k not in copied]
    producer = {o: k for k, node in enumerate(nodes) for o in node.output if o}

    # Which graph inputs each main node reads, directly or through copied layout ops.
    reads: dict[int, set[str]] = {}
    for k in main:
        reads[k] = _leaf_reads(nodes, k, producer, copied, set(inputs))
    order = _sink_leaf_fed(nodes, main, producer, leaves)
    position = {k: p for p, k in enumerate(order)}
    made = None
    if dims is not None:
        sizes = proto_sizes(model, dims, _value_types(model))
        steps = steps_of(nodes[k] for k in order)
        made = [0 if step.alias else sum(sizes.get(o, 0) for o in step.outputs) for step in steps]
    cuts = _cuts(order, reads, dict(zip(inputs, input_bytes)), num_stages, min_stage_bytes, made)
    if not cuts:
        return one_stage(model)
    if made is not None:
        cuts = _settle(cuts, steps, sizes, inputs)
    stage_of = {k: sum(position[k] > c for c in cuts) for k in order}
    return _build(model, nodes, order, stage_of, copied, producer, inputs, outputs, len(cuts) + 1)


def _copied_nodes(nodes, leaves: set[str], graph_outputs: set[str]) -> set[int]:
    """Layout ops fed only by graph inputs, constants and other such ops, whose outputs are internal."""
    copied: set[int] = set()
    made: set[str] = set()
    for k, node in enumerate(nodes):
        if (node.op_type in COPIED_OPS and node.domain in ("", "ai.onnx")
                and all(not v or v in leaves or v in made for v in node.input)
                and not any(o in graph_outputs for o in node.output)):
            copied.add(k)
            made.update(o for o in node.output if o)
    return copied


def _leaf_reads(nodes, k: int, producer: dict[str, int], copied: set[int], inputs: set[str]) -> set[str]:
    found, stack = set(), [k]
    while stack:
        for v in nodes[stack.pop()].input:
            if v in inputs:
                found.add(v)
            elif v in producer and producer[v] in copied:
                stack.append(producer[v])
    return found


def _sink_leaf_fed(nodes, main: list[int], producer: dict[str, int], leaves: set[str]) -> list[int]:
    """``main`` with each node that reads only graph inputs and constants moved to just before its first
    reader: such a node (an op redone from the stash) would otherwise run, and hold its result, from the
    first stage on."""
    main_set = set(main)
    readers: dict[int, int] = {}
    for k in main:
        for v in nodes[k].input:
            p = producer.get(v)
            if p is not None and p in main_set:
                readers.setdefault(p, k)  # main is in order: the first one seen is the first reader
    fed_by_leaves = {k for k in main if all(not v or v in leaves or producer.get(v) not in main_set
                                            for v in nodes[k].input) and k in readers}
    moved: dict[int, list[int]] = {}
    for k in main:
        if k in fed_by_leaves:
            moved.setdefault(_first_fixed_reader(k, readers, fed_by_leaves), []).append(k)
    order = []
    for k in main:
        if k in fed_by_leaves:
            continue
        order.extend(moved.get(k, ()))
        order.append(k)
    return order


def _first_fixed_reader(k: int, readers: dict[int, int], fed_by_leaves: set[int]) -> int:
    while k in fed_by_leaves:
        k = readers[k]
    return k


def _cuts(order: list[int], reads: dict[int, set[str]], sizes: dict[str, int], num_stages: int,
          min_stage_bytes: int, made: list[int] | None = None) -> list[int]:
    """Positions in ``order`` after which a stage ends: where equal shares of the inputs' bytes have had
    their last read, or, with ``made`` (the bytes each node makes), of those bytes and the bytes made
    together. Recompute leaves few, uneven stashed bytes (a checkpoint a layer), and balanced on those
    alone one stage ran two layers of BERT-small's backward; the bytes made follow the work."""
    last: dict[str, int] = {}
    for p, k in enumerate(order):
        for name in reads[k]:
            last[name] = p
    freed = sorted((p, sizes[name]) for name, p in last.items() if sizes.get(name, 0) > 0)
    total = sum(b for _, b in freed)
    stages = min(num_stages, total // min_stage_bytes if min_stage_bytes > 0 else num_stages)
    if stages < 2:
        return []
    if made is not None:
        freed = sorted(freed + [(p, b) for p, b in enumerate(made) if b > 0])
        total = sum(b for _, b in freed)
    cuts, running, j = [], 0, 1
    for p, b in freed:
        running += b
        while j < stages and running >= total * j / stages:
            if p < len(order) - 1 and (not cuts or p > cuts[-1]):
                cuts.append(p)
            j += 1
    return cuts


def _settle(cuts: list[int], steps: list[Step], sizes: dict[str, int], inputs: list[str]) -> list[int]:
    """Move each cut, by at most a quarter of a stage's length, to where the fewest bytes of values made
    inside the graph cross it (the nearest such place). Balanced on the inputs alone, a cut lands just
    after the last read of a stashed value, which with recompute is the clone that reads a checkpoint:
    the recomputed values (16 MB each at BERT-small's 4x batch) then pass to the next stage, and one
    onnxruntime session holds two layers' recomputation at once. Between layers, only the running
    gradient crosses."""
    across = crossing(steps, sizes, inputs)
    reach = max(1, len(steps) // (4 * (len(cuts) + 1)))
    last = len(steps) - 2
    settled: list[int] = []
    for c in cuts:
        lo = max(c - reach, settled[-1] + 1 if settled else 0)
        hi = min(c + reach, last)
        if lo > hi:
            continue
        settled.append(min(range(lo, hi + 1), key=lambda p: (across[p], abs(p - c))))
    return settled


def one_stage(model: onnx.ModelProto) -> StagedGraph:
    """``model`` uncut."""
    inputs, outputs = [v.name for v in model.graph.input], [v.name for v in model.graph.output]
    return StagedGraph([Stage(model, list(inputs), list(outputs), [])], inputs, outputs)


def _build(model, nodes, order: list[int], stage_of: dict[int, int], copied: set[int], producer: dict[str, int],
           inputs: list[str], outputs: list[str], num: int) -> StagedGraph:
    graph = model.graph
    types = _value_types(model)
    # An initializer that is also a graph input is only a default: the fed value wins, so it stays an input.
    fed = set(inputs)
    initializers = {t.name: t for t in graph.initializer if t.name not in fed}
    members: list[list[int]] = [[] for _ in range(num)]
    for k in order:
        members[stage_of[k]].append(k)
    # Copied layout ops join every stage with a node that reads them (and what they read in turn), in
    # front: they read only graph inputs and constants.
    for s in range(num):
        needed: set[int] = set()
        stack = list(members[s])
        while stack:
            for v in nodes[stack.pop()].input:
                p = producer.get(v)
                if p is not None and p in copied and p not in needed:
                    needed.add(p)
                    stack.append(p)
        members[s] = sorted(needed) + members[s]

    made_in = {o: stage_of[k] for k in stage_of for o in nodes[k].output if o}
    last_read: dict[str, int] = {}
    for s in range(num):
        for k in members[s]:
            for v in nodes[k].input:
                if v and v not in initializers:
                    last_read[v] = max(last_read.get(v, -1), s)
    graph_outputs = set(outputs)
    stages = []
    for s in range(num):
        made = {o for k in members[s] for o in nodes[k].output if o}
        stage_inputs = list(dict.fromkeys(v for k in members[s] for v in nodes[k].input
                                          if v and v not in made and v not in initializers))
        stage_outputs = [o for k in members[s] if k not in copied for o in nodes[k].output
                         if o and made_in.get(o) == s and (o in graph_outputs or last_read.get(o, -1) > s)]
        release = [v for v in stage_inputs if last_read.get(v) == s and v not in graph_outputs]
        used_initializers = {v for k in members[s] for v in nodes[k].input if v in initializers}
        missing = [v for v in (*stage_inputs, *stage_outputs) if v not in types]
        if missing:
            raise CannotStage(f"no type is known for {missing[:3]}, which would pass between stages")
        stage_graph_ = helper.make_graph(
            [nodes[k] for k in members[s]], f"{graph.name}_stage{s}",
            [types[v] for v in stage_inputs], [types[v] for v in stage_outputs],
            [initializers[v] for v in sorted(used_initializers)],
            value_info=[types[o] for k in members[s] for o in nodes[k].output
                        if o in types and o not in stage_outputs])
        stage_model = helper.make_model(stage_graph_, opset_imports=model.opset_import,
                                        ir_version=model.ir_version, functions=model.functions)
        stages.append(Stage(stage_model, stage_inputs, stage_outputs, release))
    produced = {o for st in stages for o in st.outputs} | set(inputs)
    lost = [o for o in outputs if o not in produced]
    if lost:
        raise CannotStage(f"graph outputs {lost[:3]} are not made by any stage")
    return StagedGraph(stages, inputs, outputs)


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every named value with a known element type: declared ones, then ONNX shape inference's."""
    found = {v.name: v for v in (*model.graph.input, *model.graph.output, *model.graph.value_info)
             if v.type.tensor_type.elem_type}
    try:
        inferred = infer_shapes(model).graph.value_info
    except Exception as exc:  # noqa: BLE001 - inference only fills in what the graph does not declare
        logger.debug("shape inference for staging failed: %s", exc)
        inferred = ()
    for v in inferred:
        if v.name not in found and v.type.tensor_type.elem_type:
            found[v.name] = v
    return found
