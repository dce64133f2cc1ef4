"""Reverse-mode automatic differentiation over ONNX graphs.

``build_gradients`` is the engine, on ``onnx_ir`` graphs: it finds the nodes that lie on a path from a
``wrt`` value to a differentiated output, checks that each has a rule (one error lists every op that
lacks one), walks them in reverse, calls the rules, un-broadcasts, and sums gradients that fan in.
``gradient_model`` is the file-level contract on ``onnx.ModelProto``s.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from onnxtrain.autodiff.broadcast import sum_to_shape
from onnxtrain.autodiff.builder import GraphBuilder, is_float
from onnxtrain.autodiff.registry import (
    GradContext,
    Registry,
    Rule,
    normalize_domain,
    zeros_like,
)
from onnxtrain.autodiff.stop_gradient import infer_shapes

# Lowest opset the rules are written for (ReduceSum/Squeeze/Unsqueeze take axes as inputs from 13).
MIN_OPSET = 13
# Highest IR version we emit unless the opsets need more: onnxruntime >= 1.20 reads IR 10.
MAX_IR_VERSION = 10


class UnsupportedOpError(NotImplementedError):
    """Raised when ops on the path to a ``wrt`` value have no gradient rule; lists every one of them."""

    def __init__(self, missing: Sequence[tuple[str, str, str, str]], opset: int | None = None):
        self.missing = list(missing)  # (domain, op_type, node name, wrt it leads to)
        not_ops = sorted({op for dom, op, _, _ in self.missing if not dom and opset and not _is_onnx_op(op, opset)})
        if not_ops:  # a misspelt op is a broken model, not a missing rule
            nodes = [f"{op} (node {name!r})" for dom, op, name, _ in self.missing if not dom and op in not_ops]
            known = sorted({s.name for s in onnx.defs.get_all_schemas() if not s.domain})
            close = {op: [k for k in known if sorted(k.lower()) == sorted(op.lower())]  # swapped letters first
                     or difflib.get_close_matches(op, known, 1) for op in not_ops}
            hints = [f"{op}: did you mean {close[op][0]}?" for op in not_ops if close[op]]
            super().__init__(f"{', '.join(nodes)}: not an op of ONNX opset {opset}"
                             + (f" ({'; '.join(hints)})" if hints else "") + "; fix the model's node")
            return
        lines = [
            f"  - {op} (domain {dom or 'ai.onnx'}), node {name!r}, on the path to {target!r}"
            for dom, op, name, target in self.missing
        ]
        kinds = sorted({f"{dom or 'ai.onnx'}::{op}" for dom, op, _, _ in self.missing})
        super().__init__(
            f"no gradient rule for {len(kinds)} op type(s) ({', '.join(kinds)}) on the path from the "
            "requested gradients to the outputs:\n" + "\n".join(lines) + "\n"
            "Register a rule for it (see onnxtrain/autodiff/rules), freeze the parameters behind it, "
            "or rewrite the model so that the op is off the gradient path."
        )


def _is_onnx_op(op_type: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


@dataclass
class _Plan:
    on_path: list[ir.Node]
    rules: dict[ir.Node, Rule]
    needed: set[ir.Value]


def _maybe_float(value: ir.Value | None) -> bool:
    """Float, or of unknown type (an op shape inference does not know): never cut a path silently."""
    return value is not None and (value.dtype is None or is_float(value))


def _opset_of(node: ir.Node, opsets: dict[str, int]) -> int:
    if node.version is not None:
        return node.version
    return opsets.get(normalize_domain(node.domain), opsets.get("ai.onnx", 1))


def _graph_opsets(graph: ir.Graph) -> dict[str, int]:
    return {normalize_domain(k): v for k, v in graph.opset_imports.items()}


def _check_order(nodes: list[ir.Node]) -> None:
    """Raise if a node reads a value that a later node produces: the walks below rely on the order, and a
    gradient would silently miss that value's contribution."""
    seen: set[ir.Node] = set()
    members = set(nodes)
    for node in nodes:
        for v in node.inputs:
            producer = None if v is None else v.producer()
            if producer is not None and producer in members and producer not in seen:
                raise ValueError(f"the graph is not in topological order: node {node.name!r} ({node.op_type}) "
                                 f"reads {v.name!r} before node {producer.name!r} ({producer.op_type}) produces it")
        seen.add(node)


