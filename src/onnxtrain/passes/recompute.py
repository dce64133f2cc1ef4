"""Recompute forward values in backward instead of keeping them, to a memory budget.

Runs on the joint training graph (forward nodes, then the gradient nodes autodiff added) before the
forward/backward split. A forward value that a gradient node reads is *stashed*: the forward graph
returns it and it stays in memory until backward. Recomputing it means cloning the forward nodes that
make it and pointing the gradient nodes at the clone; the split then puts the clones in backward, and the
value is no longer stashed (only the clone's inputs are, which usually are stashed anyway).

Candidates are the forward nodes with a stashed output (random ops never: a clone would draw again).
Each candidate's subgraph is the node plus the forward nodes that make those of its inputs which are
neither stashed nor at hand in backward (graph inputs, initializers, constants), up to
``MAX_SUBGRAPH_NODES`` nodes (once a value is recomputed, the subgraphs reading it grow back through it:
the values that stay stashed are checkpoints, see ``_take``); every node in it must be of a kind below.
Its saving is the size of its stashed outputs (dims resolved with the actual input sizes: ``dims``); its cost is the work of the
subgraph, per element for pointwise ops, ``2*M*N*K`` for a matrix product. Candidates are ranked by kind
(cheap pointwise and layout ops, then transcendental and normalising ops, then matrix products), then by
cost per byte saved; a budget takes them in that order until the stash fits it, so a smaller budget
always recomputes a superset of what a larger one does. A candidate is passed over where it would raise
the step's modelled peak (:mod:`onnxtrain.passes.peak`) above the lowest so far, or make a subgraph make
more than ``MAX_MADE_PER_SAVED`` times the bytes it saves: the modelled peak never rises as the budget
falls.

Plans (:class:`Recompute`):

- ``Recompute()`` (the default): cheap pointwise and layout ops whose inputs are stashed anyway (one pass
  over memory saves a whole activation; e.g. the ``Where(IsNaN(p), 0, p)`` after an attention softmax,
  ``0.5 * x`` and ``1 + t`` in GPT-2's GELU). What the split did before this pass.
- ``Recompute(budget=0.5)``: keep at most half the bytes stashed without recompute; ``budget=0`` as little
  as the kinds allowed can make it; ``budget=2**30``: at most 1 GiB. ``kinds`` names the kinds tried:
  by default all (``KINDS``); ``kinds=("pointwise", "transcendental")`` leaves matrix products out.
- ``Recompute(patterns={"Add+Gelu+": -1})``: the subgraphs of these patterns (op types joined by ``+``, as
  ONNX Runtime Training's ``ORTMODULE_MEMORY_OPT_CONFIG`` named them), all of them or the first ``n``.

Always (whatever the plan): chains of layout ops from graph inputs and constants (the ``Transpose`` of a
weight before a ``MatMul``) are redone in backward, so that forward keeps fusing them and no copy of the
weight is stashed.

:func:`from_env` reads ONNX Runtime Training's variables: ``ORTMODULE_MEMORY_OPT_LEVEL`` (0: the default
plan or the config's patterns; 1: ``budget=0`` over all kinds but matrix products, as its "transformer
layerwise" level; 2: ``budget=0`` over all kinds) and ``ORTMODULE_MEMORY_OPT_CONFIG`` (a JSON file with a
list of ``"pattern:1:count"`` strings, or those strings separated by commas).

The plan is logged at INFO (logger ``onnxtrain.passes``), one line per pattern, as ONNX Runtime
Training printed it: the pattern, how many there are, how many are on, and the bytes they save.
"""

from __future__ import annotations

import ast
import json
import logging
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import onnx_ir as ir

from onnxtrain.passes.dropout_masks import RANDOM_OPS
from onnxtrain.passes.liveness import ALIAS_OPS
from onnxtrain.passes.peak import PeakModel
from onnxtrain.passes.split_forward_backward import ancestors

logger = logging.getLogger("onnxtrain.passes")

