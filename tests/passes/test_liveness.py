"""The liveness model against peaks computed by hand, and the stage cuts it places."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper

from onnxtrain.passes.liveness import Step, crossing, intervals, proto_sizes, simulate, steps_of
from onnxtrain.passes.peak import PeakModel
from onnxtrain.passes.stage_graph import stage_graph
from onnxtrain.runtime.session import TorchSession
from onnxtrain.runtime.staged import StagedSession

SIZES = {"x": 100, "a": 10, "b": 20, "r": 20, "c": 5, "d": 7}


def _steps() -> list[Step]:
    """x (input) -> a -> b; r = reshape(b) (b's buffer); c reads a and r; d reads c."""
    return [Step("n0", ("x",), ("a",)), Step("n1", ("a",), ("b",)), Step("n2", ("b",), ("r",), alias=True),
            Step("n3", ("a", "r"), ("c",)), Step("n4", ("c",), ("d",))]


def test_peak_by_hand():
    # Inputs freed after their last read: after n0 {x, a} = 110; after n1 {a, b} = 30; n3 {a, b, c} = 35;
    # after n3 a and b (read through r) are freed; n4 {c, d} = 12. The peak is at n0.
    peak = simulate(_steps(), SIZES, inputs=["x"], outputs=["d"])
    assert (peak.bytes, peak.position, peak.live) == (110, 0, {"x": 100, "a": 10})
    # Held by the caller (an onnxruntime run), x stays: the peak is at n3, 100 + 10 + 20 + 5.
    held = simulate(_steps(), SIZES, inputs=["x"], outputs=["d"], hold_inputs=True)
    assert (held.bytes, held.position) == (135, 3)
    assert set(held.live) == {"x", "a", "b", "c"}  # r is b's buffer, counted once


def test_outputs_stay_to_the_end():
    spans = intervals(_steps(), SIZES, inputs=["x"], outputs=["a"])
    assert spans["a"] == (0, 4, 10)
    assert spans["b"] == (1, 3, 20)  # the alias r extends b's buffer to n3
    assert "r" not in spans
    # a grows to the end: n4 holds a, c and d.
    assert simulate(_steps(), SIZES, inputs=["x"], outputs=["a", "d"]).bytes == 110


def test_crossing_by_hand():
    # After n0: a (10); after n1: a, b (30); after n2: a, b (30); after n3: c (5); after n4: nothing.
    assert crossing(_steps(), SIZES, inputs=["x"]) == [10, 30, 30, 5, 0]


def test_sizes_resolve_symbolic_dims():
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", f, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", "n"])])
    model = helper.make_model(graph)
    assert proto_sizes(model, {"batch": 5}) == {"x": 60}  # y's n is unknown: left out
    assert proto_sizes(model, {"batch": 5, "n": 2}) == {"x": 60, "y": 80}
    assert steps_of(model.graph.node) == [Step("y", ("x",), ("y",))]