def _plan(graph: ir.Graph, wrt: Sequence[ir.Value], outputs: Sequence[ir.Value],
          registry: Registry) -> _Plan:
    opsets = _graph_opsets(graph)
    nodes = list(graph)
    _check_order(nodes)
    rules: dict[ir.Node, Rule | None] = {}

    # Values that depend (differentiably) on a wrt value.
    active: set[ir.Value] = {v for v in wrt}
    origin: dict[ir.Value, str] = {v: v.name for v in wrt}
    for node in nodes:
        hits = [v for v in node.inputs if v is not None and v in active]
        if not hits:
            continue
        rule = registry.lookup(node.domain, node.op_type, _opset_of(node, opsets))
        rules[node] = rule
        if rule is not None and not rule.differentiable:
            continue
        for out in node.outputs:
            if _maybe_float(out):
                active.add(out)
                origin[out] = origin[hits[0]]

    # Of those, the ones whose gradient reaches an output.
    needed: set[ir.Value] = {v for v in outputs if v in active}
    on_path: list[ir.Node] = []
    for node in reversed(nodes):
        if node not in rules or not any(o in needed for o in node.outputs):
            continue
        rule = rules[node]
        if rule is not None and not rule.differentiable:
            continue
        ins = [v for v in node.inputs if v is not None and v in active and _maybe_float(v)]
        if not ins:
            continue
        on_path.append(node)
        needed.update(ins)

    missing = [
        (normalize_domain(n.domain), n.op_type, n.name or "<unnamed>",
         origin.get(next(v for v in n.inputs if v is not None and v in active), "?"))
        for n in reversed(on_path) if rules[n] is None
    ]
    if missing:
        raise UnsupportedOpError(missing, opsets.get(""))
    return _Plan(on_path=on_path, rules={n: rules[n] for n in on_path}, needed=needed)


def _sum(b: GraphBuilder, terms: list[ir.Value], like: ir.Value) -> ir.Value:
    """The gradient of ``like``: the sum of its terms, each already of ``like``'s shape."""
    total = terms[0] if len(terms) == 1 else b.Sum(*terms)
    _shape_like(total, like)
    return total


def _shape_like(grad: ir.Value, value: ir.Value) -> None:
    """A gradient has its value's shape (rules un-broadcast): say so where nothing inferred it, so that
    later passes can see that the terms of a gradient sum do not broadcast."""
    if grad.shape is None and value.shape is not None and not grad.is_graph_input():
        grad.shape = value.shape


def build_gradients(graph: ir.Graph, wrt: Sequence[ir.Value], outputs: Sequence[ir.Value],
                    output_grads: Sequence[ir.Value], builder: GraphBuilder,
                    registry: Registry | None = None) -> list[ir.Value]:
    """Emit (into ``builder``) the gradient of ``sum(output * output_grad)`` with respect to ``wrt``.

    Returns one gradient value per ``wrt`` value; a value with no path to the outputs gets zeros.
    The caller inserts ``builder.nodes`` after the forward nodes.
    """
    if registry is None:
        from onnxtrain.autodiff.rules import REGISTRY as registry
    if len(outputs) != len(output_grads):
        raise ValueError("need one output gradient per differentiated output")
    plan = _plan(graph, wrt, outputs, registry)
    opsets = _graph_opsets(graph)

    grads: dict[ir.Value, list[ir.Value]] = {}
    for out, seed in zip(outputs, output_grads):
        grads.setdefault(out, []).append(seed)

    for node in plan.on_path:
        dy = [_sum(builder, grads.pop(o), o) if o in grads else None for o in node.outputs]
        if all(d is None for d in dy):
            continue
        rule = plan.rules[node]
        needs = [v is not None and v in plan.needed for v in node.inputs]
        builder.scope = f"{node.name or node.op_type}_Grad"
        ctx = GradContext(node, dy, needs, builder, _opset_of(node, opsets), opsets.get("", MIN_OPSET))
        result = tuple(rule.fn(ctx))
        while len(result) > len(node.inputs) and result[-1] is None:
            result = result[:-1]  # rules may name optional inputs the node omits
        if len(result) > len(node.inputs):
            raise ValueError(
                f"gradient rule {rule.fn.__name__} for {node.op_type} returned {len(result)} gradients "
                f"for {len(node.inputs)} inputs (node {node.name!r})"
            )
        for value, grad, wanted in zip(node.inputs, result, needs):
            if grad is None or not wanted:
                continue
            if rule.broadcast:
                grad = sum_to_shape(builder, grad, value, node.outputs[0].shape)
            _shape_like(grad, value)
            grads.setdefault(value, []).append(grad)
    builder.scope = ""

    return [_sum(builder, grads[v], v) if v in grads else zeros_like(builder, v) for v in wrt]


