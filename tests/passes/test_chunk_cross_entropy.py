"""The chunked cross-entropy pass: the loss in row blocks gives PyTorch's loss and gradients (ignore_index,
padding rows, mean and sum, all rows ignored), in a graph and under ORTModule, and lowers the modelled peak."""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain import ORTModule
from onnxtrain.autodiff.stop_gradient import strip_stop_gradients
from onnxtrain.ortmodule import DebugOptions
from onnxtrain.passes import chunk_cross_entropy as cce
from onnxtrain.passes import pipeline
from onnxtrain.passes.recompute import Recompute

HIDDEN, VOCAB = 8, 50
# 7 rows of logits a block (50 float32 classes): 30 rows make 5 blocks, the last one 2 rows + 5 padding rows.
SMALL_BLOCK = 7 * VOCAB * 4


def _loss_model(fused: bool, reduction: str = "mean") -> onnx.ModelProto:
    """logits = h @ wt (h: [batch, seq, HIDDEN]), reshaped to [rows, VOCAB]; cross-entropy with ignore_index."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["h", "wt"], ["logits"]),
             helper.make_node("Reshape", ["logits", "shape"], ["scores"])]
    if fused:
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "target"], ["loss"],
                                      reduction=reduction, ignore_index=-100))
    else:
        nodes += [helper.make_node("LogSoftmax", ["scores"], ["logp"], axis=1),
                  helper.make_node("NegativeLogLikelihoodLoss", ["logp", "target"], ["loss"],
                                   reduction=reduction, ignore_index=-100)]
    graph = helper.make_graph(
        nodes, "lm_loss",
        [helper.make_tensor_value_info("h", f, ["batch", "seq", HIDDEN]), helper.make_tensor_value_info("wt", f, [HIDDEN, VOCAB]),
         helper.make_tensor_value_info("target", TensorProto.INT64, ["rows"])],
        [helper.make_tensor_value_info("loss", f, [])],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [2], [-1, VOCAB])])
    graph.value_info.append(helper.make_tensor_value_info("scores", f, ["rows", VOCAB]))
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(strip_stop_gradients(proto).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _batch(seed: int, ignored: int = 4, batch: int = 3, seq: int = 10):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32)
    wt = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    target = rng.integers(0, VOCAB, batch * seq).astype(np.int64)
    target[rng.choice(batch * seq, ignored, replace=False)] = -100
    return h, wt, target


def _torch_loss(h, wt, target, reduction="mean"):
    th, tw = torch.tensor(h, requires_grad=True), torch.tensor(wt, requires_grad=True)
    loss = torch.nn.functional.cross_entropy((th @ tw).reshape(-1, VOCAB), torch.tensor(target),
                                             ignore_index=-100, reduction=reduction)
    loss.backward()
    return loss.detach().numpy(), th.grad.numpy(), tw.grad.numpy()


@pytest.mark.parametrize("fused", [False, True], ids=["logsoftmax_nll", "softmax_cross_entropy"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_and_its_gradients_match_pytorch(fused, reduction):
    proto = _loss_model(fused, reduction)
    h, wt, target = _batch(0)
    before = _run(proto, {"h": h, "wt": wt, "target": target})[0]
    model = ir.from_proto(proto)
    chunk = cce.ChunkCrossEntropyPass(SMALL_BLOCK)
    assert chunk(model).modified
    assert chunk.chunked == [("loss", 7, VOCAB, False)]
    ops = [n.op_type for n in model.graph]
    assert "Loop" in ops and not {"MatMul", "LogSoftmax", "SoftmaxCrossEntropyLoss"} & set(ops)  # no full logits
    after = ir.to_proto(model)
    want_loss, want_dh, want_dwt = _torch_loss(h, wt, target, reduction)
    np.testing.assert_allclose(_run(after, {"h": h, "wt": wt, "target": target})[0], want_loss, rtol=1e-5)
    np.testing.assert_allclose(before, want_loss, rtol=1e-5)

    from onnxtrain.autodiff import gradient_model

    grads = gradient_model(after, wrt=["h", "wt"])
    seed = np.array(0.7, np.float32)  # the incoming gradient scales both
    loss, dh, dwt = _run(grads, {"h": h, "wt": wt, "target": target, "loss_grad": seed})[:3]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(dh, seed * want_dh, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dwt, seed * want_dwt, rtol=1e-4, atol=1e-6)


def test_all_targets_ignored_gives_nan_and_zero_gradients_as_pytorch():
    h, wt, target = _batch(1)
    target[:] = -100
    want_loss, want_dh, want_dwt = _torch_loss(h, wt, target)
    assert np.isnan(want_loss) and not want_dh.any()
    from onnxtrain.autodiff import gradient_model

    model = ir.from_proto(_loss_model(False))
    cce.ChunkCrossEntropyPass(SMALL_BLOCK)(model)
    feeds = {"h": h, "wt": wt, "target": target, "loss_grad": np.array(1.0, np.float32)}
    loss, dh, dwt = _run(gradient_model(ir.to_proto(model), wrt=["h", "wt"]), feeds)[:3]
    assert np.isnan(loss)
    np.testing.assert_array_equal(dh, want_dh)
    np.testing.assert_array_equal(dwt, want_dwt)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_rows_gives_pytorchs_loss_and_zero_gradients(reduction):
    """An empty batch: the weight gradient's start is a [1, 1] zero that a block's product broadcasts, so one
    block runs even with no rows (its products sum nothing); PyTorch: a NaN mean or a 0 sum, zero gradients."""
    h, wt, _ = _batch(3, ignored=0, batch=0)
    target = np.zeros(0, np.int64)
    want_loss, want_dh, want_dwt = _torch_loss(h, wt, target, reduction)
    from onnxtrain.autodiff import gradient_model

    model = ir.from_proto(_loss_model(False, reduction))
    cce.ChunkCrossEntropyPass(SMALL_BLOCK)(model)
    feeds = {"h": h, "wt": wt, "target": target, "loss_grad": np.array(1.0, np.float32)}
    loss, dh, dwt = _run(gradient_model(ir.to_proto(model), wrt=["h", "wt"]), feeds)[:3]
    np.testing.assert_array_equal(loss, want_loss)  # NaN for the mean, as PyTorch
    assert dh.shape == want_dh.shape and dwt.shape == want_dwt.shape
    np.testing.assert_array_equal(dwt, want_dwt)


def test_no_constant_of_the_weights_size_is_kept(tmp_path):
    """The blocks' carried weight gradient starts from a [1, 1] zero, not zeros of the weight's shape, which
    onnxruntime's constant folding made an initializer its session kept for good (GPT-2-small: 51.8 MB of
    resting memory): the session onnxruntime optimizes holds no constant as large as the weight."""
    from onnxtrain.autodiff import gradient_model
    from onnxtrain.autodiff.engine import ir_version_for_onnxruntime

    model = ir.from_proto(_loss_model(True))
    cce.ChunkCrossEntropyPass(SMALL_BLOCK)(model)
    grads = ir_version_for_onnxruntime(strip_stop_gradients(gradient_model(ir.to_proto(model), wrt=["h", "wt"])))
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(grads.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))

    def constants(graph):
        for t in graph.initializer:
            yield t.name, int(np.prod(t.dims))
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield node.name, int(np.prod(a.t.dims))
                elif a.type == onnx.AttributeProto.GRAPH:
                    yield from constants(a.g)

    sizes = dict(constants(optimized.graph))
    assert sizes and max(sizes.values()) < HIDDEN * VOCAB, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def _stored_weight(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same loss with the weight as a Linear layer stores it: ``h @ Transpose(w)``, ``w``: [VOCAB, HIDDEN]."""
    proto = copy.deepcopy(proto)
    graph = proto.graph
    graph.node.insert(0, helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]))
    graph.input[1].CopyFrom(helper.make_tensor_value_info("w", TensorProto.FLOAT, [VOCAB, HIDDEN]))
    return proto


