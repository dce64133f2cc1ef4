"""Finite-difference checking of gradient rules on single-node models.

A :class:`Case` describes one node. ``check_case``:
1. builds the node as a float64 model and its gradient model with ``gradient_model``;
2. checks the gradient model with ``onnx.checker`` (full check, shape inference);
3. compares the gradients with central finite differences of ``sum_k <out_k, seed_k>`` in float64
   (evaluated by ``onnx.reference.ReferenceEvaluator``, or by onnxruntime for ops it lacks);
4. runs the float32 version of the gradient model in onnxruntime and compares it with the float64
   result (rtol 1e-3), proving the graph runs on the standard wheel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxtrain.autodiff import gradient_model

RNG = np.random.default_rng(0)


def F(*shape, low=-1.0, high=1.0, away_from=None):
    """A random float64 array; ``away_from`` keeps values at least 0.1 away from that point (kinks)."""
    x = RNG.uniform(low, high, size=shape)
    if away_from is not None:
        near = np.abs(x - away_from) < 0.1
        x[near] = away_from + np.where(x[near] >= away_from, 0.1, -0.1) + 0.05 * np.sign(x[near] - away_from + 1e-9)
    return x


def I(values):
    return np.asarray(values, dtype=np.int64)


@dataclass
class Case:
    op: str
    inputs: list  # [(name, array)]: float64 arrays are differentiable graph inputs, others constants
    attrs: dict = field(default_factory=dict)
    domain: str = ""
    opset: int = 20
    num_outputs: int = 1
    diff_outputs: list[int] | None = None  # which outputs to differentiate (default: all float ones)
    const: tuple[str, ...] = ()  # float inputs to treat as constants (not differentiated)
    evaluator: str = "reference"  # "reference" (float64), "ort" (float64 in onnxruntime) or "ort32"
    # "ort32": ops with float32 kernels only (most com.microsoft ops): finite differences in float32
    f64_only: bool = False  # skip the float32 onnxruntime run (ops without float32 kernels)
    rtol: float = 1e-4
    atol: float = 1e-6
    eps: float = 1e-6
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.op


def _model(case: Case, dtype) -> tuple[onnx.ModelProto, list[str], list[str]]:
    graph_inputs, inits, node_inputs, wrt = [], [], [], []
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for name, value in case.inputs:
        if value is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(dtype)
            if name not in case.const:
                graph_inputs.append(helper.make_tensor_value_info(name, elem, arr.shape))
                wrt.append(name)
                continue
        inits.append(onnx.numpy_helper.from_array(arr, name))
    outs = [f"y{i}" for i in range(case.num_outputs)]
    node = helper.make_node(case.op, node_inputs, outs, domain=case.domain, name=f"{case.op}_0", **case.attrs)
    graph = helper.make_graph([node], "case", graph_inputs,
                              [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs],
                              initializer=inits)
    opsets = [helper.make_opsetid("", case.opset)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    if not all(o.type.tensor_type.elem_type for o in model.graph.output):
        _type_outputs_by_running(model, {n: np.asarray(v).astype(dtype) for n, v in case.inputs if n in wrt})
    return model, wrt, outs


def _type_outputs_by_running(model: onnx.ModelProto, feeds) -> None:
    """Ops onnx shape inference does not know (com.microsoft ones): take the types onnxruntime computes."""
    untyped = onnx.ModelProto()
    untyped.CopyFrom(model)
    for out in untyped.graph.output:
        out.type.CopyFrom(onnx.TypeProto())
    values = ort.InferenceSession(untyped.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for out, value in zip(model.graph.output, values):
        out.CopyFrom(helper.make_tensor_value_info(out.name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))


def _has_onnx_schemas(model: onnx.ModelProto) -> bool:
    """onnxruntime registers some contrib ops (SimplifiedLayerNormalization) in the ONNX domain."""
    return all(n.domain not in ("", "ai.onnx") or onnx.defs.has(n.op_type) for n in model.graph.node)


class Erf(OpRun):
    """onnx.reference's Erf is a float32-accurate approximation; finite differences need better."""

    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


def _runner(model: onnx.ModelProto, evaluator: str):
    if evaluator == "reference":
        ref = ReferenceEvaluator(model, new_ops=[Erf])
        return lambda feeds: ref.run(None, feeds)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return lambda feeds: sess.run(None, feeds)


def check_case(case: Case) -> None:
    precision = np.float32 if case.evaluator == "ort32" else np.float64
    model, wrt, outs = _model(case, precision)
    feeds = {name: np.asarray(v).astype(precision) for name, v in case.inputs if name in wrt}
    forward = _runner(model, case.evaluator)
    y = forward(feeds)
    diff = case.diff_outputs if case.diff_outputs is not None else [
        i for i, v in enumerate(y) if np.asarray(v).dtype.kind == "f"
    ]
    diff_names = [outs[i] for i in diff]
    seeds = {f"{outs[i]}_grad": RNG.standard_normal(np.shape(y[i])).astype(np.asarray(y[i]).dtype) for i in diff}

    grad = gradient_model(model, wrt=wrt, outputs=diff_names)
    if _has_onnx_schemas(grad):  # else onnx.checker rejects the contrib op itself; onnxruntime runs it below
        onnx.checker.check_model(grad, full_check=True)
    out_names = [o.name for o in grad.graph.output]
    assert out_names[: len(outs)] == outs and out_names[len(outs):] == [f"{w}_grad" for w in wrt]
    analytic = _runner(grad, case.evaluator)({**feeds, **seeds})[len(outs):]

    def objective(f):
        res = forward(f)
        return sum(float(np.sum(np.asarray(res[i]) * seeds[f"{outs[i]}_grad"])) for i in diff)

    eps, rtol, atol = case.eps, case.rtol, case.atol
    if precision == np.float32:
        eps, rtol, atol = max(eps, 1e-2), max(rtol, 2e-2), max(atol, 1e-3)
    for name, got in zip(wrt, analytic):
        x = feeds[name]
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            numeric[idx] = (objective({**feeds, name: plus}) - objective({**feeds, name: minus})) / (2 * eps)
        np.testing.assert_allclose(got, numeric, rtol=rtol, atol=atol,
                                   err_msg=f"{case.id}: gradient of {name} vs finite differences")

    if case.f64_only or precision == np.float32:
        return
    # The same graph in float32, on onnxruntime with its default optimizations.
    model32, _, _ = _model(case, np.float32)
    grad32 = gradient_model(model32, wrt=wrt, outputs=diff_names)
    sess = ort.InferenceSession(grad32.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds32 = {k: v.astype(np.float32) for k, v in {**feeds, **seeds}.items()}
    got32 = sess.run(None, feeds32)[len(outs):]
    for name, g64, g32 in zip(wrt, analytic, got32):
        scale = max(1.0, float(np.max(np.abs(g64))) if np.size(g64) else 1.0)
        np.testing.assert_allclose(g32, g64, rtol=2e-3, atol=2e-4 * scale,
                                   err_msg=f"{case.id}: float32 onnxruntime gradient of {name}")