# -------------------------------------------------------------------------------------------------
# The model-level contract
# -------------------------------------------------------------------------------------------------


def prepare_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Bring a model to what the engine needs: opset >= 13, local functions inlined, shapes inferred."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise ValueError("the model imports no ai.onnx opset")
    if opset < MIN_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as exc:
            raise ValueError(
                f"the model uses opset {opset}; onnxtrain needs opset {MIN_OPSET} or newer and the "
                f"automatic conversion failed ({exc}). Re-export it with opset >= {MIN_OPSET}."
            ) from exc
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    if model.ByteSize() < 2**31 - 1:
        try:
            model = infer_shapes(model, data_prop=True)  # StopGradient seen as Identity
        except Exception:
            pass  # shapes are a help; the engine reports precisely where one is missing and needed
    return model


def fold_constants(model: ir.Model, protected: set[ir.Value]) -> None:
    """Fold constant subgraphs (shape arithmetic, Slice axes, masks) so rules see constants.

    Nodes reading a ``protected`` value (the parameters being differentiated) are never folded, so a
    ``Transpose(weight)`` stays a node and the weight stays a parameter: protected initializers are
    graph inputs while folding (the folder never folds a node that reads a graph input).
    """
    try:
        from onnxscript.optimizer import fold_constants as fold
    except ImportError:  # onnxscript is a dependency; without it models keep their constant subgraphs
        return
    graph = model.graph
    lifted = [v for v in protected if v.is_initializer() and not v.is_graph_input()]
    graph.inputs.extend(lifted)
    try:
        fold(model, onnx_shape_inference=False)
    finally:
        for v in lifted:
            graph.inputs.remove(v)
    ir.passes.common.RemoveUnusedNodesPass()(model)


def values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    """Every named value of ``graph``: inputs, initializers and node outputs."""
    values: dict[str, ir.Value] = {}
    for v in graph.inputs:
        values[v.name] = v
    for name, v in graph.initializers.items():
        values.setdefault(name, v)
    for node in graph:
        for v in node.outputs:
            if v.name:
                values.setdefault(v.name, v)
    return values


def grad_name(name: str) -> str:
    """The name of the gradient input/output belonging to ``name`` (never sanitized)."""
    return f"{name}_grad"


def gradient_model(model: onnx.ModelProto | str | os.PathLike, wrt: Sequence[str],
                   outputs: Sequence[str] | None = None) -> onnx.ModelProto:
    """Return a model computing the forward outputs plus the gradients of ``outputs`` w.r.t. ``wrt``.

    The result keeps every input and output of ``model``; it takes one extra input ``<out>_grad`` per
    differentiated output (the incoming gradient, same shape and type) and returns one extra output
    ``<name>_grad`` per ``wrt`` name, in order. Names are used verbatim: ONNX allows any string, so
    ``fc1.weight`` gets ``fc1.weight_grad``. If the model already has an internal value of that name, the
    internal value is renamed; a clash with a graph input or output is an error.
    """
    from onnxtrain.utils.io import load_model

    proto = prepare_model(load_model(model))
    ir_model = ir.from_proto(proto)
    graph = ir_model.graph
    ir.passes.common.TopologicalSortPass()(ir_model)
    values = values_by_name(graph)

    if isinstance(wrt, str):
        wrt = [wrt]
    wrt_values = []
    for name in wrt:
        v = values.get(name)
        if v is None or not (v.is_graph_input() or v.is_initializer()):
            raise KeyError(
                f"wrt name {name!r} is not a graph input or initializer of the model "
                f"(inputs: {[i.name for i in graph.inputs]}, "
                f"{len(graph.initializers)} initializers such as {list(graph.initializers)[:5]})"
            )
        if not is_float(v):
            raise TypeError(f"wrt name {name!r} has element type {v.dtype}; only float tensors have gradients")
        wrt_values.append(v)
    if len(set(wrt)) != len(wrt):
        raise ValueError(f"wrt names repeat: {list(wrt)}")
    fold_constants(ir_model, protected=set(wrt_values))

    graph_outputs = {v.name: v for v in graph.outputs}
    if outputs is None:
        out_values = [v for v in graph.outputs if is_float(v)]
    else:
        missing = [n for n in outputs if n not in graph_outputs]
        if missing:
            raise KeyError(f"outputs {missing} are not graph outputs (outputs: {list(graph_outputs)})")
        out_values = [graph_outputs[n] for n in outputs]
        for v in out_values:
            if not is_float(v):
                raise TypeError(f"output {v.name!r} is not a float tensor and has no gradient")
    if not out_values:
        raise ValueError("the model has no floating-point output to differentiate")

    seed_names = [grad_name(v.name) for v in out_values]
    clash = sorted(set(seed_names) & {grad_name(n) for n in wrt})
    if clash:
        raise ValueError(
            f"{clash[0]!r} would name both an output-gradient input and a gradient output (a value is "
            "both differentiated and differentiated against); drop it from `outputs` or from `wrt`"
        )
    reserve_names(graph, seed_names)
    seeds = [ir.Value(name=name, type=v.type, shape=v.shape) for name, v in zip(seed_names, out_values)]
    graph.inputs.extend(seeds)
    add_gradient_outputs(ir_model, wrt_values, out_values, seeds)
    return ir_version_for_onnxruntime(ir.to_proto(ir_model))