LEVEL_ENV = "ORTMODULE_MEMORY_OPT_LEVEL"
CONFIG_ENV = "ORTMODULE_MEMORY_OPT_CONFIG"
# Up to a transformer layer's attention block (projections, masks, softmax) from the values stashed anyway.
MAX_SUBGRAPH_NODES = 32
# A recomputation may make at most this many times the bytes it saves. Without it, BERT-small's pooler
# input (one token a sequence, 32 KB) grew back through the whole last layer once that layer was
# recomputed: the layer ran at the front of backward, and its recomputed values, shared with the layer's
# own gradient nodes, stayed alive from there (budget 0 peaked above budget 0.25).
MAX_MADE_PER_SAVED = 8
# A recomputation stops at a forward value that is not floating point (a mask, indices) of at most this many
# bytes: it is stashed instead. BERT's attention mask is a chain of 23 integer and boolean ops from the input
# mask; recomputed inside every layer's attention subgraph it took most of MAX_SUBGRAPH_NODES, and the
# query, key and value projections could not be recomputed after it (their 4 MB each stayed stashed).
MAX_KEPT_MASK_BYTES = 2**20

# Kinds, cheapest first. Cost per output element of each op in the first two; matrix products by flops.
LAYOUT = frozenset({"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "Identity", "Constant",
                    "Shape", "Size", "ConstantOfShape", "Range"})
POINTWISE = LAYOUT | frozenset({
    "IsNaN", "IsInf", "Not", "And", "Or", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
    "Where", "Neg", "Expand", "Add", "Sub", "Mul", "Div", "Relu", "Abs", "Max", "Min", "Clip",
})
TRANSCENDENTAL = frozenset({
    "Gelu", "Tanh", "Erf", "Exp", "Log", "Sigmoid", "Sqrt", "Reciprocal", "Pow", "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceMax", "LayerNormalization", "Slice", "Concat", "Split", "Gather",
    "GatherElements", "GatherND", "Pad", "Trilu",
})
MATMUL = frozenset({"MatMul", "Gemm"})
KINDS = ("pointwise", "transcendental", "matmul")
# Matrix products are tried too, last. (They once raised the peak: clones then ran at the front of
# backward; now each runs just before its first reader, see _Clones.place.)
DEFAULT_KINDS = KINDS
_OPS = {"pointwise": POINTWISE, "transcendental": TRANSCENDENTAL, "matmul": MATMUL}
_ELEMENT_COST = {"pointwise": 1.0, "transcendental": 4.0}
SHAPE_OPS = frozenset({"Shape", "Size"})  # the split moves these into forward: their readers stay


@dataclass(frozen=True)
class Recompute:
    """What to recompute (see the module docstring). ``budget``: a fraction in [0, 1] of the bytes stashed
    without recompute, or a number of bytes (an int above 1); None: the default plan, unless ``patterns``."""

    budget: float | int | None = None
    kinds: tuple[str, ...] = DEFAULT_KINDS
    patterns: Mapping[str, int] = field(default_factory=dict)
    # Sizes of symbolic dims, for the bytes each candidate saves; ORTModule adds those of the actual inputs.
    dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or self.budget < 0 \
                    or (isinstance(self.budget, float) and self.budget > 1):
                raise ValueError(f"recompute budget {self.budget!r}: use a fraction of the stashed bytes in "
                                 "[0.0, 1.0], or a number of bytes (an int)")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"recompute kinds {unknown}: use some of {list(KINDS)}")

    @property
    def saves_memory(self) -> bool:
        """Whether the plan asks for memory savings: patterns, or a budget below the whole stash (a fraction under
        1.0, or a number of bytes: an int above 1, as :func:`_choose` reads it)."""
        budget = self.budget
        return bool(self.patterns) or (budget is not None and (budget < 1 or (isinstance(budget, int) and budget > 1)))

    @classmethod
    def of(cls, value) -> Recompute:
        """A plan from a user's option: a :class:`Recompute`, None (the default), a budget, or a string
        (``"0.5"``, ``"300MB"``, ``"2GiB"``, ``"off"`` for ``budget=1.0``)."""
        if value is None:
            return cls()
        if isinstance(value, Recompute):
            return value
        if isinstance(value, str):
            return cls(budget=parse_budget(value))
        return cls(budget=value)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str) -> float | int:
    """``"0.5"`` -> 0.5, ``"300MB"`` -> 300000000, ``"off"``/``"none"`` -> 1.0 (nothing recomputed)."""
    raw = text.strip().lower()
    if raw in ("off", "none"):
        return 1.0
    match = re.fullmatch(r"([0-9.]+)\s*([kmg]i?b|b)?", raw)
    if match:
        number, unit = match.group(1), match.group(2) or ""
        try:
            if not unit and "." in number:
                return float(number)
            return int(float(number) * _UNITS[unit])
        except ValueError:
            pass
    raise ValueError(f"recompute budget {text!r}: use a fraction such as 0.5, a size such as 300MB or 2GiB, "
                     "or off")