def _layers(n_layers: int = 4, width: int = 64) -> onnx.ModelProto:
    """A backward-like chain: per layer, a recomputed value ``h_k = Relu(c_k)`` from a small checkpoint
    input ``c_k`` (one of its rows is all it holds), read twice by the layer's gradient nodes."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("dy", f, ["b", width])]
    nodes = []
    g = "dy"
    for k in range(n_layers):
        inputs.append(helper.make_tensor_value_info(f"c{k}", f, [1, width]))
        nodes += [helper.make_node("Expand", [f"c{k}", "shape"], [f"e{k}"]),
                  helper.make_node("Relu", [f"e{k}"], [f"h{k}"]),
                  helper.make_node("Mul", [g, f"h{k}"], [f"m{k}"]),
                  helper.make_node("Add", [f"m{k}", f"h{k}"], [f"g{k}"])]
        g = f"g{k}"
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [64, width])
    graph = helper.make_graph(nodes, "layers", inputs, [helper.make_tensor_value_info(g, f, ["b", width])],
                              [shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_cuts_move_between_layers():
    """Balanced on the tiny checkpoints alone, cuts fall right after a layer's first node (its last
    read of the checkpoint) and the layer's recomputed values cross into the next stage; with the
    dims known, each cut moves to between layers, where only the running gradient crosses."""
    model = _layers()
    sizes = [0] + [256] * 4
    blind = stage_graph(model, sizes, 4, 0)
    seen = stage_graph(model, sizes, 4, 0, dims={"b": 64})
    assert len(blind.stages) == len(seen.stages) == 4
    assert any(o.startswith(("e", "h")) for st in blind.stages for o in st.outputs)
    assert all(o.startswith("g") for st in seen.stages for o in st.outputs)
    # Both run the graph unchanged (numpy reference).
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((64, 64)).astype(np.float32)] + \
        [rng.standard_normal((1, 64)).astype(np.float32) for _ in range(4)]
    g = feeds[0]
    for c in feeds[1:]:
        h = np.maximum(np.broadcast_to(c, (64, 64)), 0)
        g = g * h + h
    for staged in (blind, seen):
        session = StagedSession(staged, lambda m: TorchSession(m, torch.device("cpu")))
        (out,) = session.run([torch.from_numpy(x) for x in feeds])
        np.testing.assert_allclose(out.numpy(), g, rtol=1e-6)


def _joint() -> tuple[ir.Graph, set]:
    """Forward ``y = -tanh(exp(relu(x)))``; gradient nodes ``d1 = dy * c``, ``d2 = d1 * b``, ``dx = d2 * a``
    (10 floats each: 40 bytes)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Exp", ["a"], ["b"]),
             helper.make_node("Tanh", ["b"], ["c"]), helper.make_node("Neg", ["c"], ["y"]),
             helper.make_node("Mul", ["dy", "c"], ["d1"]), helper.make_node("Mul", ["d1", "b"], ["d2"]),
             helper.make_node("Mul", ["d2", "a"], ["dx"])]
    info = [helper.make_tensor_value_info(n, f, [10]) for n in ("x", "dy", "y", "dx")]
    graph = helper.make_graph(nodes, "joint", info[:2], info[2:],
                              value_info=[helper.make_tensor_value_info(n, f, [10]) for n in "abc"] +
                              [helper.make_tensor_value_info(n, f, [10]) for n in ("d1", "d2")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    forward = {n for n in model.graph if n.outputs[0].name in "abcy"}
    return model.graph, forward


def test_peak_model_by_hand():
    graph, forward = _joint()
    model = PeakModel(graph, forward, lambda v: 40)
    # No recompute: a, b, c, y after the forward (160), d1 beside them (200); then c, b, d1 are freed.
    assert model.peak([]) == 200
    # b recomputed: freed after Tanh, its clone made just before d2 reads it; the peak is the same 200
    # (a, y, d1 and the clone at d2), but b is gone while d1 is made: 160 there instead of 200.
    exp = next(n for n in graph if n.op_type == "Exp")
    steps = model.steps([[exp]])
    assert [s.name for s in steps].index("/recomputed") == 5  # after d1 (step 4), before d2
    assert steps[6].inputs == (graph.node(4).outputs[0], ("recomputed", exp.outputs[0]))
    spans = intervals(steps, model.sizes, outputs=list(graph.outputs))
    assert spans[exp.outputs[0]][:2] == (1, 2)  # read by Tanh only
    assert model.peak([[exp]]) == 200


def test_split_peak_model_frees_the_forward_outputs_when_the_forward_returns():
    """ORTModule's forward returns y to the caller, who drops it (the loss is taken from it in the model):
    y counts until the forward's end, not beside the gradients. a, b, c and y at the forward's end (160),
    then a, b, c and d1 (160): without the split, y stays and d1 makes 200."""
    graph, forward = _joint()
    split = PeakModel(graph, forward, lambda v: 40, split=True)
    assert split.peak([]) == 160
    names = [s.name for s in split.steps([])]
    assert names.index("forward returns") == 4  # after Neg, the last forward node
    assert PeakModel(graph, forward, lambda v: 40).peak([]) == 200