@pytest.mark.parametrize("stored", [False, True], ids=["h_at_wt", "h_at_w_transposed"])
def test_extreme_logits_and_repeated_targets_match_pytorch_in_float64(stored):
    """The blocks take the log-sum-exp from the softmax's row maximum and add the one-hot part of the
    gradients outside the blocks (by target, repeated targets adding up): logits 100s apart, where the
    target's probability underflows float32, and targets drawn from 3 classes, against PyTorch in float64."""
    h, wt, target = _batch(2, ignored=3)
    h *= 40.0  # logits of several hundred: most classes' probabilities are 0 in float32
    target[target != -100] %= 3
    proto = _loss_model(True) if not stored else _stored_weight(_loss_model(True))
    model = ir.from_proto(proto)
    cce.ChunkCrossEntropyPass(SMALL_BLOCK)(model)
    from onnxtrain.autodiff import gradient_model

    weight = np.ascontiguousarray(wt.T) if stored else wt
    feeds = {"h": h, "w" if stored else "wt": weight, "target": target, "loss_grad": np.array(1.0, np.float32)}
    loss, dh, dw = _run(gradient_model(ir.to_proto(model), wrt=["h", "w" if stored else "wt"]), feeds)[:3]
    th = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    logits = (th @ (tw.T if stored else tw)).reshape(-1, VOCAB)
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(target), ignore_index=-100)
    want.backward()
    assert want.item() > 50  # the targets are far from the largest logits
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    np.testing.assert_allclose(dh, th.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-4, atol=1e-3)


