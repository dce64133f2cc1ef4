"""Gradient rules: the rnn family (LSTM, GRU, RNN).

Each rule recomputes the gates of every time step from the forward output ``Y`` with plain ops,
then carries the state gradient back through time with one ``Scan`` per direction, and finally
forms the weight gradients with a few large matrix products (see ``_rnn_common`` for the plan).
Notation per direction: ``x_t`` input, ``h_t`` hidden state, ``hp_t`` the state step t started from
(``h_{t-1}`` in processing order), ``dh`` the gradient of a state, ``dG`` the gradients of the gate
pre-activations, in ONNX's gate order (LSTM: i, o, f, c; GRU: z, r, h).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, RuleTable
from onnxtrain.autodiff.rules._rnn_common import (
    INITIAL_C,
    INITIAL_H,
    B,
    DirectionGrads,
    R,
    RecurrentNode,
    W,
    affine,
    finish,
    input_side_grads,
    one_minus,
    outer_sum,
    previous_states,
    read_node,
    scan,
    sigmoid_slope,
    split_last,
    sum_over_time_and_batch,
    tanh_slope,
    wants,
)

rules = RuleTable("rnn")
r = rules.register


@dataclass
class Direction:
    """The per-direction slices of a recurrent node's tensors (layout 0, no num_directions axis)."""

    index: int
    reverse: bool  # processes time from last to first
    w: ir.Value  # [G*H, I]
    r: ir.Value  # [G*H, H]
    w_bias: ir.Value | None  # [G*H]
    r_bias: ir.Value | None  # [G*H]
    h0: ir.Value  # [B, H], zeros when the node has no initial_h
    hs: ir.Value  # h_t for all t, [T, B, H]
    h_prev: ir.Value  # hp_t for all t, [T, B, H]
    dy: ir.Value | None  # gradient of Y for this direction, [T, B, H]
    dh_last: ir.Value  # gradient of the last state (Y_h), [B, H]: where the backward pass starts

    @property
    def backward_reverse(self) -> bool:
        """The backward Scan runs against the processing order."""
        return not self.reverse


def directions(rn: RecurrentNode, num_gates: int) -> list[Direction]:
    g, b = rn.g, rn.b
    gh = num_gates * rn.hidden
    out = []
    for index, name in enumerate(rn.directions):
        reverse = name == "reverse"
        w_bias = r_bias = None
        if g.has_input(B):
            w_bias, r_bias = split_last(b, rn.per_direction(g.inputs[B], index, 0), [gh, gh], axis=0)
        h0 = rn.state(rn.initial_h, index)
        hs = rn.per_direction(rn.y, index, 1)
        out.append(Direction(
            index=index, reverse=reverse,
            w=rn.per_direction(g.inputs[W], index, 0), r=rn.per_direction(g.inputs[R], index, 0),
            w_bias=w_bias, r_bias=r_bias, h0=h0, hs=hs,
            h_prev=previous_states(b, hs, h0, reverse),
            dy=rn.per_direction(rn.dy, index, 1), dh_last=rn.state(rn.dy_h, index),
        ))
    return out


def _bias_grad(g: GradContext, w_side: ir.Value, r_side: ir.Value) -> ir.Value:
    """The B gradient [Wb; Rb] from the gradients of the input- and state-side pre-activations."""
    wb = sum_over_time_and_batch(g, w_side)
    rb = wb if r_side is w_side else sum_over_time_and_batch(g, r_side)
    return g.b.Concat(wb, rb, axis=0)


def _add_bias(b, w_bias, r_bias):
    return b.Add(w_bias, r_bias) if w_bias is not None else None


# -------------------------------------------------------------------------------------------------
# LSTM
# -------------------------------------------------------------------------------------------------