def reserve_names(graph: ir.Graph, names: Sequence[str]) -> set[str]:
    """Free ``names`` for new graph inputs/outputs; internal values of those names are renamed.

    A clash with an existing graph input or output is an error. Returns every name now taken.
    """
    values = values_by_name(graph)
    io_names = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    taken = set(values) | set(names)
    for name in names:
        if name in io_names:
            raise ValueError(f"the model already has an input or output named {name!r}; rename it first")
        if name in values:  # an internal value: step aside
            new = f"{name}__orig"
            while new in taken:
                new += "_"
            values[name].name = new
            taken.add(new)
    return taken


def add_gradient_outputs(model: ir.Model, wrt: Sequence[ir.Value], outputs: Sequence[ir.Value],
                         seeds: Sequence[ir.Value] | None = None,
                         names: Sequence[str] | None = None) -> list[ir.Value]:
    """Append the gradient of ``outputs`` w.r.t. ``wrt`` to ``model`` as outputs ``<name>_grad``.

    ``seeds`` are the incoming output gradients (values the caller added, e.g. graph inputs);
    ``None`` differentiates scalar outputs with a seed of one (a loss). ``names`` default to the
    ``wrt`` values' names. Returns the new graph outputs, in ``wrt`` order.
    """
    graph = model.graph
    out_names = [grad_name(n) for n in (names if names is not None else [v.name for v in wrt])]
    builder = GraphBuilder(taken_names=reserve_names(graph, out_names), opset=_graph_opsets(graph).get("", MIN_OPSET))
    if seeds is None:
        seeds = [builder.const(np.ones((), dtype=v.dtype.numpy())) for v in outputs]
    grads = build_gradients(graph, wrt, outputs, seeds, builder)
    made = set(builder.nodes)
    final: list[ir.Value] = []
    for name, v, g in zip(out_names, wrt, grads):
        # A gradient that is not a new value (a seed, a forward value) or is shared gets its own node.
        if g.producer() not in made or g in final or g.is_graph_output():
            g = builder.Identity(g)
        g.name, g.type, g.shape = name, v.type, v.shape
        final.append(g)
    graph.extend(builder.nodes)
    graph.outputs.extend(final)
    if any(n.domain == "com.microsoft" for n in builder.nodes):
        graph.opset_imports.setdefault("com.microsoft", 1)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return final


def ir_version_for_onnxruntime(model: onnx.ModelProto) -> onnx.ModelProto:
    """Lower the IR version to one every supported onnxruntime reads, but not below what the opsets need."""
    needed = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(needed, min(model.ir_version, MAX_IR_VERSION))
    return model


__all__ = [
    "UnsupportedOpError",
    "add_gradient_outputs",
    "build_gradients",
    "grad_name",
    "gradient_model",
    "ir_version_for_onnxruntime",
    "prepare_model",
    "reserve_names",
    "sum_to_shape",
    "values_by_name",
]