def test_a_block_makes_two_vocabulary_sized_values():
    """Each block's vocabulary-sized values are fresh buffers every block (without onnxruntime's arena, pages
    mapped afresh: GPT-2-small at 4x, 1056k -> 768k page faults a step at budget 0.5): the block's logits
    and their softmax, and nothing else of that size (the log-softmax, its exponent, the coefficient's
    product and the one-hot scatter were four more)."""
    proto = _loss_model(True)
    for d, size in zip(proto.graph.input[0].type.tensor_type.shape.dim, (3, 10, HIDDEN)):
        d.dim_value = size
    proto.graph.input[2].type.tensor_type.shape.dim[0].dim_value = 30
    model = ir.from_proto(proto)
    cce.ChunkCrossEntropyPass(SMALL_BLOCK)(model)
    inferred = onnx.shape_inference.infer_shapes(strip_stop_gradients(ir.to_proto(model)))
    loop = next(n for n in inferred.graph.node if n.op_type == "Loop")
    body = helper.get_attribute_value(loop.attribute[0])
    wide = [v.name for v in body.value_info
            if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[-1].dim_value == VOCAB]
    producers = {o: n.op_type for n in body.node for o in n.output}
    assert sorted(producers[name] for name in wide) == ["Gemm", "Softmax"], wide


def test_other_losses_are_left_alone():
    weighted = _loss_model(True)
    weighted.graph.node[-1].input.append("class_weight")
    weighted.graph.input.append(helper.make_tensor_value_info("class_weight", TensorProto.FLOAT, [VOCAB]))
    none = _loss_model(False, "none")
    for proto in (weighted, none):
        assert not cce.ChunkCrossEntropyPass(SMALL_BLOCK)(ir.from_proto(proto)).modified


def test_budgets_below_one_ask_for_it():
    assert not cce.chunks_for(None) and not cce.chunks_for(Recompute())
    assert not cce.chunks_for(Recompute(budget=1.0))
    assert cce.chunks_for(Recompute(budget=0.5)) and cce.chunks_for(Recompute(budget=0.0))
    assert cce.chunks_for(Recompute(budget=300 * 2**20))
    assert pipeline.before_autodiff(Recompute(budget=0.5)).names == ["chunk_cross_entropy"]
    assert pipeline.before_autodiff(None).names == []


class _TinyLM(torch.nn.Module):
    """Embedding, a tanh layer and an untied head without bias; returns the loss, or the loss and the logits."""

    def __init__(self, return_logits: bool, reduction: str = "mean"):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layer = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.return_logits, self.reduction = return_logits, reduction

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.layer(self.embed(ids))))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                                 reduction=self.reduction)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("return_logits", [False, True], ids=["loss_only", "loss_and_logits"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ortmodule_with_a_budget_matches_eager_pytorch(monkeypatch, caplog, return_logits, reduction):
    monkeypatch.setattr(cce, "BLOCK_BYTES", SMALL_BLOCK)
    torch.manual_seed(0)
    model = _TinyLM(return_logits, reduction)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (3, 10))
    labels = ids.clone()
    labels[0, 6:] = -100  # padding rows
    labels[2, 1] = -100
    ort_model = ORTModule(model, DebugOptions(recompute=0.5, fallback=False))
    with caplog.at_level(logging.INFO, logger="onnxtrain.passes"):
        got = ort_model(ids, labels)
    want = eager(ids, labels)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "chunked cross-entropy" in text and "blocks of 7 rows" in text, text
    assert ("still made" in text) == return_logits
    got_loss, want_loss = (got[0], want[0]) if return_logits else (got, want)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    if return_logits:  # the logits output stays, and its own gradient flows too
        torch.testing.assert_close(got[1], want[1])
        seed = torch.randn_like(want[1])
        (got_loss + (got[1] * seed).sum()).backward()
        (want_loss + (want[1] * seed).sum()).backward()
    else:
        got_loss.backward()
        want_loss.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_logits_returned_but_only_the_loss_backpropagated_prune_the_logits_gradient(monkeypatch):
    """GPT-2's case: the backward graph is built without the logits' gradient input (no [rows, vocab] zeros
    fed, no products of them), and the gradients are eager PyTorch's."""
    monkeypatch.setattr(cce, "BLOCK_BYTES", SMALL_BLOCK)
    torch.manual_seed(0)
    model = _TinyLM(True)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (3, 10))
    ort_model = ORTModule(model, DebugOptions(recompute=0.5, fallback=False))
    ort_model(ids, ids)[0].backward()
    eager(ids, ids)[0].backward()
    sessions = {present: session for entries in ort_model._cache.values() for g in entries
                for t in g.training.values() for present, session in t._backward.items()}
    assert list(sessions) == [(True, False)] and sessions[(True, False)] is not None  # None: zeros are fed
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_modelled_peak_goes_down(monkeypatch):
    """Budget 0.5 on a model whose logits dominate: the planner's modelled peak is lower with the pass."""

    def peak(chunked: bool) -> int:
        monkeypatch.setattr(pipeline, "chunks_for", lambda plan: chunked)
        torch.manual_seed(0)
        model = ORTModule(_TinyLM(False), DebugOptions(recompute=0.5, fallback=False))
        ids = torch.randint(0, VOCAB, (8, 32))
        model(ids, ids).backward()
        plans = [t.recompute for entries in model._cache.values() for g in entries for t in g.training.values()]
        return max(p.peak_bytes for p in plans)

    assert peak(True) < 0.6 * peak(False)


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.head = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.layer(x)))


