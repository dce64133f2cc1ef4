"""Convolutions over small images as one product over the whole batch, for onnxruntime.

onnxruntime's CPU ``Conv`` and ``ConvTranspose`` run one matrix product per image of the batch, ``[M, C * P] x
[C * P, L]`` for ``L`` output positions: where ``L`` is small (ResNet-18's last stages at 64x64: 2x2 and 4x4) each
product reads the whole weight for a few columns, and the node runs at a fraction of the machine's speed (the
512-channel 3x3 convolutions of ResNet-18's last stage: 10 ms each forward, 16 ms each ``ConvTranspose`` backward,
batch 16, against 2 ms written as below; docs/design.md "Convolutions on onnxruntime"). Where ``L`` is at most
:data:`MAX_POSITIONS` (static image sizes), rewritten with the batch in the product's columns:

- ``Conv`` (the forward's): the windows of every kernel offset ``p`` stacked ``[C, P, B * L]`` (input transposed
  to ``[C, B, ...]`` once, padded, one strided ``Slice`` per offset), one ``MatMul`` ``[M, C * P] x [C * P, B * L]``,
  transposed back to ``[B, M, ...]``, plus the bias;
- ``ConvTranspose`` without pads (a convolution's input gradient: :func:`onnxtrain.autodiff.rules._nn_window.
  input_adjoint`): one ``Gemm`` ``[B * L, M] x [M, C * P]`` and ``Col2Im``, which adds each window back.

The same sums in another order (float32: within rounding of the node). Only ungrouped nodes with a weight of
static shape and images of static size; anything else is left alone. onnxruntime only
(:func:`onnxtrain.passes.pipeline.onnxruntime_graphs`): OpenVINO's plugin has its own convolutions.
"""

from __future__ import annotations

import itertools
import math

import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder
from onnxtrain.passes.conv_patches import _values
from onnxtrain.passes.rewrite import static_shape

_DOMAINS = ("", "ai.onnx")
MAX_POSITIONS = 16  # output positions per image rewritten at most (measured: 4x4 faster, 8x8 slower than the node)
COL2IM_OPSET = 18


class ConvBatchGemmPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 0)
        modified = False
        for node in list(graph):
            if node.op_type == "Conv" and node.domain in _DOMAINS and _spatial(node, node.outputs[0]) is not None:
                _rewrite_conv(graph, node)
                modified = True
            elif node.op_type == "ConvTranspose" and node.domain in _DOMAINS and opset >= COL2IM_OPSET and \
                    _spatial(node, node.inputs[0]) is not None and _pad_free(node):
                _rewrite_conv_transpose(graph, node)
                modified = True
        return ir.passes.PassResult(model, modified=modified)


def _spatial(node: ir.Node, positions: ir.Value) -> list[int] | None:
    """The static spatial sizes of ``positions`` (an output of ``node``, or its input for a ``ConvTranspose``) when
    ``node`` is one this pass rewrites: ungrouped, weight of static shape, images of static size, few positions."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None or node.attributes.get_int("group", 1) != 1:
        return None
    x, w = node.inputs[0], node.inputs[1]
    if not static_shape(w.shape) or x.shape is None or len(x.shape) != len(w.shape) or not static_shape(x.shape, 2) or \
            positions.shape is None or not static_shape(positions.shape, 2) or len(w.shape) < 3:
        return None
    if node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    sizes = list(positions.shape)[2:]
    return sizes if math.prod(sizes) <= MAX_POSITIONS else None


def _pad_free(node: ir.Node) -> bool:
    n = len(node.inputs[1].shape) - 2
    return not any(node.attributes.get_ints("pads", [0] * 2 * n)) and \
        not any(node.attributes.get_ints("output_padding", [0] * n)) and node.attributes.get("output_shape") is None


def _builder(graph: ir.Graph, node: ir.Node) -> GraphBuilder:
    return GraphBuilder((v.name for v in _values(graph)), prefix=f"{node.name or node.op_type}/batch_gemm")


def _replace(graph: ir.Graph, node: ir.Node, b: GraphBuilder, y: ir.Value) -> None:
    out = node.outputs[0]
    y.shape, y.type = out.shape, out.type
    ir.convenience.replace_nodes_and_values(graph, node, [node], b.nodes, [out], [y])


def _rewrite_conv(graph: ir.Graph, node: ir.Node) -> None:
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    out_sizes = list(node.outputs[0].shape)[2:]
    kernel = list(w.shape)[2:]
    n, (m, c) = len(kernel), list(w.shape)[:2]
    strides = list(node.attributes.get_ints("strides", [1] * n))
    dilations = list(node.attributes.get_ints("dilations", [1] * n))
    pads = list(node.attributes.get_ints("pads", [0] * 2 * n))
    b = _builder(graph, node)
    xt = b.Transpose(x, perm=[1, 0, *range(2, 2 + n)])  # [C, B, S...]
    if any(pads):
        xt = b.Pad(xt, b.ints([0, 0, *pads[:n], 0, 0, *pads[n:]]))
    axes, steps = b.ints(list(range(2, 2 + n))), b.ints(strides)
    spans = [(o - 1) * s + 1 for o, s in zip(out_sizes, strides)]
    windows = []
    for p in itertools.product(*(range(k) for k in kernel)):  # W's order: channel-major, then kernel offset
        start = [q * d for q, d in zip(p, dilations)]
        window = b.Slice(xt, b.ints(start), b.ints([a + s for a, s in zip(start, spans)]), axes, steps)
        windows.append(b.Unsqueeze(window, b.ints([1])))  # [C, 1, B, L...]
    stacked = b.Concat(*windows, axis=1) if len(windows) > 1 else windows[0]  # [C, P, B, L...]
    columns = b.Reshape(stacked, b.ints([c * math.prod(kernel), -1]))  # [C * P, B * L]
    y = b.MatMul(b.Reshape(w, b.ints([m, -1])), columns)  # [M, B * L]
    y = b.Transpose(b.Reshape(y, b.ints([m, -1, *out_sizes])), perm=[1, 0, *range(2, 2 + n)])
    if bias is not None:
        y = b.Add(y, b.Reshape(bias, b.ints([m] + [1] * n)))
    _replace(graph, node, b, y)


def _rewrite_conv_transpose(graph: ir.Graph, node: ir.Node) -> None:
    dy, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    in_sizes = list(dy.shape)[2:]
    kernel = list(w.shape)[2:]
    n, (m, c) = len(kernel), list(w.shape)[:2]
    strides = list(node.attributes.get_ints("strides", [1] * n))
    dilations = list(node.attributes.get_ints("dilations", [1] * n))
    full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(in_sizes, strides, kernel, dilations)]
    b = _builder(graph, node)
    rows = b.Reshape(b.Transpose(dy, perm=[0, *range(2, 2 + n), 1]), b.ints([-1, m]))  # [B * L, M]
    columns = b.Gemm(rows, b.Reshape(w, b.ints([m, -1])))  # [B * L, C * P]
    columns = b.Transpose(b.Reshape(columns, b.ints([-1, math.prod(in_sizes), c * math.prod(kernel)])),
                          perm=[0, 2, 1])  # [B, C * P, L]
    y = b.Col2Im(columns, b.ints(full), b.ints(kernel), strides=strides, dilations=dilations)  # [B, C, S...]
    if bias is not None:
        y = b.Add(y, b.Reshape(bias, b.ints([c] + [1] * n)))
    _replace(graph, node, b, y)
