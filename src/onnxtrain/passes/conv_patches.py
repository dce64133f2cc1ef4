"""A convolution whose kernel has a dynamic size, as products over input windows, for OpenVINO's CPU plugin.

A convolution's weight gradient is a correlation of the padded input with the output gradient
(:func:`onnxtrain.autodiff.rules._nn_window.weight_gradient`): a ``Conv`` whose kernel is the output gradient,
of dynamic size wherever the batch (or the image size) is, followed by a ``Slice`` keeping the first ``P``
positions of each spatial axis (the forward kernel's size, static). OpenVINO's CPU plugin compiles no
convolution with a kernel of dynamic size (2026.4: "Doesn't support dynamic weights shape"), so every
convolution model fell back under autocast bf16.

Rewritten, where a ``Conv`` with a kernel not of static size is read only by such a ``Slice`` (constant starts
0, constant ends ``P`` on every spatial axis, step 1), without pads: each of the ``P`` output positions (one per
forward kernel offset ``p``) is one product. With stride ``a``, dilation ``e`` and the kernel's spatial length
``Q`` (read from its shape at run time), the input window of position ``p`` is ``X[:, :, p * a : p * a + (Q - 1)
* e + 1 : e]`` (one strided ``Slice``), and with ``group`` ``G``::

    Y[b, g * Mg + m, p] = sum over c < C / G, q of window_p[b, g * C / G + c, q] * W[g * Mg + m, c, q]

one ``MatMul`` ``[B, C * Q] x [C * Q, M]`` (groups: batched, ``[G, B, C / G * Q] x [G, C / G * Q, Mg]``), the
kernel reshaped once for all positions; the ``P`` products are stacked to ``[B, M, P...]``. The same sums in
another order (float32: within rounding of the ``Conv``). Each window is the input's size over the strides,
made and read one at a time: stacking all windows first (im2col) held ``P`` times the input and cost two
transposes of it (ResNet-18's backward, docs/precision.md). Slices only move values, so under OpenVINO's bf16
hint the product reads the same bf16 input and output gradient that autocast's convolution backward reads. Run
only on graphs for OpenVINO (:mod:`onnxtrain.passes.pipeline`); any other ``Conv`` is left alone, and a kernel of
dynamic size left over is refused by :func:`onnxtrain.runtime.openvino.dynamic_kernel`.
"""

from __future__ import annotations

import itertools
import math

import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder
from onnxtrain.passes.rewrite import constant_ints, rewrite_each, static_shape

_DOMAINS = ("", "ai.onnx")
MAX_POSITIONS = 1024  # output positions (a forward kernel's size) rewritten at most: a Slice and a MatMul each
MAX_COLUMNS = 16  # ConvColumnsPass: positions stacked at most (their windows are that many copies of the input)


class ConvPatchesPass(ir.passes.InPlacePass):
    """One product per output position (OpenVINO: its plugin compiles no kernel of dynamic size)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = rewrite_each(model.graph, _positions, _rewrite)
        return ir.passes.PassResult(model, modified=bool(done))


class ConvColumnsPass(ir.passes.InPlacePass):
    """All positions' windows stacked and one ``Gemm`` (onnxruntime, where the ``Conv`` runs one small product
    per image of its batch): see the module's docstring."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        done = rewrite_each(model.graph, _column_positions, _rewrite_columns)
        return ir.passes.PassResult(model, modified=bool(done))


def _ints(value: ir.Value | None) -> list[int] | None:
    ints = constant_ints(value)
    return None if ints is None else ints.reshape(-1).tolist()


def _positions(node: ir.Node) -> list[int] | None:
    """The output positions a ``Conv`` with a kernel of dynamic size must make per spatial axis (the ends of the
    one ``Slice`` that reads it), or None where it is not of the form this pass rewrites."""
    if node.op_type != "Conv" or node.domain not in _DOMAINS or len(node.inputs) < 2 or len(node.inputs) > 2:
        return None
    x, w = node.inputs[0], node.inputs[1]
    if w is None or static_shape(w.shape) or x is None or len(node.outputs[0].uses()) != 1:
        return None
    reader, slot = next(iter(node.outputs[0].uses()))
    if reader.op_type != "Slice" or reader.domain not in _DOMAINS or slot != 0 or len(reader.inputs) < 4:
        return None
    starts, ends, axes = (_ints(v) for v in reader.inputs[1:4])
    n = len(ends or ())
    steps = _ints(reader.inputs[4]) if len(reader.inputs) > 4 and reader.inputs[4] is not None else [1] * n
    if n < 1 or starts != [0] * n or axes != list(range(2, 2 + n)) or steps != [1] * n or \
            any(e < 1 for e in ends) or math.prod(ends) > MAX_POSITIONS:
        return None
    if (x.shape is not None and len(x.shape) != n + 2) or any(node.attributes.get_ints("pads", [0] * 2 * n)) or \
            node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    return ends


def _column_positions(node: ir.Node) -> list[int] | None:
    """:func:`_positions` for :class:`ConvColumnsPass`: ungrouped, at most :data:`MAX_COLUMNS` positions."""
    positions = _positions(node)
    if positions is None or node.attributes.get_int("group", 1) != 1 or math.prod(positions) > MAX_COLUMNS:
        return None
    return positions


