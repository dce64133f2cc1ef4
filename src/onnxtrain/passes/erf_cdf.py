"""GELU's gradient's ``Phi(x) = 0.5 * erf(x / sqrt 2) + 0.5`` as ``Mul`` and ``Add``, not ``HardSigmoid``, for OpenVINO.

The GELU gradient rule (:func:`onnxtrain.autodiff.rules.nn._gelu_erf_slope`) writes ``0.5 * erf + 0.5`` as one
``HardSigmoid(alpha=0.5, beta=0.5)`` of the ``Erf``: onnxruntime runs it in place, and its clamp to [0, 1]
never bites on [-1, 1]. OpenVINO's CPU plugin has only a reference float32 kernel for ``HardSigmoid``
(``ref_any_f32``): under its bf16 hint it converts the bf16 ``Erf`` to float32, runs the reference kernel and
converts back, while ``Mul`` and ``Add`` join the jit-compiled elementwise chain of the ``Erf`` around them.
BERT-small's fused call (four GELU layers): 3.3 ms of ``HardSigmoid`` and about 6 ms of conversions around it
of 334 ms node time, one thread, loaded (docs/precision.md).

Rewritten: a ``HardSigmoid`` whose input is an ``Erf``'s output and whose ``alpha * [-1, 1] + beta`` lies in
[0, 1] (so the clamp is the identity): ``Add(Mul(erf, alpha), beta)``, constants of the value's type. Any
other ``HardSigmoid`` is left alone. Run only on graphs for OpenVINO (:mod:`onnxtrain.passes.pipeline`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

_DOMAINS = ("", "ai.onnx")


class ErfCdfPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = rewrite_each(model.graph, _is_cdf, _rewrite)
        return ir.passes.PassResult(model, modified=bool(done))


def _is_cdf(node: ir.Node) -> bool:
    if node.op_type != "HardSigmoid" or node.domain not in _DOMAINS or node.inputs[0] is None:
        return False
    source = node.inputs[0].producer()
    if source is None or source.op_type != "Erf" or source.domain not in _DOMAINS or _dtype(node) is None:
        return False
    alpha, beta = node.attributes.get_float("alpha", 0.2), node.attributes.get_float("beta", 0.5)
    return 0.0 <= min(beta - alpha, beta + alpha) and max(beta - alpha, beta + alpha) <= 1.0


def _dtype(node: ir.Node) -> ir.DataType | None:
    """The element type of the ``Erf`` (its output's, else its input's)."""
    erf = node.inputs[0]
    source = erf.producer().inputs[0]
    return erf.dtype or (source.dtype if source is not None else None)


def _rewrite(graph: ir.Graph, node: ir.Node) -> None:
    erf, out = node.inputs[0], node.outputs[0]
    dtype = _dtype(node).numpy()
    name = node.name or out.name

    def constant(suffix: str, value: float) -> ir.Node:
        return ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(np.array(value, dtype)))],
                       name=f"{name}/{suffix}")

    alpha = constant("alpha", node.attributes.get_float("alpha", 0.2))
    beta = constant("beta", node.attributes.get_float("beta", 0.5))
    scaled = ir.Value(name=f"{name}/scaled", type=out.type, shape=out.shape)
    result = ir.Value(name=None, type=out.type, shape=out.shape)
    nodes = [alpha, beta,
             ir.Node("", "Mul", [erf, alpha.outputs[0]], outputs=[scaled], name=f"{name}/mul"),
             ir.Node("", "Add", [scaled, beta.outputs[0]], outputs=[result], name=f"{name}/add")]
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, [out], [result])