def from_env(environ: Mapping[str, str] = os.environ) -> Recompute | None:
    """The plan ONNX Runtime Training's variables ask for, or None where neither is set."""
    level_raw = environ.get(LEVEL_ENV, "").strip()
    config_raw = environ.get(CONFIG_ENV, "").strip()
    if not level_raw and not config_raw:
        return None
    if level_raw not in ("", "0", "1", "2"):
        raise ValueError(f"{LEVEL_ENV}={level_raw!r}: use 0 (the config's patterns), 1 (recompute all but "
                         "matrix products) or 2 (recompute all)")
    patterns = _parse_config(config_raw) if config_raw else {}
    if level_raw == "1":
        return Recompute(budget=0.0, kinds=("pointwise", "transcendental"), patterns=patterns)
    if level_raw == "2":
        return Recompute(budget=0.0, kinds=KINDS, patterns=patterns)
    return Recompute(patterns=patterns)


def _parse_config(raw: str) -> dict[str, int]:
    if os.path.isfile(raw):
        with open(raw, encoding="utf-8") as f:
            entries = json.load(f)
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError(f"{CONFIG_ENV}={raw!r}: the file must hold a JSON list of 'pattern:1:count' strings")
    else:
        entries = [e for e in raw.split(",") if e.strip()]
    patterns = {}
    for entry in entries:
        parts = entry.strip().split(":")
        if len(parts) != 3 or parts[1] != "1" or not re.fullmatch(r"-?[0-9]+", parts[2]):
            raise ValueError(f"{CONFIG_ENV}: {entry!r} is not 'pattern:1:count' (type 1 is recompute; count -1 "
                             "for all of the pattern)")
        patterns[parts[0] if parts[0].endswith("+") else parts[0] + "+"] = int(parts[2])
    return patterns


# -------------------------------------------------------------------------------------------------
# Sizes
# -------------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.floordiv, ast.Mod: operator.mod}


def _eval_dim(text: str, dims: Mapping[str, int]) -> int | None:
    """A symbolic dim (``"batch"``, ``"2*s0 + 1"``) with the symbols' sizes, or None."""
    if text in dims:
        return dims[text]
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return dims.get(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if left is None or right is None or (right == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult))):
                return None
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min", "Max", "Min"):
            args = [value(a) for a in node.args]
            return None if None in args or not args else (max if node.func.id.lower() == "max" else min)(args)
        return None

    return value(tree)


def value_bytes(value: ir.Value, dims: Mapping[str, int]) -> int | None:
    """The size of ``value`` with symbolic dims resolved by ``dims``; None where a dim or the type is unknown."""
    if value.shape is None or value.dtype is None:
        return None
    elements = 1
    for d in value.shape:
        size = d if isinstance(d, int) else None if d.value is None else _eval_dim(str(d.value), dims)
        if size is None:
            return None
        elements *= size
    return int(elements * value.dtype.itemsize)


def dims_from_inputs(graph: ir.Graph, shapes: Iterable[tuple[int, ...] | None]) -> dict[str, int]:
    """Symbol -> size, from the graph inputs' symbolic dims and the actual input shapes (in input order)."""
    dims: dict[str, int] = {}
    for value, shape in zip(graph.inputs, shapes):
        if shape is None or value.shape is None or len(value.shape) != len(shape):
            continue
        for d, size in zip(value.shape, shape):
            if isinstance(d, ir.SymbolicDim) and d.value is not None:
                dims.setdefault(d.value, int(size))
    return dims


