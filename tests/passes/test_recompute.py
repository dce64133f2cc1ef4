"""The recompute pass: the joint graph gives the same values before and after it (onnxruntime), the split
after it stashes fewer bytes as the budget falls, and its plan and knobs read as documented."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.passes import split_forward_backward
from onnxtrain.passes.recompute import KINDS, Recompute, RecomputePass, from_env, parse_budget, value_bytes

RNG = np.random.default_rng(0)
BATCH, HIDDEN = 6, 8


def _run(model, feeds):
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    proto.ir_version = min(proto.ir_version, 10)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, feeds)))


def _block() -> onnx.ModelProto:
    """Two MLP layers with a bias, a GELU made of pointwise ops and Erf, a Tanh and a Softmax head."""
    f = TensorProto.FLOAT
    nodes = []
    h = "x"
    for k in range(2):
        nodes += [
            helper.make_node("MatMul", [h, f"w{k}"], [f"m{k}"]),
            helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"]),
            helper.make_node("Mul", [f"a{k}", "inv_sqrt2"], [f"s{k}"]),
            helper.make_node("Erf", [f"s{k}"], [f"e{k}"]),
            helper.make_node("Add", [f"e{k}", "one"], [f"p{k}"]),
            helper.make_node("Mul", [f"a{k}", f"p{k}"], [f"q{k}"]),
            helper.make_node("Mul", [f"q{k}", "half"], [f"g{k}"]),
            helper.make_node("Tanh", [f"g{k}"], [f"t{k}"]),
        ]
        h = f"t{k}"
    nodes.append(helper.make_node("Softmax", [h], ["y"], axis=-1))
    inputs = [helper.make_tensor_value_info("x", f, ["batch", HIDDEN])]
    for k in range(2):
        inputs += [helper.make_tensor_value_info(f"w{k}", f, [HIDDEN, HIDDEN]),
                   helper.make_tensor_value_info(f"b{k}", f, [HIDDEN])]
    consts = [helper.make_tensor(n, f, [], [v]) for n, v in (("inv_sqrt2", 0.5 ** 0.5), ("one", 1.0), ("half", 0.5))]
    graph = helper.make_graph(nodes, "block", inputs, [helper.make_tensor_value_info("y", f, ["batch", HIDDEN])],
                              initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _feeds():
    x = RNG.standard_normal((BATCH, HIDDEN)).astype(np.float32)
    params = []
    for _ in range(2):
        params += [RNG.standard_normal((HIDDEN, HIDDEN)).astype(np.float32) / 3,
                   RNG.standard_normal(HIDDEN).astype(np.float32)]
    return [x, *params], RNG.standard_normal((BATCH, HIDDEN)).astype(np.float32)


def _training() -> onnx.ModelProto:
    return gradient_model(_block(), wrt=["x", "w0", "b0", "w1", "b1"])


def _stashed_bytes(split, dims) -> int:
    outputs = list(split.forward.graph.outputs)
    return sum(value_bytes(outputs[i], dims) or 0 for i in split.stashed_outputs)


def _recompute_and_split(plan: Recompute, inputs, dy):
    """Run the pass on the joint graph, then split it; both must give the joint graph's values."""
    training = _training()
    want = _run(training, [*inputs, dy])
    model = ir.from_proto(training)
    recompute = RecomputePass(num_forward_outputs=1, plan=plan, dims={"batch": BATCH})
    recompute(model)
    after = _run(model, [*inputs, dy])
    for got, expected in zip(after, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    split = split_forward_backward(model, num_forward_outputs=1, num_output_grads=1)
    outs = _run(split.forward, inputs)
    grads = _run(split.backward, [dy] + [outs[i] for i in split.stashed_outputs]
                 + [inputs[j] for j in split.reused_inputs])
    for got, expected in zip(grads, want[1:]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    return recompute.plan, split


def test_smaller_budgets_stash_fewer_bytes_with_the_same_gradients():
    inputs, dy = _feeds()
    dims = {"batch": BATCH}
    stashed, peaks = [], []
    for budget in (1.0, 0.75, 0.5, 0.25, 0.0):
        plan, split = _recompute_and_split(Recompute(budget=budget, kinds=KINDS), inputs, dy)
        stashed.append(_stashed_bytes(split, dims))
        peaks.append(plan.peak_bytes)
        kept = plan.stashed_bytes - plan.saved_bytes
        # Met down to 0.5; below, the candidates that would meet the budget raise the modelled peak.
        assert budget < 0.5 or kept <= budget * plan.stashed_bytes, (budget, kept)
    assert stashed == sorted(stashed, reverse=True) and stashed[-1] < stashed[0], stashed
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0], peaks
    # budget 1.0 recomputes nothing: every stashed forward value is read by backward as it is
    plan, _ = _recompute_and_split(Recompute(budget=1.0), inputs, dy)
    assert plan.saved_bytes == 0


def test_cheap_kinds_go_first_and_matmuls_only_when_allowed():
    inputs, dy = _feeds()
    # At 0.75 no candidate raises the modelled peak (below, a Tanh chain would, and is passed over).
    half, _ = _recompute_and_split(Recompute(budget=0.75, kinds=KINDS), inputs, dy)
    on = [c for c in half.candidates if c.on]
    off = [c for c in half.candidates if not c.on and c.saved]
    order = ("pointwise", "transcendental", "matmul")
    assert on and max(order.index(c.kind) for c in on) <= min((order.index(c.kind) for c in off), default=2)
    no_matmul, _ = _recompute_and_split(Recompute(budget=0.0, kinds=("pointwise", "transcendental")), inputs, dy)
    assert not any(c.on and c.kind == "matmul" for c in no_matmul.candidates)
    assert Recompute(budget=0.0) == Recompute(budget=0.0, kinds=KINDS)  # matrix products last, but tried
    everything, split = _recompute_and_split(Recompute(budget=0.0, kinds=KINDS), inputs, dy)
    assert everything.saved_bytes >= no_matmul.saved_bytes


def test_budget_zero_checkpoints_grow_subgraphs_back_to_kept_values_and_clones_sit_late():
    """At budget 0 a recomputed value's subgraph reaches back through the values recomputed before it (a
    chain with a MatMul and the GELU after it), and each clone reads only values that stay stashed, leaves
    and clones; each clone sits just before the first gradient node that needs it, not at the front of
    backward (where every recomputed value would be alive at once)."""
    inputs, dy = _feeds()
    plan, _ = _recompute_and_split(Recompute(budget=0.0, kinds=KINDS), inputs, dy)
    on = [c for c in plan.candidates if c.on]
    assert any(c.kind == "matmul" and len(c.nodes) > 2 for c in on), [c.pattern for c in on]
    dropped = {v for c in on for v in c.outputs}
    for c in on:
        inside = {v for n in c.nodes for v in n.outputs}
        assert not any(v in dropped and v not in inside for n in c.nodes for v in n.inputs), c.pattern

    model = ir.from_proto(_training())
    RecomputePass(num_forward_outputs=1, plan=Recompute(budget=0.0, kinds=KINDS), dims={"batch": BATCH})(model)
    nodes = list(model.graph)
    is_clone = [(n.name or "").rsplit("/", 1)[-1].startswith("recomputed") for n in nodes]
    assert any(is_clone)
    for k, node in enumerate(nodes):
        if not is_clone[k]:
            continue
        readers = {r for v in node.outputs for r, _ in v.uses()}
        nxt = next(j for j in range(k + 1, len(nodes)) if not is_clone[j])
        # the first non-clone node after it reads it, or reads a clone that (in turn) reads it
        frontier, reached = set(readers), set()
        while frontier:
            r = frontier.pop()
            reached.add(r)
            if is_clone[nodes.index(r)]:
                frontier |= {u for v in r.outputs for u, _ in v.uses()} - reached
        assert nodes[nxt] in reached, (node.name, nodes[nxt].op_type)


def test_default_plan_redoes_single_cheap_ops_only():
    inputs, dy = _feeds()
    plan, split = _recompute_and_split(Recompute(), inputs, dy)
    assert all(c.on == (c.kind == "pointwise" and len(c.nodes) == 1) for c in plan.candidates)
    backward_ops = {n.op_type for n in split.backward.graph}
    assert "Erf" not in backward_ops and "Tanh" not in backward_ops


def test_patterns_turn_on_exactly_those_subgraphs():
    inputs, dy = _feeds()
    plan, _ = _recompute_and_split(Recompute(), inputs, dy)
    pattern = next(c.pattern for c in plan.candidates if c.kind == "transcendental")
    chosen, split = _recompute_and_split(Recompute(patterns={pattern: 1}), inputs, dy)
    assert [c.pattern for c in chosen.candidates if c.on] == [pattern]


def test_plan_is_logged_as_a_table(caplog):
    inputs, dy = _feeds()
    with caplog.at_level(logging.INFO, logger="onnxtrain.passes"):
        _recompute_and_split(Recompute(budget=0.5), inputs, dy)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "recompute plan:" in text and "MiB saved" in text and "Erf+" in text


def test_knobs_parse_and_bad_values_say_what_to_use(tmp_path):
    assert parse_budget("0.5") == 0.5 and parse_budget("300MB") == 300_000_000 and parse_budget("2GiB") == 2 ** 31
    assert parse_budget("off") == 1.0
    assert Recompute.of("1GiB").budget == 2 ** 30 and Recompute.of(None) == Recompute()
    with pytest.raises(ValueError, match="fraction"):
        parse_budget("half")
    with pytest.raises(ValueError, match="fraction"):
        Recompute(budget=1.5)
    assert from_env({}) is None
    assert from_env({"ORTMODULE_MEMORY_OPT_LEVEL": "2"}) == Recompute(budget=0.0, kinds=KINDS)
    assert from_env({"ORTMODULE_MEMORY_OPT_LEVEL": "1"}).kinds == ("pointwise", "transcendental")
    assert from_env({"ORTMODULE_MEMORY_OPT_CONFIG": "Mul+Erf+:1:-1,Tanh:1:2"}).patterns == {"Mul+Erf+": -1, "Tanh+": 2}
    config = tmp_path / "mem.json"
    config.write_text('["Add+:1:-1"]')
    assert from_env({"ORTMODULE_MEMORY_OPT_CONFIG": str(config)}).patterns == {"Add+": -1}
    with pytest.raises(ValueError, match="pattern:1:count"):
        from_env({"ORTMODULE_MEMORY_OPT_CONFIG": "Add+:0:-1"})
    with pytest.raises(ValueError, match="ORTMODULE_MEMORY_OPT_LEVEL"):
        from_env({"ORTMODULE_MEMORY_OPT_LEVEL": "3"})


def test_a_small_value_is_not_recomputed_through_a_large_recomputation():
    """``z = y * y`` with ``y = Tanh(Gather(Exp(x * x), 0))``: once ``Exp``'s output (batch x 8) is recomputed, recomputing
    the one row ``y`` too would redo ``Exp`` for it (a chain making 2 + 2 * batch times the bytes it
    saves), sharing the recomputed ``Exp`` with a gradient node far from ``y``'s. ``y`` stays stashed,
    and the gradients are unchanged."""
    f = TensorProto.FLOAT
    batch = 64
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"]), helper.make_node("Exp", ["a"], ["e"]),
             helper.make_node("Gather", ["e", "zero"], ["s"], axis=0), helper.make_node("Tanh", ["s"], ["y"]), helper.make_node("Mul", ["y", "y"], ["z"])]
    graph = helper.make_graph(nodes, "row", [helper.make_tensor_value_info("x", f, ["batch", HIDDEN])],
                              [helper.make_tensor_value_info("z", f, [HIDDEN])],
                              initializer=[helper.make_tensor("zero", TensorProto.INT64, [], [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    training = gradient_model(model, wrt=["x"])
    x = RNG.standard_normal((batch, HIDDEN)).astype(np.float32) / 2
    dy = RNG.standard_normal(HIDDEN).astype(np.float32)
    want = _run(training, [x, dy])
    ir_model = ir.from_proto(training)
    recompute = RecomputePass(num_forward_outputs=1, plan=Recompute(budget=0.0), dims={"batch": batch})
    recompute(ir_model)
    for got, expected in zip(_run(ir_model, [x, dy]), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    on = {c.node.op_type: c.on for c in recompute.plan.candidates}
    assert on.get("Exp") is True and on.get("Tanh") is False, [(c.pattern, c.on) for c in recompute.plan.candidates]


def test_a_recomputation_reads_a_small_mask_from_the_stash_instead_of_its_long_chain():
    """``z = y * y``, ``y = Tanh(x + Where(mask, 0, -1))``, the boolean mask made from an int64 input by a
    chain of 40 ops (as BERT's attention mask is, by 23). Recomputing ``y`` would redo that chain, more
    than MAX_SUBGRAPH_NODES nodes; it stops at the mask instead, which the split stashes (one byte an
    element, against four for ``y``) and ``Plan.kept_bytes`` counts. Gradients as numpy's."""
    f = TensorProto.FLOAT
    batch, chain = 16, 40
    nodes = [helper.make_node("Cast", ["keep"], ["c0"], to=TensorProto.BOOL)]
    nodes += [helper.make_node("Not", [f"c{k}"], [f"c{k + 1}"]) for k in range(chain)]
    nodes += [helper.make_node("Where", [f"c{chain}", "zero", "minus_one"], ["bias"]),
              helper.make_node("Add", ["x", "bias"], ["a"]), helper.make_node("Tanh", ["a"], ["y"]),
              helper.make_node("Mul", ["y", "y"], ["z"])]
    graph = helper.make_graph(
        nodes, "masked",
        [helper.make_tensor_value_info("x", f, ["batch", HIDDEN]),
         helper.make_tensor_value_info("keep", TensorProto.INT64, ["batch", HIDDEN])],
        [helper.make_tensor_value_info("z", f, ["batch", HIDDEN])],
        initializer=[helper.make_tensor("zero", f, [], [0.0]), helper.make_tensor("minus_one", f, [], [-1.0])])
    training = gradient_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
                              wrt=["x"])
    x = RNG.standard_normal((batch, HIDDEN)).astype(np.float32)
    keep = RNG.integers(0, 2, (batch, HIDDEN)).astype(np.int64)
    dz = RNG.standard_normal((batch, HIDDEN)).astype(np.float32)
    y = np.tanh(x + np.where(keep != 0, 0.0, -1.0)).astype(np.float32)  # an even number of Nots
    model = ir.from_proto(training)
    recompute = RecomputePass(num_forward_outputs=1, plan=Recompute(budget=0.0), dims={"batch": batch})
    recompute(model)
    on = {c.node.op_type: c.on for c in recompute.plan.candidates}
    assert on.get("Tanh") is True, [(c.pattern, c.on) for c in recompute.plan.candidates]
    split = split_forward_backward(model, num_forward_outputs=1, num_output_grads=1)
    stashed = [list(split.forward.graph.outputs)[i] for i in split.stashed_outputs]
    assert [v.dtype for v in stashed] == [ir.DataType.BOOL], [(v.name, v.dtype) for v in stashed]
    assert recompute.plan.kept_bytes == _stashed_bytes(split, {"batch": batch}) == batch * HIDDEN
    outs = _run(split.forward, [x, keep])
    np.testing.assert_allclose(outs[0], y * y, rtol=1e-5, atol=1e-6)
    (dx,) = _run(split.backward, [dz] + [outs[i] for i in split.stashed_outputs]
                 + [[x, keep][j] for j in split.reused_inputs])
    np.testing.assert_allclose(dx, dz * 2 * y * (1 - y * y), rtol=1e-4, atol=1e-5)


def test_a_small_recomputation_already_on_does_not_keep_a_larger_one_off():
    """``z = w * w``, ``w = Where(IsNaN(p), 0, p)``, ``p = Softmax(x @ W)`` (BERT's attention probabilities
    and their NaN guard). At budget 0 the boolean ``IsNaN(p)`` (one byte an element) is recomputed first, from
    the stashed ``p``; recomputing ``p`` too then makes ``IsNaN``'s subgraph redo the product and the softmax,
    9 times the bytes ``IsNaN`` alone saves, so the first pass over the candidates refuses it. The clones
    are shared (each node is cloned once), and where the budget is still not met the second pass holds
    ``p``'s recomputation to its own subgraph's bytes (twice what it saves): it goes on, and only the
    inputs stay stashed. Before, ``p`` stayed stashed (BERT-small's four attention probabilities, 32 MiB
    at 4x batch, on-device). Gradients as numpy's."""
    f = TensorProto.FLOAT
    batch = 64
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Softmax", ["h"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["m"]), helper.make_node("Where", ["m", "zero", "p"], ["g"]),
             helper.make_node("Mul", ["g", "g"], ["z"])]
    graph = helper.make_graph(
        nodes, "guarded_softmax",
        [helper.make_tensor_value_info("x", f, ["batch", HIDDEN]), helper.make_tensor_value_info("w", f, [HIDDEN, HIDDEN])],
        [helper.make_tensor_value_info("z", f, ["batch", HIDDEN])], initializer=[helper.make_tensor("zero", f, [], [0.0])])
    training = gradient_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
                              wrt=["x", "w"])
    x = RNG.standard_normal((batch, HIDDEN)).astype(np.float32)
    w = RNG.standard_normal((HIDDEN, HIDDEN)).astype(np.float32) / 3
    dz = RNG.standard_normal((batch, HIDDEN)).astype(np.float32)
    model = ir.from_proto(training)
    recompute = RecomputePass(num_forward_outputs=1, plan=Recompute(budget=0.0), dims={"batch": batch})
    recompute(model)
    on = {c.node.op_type: c.on for c in recompute.plan.candidates}
    assert on.get("IsNaN") is True and on.get("Softmax") is True, [(c.pattern, c.on) for c in recompute.plan.candidates]
    split = split_forward_backward(model, num_forward_outputs=1, num_output_grads=1)
    assert recompute.plan.kept_bytes == _stashed_bytes(split, {"batch": batch}) == 0
    outs = _run(split.forward, [x, w])
    h = x @ w
    p = np.exp(h - h.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(outs[0], p * p, rtol=1e-5, atol=1e-6)
    dx, dw = _run(split.backward, [dz] + [outs[i] for i in split.stashed_outputs]
                  + [[x, w][j] for j in split.reused_inputs])
    dp = dz * 2 * p
    dh = p * (dp - (dp * p).sum(-1, keepdims=True))
    np.testing.assert_allclose(dx, dh @ w.T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, x.T @ dh, rtol=1e-4, atol=1e-5)
