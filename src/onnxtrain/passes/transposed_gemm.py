"""A ``Transpose`` of a ``Gemm``'s product becomes one ``Gemm`` of the swapped operands: ``(A'B')^T = B'^T A'^T``.

A weight used transposed in the forward (``MatMul(x, Transpose(W))``, as torch.export writes a linear layer,
or GPT-2's tied ``lm_head``) gets its gradient from the MatMul rule as ``Gemm(x_rows, dy_rows, transA=1)``
(``[in, out]``) and then from the Transpose rule as ``Transpose`` of that (``[out, in]``). OpenVINO's CPU
plugin runs that Transpose on its reference float32 kernel after converting the bfloat16 product to float32:
on GPT-2-small's ``lm_head`` (``[256, 50257]``) 151 ms of a 1148 ms fused call, one thread, loaded
(docs/precision.md), BERT-small's linear layers 13 ms of 223. The swapped ``Gemm(dy_rows, x_rows, transA=1,
transB=1)`` writes ``[out, in]`` directly; both libraries read a transposed operand in place.

Rewritten: ``Transpose`` (perm absent or ``[1, 0]``) whose input is the only use of a two-input ``Gemm``'s
output (not a graph output). ``alpha`` is kept; a ``Gemm`` with ``C`` is left alone. The products are the
same dot products; a library may sum them in another order (float32 rounding).
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.passes.rewrite import rewrite_each

_DOMAINS = ("", "ai.onnx")


class TransposedGemmPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = rewrite_each(model.graph, _transposed_gemm, _rewrite)
        return ir.passes.PassResult(model, modified=bool(done))


def _transposed_gemm(node: ir.Node) -> ir.Node | None:
    """The Gemm whose product ``node`` transposes, if the pair can become one Gemm, else None."""
    if node.op_type != "Transpose" or node.domain not in _DOMAINS or node.inputs[0] is None:
        return None
    perm = node.attributes.get_ints("perm", None)
    if perm is not None and list(perm) != [1, 0]:
        return None
    product = node.inputs[0]
    gemm = product.producer()
    if gemm is None or gemm.op_type != "Gemm" or gemm.domain not in _DOMAINS:
        return None
    if len(gemm.inputs) > 2 and gemm.inputs[2] is not None:
        return None
    if len(product.uses()) != 1 or product.is_graph_output():
        return None
    return gemm


def _rewrite(graph: ir.Graph, node: ir.Node, gemm: ir.Node) -> None:
    a, b = gemm.inputs[0], gemm.inputs[1]
    trans_a, trans_b = gemm.attributes.get_int("transA", 0), gemm.attributes.get_int("transB", 0)
    attributes = {"alpha": gemm.attributes.get_float("alpha", 1.0), "transA": 1 - trans_b, "transB": 1 - trans_a}
    out = ir.Value(name=None, type=node.outputs[0].type, shape=node.outputs[0].shape)
    swapped = ir.Node("", "Gemm", [b, a], attributes=ir.convenience.convert_attributes(attributes), outputs=[out],
                      name=f"{gemm.name}/transposed" if gemm.name else None)
    ir.convenience.replace_nodes_and_values(graph, node, [gemm, node], [swapped], [node.outputs[0]], [out])
