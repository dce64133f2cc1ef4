"""What the LSTM, GRU and RNN gradients share: reading the node, time shifts, a Scan helper, stacking.

Every recurrent gradient follows the same plan, per direction:
1. take the hidden states ``h_t`` from the forward output ``Y`` (the rule asks the node for ``Y`` if
   it omitted it) and form ``H_prev`` (the state each step started from) by shifting them one step;
2. recompute the gate activations for all time steps at once with plain ops (no loop: the inputs of
   every step are known);
3. run one reverse-time ``Scan`` that carries the gradient of the state (and of the LSTM cell) back,
   step by step, emitting the gradients of the gate pre-activations;
4. turn those into the gradients of ``X``, ``W``, ``R``, ``B`` with a few large matrix products.
Nothing depends on a static sequence length.

All time-major tensors here are in layout 0 (``[seq, batch, ...]``); ``read_node`` transposes
layout-1 inputs and ``finish`` transposes the gradients back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder
from onnxtrain.autodiff.registry import GradContext

# Input positions shared by LSTM, GRU and RNN.
X, W, R, B, SEQUENCE_LENS, INITIAL_H, INITIAL_C, P = range(8)
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min


class UnsupportedRecurrentError(NotImplementedError):
    """The node uses a feature of LSTM/GRU/RNN that the gradient rule does not cover."""


@dataclass
class RecurrentNode:
    """A recurrent node read for its gradient; the tensors are in layout 0."""

    g: GradContext
    hidden: int  # H, static
    directions: list[str]  # ["forward"], ["reverse"] or ["forward", "reverse"]
    x: ir.Value  # [T, B, I]
    y: ir.Value  # [T, D, B, H]
    dy: ir.Value | None  # gradient of Y, [T, D, B, H]
    dy_h: ir.Value | None  # gradient of Y_h, [D, B, H]
    dy_c: ir.Value | None  # gradient of Y_c (LSTM), [D, B, H]
    initial_h: ir.Value | None  # [D, B, H]
    initial_c: ir.Value | None  # [D, B, H]
    layout: int = 0
    dtype: ir.DataType = ir.DataType.FLOAT  # element type of X and of every gradient
    activations: list[str] = field(default_factory=list)  # lower-case names, all directions
    _zeros: ir.Value | None = field(default=None, repr=False)

    @property
    def b(self) -> GraphBuilder:
        return self.g.b

    def zeros_state(self) -> ir.Value:
        """Zeros of shape [B, H] (a missing initial state, or a state gradient nothing flows into)."""
        if self._zeros is None:
            b = self.b
            batch = b.Slice(b.Shape(self.x), b.ints([1]), b.ints([2]))
            shape = b.Concat(batch, b.ints([self.hidden]), axis=0)
            zero = ir.tensor(np.zeros((1,), dtype=self.dtype.numpy()))
            self._zeros = b.ConstantOfShape(shape, value=zero)
        return self._zeros

    def per_direction(self, value: ir.Value | None, d: int, axis: int) -> ir.Value | None:
        """Direction ``d`` of a tensor with a num_directions axis (that axis removed)."""
        if value is None:
            return None
        return self.b.Gather(value, self.b.ints(d), axis=axis)

    def state(self, value: ir.Value | None, d: int) -> ir.Value:
        """Direction ``d`` of an initial state or a state gradient, zeros when absent: [B, H]."""
        return self.per_direction(value, d, 0) if value is not None else self.zeros_state()


def unsupported(node: ir.Node, what: str) -> UnsupportedRecurrentError:
    return UnsupportedRecurrentError(
        f"{node.op_type} node {node.name!r}: the gradient does not support {what}. "
        f"Supported: directions forward/reverse/bidirectional, layout 0 or 1, optional B, initial_h"
        f"{', initial_c' if node.op_type == 'LSTM' else ''}, default activations. Re-export the model "
        "without it, or keep this node off the gradient path (freeze its weights and inputs)."
    )


def read_node(g: GradContext, default_activations: Sequence[str],
              activation_choices: Sequence[str] = ()) -> RecurrentNode:
    """Check the node's attributes and inputs, and bring what the gradient needs to layout 0.

    ``activation_choices``: for ops with one activation per direction (RNN), the ones the rule
    differentiates besides the default; otherwise only the defaults are accepted.
    """
    node = g.node
    direction = g.attr("direction", "forward")
    if isinstance(direction, bytes):
        direction = direction.decode()
    if direction not in ("forward", "reverse", "bidirectional"):
        raise unsupported(node, f"direction={direction!r}")
    directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]

    defaults = [a.lower() for a in default_activations]
    activations = defaults * len(directions)
    if g.attr("activations") is not None:
        names = [a.decode() if isinstance(a, bytes) else a for a in g.attr("activations")]
        lowered = [a.lower() for a in names]
        if lowered == defaults:  # some exporters list them once for both directions
            lowered = defaults * len(directions)
        choices = {*defaults, *(c.lower() for c in activation_choices)}
        if len(lowered) != len(activations) or any(
            a not in choices if activation_choices else a != want for a, want in zip(lowered, activations)
        ):
            allowed = sorted(choices) if activation_choices else list(default_activations)
            raise unsupported(node, f"attribute activations={names} (per direction: {allowed})")
        activations = lowered
    for name in ("activation_alpha", "activation_beta", "clip"):
        if g.attr(name) is not None:
            raise unsupported(node, f"attribute {name!r}")
    if g.attr("input_forget", 0):
        raise unsupported(node, "attribute input_forget=1")
    layout = g.attr("layout", 0)
    if layout not in (0, 1):
        raise unsupported(node, f"attribute layout={layout}")
    if node.op_type == "LSTM" and g.has_input(P):
        raise unsupported(node, "peepholes (input P)")
    if g.has_input(SEQUENCE_LENS):
        _check_full_sequence_lens(g, layout)

    hidden = g.attr("hidden_size")
    r_shape = g.inputs[R].shape
    if hidden is None and r_shape is not None and isinstance(r_shape[-1], int):
        hidden = r_shape[-1]
    if not isinstance(hidden, int):
        raise ValueError(f"{node.op_type} node {node.name!r}: the gradient needs a static hidden size "
                         "(attribute hidden_size, or a static last dimension of R)")

    b = g.b
    x, y = g.inputs[X], g.output(0)
    dy, dy_h = g.dy[0], (g.dy[1] if len(g.dy) > 1 else None)
    dy_c = g.dy[2] if len(g.dy) > 2 else None
    initial_h = g.inputs[INITIAL_H] if g.has_input(INITIAL_H) else None
    initial_c = g.inputs[INITIAL_C] if node.op_type == "LSTM" and g.has_input(INITIAL_C) else None
    if layout == 1:  # [B, T, I] -> [T, B, I]; Y [B, T, D, H] -> [T, D, B, H]; states [B, D, H] -> [D, B, H]
        x = b.Transpose(x, perm=[1, 0, 2])
        y = b.Transpose(y, perm=[1, 2, 0, 3])
        dy = b.Transpose(dy, perm=[1, 2, 0, 3]) if dy is not None else None
        dy_h, dy_c, initial_h, initial_c = (
            b.Transpose(v, perm=[1, 0, 2]) if v is not None else None
            for v in (dy_h, dy_c, initial_h, initial_c)
        )
    return RecurrentNode(g, hidden, directions, x, y, dy, dy_h, dy_c, initial_h, initial_c, layout,
                         g.inputs[X].dtype or g.inputs[W].dtype, activations)


def _check_full_sequence_lens(g: GradContext, layout: int) -> None:
    """sequence_lens is accepted only when it is a constant equal to the full sequence length."""
    lens = g.const_input(SEQUENCE_LENS)
    x_shape = g.inputs[X].shape
    seq = x_shape[1 if layout else 0] if x_shape is not None else None
    if lens is None or not isinstance(seq, int) or not np.all(lens == seq):
        raise unsupported(g.node, "input sequence_lens (variable sequence lengths); only a constant "
                                  "equal to the full sequence length is accepted")


# -------------------------------------------------------------------------------------------------
# Time shifts and gates
# -------------------------------------------------------------------------------------------------


def previous_states(b: GraphBuilder, states: ir.Value, first: ir.Value, reverse: bool) -> ir.Value:
    """The state each step started from: ``[first, s_0, ..., s_{T-2}]`` (forward) or
    ``[s_1, ..., s_{T-1}, first]`` (reverse); ``states`` is [T, B, H] and ``first`` [B, H]."""
    first = b.Unsqueeze(first, b.ints([0]))
    if reverse:
        return b.Concat(b.Slice(states, b.ints([1]), b.ints([INT64_MAX]), b.ints([0])), first, axis=0)
    return b.Concat(first, b.Slice(states, b.ints([0]), b.ints([-1]), b.ints([0])), axis=0)


def split_last(b: GraphBuilder, value: ir.Value, sizes: Sequence[int], axis: int = -1) -> tuple:
    """Split along ``axis`` into static sizes (works from opset 13: sizes as an input)."""
    parts = b.op("Split", value, b.ints(list(sizes)), axis=axis, num_outputs=len(sizes))
    return parts if len(sizes) > 1 else (parts,)


def affine(b: GraphBuilder, inputs: ir.Value, weight: ir.Value, bias: ir.Value | None) -> ir.Value:
    """``inputs @ weight^T (+ bias)`` for time-major inputs [T, B, K] and weight [G, K]."""
    out = b.MatMul(inputs, b.Transpose(weight, perm=[1, 0]))
    return b.Add(out, bias) if bias is not None else out


def one_minus(b: GraphBuilder, x: ir.Value, dtype: ir.DataType) -> ir.Value:
    return b.Sub(b.const(1.0, dtype=dtype), x)


def sigmoid_slope(b: GraphBuilder, s: ir.Value, dtype: ir.DataType) -> ir.Value:
    """d sigmoid / d a, from s = sigmoid(a)."""
    return b.Mul(s, one_minus(b, s, dtype))


def tanh_slope(b: GraphBuilder, t: ir.Value, dtype: ir.DataType) -> ir.Value:
    """d tanh / d a, from t = tanh(a)."""
    return one_minus(b, b.Mul(t, t), dtype)


def sum_over_time_and_batch(g: GradContext, grad: ir.Value) -> ir.Value:
    return g.reduce("ReduceSum", grad, [0, 1], keepdims=0)


def outer_sum(b: GraphBuilder, grad: ir.Value, inputs: ir.Value) -> ir.Value:
    """``sum_t grad_t^T @ inputs_t`` for [T, B, G] and [T, B, K]: a [G, K] weight gradient."""
    return b.Gemm(b.Flatten(grad, axis=2), b.Flatten(inputs, axis=2), transA=1)


def flip_time(b: GraphBuilder, x: ir.Value) -> ir.Value:
    """``x[::-1]`` along the leading (time) axis."""
    return b.Slice(x, b.ints([-1]), b.ints([INT64_MIN]), b.ints([0]), b.ints([-1]))


# -------------------------------------------------------------------------------------------------
# Scan
# -------------------------------------------------------------------------------------------------

StepFn = Callable[[GraphBuilder, list[ir.Value], list[ir.Value]], tuple[list[ir.Value], list[ir.Value]]]


def scan(b: GraphBuilder, step: StepFn, states: Sequence[ir.Value], xs: Sequence[ir.Value],
         num_outputs: int, reverse: bool, dtype: ir.DataType, name: str) -> tuple[list, list]:
    """Emit a ``Scan`` over the leading (time) axis of ``xs``.

    ``step(sb, state_args, x_args)`` builds one step with the builder ``sb`` and returns
    ``(new_states, step_outputs)``; it may use values of the enclosing graph directly.
    Returns ``(final_states, stacked_outputs)``, the outputs in the time order of ``xs`` whatever the
    scan direction.
    """
    sb = GraphBuilder(prefix=f"{b.scope}/{name}", opset=b.opset)
    sb.scope = f"{b.scope}/{name}"
    state_args = [ir.Value(name=f"{name}_state{i}", type=ir.TensorType(dtype)) for i in range(len(states))]
    x_args = [ir.Value(name=f"{name}_x{i}", type=ir.TensorType(dtype)) for i in range(len(xs))]
    new_states, outs = step(sb, state_args, x_args)
    if len(new_states) != len(states) or len(outs) != num_outputs:
        raise AssertionError("scan step returned the wrong number of values")

    body_outputs: list[ir.Value] = []
    for value in [*new_states, *outs]:
        # A body output must be produced in the body and appear once.
        if value.producer() is None or value.producer() not in sb.nodes or value in body_outputs:
            value = sb.Identity(value)
        body_outputs.append(value)
    # Names unique across the whole model (subgraphs may not shadow outer names).
    for arg in [*state_args, *x_args]:
        arg.name = b.fresh_name(f"{sb.scope}/{arg.name}")
    for node in sb.nodes:
        node.name = b.fresh_name(node.name)
        for out in node.outputs:
            out.name = b.fresh_name(out.name)
    for value in body_outputs:
        value.type = ir.TensorType(dtype)
    body = ir.Graph([*state_args, *x_args], body_outputs, nodes=sb.nodes,
                    name=b.fresh_name(f"{sb.scope}_body"))

    # A reverse scan is a forward one over time-flipped inputs: Scan's own scan_input_directions
    # would do, but onnx.reference (our float64 check) implements only the forward direction.
    if reverse:
        xs = [flip_time(b, x) for x in xs]
    results = b.op("Scan", *states, *xs, body=body, num_scan_inputs=len(xs),
                   num_outputs=len(states) + num_outputs)
    results = list(results) if isinstance(results, tuple) else [results]
    if reverse:
        results[len(states):] = [flip_time(b, y) for y in results[len(states):]]
    return results[: len(states)], results[len(states):]


# -------------------------------------------------------------------------------------------------
# Assembling the gradients of all directions
# -------------------------------------------------------------------------------------------------


@dataclass
class DirectionGrads:
    """The gradients of one direction (layout 0, no num_directions axis); None when not needed."""

    x: ir.Value | None = None  # [T, B, I]
    w: ir.Value | None = None  # [G*H, I]
    r: ir.Value | None = None  # [G*H, H]
    b: ir.Value | None = None  # [2*G*H]
    initial_h: ir.Value | None = None  # [B, H]
    initial_c: ir.Value | None = None  # [B, H]


def input_side_grads(rn: RecurrentNode, grads: DirectionGrads, gate_grads: ir.Value, w: ir.Value) -> None:
    """Fill the X and W gradients from the gradients of the input-side pre-activations [T, B, G*H]."""
    g, b = rn.g, rn.b
    if g.needs[X]:
        grads.x = b.MatMul(gate_grads, w)
    if g.needs[W]:
        grads.w = outer_sum(b, gate_grads, rn.x)


def finish(rn: RecurrentNode, per_direction: list[DirectionGrads]) -> tuple:
    """Stack the directions, restore the layout; one gradient per node input."""
    b, g = rn.b, rn.g

    def stack(name: str) -> ir.Value | None:
        parts = [getattr(d, name) for d in per_direction]
        if any(p is None for p in parts):
            return None
        if len(parts) == 1:
            return b.Unsqueeze(parts[0], b.ints([0]))
        return b.Concat(*(b.Unsqueeze(p, b.ints([0])) for p in parts), axis=0)

    dx = None
    if g.needs[X]:
        xs = [d.x for d in per_direction]
        dx = xs[0] if len(xs) == 1 else b.Add(*xs)
        if rn.layout == 1:
            dx = b.Transpose(dx, perm=[1, 0, 2])
    dh0, dc0 = stack("initial_h"), stack("initial_c")
    if rn.layout == 1:
        dh0 = b.Transpose(dh0, perm=[1, 0, 2]) if dh0 is not None else None
        dc0 = b.Transpose(dc0, perm=[1, 0, 2]) if dc0 is not None else None
    grads = [dx, stack("w"), stack("r"), stack("b"), None, dh0]
    if g.node.op_type == "LSTM":
        grads.append(dc0)
    return tuple(grads)


def wants(g: GradContext, i: int) -> bool:
    return i < len(g.needs) and g.needs[i]