# -------------------------------------------------------------------------------------------------
# The pass
# -------------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    node: ir.Node  # the forward node whose stashed outputs are recomputed
    nodes: list[ir.Node]  # its subgraph, in graph order (the node last)
    kind: str
    saved: int  # bytes of its stashed outputs; 0 where unknown
    cost: float
    outputs: list[ir.Value] = field(default_factory=list)  # its stashed outputs
    on: bool = False

    @property
    def pattern(self) -> str:
        return "".join(f"{n.op_type}+" for n in self.nodes)


@dataclass(frozen=True)
class Saved:
    """Stash that a pass before autodiff removed (the chunked loss's log-softmax, for one): ``removed`` are
    the values the stash would have held without it, ``added`` those it holds instead (the values may be
    detached from the graph; their symbolic dims are resolved as the candidates' are). Shown in the plan's
    table as a line of its own, and not counted in the budget: a budget is a fraction of the stash the
    plan works on, which such a pass (run only under a budget) has already made smaller. Counted, GPT-2-small
    at 4x batch and budget 0.5 recomputed nothing more and its activation memory fell 29% from budget 1.0
    instead of 44% (twelfth session)."""

    name: str
    removed: tuple[ir.Value, ...]
    added: tuple[ir.Value, ...] = ()

    def bytes(self, dims: Mapping[str, int]) -> int:
        return max(0, sum(_size(v, dims) for v in self.removed) - sum(_size(v, dims) for v in self.added))


@dataclass
class Plan:
    candidates: list[Candidate]
    stashed_bytes: int  # without recompute (layout chains from leaves are always redone); ``presaved`` not in it
    # The step's modelled peak above what stays alive between steps (passes/peak.py), without recompute
    # and with this plan; None where not modelled.
    base_peak_bytes: int | None = None
    peak_bytes: int | None = None
    # What the split stashes with this plan: the values not recomputed, and the masks and indices that the
    # recomputations read (MAX_KEPT_MASK_BYTES); None until the pass has cloned.
    kept_bytes: int | None = None
    # What passes before autodiff already took off the stash (name, bytes): in the table, not the budget.
    presaved: list[tuple[str, int]] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(c.saved for c in self.candidates if c.on)

    def table(self) -> str:
        """One line per pattern: how many there are, how many are on, the bytes they save."""
        rows: dict[str, list[Candidate]] = {}
        for c in self.candidates:
            rows.setdefault(c.pattern, []).append(c)
        lines = [f"recompute plan: {self.saved_bytes / 2**20:.1f} of {self.stashed_bytes / 2**20:.1f} MiB of "
                 f"stashed activations recomputed ({len(self.candidates)} candidates)"]
        if self.kept_bytes is not None:
            lines.append(f"  stash kept: {self.kept_bytes / 2**20:.1f} MiB")
        if self.peak_bytes is not None and self.base_peak_bytes is not None:
            lines.append(f"  modelled peak of a step: {self.peak_bytes / 2**20:.1f} MiB "
                         f"({self.base_peak_bytes / 2**20:.1f} MiB without recompute)")
        lines += [f"  {'pattern':<48} {'kind':<14} {'count':>5} {'on':>5} {'MiB saved':>10} {'MiB if all':>10}"]
        for name, size in self.presaved:
            lines.append(f"  {name:<48} {'before autodiff':<14} {1:>5} {1:>5} {size / 2**20:>10.2f} {size / 2**20:>10.2f}")
        for pattern, group in sorted(rows.items(), key=lambda kv: -sum(c.saved for c in kv[1])):
            on = [c for c in group if c.on]
            lines.append(f"  {pattern:<48} {group[0].kind:<14} {len(group):>5} {len(on):>5} "
                         f"{sum(c.saved for c in on) / 2**20:>10.2f} {sum(c.saved for c in group) / 2**20:>10.2f}")
        return "\n".join(lines)


