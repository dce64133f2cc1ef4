"""defer_row_scatters: embedding gradients leave the graph as ids and rows; adding them up (numpy's
``np.add.at`` here, torch's ``index_add_`` in ORTModule) gives PyTorch's gradients."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.passes.defer_row_scatters import RowScatters, defer_row_scatters

RNG = np.random.default_rng(0)
V, D, N = 11, 4, 9


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def _finish(outputs: list[np.ndarray], plan: RowScatters, shapes: dict[int, tuple]) -> list[np.ndarray]:
    grads = [None] * plan.num_outputs
    for k, position in enumerate(plan.kept):
        grads[position] = outputs[k]
    for s in plan.scatters:  # into the base, else into what earlier scatters of the gradient made, else zeros
        target = grads[s.gradient] if grads[s.gradient] is not None else np.zeros(shapes[s.gradient], np.float32)
        np.add.at(target, outputs[s.ids], outputs[s.rows])
        grads[s.gradient] = target
    return grads


def _tied_lm(second: str = "P") -> onnx.ModelProto:
    """loss = sum(w * ((E[ids] + T[pos]) @ E^T)), T = ``second``: E is both an embedding and the output
    projection; T is another table P, or E itself looked up a second time."""
    nodes = [helper.make_node("Gather", ["E", "ids"], ["tok"]),
             helper.make_node("Gather", [second, "pos"], ["at"]),
             helper.make_node("Add", ["tok", "at"], ["h"]),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Et"], ["logits"]),
             helper.make_node("Mul", ["logits", "w"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    f = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
    i = lambda n, s: helper.make_tensor_value_info(n, TensorProto.INT64, s)
    tables = [f("E", [V, D])] + ([f("P", [N, D])] if second == "P" else [])
    graph = helper.make_graph(nodes, "lm", [*tables, i("ids", ["n"]), i("pos", ["n"]), f("w", ["n", V])],
                              [f("loss", [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_embedding_gradients_come_out_as_rows_and_add_up_to_torchs():
    proto = gradient_model(_tied_lm(), wrt=["E", "P"])
    model = ir.from_proto(proto)
    plan = defer_row_scatters(model)
    rewritten = ir.to_proto(model)
    assert "ScatterElements" not in {n.op_type for n in rewritten.graph.node}
    by_gradient = {s.gradient: s for s in plan.scatters}
    names = [o.name for o in proto.graph.output]
    e, p = names.index("E_grad"), names.index("P_grad")
    assert set(by_gradient) == {e, p}
    assert by_gradient[e].base is not None  # tied: the projection's gradient, rows added into it
    assert by_gradient[p].base is None  # zeros of P's shape

    ids = np.array([3, 0, 3, 7, 3, 0, 10, 7, 3])  # repeats
    pos = np.arange(N)
    feeds = {"E": RNG.standard_normal((V, D)).astype(np.float32), "P": RNG.standard_normal((N, D)).astype(np.float32),
             "ids": ids, "pos": pos, "w": RNG.standard_normal((N, V)).astype(np.float32),
             "loss_grad": np.array(1.0, np.float32)}
    grads = _finish(_run(rewritten, feeds), plan, {e: (V, D), p: (N, D)})

    E = torch.tensor(feeds["E"], requires_grad=True)
    P = torch.tensor(feeds["P"], requires_grad=True)
    loss = (((E[torch.tensor(ids)] + P[torch.tensor(pos)]) @ E.T) * torch.tensor(feeds["w"])).sum()
    loss.backward()
    np.testing.assert_allclose(grads[e], E.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[p], P.grad.numpy(), rtol=1e-5, atol=1e-5)
    for k, (got, want) in enumerate(zip(grads, _run(proto, feeds))):  # everything else unchanged
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=names[k])


def _scatter_plus(other: str) -> onnx.ModelProto:
    """out = ScatterElements(zeros, Expand(Reshape(ids, [-1, 1]), Shape(rows)), rows, add) + ``other``."""
    c = lambda name, values: helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
    nodes = [c("shape", [V, D]), c("view", [-1, 1]),
             helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
             helper.make_node("Reshape", ["ids", "view"], ["column"]),
             helper.make_node("Shape", ["rows"], ["rows_shape"]),
             helper.make_node("Expand", ["column", "rows_shape"], ["index"]),
             helper.make_node("ScatterElements", ["zeros", "index", "rows"], ["scattered"], axis=0, reduction="add"),
             helper.make_node("Relu", ["x"], ["relu"]),
             helper.make_node("Add", ["scattered", other], ["out"])]
    f = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [N]),
                                           f("rows", [N, D]), f("x", [V, D])], [f("out", [V, D])],
                              value_info=[f("relu", [V, D])])  # the pass needs the terms' shapes
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_rows_are_added_in_place_only_into_memory_the_graph_owns():
    feeds = {"ids": np.array([1, 1, 2, 0, 1, 5, 5, 9, 1]), "rows": RNG.standard_normal((N, D)).astype(np.float32),
             "x": RNG.standard_normal((V, D)).astype(np.float32)}
    # x is a graph input: onnxruntime may hand it back as the output, so nothing may be added into it
    model = ir.from_proto(_scatter_plus("x"))
    plan = defer_row_scatters(model)
    assert plan.scatters == [] and plan.partial == {0}  # its lookup's ids stay inside the graph
    assert "ScatterElements" in {n.op_type for n in model.graph}
    # Relu(x) is the graph's own tensor
    proto = _scatter_plus("relu")
    model = ir.from_proto(proto)
    plan = defer_row_scatters(model)
    assert [(s.gradient, s.base) for s in plan.scatters] == [(0, 0)] and plan.partial == set()
    got = _finish(_run(ir.to_proto(model), feeds), plan, {})
    np.testing.assert_allclose(got[0], _run(proto, feeds)[0], rtol=1e-6, atol=1e-6)


def test_every_lookup_of_a_table_leaves_the_graph():
    """E looked up twice (an encoder's and a decoder's tokens) and tied to the projection, as in BART:
    both lookups' rows come out (the caller sees each lookup's ids), added into the projection's gradient."""
    proto = gradient_model(_tied_lm("E"), wrt=["E"])
    model = ir.from_proto(proto)
    plan = defer_row_scatters(model)
    assert "ScatterElements" not in {n.op_type for n in model.graph}
    e = [o.name for o in proto.graph.output].index("E_grad")
    assert [(s.gradient, s.base is not None) for s in plan.scatters] == [(e, True), (e, False)]
    assert plan.partial == set()

    ids, pos = np.array([3, 0, 3, 7, 3, 0, 10, 7, 3]), np.array([1, 1, 2, 0, 1, 5, 5, 9, 1])
    feeds = {"E": RNG.standard_normal((V, D)).astype(np.float32), "ids": ids, "pos": pos,
             "w": RNG.standard_normal((N, V)).astype(np.float32), "loss_grad": np.array(1.0, np.float32)}
    grad = _finish(_run(ir.to_proto(model), feeds), plan, {e: (V, D)})[e]
    E = torch.tensor(feeds["E"], requires_grad=True)
    ((E[torch.tensor(ids)] + E[torch.tensor(pos)]) @ E.T * torch.tensor(feeds["w"])).sum().backward()
    np.testing.assert_allclose(grad, E.grad.numpy(), rtol=1e-5, atol=1e-5)