@r("LSTM", since=7)
def grad_lstm(g: GradContext):
    """i, o, f = sigmoid(.), c~ = tanh(.) of x W^T + hp R^T + Wb + Rb;
    c_t = f c_{t-1} + i c~;  h_t = o tanh(c_t)."""
    rn = read_node(g, ("Sigmoid", "Tanh", "Tanh"))
    b, hidden = g.b, rn.hidden
    dtype = rn.dtype
    results = []
    for d in directions(rn, 4):
        pre = b.Add(affine(b, rn.x, d.w, _add_bias(b, d.w_bias, d.r_bias)), affine(b, d.h_prev, d.r, None))
        pre_i, pre_o, pre_f, pre_c = split_last(b, pre, [hidden] * 4)
        i, o, f, c_new = b.Sigmoid(pre_i), b.Sigmoid(pre_o), b.Sigmoid(pre_f), b.Tanh(pre_c)

        # The cell states are not a forward output: recompute c_t = f_t c_{t-1} + i_t c~_t.
        def cell_step(sb, states, xs):
            (c_prev,), (f_t, ic_t) = states, xs
            c = sb.Add(sb.Mul(f_t, c_prev), ic_t)
            return [c], [c]

        c0 = rn.state(rn.initial_c, d.index)
        _, (cs,) = scan(b, cell_step, [c0], [f, b.Mul(i, c_new)], 1, d.reverse, dtype, "cell")
        c_prev = previous_states(b, cs, c0, d.reverse)
        tanh_c = b.Tanh(cs)

        # dG = [dc, dh, dc, dc] * coef, with coef the local derivatives of h and c to each gate.
        coef = b.Concat(
            b.Mul(c_new, sigmoid_slope(b, i, dtype)),  # dc/d pre_i
            b.Mul(tanh_c, sigmoid_slope(b, o, dtype)),  # dh/d pre_o
            b.Mul(c_prev, sigmoid_slope(b, f, dtype)),  # dc/d pre_f
            b.Mul(i, tanh_slope(b, c_new, dtype)),  # dc/d pre_c
            axis=2,
        )
        dc_dh = b.Mul(o, tanh_slope(b, tanh_c, dtype))  # through h_t = o tanh(c_t)
        r_d = d.r

        def backward_step(sb, states, xs):
            (dh_next, dc_next), (coef_t, dc_dh_t, f_t, *dy_t) = states, xs
            dh = sb.Add(dh_next, dy_t[0]) if dy_t else dh_next
            dc = sb.Add(dc_next, sb.Mul(dh, dc_dh_t))
            dgates = sb.Mul(sb.Concat(dc, dh, dc, dc, axis=-1), coef_t)
            return [sb.MatMul(dgates, r_d), sb.Mul(dc, f_t)], [dgates]

        xs = [coef, dc_dh, f] + ([d.dy] if d.dy is not None else [])
        dc_last = rn.state(rn.dy_c, d.index)
        (dh0, dc0), (dgates,) = scan(b, backward_step, [d.dh_last, dc_last], xs, 1,
                                     d.backward_reverse, dtype, "backward")

        grads = DirectionGrads(initial_h=dh0 if wants(g, INITIAL_H) else None,
                               initial_c=dc0 if wants(g, INITIAL_C) else None)
        input_side_grads(rn, grads, dgates, d.w)
        if wants(g, R):
            grads.r = outer_sum(b, dgates, d.h_prev)
        if wants(g, B):
            grads.b = _bias_grad(g, dgates, dgates)
        results.append(grads)
    return finish(rn, results)


# -------------------------------------------------------------------------------------------------
# GRU
# -------------------------------------------------------------------------------------------------


