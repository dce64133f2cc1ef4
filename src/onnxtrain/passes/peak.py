"""The modelled peak of a training step under a recompute plan, for :mod:`onnxtrain.passes.recompute`.

The joint graph (forward nodes, then gradient nodes) runs in graph order; a recomputed subgraph's clones
run just before the first gradient node that reads them (as ``_Clones.place`` puts them), and the
gradient nodes read the clones instead of the forward values, which are then freed after their last
forward reader. :func:`onnxtrain.passes.liveness.simulate` gives the peak of the bytes alive at once;
graph inputs and initializers (parameters, the batch) count 0: the peak is above what stays alive between
steps, as the activation memory the benchmark measures. ``Shape``/``Size`` gradient nodes read nothing:
the split runs them in forward.

The graph's outputs: with ``split=True`` (ORTModule, whose forward and backward are two sessions) the
forward's outputs are alive until the forward returns and then the caller's, who drops them (a training
loop keeps the loss's value, not the logits), so they count until the last forward node; the gradients
to the end. With ``split=False`` (the artifacts' one session) every output is alive to the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import onnx_ir as ir

from onnxtrain.passes.liveness import ALIAS_OPS, Step, simulate

SHAPE_OPS = frozenset({"Shape", "Size"})


def _onnx(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


class PeakModel:
    """``peak(subgraphs)``: the modelled peak, in bytes, with those subgraphs (lists of forward nodes)
    recomputed for the gradient nodes."""

    def __init__(self, graph: ir.Graph, forward: set[ir.Node], size: Callable[[ir.Value], int], split: bool = False):
        self.nodes = list(graph)
        self.position = {node: k for k, node in enumerate(self.nodes)}
        self.forward = forward
        returned = [v for v in graph.outputs if v.producer() in forward] if split else []
        self.outputs = [v for v in graph.outputs if v not in returned]
        # the forward's outputs are read once more where the forward returns (after its last node)
        self.returned = returned
        self.forward_end = max((self.position[n] for n in forward), default=-1)
        self.sizes: dict[object, int] = {}
        for node in self.nodes:
            for v in node.outputs:
                self.sizes[v] = size(v)
                self.sizes[("recomputed", v)] = self.sizes[v]

    def _reads(self, node: ir.Node) -> list[ir.Value]:
        if node not in self.forward and _onnx(node) and node.op_type in SHAPE_OPS:
            return []
        return [v for v in node.inputs if v is not None]

    def steps(self, subgraphs: Iterable[Sequence[ir.Node]]) -> list[Step]:
        cloned = sorted({n for nodes in subgraphs for n in nodes}, key=self.position.__getitem__)
        made = {v for n in cloned for v in n.outputs}

        def backward_read(v: ir.Value) -> object:
            return ("recomputed", v) if v in made else v

        anchor: dict[ir.Node, int | None] = {}
        readers_of: dict[ir.Value, list[int]] = {}
        for node in self.nodes:
            if node not in self.forward:
                for v in self._reads(node):
                    if v in made:
                        readers_of.setdefault(v, []).append(self.position[node])
        clone_readers: dict[ir.Value, list[ir.Node]] = {}
        for n in cloned:
            for v in n.inputs:
                if v in made:
                    clone_readers.setdefault(v, []).append(n)
        for n in reversed(cloned):  # a clone's clone readers come after it
            first = [p for v in n.outputs for p in readers_of.get(v, ())]
            first += [anchor[m] for v in n.outputs for m in clone_readers.get(v, ()) if anchor.get(m) is not None]
            anchor[n] = min(first) if first else None
        before: dict[int, list[ir.Node]] = {}
        for n in cloned:
            if anchor[n] is not None:
                before.setdefault(anchor[n], []).append(n)

        def step(node: ir.Node, name: str, reads: list[object], outs: list[object]) -> Step:
            alias = _onnx(node) and node.op_type in ALIAS_OPS and bool(reads) and node.inputs[0] is not None
            return Step(name, tuple(reads), tuple(outs), alias)

        steps = []
        for k, node in enumerate(self.nodes):
            for n in before.get(k, ()):
                steps.append(step(n, f"{n.name}/recomputed", [backward_read(v) for v in n.inputs if v is not None],
                                  [("recomputed", v) for v in n.outputs]))
            reads = self._reads(node)
            if node not in self.forward:
                reads = [backward_read(v) for v in reads]
            steps.append(step(node, node.name or "", reads, list(node.outputs)))
            if k == self.forward_end and self.returned:
                steps.append(Step("forward returns", tuple(self.returned), ()))
        return steps

    def peak(self, subgraphs: Iterable[Sequence[ir.Node]]) -> int:
        return simulate(self.steps(subgraphs), self.sizes, outputs=self.outputs).bytes
