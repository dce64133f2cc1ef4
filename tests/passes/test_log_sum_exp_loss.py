"""LogSumExpLossPass: the loss and the gradient's probabilities from a log-sum-exp, checked by onnxruntime before
and after the pass against numpy in float64."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.passes.log_sum_exp_loss import log_sum_exp_loss

N, C, IGNORE = 6, 9, -100


def _model(reduction: str = "mean", ignore_index: int | None = IGNORE, logp_output: bool = False,
           with_exp: bool = True, opset: int = 18) -> onnx.ModelProto:
    nll = {"reduction": reduction, **({"ignore_index": ignore_index} if ignore_index is not None else {})}
    nodes = [helper.make_node("LogSoftmax", ["x"], ["logp"], axis=1),
             helper.make_node("NegativeLogLikelihoodLoss", ["logp", "t"], ["loss"], **nll)]
    loss_shape = [N] if reduction == "none" else []
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, loss_shape)]
    if with_exp:  # the cross-entropy gradient's probabilities, times a scale (as the rule's Mul)
        nodes += [helper.make_node("Exp", ["logp"], ["p"]), helper.make_node("Mul", ["p", "k"], ["scaled"])]
        outputs.append(helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [N, C]))
    if logp_output:
        outputs.append(helper.make_tensor_value_info("logp", TensorProto.FLOAT, [N, C]))
    graph = helper.make_graph(nodes, "loss", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C]),
                                              helper.make_tensor_value_info("t", TensorProto.INT64, [N])],
                              outputs, initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [0.25])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(proto: onnx.ModelProto, x: np.ndarray, t: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "t": t})


def _reference(x: np.ndarray, t: np.ndarray, reduction: str, ignore_index: int | None):
    x64 = x.astype(np.float64)
    logp = x64 - x64.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    keep = np.ones(N, bool) if ignore_index is None else t != ignore_index
    picked = -logp[np.arange(N), np.where(keep, t, 0)] * keep
    loss = {"none": picked, "sum": picked.sum(), "mean": picked.sum() / keep.sum()}[reduction]
    return loss, np.exp(logp) * 0.25


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [IGNORE, None])
def test_loss_and_probabilities_match_numpy(reduction, ignore_index):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((N, C)) * 4).astype(np.float32)
    t = rng.integers(0, C, N)
    if ignore_index is not None:
        t[[1, 4]] = ignore_index
    proto = _model(reduction, ignore_index)
    out = log_sum_exp_loss(proto)
    onnx.checker.check_model(out, full_check=True)
    ops = [n.op_type for n in out.graph.node]
    assert "LogSoftmax" not in ops and ops.count("NegativeLogLikelihoodLoss") == 1
    loss, scaled = _reference(x, t, reduction, ignore_index)
    before, after = _run(proto, x, t), _run(out, x, t)
    for ours in (before, after):
        np.testing.assert_allclose(ours[0], loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours[1], scaled, rtol=1e-5, atol=1e-7)


def test_the_gradient_reuses_the_forward_exponentials():
    """One exponential over the [N, C] scores, the forward's: the gradient's probabilities are that ``Exp``
    times ``1 / s`` (an [N, C] multiply), not a second ``Exp`` over the scores (OpenVINO's plugin spent most of
    that pass computing it). The values: test_loss_and_probabilities_match_numpy."""
    out = onnx.shape_inference.infer_shapes(log_sum_exp_loss(_model("mean")))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*out.graph.value_info, *out.graph.output]}
    wide = [n for n in out.graph.node if n.op_type == "Exp" and shapes.get(n.output[0]) == [N, C]]
    assert len(wide) == 1
    probabilities = next(n for n in out.graph.node if "scaled" in n.output).input[0]
    producer = next(n for n in out.graph.node if probabilities in n.output)
    assert producer.op_type == "Mul" and wide[0].output[0] in producer.input


def test_all_rows_ignored_gives_what_the_op_gives():
    proto = _model("mean")
    x = np.zeros((N, C), np.float32)
    t = np.full(N, IGNORE, np.int64)
    before, after = _run(proto, x, t), _run(log_sum_exp_loss(proto), x, t)
    np.testing.assert_array_equal(before[0], after[0])  # the op's own mean over no rows, either way
    np.testing.assert_allclose(after[1], before[1], rtol=1e-6)


@pytest.mark.parametrize("case", [{"logp_output": True}, {"with_exp": False}, {"opset": 17}])
def test_left_alone(case):
    """The log-probabilities an output (a split forward stashes them), no gradient's Exp reading them, or an
    opset before 18: unchanged."""
    proto = _model(**case)
    assert [n.op_type for n in log_sum_exp_loss(proto).graph.node] == [n.op_type for n in proto.graph.node]