@r("GRU", since=7)
def grad_gru(g: GradContext):
    """z, r = sigmoid(x W^T + hp R^T + Wb + Rb) (their z, r blocks);
    h~ = tanh(x Wh^T + (r hp) Rh^T + Rbh + Wbh)   (linear_before_reset=0)
    h~ = tanh(x Wh^T + r (hp Rh^T + Rbh) + Wbh)   (linear_before_reset=1);
    h_t = (1 - z) h~ + z hp."""
    rn = read_node(g, ("Sigmoid", "Tanh"))
    b, hidden = g.b, rn.hidden
    dtype = rn.dtype
    linear_before_reset = g.attr("linear_before_reset", 0)
    results = []
    for d in directions(rn, 3):
        x_z, x_r, x_h = split_last(b, affine(b, rn.x, d.w, d.w_bias), [hidden] * 3)
        hp = d.h_prev
        if linear_before_reset:
            h_z, h_r, h_lin = split_last(b, affine(b, hp, d.r, d.r_bias), [hidden] * 3)
            z, r_gate = b.Sigmoid(b.Add(x_z, h_z)), b.Sigmoid(b.Add(x_r, h_r))
            h_new = b.Tanh(b.Add(x_h, b.Mul(r_gate, h_lin)))
        else:
            r_zr, r_h = split_last(b, d.r, [2 * hidden, hidden], axis=0)
            rb_zr = rb_h = None
            if d.r_bias is not None:
                rb_zr, rb_h = split_last(b, d.r_bias, [2 * hidden, hidden], axis=0)
            h_z, h_r = split_last(b, affine(b, hp, r_zr, rb_zr), [hidden] * 2)
            z, r_gate = b.Sigmoid(b.Add(x_z, h_z)), b.Sigmoid(b.Add(x_r, h_r))
            reset_hp = b.Mul(r_gate, hp)
            h_new = b.Tanh(b.Add(x_h, affine(b, reset_hp, r_h, rb_h)))

        # Local derivatives of h_t to the pre-activations of z and h~.
        coef_z = b.Mul(b.Sub(hp, h_new), sigmoid_slope(b, z, dtype))
        coef_h = b.Mul(one_minus(b, z, dtype), tanh_slope(b, h_new, dtype))
        dy = [d.dy] if d.dy is not None else []
        grads = DirectionGrads()

        if linear_before_reset:
            # pre_h = x Wh^T + r * lin, lin = hp Rh^T + Rbh: d lin = d pre_h * r, d pre_r = d pre_h * lin * r'.
            # Every state-side pre-activation gradient is dh times a local derivative.
            coef_r = b.Mul(coef_h, b.Mul(h_lin, sigmoid_slope(b, r_gate, dtype)))
            coef_state = b.Concat(coef_z, coef_r, b.Mul(coef_h, r_gate), axis=2)
            r_d = d.r

            def backward_step(sb, states, xs):
                (dh_next,), (z_t, coef_t, *dy_t) = states, xs
                dh = sb.Add(dh_next, dy_t[0]) if dy_t else dh_next
                d_state_side = sb.Mul(sb.Concat(dh, dh, dh, axis=-1), coef_t)  # d(hp R^T + Rb)
                dh_prev = sb.Add(sb.Mul(dh, z_t), sb.MatMul(d_state_side, r_d))
                return [dh_prev], [dh, d_state_side]

            (dh0,), (dh_all, d_state_side) = scan(b, backward_step, [d.dh_last], [z, coef_state, *dy], 2,
                                                  d.backward_reverse, dtype, "backward")
            d_zr = b.Slice(d_state_side, b.ints([0]), b.ints([2 * hidden]), b.ints([2]))
            d_input_side = b.Concat(d_zr, b.Mul(dh_all, coef_h), axis=2)
            input_side_grads(rn, grads, d_input_side, d.w)
            if wants(g, R):
                grads.r = outer_sum(b, d_state_side, hp)
            if wants(g, B):
                grads.b = _bias_grad(g, d_input_side, d_state_side)
        else:
            # pre_h = x Wh^T + (r hp) Rh^T + Rbh: d(r hp) = d pre_h Rh, which flows to r and to hp.
            hp_slope = b.Mul(hp, sigmoid_slope(b, r_gate, dtype))

            def backward_step(sb, states, xs):
                (dh_next,), (z_t, r_t, coef_z_t, coef_h_t, hp_slope_t, *dy_t) = states, xs
                dh = sb.Add(dh_next, dy_t[0]) if dy_t else dh_next
                d_pre_h = sb.Mul(dh, coef_h_t)
                d_reset_hp = sb.MatMul(d_pre_h, r_h)
                d_zr = sb.Concat(sb.Mul(dh, coef_z_t), sb.Mul(d_reset_hp, hp_slope_t), axis=-1)
                dh_prev = sb.Sum(sb.Mul(dh, z_t), sb.Mul(d_reset_hp, r_t), sb.MatMul(d_zr, r_zr))
                return [dh_prev], [sb.Concat(d_zr, d_pre_h, axis=-1)]

            xs = [z, r_gate, coef_z, coef_h, hp_slope, *dy]
            (dh0,), (dgates,) = scan(b, backward_step, [d.dh_last], xs, 1,
                                     d.backward_reverse, dtype, "backward")
            input_side_grads(rn, grads, dgates, d.w)
            if wants(g, R):
                d_zr, d_pre_h = split_last(b, dgates, [2 * hidden, hidden])
                grads.r = b.Concat(outer_sum(b, d_zr, hp), outer_sum(b, d_pre_h, reset_hp), axis=0)
            if wants(g, B):
                grads.b = _bias_grad(g, dgates, dgates)
        if wants(g, INITIAL_H):
            grads.initial_h = dh0
        results.append(grads)
    return finish(rn, results)


# -------------------------------------------------------------------------------------------------
# RNN
# -------------------------------------------------------------------------------------------------


@r("RNN", since=7)
def grad_rnn(g: GradContext):
    """h_t = f(x W^T + hp R^T + Wb + Rb), f = Tanh (default), Relu or Sigmoid per direction."""
    rn = read_node(g, ("Tanh",), activation_choices=("Relu", "Sigmoid"))
    b, dtype = g.b, rn.dtype
    results = []
    for d in directions(rn, 1):
        slope = _activation_slope(b, rn.activations[d.index], d.hs, dtype)
        r_d = d.r

        def backward_step(sb, states, xs):
            (dh_next,), (slope_t, *dy_t) = states, xs
            dh = sb.Add(dh_next, dy_t[0]) if dy_t else dh_next
            d_pre = sb.Mul(dh, slope_t)
            return [sb.MatMul(d_pre, r_d)], [d_pre]

        xs = [slope] + ([d.dy] if d.dy is not None else [])
        (dh0,), (d_pre,) = scan(b, backward_step, [d.dh_last], xs, 1, d.backward_reverse,
                                dtype, "backward")
        grads = DirectionGrads(initial_h=dh0 if wants(g, INITIAL_H) else None)
        input_side_grads(rn, grads, d_pre, d.w)
        if wants(g, R):
            grads.r = outer_sum(b, d_pre, d.h_prev)
        if wants(g, B):
            grads.b = _bias_grad(g, d_pre, d_pre)
        results.append(grads)
    return finish(rn, results)


def _activation_slope(b, activation: str, h: ir.Value, dtype: ir.DataType) -> ir.Value:
    """f'(a) from h = f(a)."""
    if activation == "tanh":
        return tanh_slope(b, h, dtype)
    if activation == "sigmoid":
        return sigmoid_slope(b, h, dtype)
    assert activation == "relu", activation
    return b.Cast(b.Greater(h, b.const(0.0, dtype=dtype)), to=dtype)