class RecomputePass(ir.passes.InPlacePass):
    """Clone the planned forward subgraphs for the gradient nodes (see the module docstring).

    ``num_forward_outputs``: the joint graph's first outputs are the forward's (the rest are gradients);
    ``dims``: sizes of symbolic dims, over the plan's; ``saved``: what passes before autodiff took off the
    stash (:class:`Saved`), shown in the plan's table; ``split``: whether the graph is split into a
    forward and a backward session, whose outputs the caller drops after the forward (ORTModule), or runs
    as one (the artifacts; :class:`~onnxtrain.passes.peak.PeakModel`). After the call, ``self.plan`` is the plan it
    followed.
    """

    def __init__(self, num_forward_outputs: int, plan: Recompute | None = None, dims: Mapping[str, int] | None = None,
                 saved: Iterable[Saved] = (), split: bool = True):
        super().__init__()
        self.split = split  # the graph runs as a forward and a backward session (ORTModule), or as one
        self.num_forward_outputs = num_forward_outputs
        self.options = plan or Recompute()
        self.dims = {**self.options.dims, **(dims or {})}
        self.presaved = list(saved)
        self.plan: Plan | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        fwd_outputs = list(graph.outputs[: self.num_forward_outputs])
        forward = ancestors(fwd_outputs)
        order = {node: k for k, node in enumerate(graph)}
        leaves = set(graph.inputs) | set(graph.initializers.values())
        if not forward or len(forward) == len(order):
            return ir.passes.PassResult(model, modified=False)
        clones = _Clones(graph, forward, leaves)
        modified = clones.layout_chains()
        stashed = _stashed(graph, forward, leaves)
        # Layout chains from leaves are redone whatever the plan: for a candidate they are leaves too, and so
        # are small masks and indices, which a recomputation reads from the stash.
        bounds = leaves | set(clones.of) | _masks(forward, self.dims)
        candidates = _candidates(stashed, forward, bounds, set(fwd_outputs), order, self.dims, self.options.kinds)
        presaved = [(p.name, p.bytes(self.dims)) for p in self.presaved]
        plan = Plan(candidates, sum(_size(v, self.dims) for v in stashed if v not in fwd_outputs), presaved=presaved)
        model_peak = PeakModel(graph, forward, lambda v: _size(v, self.dims), self.split).peak if candidates else None
        _choose(plan, self.options, stashed, bounds, order, self.dims, model_peak)
        if model_peak is not None:
            plan.base_peak_bytes = model_peak([])
            plan.peak_bytes = model_peak([c.nodes for c in candidates if c.on])
        for c in sorted((c for c in candidates if c.on), key=lambda c: order[c.node]):
            clones.recompute(c.nodes)
            modified = True
        clones.place()
        plan.kept_bytes = sum(_size(v, self.dims) for v in _stashed(graph, forward, leaves) if v not in fwd_outputs)
        self.plan = plan
        if candidates:
            logger.info("%s", plan.table())
        return ir.passes.PassResult(model, modified=modified)


