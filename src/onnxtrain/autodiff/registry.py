"""Gradient rules: one small function per op, registered declaratively in per-family tables.

A rule receives a :class:`GradContext` and returns one gradient per node input (``None`` for "no
gradient"; a shorter tuple means the trailing inputs get none). It states only the math: the engine
does the reverse walk, pruning, fan-in sums, un-broadcasting (for rules registered with
``broadcast=True``) and the arity check.

Each family of rules lives in ``rules/<family>.py`` and fills its own :class:`RuleTable`;
``rules/__init__.py`` lists the tables explicitly and :class:`Registry` joins them, rejecting two rules
for the same ``(domain, op_type)`` whose opset ranges overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.broadcast import sum_to_shape
from onnxtrain.autodiff.builder import GraphBuilder, is_float

ONNX_DOMAIN = ""
MS_DOMAIN = "com.microsoft"
# onnxtrain's own ops: ``StopGradient`` (an Identity that no gradient flows through; ORTModule marks
# ``detach()`` and ``no_grad`` blocks with it, and :mod:`onnxtrain.autodiff.stop_gradient` turns it into
# an Identity before a graph reaches onnxruntime).
ONNXTRAIN_DOMAIN = "onnxtrain"
STOP_GRADIENT = "StopGradient"


def normalize_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


class GradContext:
    """What a rule sees: the forward node, its values, the output gradients and a builder."""

    def __init__(self, node: ir.Node, dy: Sequence[ir.Value | None], needs: Sequence[bool],
                 builder: GraphBuilder, opset: int, onnx_opset: int | None = None):
        self.node = node
        self.inputs: list[ir.Value | None] = list(node.inputs)
        self.outputs: list[ir.Value] = list(node.outputs)
        self.dy = list(dy)
        self.needs = list(needs)  # needs[i]: is the gradient of input i wanted (grad_input_mask)
        self.b = builder
        self.opset = opset  # of the node's own domain
        self.onnx_opset = opset if onnx_opset is None else onnx_opset  # of ai.onnx: for the ops rules emit

    # -- attributes and constant inputs ---------------------------------------------------
    def attr(self, name: str, default=None):
        """The node's attribute ``name`` as a Python value (lists for repeated ones), or ``default``."""
        attr = self.node.attributes.get(name)
        if attr is None:
            return default
        value = attr.value
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return list(value)
        return value

    def const_input(self, i: int) -> np.ndarray | None:
        """The numpy value of input ``i`` if it is a constant or an initializer, else ``None``."""
        if i >= len(self.inputs) or self.inputs[i] is None:
            return None
        value = self.inputs[i]
        if value.const_value is not None:
            return value.const_value.numpy()
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            return producer.attributes["value"].value.numpy()
        return None

    def output(self, i: int) -> ir.Value:
        """Forward output ``i``, added to the node if it omitted it (Dropout's mask, LayerNorm's
        saved statistics, MaxPool's indices): backward then reuses it instead of recomputing."""
        if i >= len(self.node.outputs):
            self.node.resize_outputs(i + 1)
        for skipped in self.node.outputs[:i]:
            if skipped.name is None:  # outputs added below i stay omitted
                skipped.name = ""
        out = self.node.outputs[i]
        if not out.name:
            out.name = self.b.fresh_name(f"{self.node.name or self.node.op_type}_output_{i}")
        self.outputs = list(self.node.outputs)
        return out

    def has_input(self, i: int) -> bool:
        """Whether the node has its ``i``-th input (optional inputs may be absent)."""
        return i < len(self.inputs) and self.inputs[i] is not None

    # -- static shape facts ---------------------------------------------------------------
    @staticmethod
    def rank(value: ir.Value) -> int | None:
        """The rank of ``value``, or None when its shape is unknown."""
        return None if value.shape is None else len(value.shape)

    def shape(self, value: ir.Value) -> ir.Value:
        """A ``Shape`` node's output: the run-time shape of ``value``."""
        return self.b.Shape(value)

    def scalar(self, x: float, like: ir.Value | None = None) -> ir.Value:
        """A constant scalar ``x`` of the element type of ``like`` (default: the node's first input)."""
        return self.b.scalar(x, like if like is not None else self.inputs[0])

    def zeros_like(self, value: ir.Value) -> ir.Value:
        """Zeros of the shape and type of ``value``."""
        return zeros_like(self.b, value)

    def sum_to(self, grad: ir.Value, x: ir.Value, grad_shape=None) -> ir.Value:
        """Un-broadcast ``grad`` to ``x``'s shape; ``grad_shape`` defaults to output 0's shape."""
        return sum_to_shape(self.b, grad, x, self.outputs[0].shape if grad_shape is None else grad_shape)

    def reduce(self, op_type: str, x: ir.Value, axes, keepdims: int = 1) -> ir.Value:
        """``Reduce*`` over ``axes`` (a list of ints, or an int64 value) in the form this opset takes."""
        axes_as_input = self.onnx_opset >= (13 if op_type == "ReduceSum" else 18)
        if axes_as_input:
            return self.b.op(op_type, x, axes if isinstance(axes, ir.Value) else self.b.ints(list(axes)),
                             keepdims=keepdims)
        if isinstance(axes, ir.Value):
            raise ValueError(f"{op_type} of opset {self.onnx_opset} needs constant axes")
        return self.b.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def dy_or_zeros(self, i: int) -> ir.Value:
        """The gradient of output ``i``, or zeros of its shape when nothing flows into it."""
        return self.dy[i] if self.dy[i] is not None else self.zeros_like(self.outputs[i])