class _Windows:
    """What both rewrites read: the node's attributes and, per output position, its input window."""

    def __init__(self, graph: ir.Graph, node: ir.Node, positions: list[int], what: str):
        self.x, self.w = node.inputs[0], node.inputs[1]
        self.crop = next(iter(node.outputs[0].uses()))[0]
        n = self.n = len(positions)
        self.strides = list(node.attributes.get_ints("strides", [1] * n))
        dilations = list(node.attributes.get_ints("dilations", [1] * n))
        self.group = node.attributes.get_int("group", 1)
        b = self.b = GraphBuilder((v.name for v in _values(graph)), prefix=f"{node.name or 'Conv'}/{what}")
        self.axes, self.steps = b.ints(list(range(2, 2 + n))), b.ints(dilations)
        # (Q - 1) * e + 1 per axis: the input span of one output position's window, Q the kernel's run time length
        self.span = b.Add(b.Mul(b.Sub(b.Slice(b.Shape(self.w), b.ints([2]), b.ints([2 + n])), b.ints([1])),
                                self.steps), b.ints([1]))

    def window(self, p: tuple[int, ...]) -> ir.Value:
        """The input window of output position ``p``: ``[B, C, Q...]``."""
        b = self.b
        start = b.ints([q * s for q, s in zip(p, self.strides)])
        return b.Slice(self.x, start, b.Add(start, self.span), self.axes, self.steps)

    def replace(self, graph: ir.Graph, node: ir.Node, y: ir.Value) -> None:
        out = self.crop.outputs[0]
        y.shape, y.type = out.shape, out.type
        ir.convenience.replace_nodes_and_values(graph, node, [node, self.crop], self.b.nodes, [out], [y])


def _rewrite_columns(graph: ir.Graph, node: ir.Node, positions: list[int]) -> None:
    """``Y[b, m, p] = sum over c, q of window_p[b, c, q] * W[m, c, q]`` as one ``Gemm``: the kernel ``[M, C * Q]``
    times the windows stacked ``[B * P, C * Q]``, transposed by the ``Gemm`` itself (``transB``). Its product
    ``[M, B, P...]`` is transposed to the node's ``[B, M, P...]``: the weight gradient transposes that back, and
    onnxruntime drops the two transposes."""
    win = _Windows(graph, node, positions, "columns")
    b, count = win.b, math.prod(positions)
    windows = [b.Unsqueeze(win.window(p), b.ints([1])) for p in itertools.product(*(range(k) for k in positions))]
    stacked = b.Concat(*windows, axis=1) if count > 1 else windows[0]  # [B, P, C, Q...]
    rows = b.Mul(b.Slice(b.Shape(win.x), b.ints([0]), b.ints([1])), b.ints([count]))  # B * P
    columns = b.Reshape(stacked, b.Concat(rows, b.ints([-1]), axis=0))  # [B * P, C * Q]
    products = b.Gemm(b.Reshape(win.w, b.ints([0, -1])), columns, transB=1)  # [M, B * P]
    y = b.Reshape(products, b.ints([0, -1, *positions]))  # [M, B, P...]
    win.replace(graph, node, b.Transpose(y, perm=[1, 0, *range(2, 2 + win.n)]))


def _rewrite(graph: ir.Graph, node: ir.Node, positions: list[int]) -> None:
    win = _Windows(graph, node, positions, "patches")
    w, n, group, b = win.w, win.n, win.group, win.b
    # the kernel as [G, C / G * Q, Mg] (G == 1: [C * Q, M]), made once and read by every position's product
    kernel = b.Reshape(w, b.ints([0, -1]))  # [M, C / G * Q]
    if group > 1:
        kernel = b.Reshape(kernel, b.Concat(b.ints([group, -1]), b.Slice(b.Shape(kernel), b.ints([1]), b.ints([2])),
                                            axis=0))  # [G, Mg, C / G * Q]
    kernel = b.Transpose(kernel, perm=[0, 2, 1] if group > 1 else [1, 0])
    products = []
    for p in itertools.product(*(range(k) for k in positions)):
        window = win.window(p)  # [B, C, Q...]
        if group > 1:  # [G, B, C / G * Q]
            rows = b.Transpose(b.Reshape(window, b.ints([0, group, -1])), perm=[1, 0, 2])
        else:
            rows = b.Reshape(window, b.ints([0, -1]))  # [B, C * Q]
        products.append(b.Unsqueeze(b.MatMul(rows, kernel), b.ints([-1])))  # [G, B, Mg, 1] or [B, M, 1]
    y = b.Concat(*products, axis=-1) if len(products) > 1 else products[0]
    if group > 1:
        y = b.Transpose(y, perm=[1, 0, 2, 3])  # [B, G, Mg, P]
    win.replace(graph, node, b.Reshape(y, b.ints([0, -1, *positions])))


def _values(graph: ir.Graph):
    yield from itertools.chain(graph.inputs, graph.initializers.values())
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs
