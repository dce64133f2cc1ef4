"""Cutting a backward-like graph into stages: the staged run matches numpy, and inputs are freed early."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain.passes.stage_graph import CannotStage, stage_graph
from onnxtrain.runtime.session import TorchSession
from onnxtrain.runtime.staged import StagedSession

N = 8


def _chain() -> onnx.ModelProto:
    """A backward pass through three layers ``y = a_k * (x @ W.T)``: ``a3`` is read first, ``a1`` last.
    ``r = a2 * a2`` reads only inputs (like an op redone from the stash)."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, [4, N]) for n in ("dy", "a1", "a2", "a3")]
    inputs.append(helper.make_tensor_value_info("W", f, [N, N]))
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("Mul", ["a2", "a2"], ["r"]),
        helper.make_node("MatMul", ["dy", "Wt"], ["g1"]),
        helper.make_node("Mul", ["g1", "a3"], ["h1"]),
        helper.make_node("MatMul", ["h1", "Wt"], ["g2"]),
        helper.make_node("Mul", ["g2", "a2"], ["h2"]),
        helper.make_node("Add", ["h2", "r"], ["h3"]),
        helper.make_node("MatMul", ["h3", "Wt"], ["g3"]),
        helper.make_node("Mul", ["g3", "a1"], ["dx"]),
        helper.make_node("ReduceSum", ["h1"], ["s"], keepdims=0),
    ]
    outputs = [helper.make_tensor_value_info("dx", f, [4, N]), helper.make_tensor_value_info("s", f, [])]
    graph = helper.make_graph(nodes, "chain", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _feeds(seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, N, generator=g) for _ in range(4)] + [torch.randn(N, N, generator=g)]


def _reference(dy, a1, a2, a3, w):
    h1 = (dy @ w.T) * a3
    h3 = (h1 @ w.T) * a2 + a2 * a2
    return (h3 @ w.T) * a1, h1.sum()


def _session(proto):
    return TorchSession(proto, torch.device("cpu"))


SIZES = [0, 100, 100, 100, 0]  # dy and W stay alive anyway; a1, a2, a3 can be freed


def test_three_stages_match_numpy_and_release_each_input_after_its_last_read():
    staged = stage_graph(_chain(), SIZES, num_stages=3)
    assert len(staged.stages) == 3
    ops = [[n.op_type for n in stage.model.graph.node] for stage in staged.stages]
    # The weight's Transpose is copied into every stage with a MatMul; r runs just before its reader.
    assert all(o.count("Transpose") == 1 for o in ops), ops
    assert ops[1] == ["Transpose", "MatMul", "Mul", "Mul"] and ops[2][:2] == ["Transpose", "Add"], ops
    released = [set(stage.release) for stage in staged.stages]
    assert "a3" in released[0] and "a2" in released[1] and "a1" in released[2]
    feeds = _feeds()
    expected = _reference(*[t.numpy().astype(np.float64) for t in feeds])
    got = StagedSession(staged, _session).run(list(feeds))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-5)


def test_inputs_are_freed_before_the_later_stages_run():
    staged = stage_graph(_chain(), SIZES, num_stages=3)
    runner = StagedSession(staged, _session)
    feeds = _feeds()
    refs = {name: weakref.ref(t) for name, t in zip(staged.inputs, feeds)}
    alive_at_stage = []
    for session in runner.sessions:
        run = session.run

        def recording(inputs, run=run):
            gc.collect()
            alive_at_stage.append({n for n, r in refs.items() if r() is not None})
            return run(inputs)

        session.run = recording
    runner.run(feeds)
    assert feeds == []  # the caller's list is emptied: the run holds the only references
    assert "a3" not in alive_at_stage[1] and "a3" in alive_at_stage[0]
    assert "a2" not in alive_at_stage[2] and "a1" in alive_at_stage[2]
    assert "W" in alive_at_stage[2]  # read by every stage's copy of its Transpose


def test_no_cut_where_a_stage_would_free_too_little():
    staged = stage_graph(_chain(), SIZES, num_stages=3, min_stage_bytes=150)
    assert len(staged.stages) == 2
    staged = stage_graph(_chain(), SIZES, num_stages=3, min_stage_bytes=1000)
    assert len(staged.stages) == 1 and staged.stages[0].model is not None
    assert stage_graph(_chain(), [0] * 5, num_stages=4).stages[0].inputs == staged.inputs


def test_control_flow_is_refused_and_sizes_must_match_inputs():
    model = _chain()
    branch = helper.make_graph([helper.make_node("Identity", ["a1"], ["o"])], "b", [],
                               [helper.make_tensor_value_info("o", TensorProto.FLOAT, [4, N])])
    cond = helper.make_node("If", ["c"], ["iffed"], then_branch=branch, else_branch=branch)
    model.graph.node.append(cond)
    model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    with pytest.raises(CannotStage, match="control flow"):
        stage_graph(model, SIZES + [0], num_stages=2)
    with pytest.raises(ValueError, match="5 entries for 6 graph inputs"):
        stage_graph(model, SIZES, num_stages=2)


def test_an_untyped_crossing_value_is_refused():
    model = _chain()
    model.graph.node[3].domain = "example.unknown"  # h1 = Mul(...) of a domain shape inference does not know
    model.opset_import.append(helper.make_opsetid("example.unknown", 1))
    with pytest.raises(CannotStage, match="no type is known"):
        stage_graph(model, SIZES, num_stages=3)