def zeros_like(b: GraphBuilder, value: ir.Value) -> ir.Value:
    zero = ir.tensor(np.zeros((1,), dtype=value.dtype.numpy()))
    return b.ConstantOfShape(b.Shape(value), value=zero)


RuleFn = Callable[[GradContext], Sequence[ir.Value | None]]


@dataclass(frozen=True)
class Rule:
    domain: str
    op_type: str
    fn: RuleFn
    since: int = 1
    until: int | None = None  # inclusive upper opset, None for open
    broadcast: bool = False  # the engine un-broadcasts the input gradients
    kind: str = "rule"  # "rule", "no_grad" (outputs not differentiable), "zero_grad" (gradient is 0)

    def covers(self, opset: int) -> bool:
        """Whether this rule applies at ``opset``."""
        return self.since <= opset and (self.until is None or opset <= self.until)

    @property
    def differentiable(self) -> bool:
        """False for ops registered as having no gradient (``no_grad``)."""
        return self.kind == "rule"


def _no_gradient(g: GradContext):
    return ()


class RuleTable:
    """The rules of one family, declared with the decorators and helpers below."""

    def __init__(self, family: str):
        self.family = family
        self.rules: list[Rule] = []

    def register(self, *op_types: str, domain: str = ONNX_DOMAIN, since: int = 1,
                 until: int | None = None, broadcast: bool = False):
        """Decorator: register the function as the gradient rule of ``op_types`` for opsets ``since``..``until``."""
        def decorate(fn: RuleFn) -> RuleFn:
            for op_type in op_types:
                self.rules.append(Rule(normalize_domain(domain), op_type, fn, since, until, broadcast))
            return fn

        return decorate

    # -- category helpers -----------------------------------------------------------------
    def no_grad(self, *op_types: str, domain: str = ONNX_DOMAIN) -> None:
        """Ops whose outputs carry no gradient (shapes, comparisons, indices, random numbers)."""
        for op_type in op_types:
            self.rules.append(Rule(normalize_domain(domain), op_type, _no_gradient, kind="no_grad"))

    def zero_grad(self, *op_types: str, domain: str = ONNX_DOMAIN) -> None:
        """Piecewise-constant float ops (Round, Floor, ...): their gradient is zero almost everywhere."""
        for op_type in op_types:
            self.rules.append(Rule(normalize_domain(domain), op_type, _no_gradient, kind="zero_grad"))

    def elementwise(self, op_type: str, dfdx: Callable[[GradContext, ir.Value, ir.Value], ir.Value],
                    domain: str = ONNX_DOMAIN, since: int = 1) -> None:
        """Unary elementwise ``y = f(x)``: ``dx = dy * dfdx(g, x, y)``."""

        def rule(g: GradContext):
            return (g.b.Mul(g.dy[0], dfdx(g, g.inputs[0], g.outputs[0])),)

        rule.__name__ = f"grad_{op_type}"
        self.register(op_type, domain=domain, since=since)(rule)

    def linear(self, op_type: str, adjoint: Callable[[GradContext, ir.Value], ir.Value],
               domain: str = ONNX_DOMAIN, since: int = 1) -> None:
        """Ops linear in their first input (the others are parameters): ``dx = adjoint(g, dy)``."""

        def rule(g: GradContext):
            return (adjoint(g, g.dy[0]),)

        rule.__name__ = f"grad_{op_type}"
        self.register(op_type, domain=domain, since=since)(rule)


class DuplicateRuleError(ValueError):
    pass


class Registry:
    """Every rule table joined, keyed by ``(domain, op_type)``; rejects two rules whose opset ranges overlap."""
    def __init__(self, *tables: RuleTable):
        self._rules: dict[tuple[str, str], list[Rule]] = {}
        for table in tables:
            for rule in table.rules:
                self._add(rule, table.family)

    def _add(self, rule: Rule, family: str) -> None:
        key = (rule.domain, rule.op_type)
        for other in self._rules.get(key, []):
            lo = max(rule.since, other.since)
            hi_candidates = [u for u in (rule.until, other.until) if u is not None]
            hi = min(hi_candidates) if hi_candidates else None
            if hi is None or lo <= hi:
                raise DuplicateRuleError(
                    f"two gradient rules for {rule.domain or 'ai.onnx'}::{rule.op_type} cover the same "
                    f"opsets ({family} table); give them disjoint since/until ranges"
                )
        self._rules.setdefault(key, []).append(rule)

    def lookup(self, domain: str, op_type: str, opset: int) -> Rule | None:
        """The rule for ``op_type`` in ``domain`` at ``opset``, or None when no rule covers it."""
        for rule in self._rules.get((normalize_domain(domain), op_type), []):
            if rule.covers(opset):
                return rule
        return None

    def __iter__(self):
        for rules in self._rules.values():
            yield from rules

    def op_types(self) -> list[tuple[str, str]]:
        """Every ``(domain, op_type)`` that has a rule, sorted."""
        return sorted(self._rules)


__all__ = [
    "GradContext",
    "Registry",
    "Rule",
    "RuleTable",
    "DuplicateRuleError",
    "is_float",
    "zeros_like",
    "ONNX_DOMAIN",
    "MS_DOMAIN",
]