def test_on_device_artifacts_with_a_budget_train_in_blocks(tmp_path, monkeypatch):
    """The training model of generate_artifacts(recompute=0.5) has the loop, and one step of the torch-free
    runtime gives PyTorch's loss and gradients."""
    from onnxtrain.api import CheckpointState, Module
    from tests.ondevice.helpers import export, generate

    monkeypatch.setattr(cce, "BLOCK_BYTES", SMALL_BLOCK)
    torch.manual_seed(0)
    model = _Head()
    path = export(model, (torch.randn(30, HIDDEN),), tmp_path / "head.onnx", ["x"])
    params = [n for n, _ in model.named_parameters()]
    paths = generate(path, tmp_path / "art", requires_grad=params, loss="crossentropy",
                     recompute=Recompute(budget=0.5, dims={"batch": 30}))
    ops = [n.op_type for n in onnx.load(str(paths.training_model)).graph.node]
    assert "Loop" in ops and "LogSoftmax" not in ops and "SoftmaxCrossEntropyLoss" not in ops
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((30, HIDDEN)).astype(np.float32)
    labels = rng.integers(0, VOCAB, 30).astype(np.int64)
    loss = module(x, labels)
    expected = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
    expected.backward()
    np.testing.assert_allclose(np.asarray(loss), expected.item(), rtol=1e-5)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_plan_shows_what_the_chunked_loss_took_off_the_stash(monkeypatch, caplog):
    """The log-softmax the blocks no longer stash, less the two gradients they stash instead, is a line of
    the plan's table; the budget is a fraction of the stash that remains (smaller by exactly that)."""
    monkeypatch.setattr(cce, "BLOCK_BYTES", SMALL_BLOCK)
    batch, seq = 8, 32

    def plan(chunked: bool):
        monkeypatch.setattr(pipeline, "chunks_for", lambda options: chunked)
        torch.manual_seed(0)
        model = ORTModule(_TinyLM(False), DebugOptions(recompute=0.5, fallback=False))
        ids = torch.randint(0, VOCAB, (batch, seq))
        with caplog.at_level(logging.INFO, logger="onnxtrain.passes"):
            model(ids, ids).backward()
        (found,) = [t.recompute for entries in model._cache.values() for g in entries for t in g.training.values()]
        return found

    plain, chunked = plan(False), plan(True)
    rows = batch * seq
    net = (rows * VOCAB - rows * HIDDEN - HIDDEN * VOCAB) * 4  # log-softmax out; the gradients of h and W in
    assert plain.presaved == []
    assert [size for _, size in chunked.presaved] == [net]
    assert chunked.stashed_bytes == plain.stashed_bytes - net
    assert chunked.saved_bytes == sum(c.saved for c in chunked.candidates if c.on)
    assert chunked.saved_bytes <= chunked.stashed_bytes
    assert "chunked cross-entropy" in chunked.table() and f"{net / 2**20:.2f}" in chunked.table()