def _is_onnx(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _kind(node: ir.Node) -> str | None:
    if node.domain == "com.microsoft" and node.op_type in ("Gelu", "FastGelu", "BiasGelu"):
        return "transcendental"
    if not _is_onnx(node) or node.op_type in RANDOM_OPS:
        return None
    for kind in KINDS:
        if node.op_type in _OPS[kind]:
            return kind
    return None


def _backward_readers(value: ir.Value, forward: set[ir.Node]) -> list[tuple[ir.Node, int]]:
    """The gradient nodes reading ``value``, but for Shape/Size (the split runs those in forward)."""
    return [(node, i) for node, i in value.uses()
            if node not in forward and not (_is_onnx(node) and node.op_type in SHAPE_OPS)]


def _stashed(graph: ir.Graph, forward: set[ir.Node], leaves: set[ir.Value]) -> list[ir.Value]:
    seen: dict[ir.Value, None] = {}
    for node in graph:
        if node in forward:
            continue
        for v in node.inputs:
            if v is not None and v not in leaves and v.producer() in forward and v not in seen \
                    and not (_is_onnx(node) and node.op_type in SHAPE_OPS):
                seen[v] = None
    return list(seen)


def _masks(forward: set[ir.Node], dims: Mapping[str, int]) -> set[ir.Value]:
    """Forward values that are not floating point and of at most MAX_KEPT_MASK_BYTES (masks, indices): a
    recomputation reads them from the stash rather than redoing the (often long) chains that make them."""
    return {v for node in forward for v in node.outputs
            if v.dtype is not None and not v.dtype.is_floating_point() and 0 < _size(v, dims) <= MAX_KEPT_MASK_BYTES}


def _size(value: ir.Value, dims: Mapping[str, int]) -> int:
    return value_bytes(value, dims) or 0


def _elements(value: ir.Value, dims: Mapping[str, int]) -> int:
    size = _size(value, dims)
    return int(size // value.dtype.itemsize) if size else 0


def _node_cost(node: ir.Node, kind: str, dims: Mapping[str, int]) -> float:
    out = sum(_elements(v, dims) for v in node.outputs)
    if kind != "matmul":
        return _ELEMENT_COST[kind] * out
    a = node.inputs[0]
    inner = a.shape[-1] if a.shape is not None and len(a.shape) else None
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0) and a.shape is not None:
        inner = a.shape[0]
    k = inner if isinstance(inner, int) else None if inner is None or inner.value is None else _eval_dim(str(inner.value), dims)
    return 2.0 * out * (k or 1)


def _candidates(stashed: list[ir.Value], forward: set[ir.Node], leaves: set[ir.Value], kept: set[ir.Value],
                order: dict[ir.Node, int], dims: Mapping[str, int], kinds: Iterable[str]) -> list[Candidate]:
    allowed = set(kinds)
    stash = set(stashed)
    by_node: dict[ir.Node, list[ir.Value]] = {}
    for v in stashed:
        if v not in kept:
            by_node.setdefault(v.producer(), []).append(v)
    found = []
    for node, outs in by_node.items():
        nodes = _subgraph(node, stash, leaves)
        if nodes is None:
            continue
        node_kinds = [_kind(n) for n in nodes]
        if any(k is None for k in node_kinds):
            continue
        kind = max(node_kinds, key=KINDS.index)
        if kind not in allowed and not (kind == "pointwise" and len(nodes) == 1):
            continue
        nodes.sort(key=order.get)
        cost = sum(_node_cost(n, _kind(n), dims) for n in nodes)
        found.append(Candidate(node, nodes, kind, sum(_size(v, dims) for v in outs), cost, outs))
    return found


def _subgraph(node: ir.Node, stash: set[ir.Value], leaves: set[ir.Value]) -> list[ir.Node] | None:
    """``node`` and the producers of its inputs that are neither stashed nor leaves, recursively; None if
    that takes more than MAX_SUBGRAPH_NODES nodes."""
    nodes, stack = [node], [node]
    seen = {node}
    while stack:
        for v in stack.pop().inputs:
            if v is None or v in stash or v in leaves:
                continue
            producer = v.producer()
            if producer is None:
                return None
            if producer not in seen:
                seen.add(producer)
                nodes.append(producer)
                stack.append(producer)
                if len(nodes) > MAX_SUBGRAPH_NODES:
                    return None
    return nodes


def _choose(plan: Plan, options: Recompute, stashed: list[ir.Value], leaves: set[ir.Value],
            order: dict[ir.Node, int], dims: Mapping[str, int],
            model_peak: Callable[[list[list[ir.Node]]], int] | None = None) -> None:
    """Turn candidates on: the patterns asked for, then the default plan or a budget's prefix."""
    counts = dict(options.patterns)
    for c in plan.candidates:
        left = counts.get(c.pattern)
        if left is not None and left != 0:
            c.on = True
            counts[c.pattern] = left - 1
    if options.budget is None:
        if not options.patterns:
            for c in plan.candidates:
                c.on = c.on or (c.kind == "pointwise" and len(c.nodes) == 1)
        return
    target = options.budget if isinstance(options.budget, int) and options.budget > 1 \
        else options.budget * plan.stashed_bytes
    ranked = sorted((c for c in plan.candidates if c.saved > 0),
                    key=lambda c: (KINDS.index(c.kind), c.cost / c.saved, c.pattern))
    _take(plan, ranked, target, stashed, leaves, order, dims, set(options.kinds), model_peak)


def _take(plan: Plan, ranked: list[Candidate], target: float, stashed: list[ir.Value], leaves: set[ir.Value],
          order: dict[ir.Node, int], dims: Mapping[str, int], allowed: set[str],
          model_peak: Callable[[list[list[ir.Node]]], int] | None = None) -> None:
    """Turn on ``ranked``'s candidates in order until the stash fits ``target`` bytes. Each subgraph reaches
    back through the values recomputed before it, up to values that stay stashed (so recomputing the
    input of a recomputed value grows that value's subgraph: checkpointing, with the values that stay
    stashed as the checkpoints). A candidate is refused where it would make its own subgraph, or one
    already on, longer than ``MAX_SUBGRAPH_NODES`` nodes or of a kind not allowed: that bounds every
    recomputation to about a layer, instead of redoing the whole forward at the start of backward.
    With ``model_peak``, a candidate is also refused where it would raise the step's modelled peak
    above the lowest one so far: a budget takes a prefix of the same sequence of plans, so the modelled
    peak never rises as the budget falls.

    The candidates go by twice. The first time a candidate is also refused where a subgraph already on
    would grow past ``MAX_MADE_PER_SAVED`` times the bytes *it* saves; where the budget is still not met,
    the second time only the candidate's own subgraph is held to that (the subgraphs it grows share their
    clones with it: each node is cloned once). That second sequence recomputes whole layers from the
    values kept at their boundaries (BERT-small's attention probabilities grow the boolean ``IsNaN`` of
    them, 2 MiB at 4x batch, through the softmax): on-device BERT-small at 4x batch and budget 0, 104.1 ->
    64.5 MiB kept. Budgets the first sequence meets (0.5) keep their plans (docs/memory.md)."""
    stash = set(stashed)
    on = [c for c in plan.candidates if c.on]
    for c in on:
        stash.difference_update(c.outputs)
    left = plan.stashed_bytes - plan.saved_bytes
    lowest = model_peak([d.nodes for d in on]) if model_peak is not None and left > target else None
    for c, shared in [(c, False) for c in ranked] + [(c, True) for c in ranked]:
        if left <= target:
            break
        if c.on:
            continue
        trial = stash - set(c.outputs)
        grown = [_allowed_subgraph(d.node, trial, leaves, allowed) for d in (*on, c)]
        held = zip((c,), grown[-1:]) if shared else zip((*on, c), grown)
        if any(g is None for g in grown) or any(_made(g[0], dims) > MAX_MADE_PER_SAVED * d.saved for d, g in held):
            continue
        if lowest is not None:
            peak = model_peak([sorted(g[0], key=order.get) for g in grown])
            if peak > lowest:
                continue
            lowest = peak
        for d, (nodes, kind) in zip((*on, c), grown):
            nodes.sort(key=order.get)
            d.nodes, d.kind = nodes, kind
            d.cost = sum(_node_cost(n, _kind(n), dims) for n in nodes)
        c.on = True
        on.append(c)
        stash = trial
        left -= c.saved


def _made(nodes: list[ir.Node], dims: Mapping[str, int]) -> int:
    """The bytes a subgraph's nodes make when it is recomputed (a Reshape's output is its input's buffer)."""
    return sum(_size(v, dims) for n in nodes if not (_is_onnx(n) and n.op_type in ALIAS_OPS) for v in n.outputs)


def _allowed_subgraph(node: ir.Node, stash: set[ir.Value], leaves: set[ir.Value],
                      allowed: set[str]) -> tuple[list[ir.Node], str] | None:
    nodes = _subgraph(node, stash, leaves)
    kinds = None if nodes is None else [_kind(n) for n in nodes]
    if kinds is None or None in kinds:
        return None
    kind = max(kinds, key=KINDS.index)
    if kind not in allowed and not (kind == "pointwise" and len(nodes) == 1):
        return None
    return nodes, kind


class _Clones:
    """Clones forward nodes so that the gradient nodes read the clones' outputs."""

    def __init__(self, graph: ir.Graph, forward: set[ir.Node], leaves: set[ir.Value]):
        self.graph, self.forward, self.leaves = graph, forward, leaves
        self.of: dict[ir.Value, ir.Value] = {}  # forward value -> its clone
        # Clones go after the last forward node, in the order made (each after the ones it reads).
        self._cursor = max(forward, key={n: k for k, n in enumerate(graph)}.get) if forward else None

    def layout_chains(self) -> bool:
        """Clone layout chains from leaves that some gradient node reads (a weight's Transpose)."""
        memo: dict[ir.Value, bool] = {}

        def from_leaves(v: ir.Value | None) -> bool:
            if v is None or v in self.leaves:
                return True
            if v not in memo:
                node = v.producer()
                memo[v] = (node is not None and node in self.forward and _is_onnx(node) and node.op_type in LAYOUT
                           and all(from_leaves(i) for i in node.inputs))
            return memo[v]

        chains = [v for v in _stashed(self.graph, self.forward, self.leaves) if from_leaves(v)]
        for v in chains:
            self.recompute(_chain(v, self.leaves))
        return bool(chains)

    def recompute(self, nodes: list[ir.Node]) -> None:
        """Clone ``nodes`` (in graph order) after the forward nodes; point the gradient nodes that read
        their outputs (earlier clones included) at the clones."""
        for node in nodes:
            if node.outputs[0] in self.of:
                continue
            inputs = [self.of.get(v, v) if v is not None else None for v in node.inputs]
            attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
            copy = ir.Node(node.domain, node.op_type, inputs, attributes=attributes,
                           num_outputs=len(node.outputs), name=_clone_name(node, len(self.of)))
            for old, new in zip(node.outputs, copy.outputs):
                new.name = f"{old.name}/recomputed" if old.name else None
                new.type, new.shape = old.type, old.shape
                self.of[old] = new
            self.graph.insert_after(self._cursor, copy)
            self._cursor = copy
            for old, new in zip(node.outputs, copy.outputs):
                for reader, i in _backward_readers(old, self.forward):
                    reader.replace_input_with(i, new)


    def place(self) -> None:
        """Move each clone to just before the first gradient node that reads it (or reads a clone made
        from it). Made at the front of backward, every recomputed value would be alive from the start of
        backward on, beside the gradients (and the staged backward would run them in its first stage):
        the peak rose instead of falling when matrix products were recomputed so."""
        clones = [v.producer() for v in dict.fromkeys(self.of.values())]
        clones = list(dict.fromkeys(clones))  # in the order made: each after the clones it reads
        if not clones:
            return
        is_clone = set(clones)
        anchor: dict[ir.Node, ir.Node | None] = {}
        position = {node: k for k, node in enumerate(self.graph)}
        for clone in reversed(clones):  # readers first: a clone's clone readers were made after it
            first = None
            for out in clone.outputs:
                for reader, _ in out.uses():
                    where = anchor.get(reader) if reader in is_clone else reader
                    if where is not None and (first is None or position[where] < position[first]):
                        first = where
            anchor[clone] = first
        for clone in clones:
            if anchor[clone] is not None:
                self.graph.remove(clone)
        for clone in clones:
            if anchor[clone] is not None:
                self.graph.insert_before(anchor[clone], clone)


def _clone_name(node: ir.Node, k: int) -> str:
    return f"{node.name}/recomputed" if node.name else f"{node.op_type}/recomputed_{k}"


def _chain(value: ir.Value, leaves: set[ir.Value]) -> list[ir.Node]:
    nodes: list[ir.Node] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or v in leaves:
            continue
        node = v.producer()
        if node not in nodes:
            nodes.append(node)
            stack.extend(node.inputs)
    return nodes[::-1]
