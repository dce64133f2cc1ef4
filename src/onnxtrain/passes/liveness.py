"""Which values are alive, and how many bytes they hold, as a graph runs node by node in a given order.

A value is alive from the node that makes it to the last node that reads it; a graph output stays alive
to the end (the caller gets it). Graph inputs are the caller's: with ``hold_inputs`` (an onnxruntime
session, which keeps every input of a run until it returns) they are alive throughout, otherwise each is
freed after its last read. Layout ops that onnxruntime runs without a copy (``Reshape``, ``Flatten``,
``Squeeze``, ``Unsqueeze``, ``Identity``) make no buffer: their output is their input's, and that buffer
lives until the last read of either.

:mod:`onnxtrain.passes.stage_graph` places backward's stage cuts with it (values that cross a cut are
passed from one session to the next). On BERT-small at 4x batch, the stash kept plus the largest
internal peak of a backward stage (modelled in onnxruntime's own execution order, with the sizes its
profiler reports) came within a few MB of the measured activation memory (docs/memory.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import onnx

ALIAS_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


@dataclass(frozen=True)
class Step:
    """One node as liveness sees it: what it reads and makes, and whether its output is its input's buffer."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    alias: bool = False


@dataclass
class Peak:
    """The most bytes alive at once: ``bytes`` after step ``position`` (-1: before any), and the values then alive."""

    bytes: int
    position: int
    live: dict[str, int] = field(default_factory=dict)  # buffer (its first value's name) -> bytes

    def largest(self, n: int = 10) -> list[tuple[str, int]]:
        return sorted(self.live.items(), key=lambda kv: -kv[1])[:n]


def steps_of(nodes: Iterable[onnx.NodeProto]) -> list[Step]:
    return [Step(n.name or n.output[0], tuple(n.input), tuple(o for o in n.output if o),
                 n.op_type in ALIAS_OPS and n.domain in ("", "ai.onnx") and bool(n.input) and bool(n.input[0]))
            for n in nodes]


def _buffers(steps: Sequence[Step]) -> dict[str, str]:
    """Value name -> the name of the value whose buffer it is (itself, or an aliased op's input's)."""
    root: dict[str, str] = {}
    for step in steps:
        if step.alias and step.outputs:
            root[step.outputs[0]] = root.get(step.inputs[0], step.inputs[0])
    return root


def intervals(steps: Sequence[Step], sizes: Mapping[str, int], inputs: Iterable[str] = (),
              outputs: Iterable[str] = (), hold_inputs: bool = False) -> dict[str, tuple[int, int, int]]:
    """Buffer -> (first step alive, last step alive, bytes). Graph inputs start at -1; with ``hold_inputs``
    they, and graph outputs, last to the end. A value of unknown size counts 0 bytes."""
    root = _buffers(steps)
    end = len(steps) - 1
    inputs = list(inputs)
    spans: dict[str, list[int]] = {v: [-1, -1 if not hold_inputs else end] for v in inputs}
    for p, step in enumerate(steps):
        for v in step.inputs:
            if v:
                b = root.get(v, v)
                if b in spans:
                    spans[b][1] = max(spans[b][1], p)
        for v in step.outputs:
            b = root.get(v, v)
            if b not in spans:
                spans[b] = [p, p]
            else:
                spans[b][1] = max(spans[b][1], p)
    for v in outputs:
        b = root.get(v, v)
        if b in spans:
            spans[b][1] = end
    return {b: (lo, hi, int(sizes.get(b, 0) or 0)) for b, (lo, hi) in spans.items()}


def simulate(steps: Sequence[Step], sizes: Mapping[str, int], inputs: Iterable[str] = (),
             outputs: Iterable[str] = (), hold_inputs: bool = False) -> Peak:
    """The peak of the bytes alive at once while ``steps`` run in order (see the module docstring): a step's
    outputs are alive beside its inputs, and what it read for the last time is freed after it."""
    spans = intervals(steps, sizes, inputs, outputs, hold_inputs)
    starts: dict[int, list[str]] = {}
    ends: dict[int, list[str]] = {}
    for b, (lo, hi, _) in spans.items():
        starts.setdefault(lo, []).append(b)
        ends.setdefault(hi, []).append(b)
    live: dict[str, int] = {}
    for b in starts.get(-1, ()):
        live[b] = spans[b][2]
    current = sum(live.values())
    best = Peak(current, -1, dict(live))
    for p in range(len(steps)):
        for b in starts.get(p, ()):
            live[b] = spans[b][2]
            current += spans[b][2]
        if current > best.bytes:
            best = Peak(current, p, dict(live))
        for b in ends.get(p, ()):
            current -= live.pop(b, 0)
    return best


def crossing(steps: Sequence[Step], sizes: Mapping[str, int], inputs: Iterable[str] = ()) -> list[int]:
    """For each position p, the bytes of values made at or before step p and read after it (graph
    inputs left out): what a cut after step p would pass from one stage to the next."""
    spans = intervals(steps, sizes, (), (), False)
    given = set(inputs)
    delta = [0] * (len(steps) + 1)
    for b, (lo, hi, size) in spans.items():
        if b in given or lo < 0 or hi <= lo:
            continue
        delta[lo] += size
        delta[hi] -= size
    out, running = [], 0
    for p in range(len(steps)):
        running += delta[p]
        out.append(running)
    return out


def proto_sizes(model: onnx.ModelProto, dims: Mapping[str, int],
                types: Mapping[str, onnx.ValueInfoProto] | None = None) -> dict[str, int]:
    """Bytes of each value of ``model`` whose type is known (``types``, else the declared ones), with
    symbolic dims resolved by ``dims``; values with a dim not resolved are left out."""
    if types is None:
        types = {v.name: v for v in (*model.graph.input, *model.graph.output, *model.graph.value_info)}
    sizes: dict[str, int] = {}
    for name, info in types.items():
        tensor = info.type.tensor_type
        if not tensor.elem_type or not tensor.HasField("shape"):
            continue
        elements = 1
        for d in tensor.shape.dim:
            size = d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param) if d.dim_param else None
            if size is None:
                break
            elements *= size
        else:
            sizes[name] = elements * onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
    return sizes
