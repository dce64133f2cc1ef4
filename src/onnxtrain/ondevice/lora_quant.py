"""The quantized frozen base of LoRA artifacts: int8 per row, or int4 per block of 32.

``quantize_base_int8`` replaces each frozen float32 matrix ``W`` by ``<W>.int8`` (int8) and ``<W>.scale``
(one float32 per row, symmetric: ``W ~= q * scale[:, None]``):

- a matrix that only ``Gather`` reads along axis 0 (an embedding table) is gathered as int8 first and
  only the gathered rows are dequantized (``Cast(Gather(q)) * Unsqueeze(Gather(scale))``), so no float32
  copy of the table is ever made;
- any other matrix (a linear weight ``[out, in]``) is read through a standard ``DequantizeLinear(axis=0)``.

``quantize_base(..., bits=4)`` stores ``<W>.int4`` instead: symmetric int4 per block of 32 values along each
row (16 where the row's length is not a multiple of 32; ``<W>.scale`` is ``[out, in / block]``), two values a byte in a uint8 tensor (the checkpoint and the
runtime bind numpy arrays, and numpy has no int4). The graph unpacks it with standard ONNX ops (BitShift,
Sub, Concat, Reshape, Cast, Mul; opset 15 or later), so the artifacts run on any ONNX runtime; this is
what ``DequantizeLinear`` with an int4 tensor and ``block_size=32`` (opset 21) computes, without needing
int4 tensors as graph inputs. Embedding tables are gathered packed, then unpacked.

No float32 copy of a weight lives from forward to backward: the backward of ``y = x W^T`` reads ``W``
again (``dx = dy W``), and the gradient nodes get their own dequantization (int8:
:func:`dequantize_where_read`, which also makes onnxruntime run each one just before its product and
keeps its planner from holding one buffer per weight shape all step; int4: :func:`unpack_again_in_backward`).
What remains of a step's peak is the activations kept for backward, as with a float32 base, and the
largest dequantized weight while its product runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper


def quantize_rows_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: ``weight ~= q * scale[:, None]``, q in [-127, 127]."""
    w = np.asarray(weight, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _gathered_only(name: str, readers: dict[str, list[onnx.NodeProto]], outputs: set[str]) -> bool:
    """Whether only ``Gather(name, indices, axis=0)`` reads ``name`` (and no graph output is it)."""
    nodes = readers.get(name, [])
    return bool(nodes) and name not in outputs and all(
        n.op_type == "Gather" and n.domain in ("", "ai.onnx") and n.input[0] == name and name not in n.input[1:]
        and all(a.name != "axis" or helper.get_attribute_value(a) == 0 for a in n.attribute) for n in nodes)


def _gather_then_dequantize(gather: onnx.NodeProto, qname: str, sname: str) -> list[onnx.NodeProto]:
    """``Gather(W, idx)`` as ``Cast(Gather(q, idx), float) * Unsqueeze(Gather(scale, idx), -1)``."""
    out, base = gather.output[0], gather.name or f"gather/{gather.output[0]}"
    idx = gather.input[1]
    return [
        helper.make_node("Gather", [qname, idx], [f"{out}.int8"], axis=0, name=f"{base}/int8"),
        helper.make_node("Cast", [f"{out}.int8"], [f"{out}.float"], to=onnx.TensorProto.FLOAT, name=f"{base}/cast"),
        helper.make_node("Gather", [sname, idx], [f"{out}.scale"], axis=0, name=f"{base}/scale"),
        helper.make_node("Unsqueeze", [f"{out}.scale", f"{out}.axes"], [f"{out}.scale_column"], name=f"{base}/unsqueeze"),
        helper.make_node("Mul", [f"{out}.float", f"{out}.scale_column"], [out], name=f"{base}/dequantize"),
    ]


INT4_BLOCK = 32
INT4_BLOCKS = (INT4_BLOCK, 16)  # 16 where a row's length is not a multiple of 32 (688: 43 blocks of 16)
_C = "lora.int4."  # the int4 reading's shared constants


def quantize_blocks_int4(weight: np.ndarray, block: int = INT4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per block of ``block`` values along each row: ``weight ~= q * scale`` blockwise, q in
    [-7, 7]. Returns ``(packed, scale)``: ``packed`` uint8 ``[out, in / 2]`` holds ``q + 8`` of the even
    columns in its low 4 bits and of the odd ones in its high 4 bits; ``scale`` is ``[out, in / block]``."""
    w = np.asarray(weight, dtype=np.float32)
    rows, cols = w.shape
    if cols % block or block % 2:
        raise ValueError(f"int4 blocks of {block} need rows whose length is a multiple of it; got {w.shape}")
    blocks = w.reshape(rows, cols // block, block)
    amax = np.abs(blocks).max(axis=2)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = (np.clip(np.rint(blocks / scale[:, :, None]), -7, 7) + 8).astype(np.uint8).reshape(rows, cols)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), scale


def dequantize_blocks_int4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """numpy's reading of :func:`quantize_blocks_int4`'s output (what the graph computes)."""
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32) - 8
    block = q.shape[-1] // scale.shape[-1]
    return (q.reshape(*scale.shape, block) * scale[..., None]).reshape(q.shape)


def _int4_constants(cols: int, block: int) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(np.array(4, dtype=np.uint8), f"{_C}4"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{_C}last"),
            numpy_helper.from_array(np.array(8.0, dtype=np.float32), f"{_C}8"),
            numpy_helper.from_array(np.array([block], dtype=np.int64), f"{_C}block{block}"),
            numpy_helper.from_array(np.array([cols], dtype=np.int64), f"{_C}cols{cols}")]


def _unpack_int4(packed: str, scale: str, out: str, cols: int, block: int) -> list[onnx.NodeProto]:
    """Nodes computing ``out`` (``[..., cols]`` float32) from ``packed`` (``[..., cols / 2]`` uint8) and
    ``scale`` (``[..., cols / block]``), for a matrix or for rows gathered from one."""
    p = f"{out}.int4"
    return [
        helper.make_node("BitShift", [packed, f"{_C}4"], [f"{p}.high"], direction="RIGHT", name=f"{p}/high"),
        helper.make_node("BitShift", [f"{p}.high", f"{_C}4"], [f"{p}.high_shifted"], direction="LEFT",
                         name=f"{p}/high_shifted"),
        helper.make_node("Sub", [packed, f"{p}.high_shifted"], [f"{p}.low"], name=f"{p}/low"),
        helper.make_node("Unsqueeze", [f"{p}.low", f"{_C}last"], [f"{p}.low_column"], name=f"{p}/low_column"),
        helper.make_node("Unsqueeze", [f"{p}.high", f"{_C}last"], [f"{p}.high_column"], name=f"{p}/high_column"),
        helper.make_node("Concat", [f"{p}.low_column", f"{p}.high_column"], [f"{p}.pairs"], axis=-1, name=f"{p}/pairs"),
        helper.make_node("Shape", [scale], [f"{p}.scale_shape"], name=f"{p}/scale_shape"),
        helper.make_node("Concat", [f"{p}.scale_shape", f"{_C}block{block}"], [f"{p}.block_shape"], axis=0,
                         name=f"{p}/block_shape"),
        helper.make_node("Reshape", [f"{p}.pairs", f"{p}.block_shape"], [f"{p}.blocks"], name=f"{p}/blocks"),
        helper.make_node("Cast", [f"{p}.blocks"], [f"{p}.float"], to=onnx.TensorProto.FLOAT, name=f"{p}/cast"),
        helper.make_node("Sub", [f"{p}.float", f"{_C}8"], [f"{p}.centered"], name=f"{p}/center"),
        helper.make_node("Unsqueeze", [scale, f"{_C}last"], [f"{p}.scale_column"], name=f"{p}/scale_column"),
        helper.make_node("Mul", [f"{p}.centered", f"{p}.scale_column"], [f"{p}.scaled"], name=f"{p}/scale"),
        helper.make_node("Shape", [scale], [f"{p}.rows_shape"], end=-1, name=f"{p}/rows_shape"),
        helper.make_node("Concat", [f"{p}.rows_shape", f"{_C}cols{cols}"], [f"{p}.out_shape"], axis=0,
                         name=f"{p}/out_shape"),
        helper.make_node("Reshape", [f"{p}.scaled", f"{p}.out_shape"], [out], name=f"{p}/dequantize"),
    ]


BITS = {8: "int8", 4: "int4"}


def quantize_base(model: onnx.ModelProto, names: Sequence[str], bits: int = 8) -> tuple[onnx.ModelProto, list[str]]:
    """Replace each named float32 matrix initializer ``W`` by ``<W>.int8`` (``bits=8``) or ``<W>.int4``
    (``bits=4``, packed) and ``<W>.scale``, read as the module docstring says.

    Returns the model and the names of the new initializers in place of the quantized ones; initializers
    that are not float32 matrices (or, for int4, whose rows are a multiple of neither 32 nor 16) are left as
    they are and keep their names.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {list(BITS)}, got {bits!r}")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    opset = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    need = 13 if bits == 8 else 15
    if opset is not None and opset.version < need:
        raise ValueError(f"{BITS[bits]} base weights need opset >= {need} (DequantizeLinear with axis; Shape with "
                         f"end); the model has {opset.version}")
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    readers = _readers(graph)
    outputs = {o.name for o in graph.output}
    head, kept, out_names, replaced, constants = [], [], [], {}, {}
    for t in list(graph.initializer):
        block = next((b for b in INT4_BLOCKS if len(t.dims) == 2 and t.dims[1] % b == 0), None)
        if t.name not in names or t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2 \
                or (bits == 4 and block is None):
            kept.append(t)
            if t.name in names:
                out_names.append(t.name)
            continue
        weight = numpy_helper.to_array(t)
        q, scale = quantize_rows_int8(weight) if bits == 8 else quantize_blocks_int4(weight, block)
        qname, sname = f"{t.name}.{BITS[bits]}", f"{t.name}.scale"
        clash = [n for n in (qname, sname) if n in taken]
        if clash:
            raise ValueError(f"cannot quantize {t.name!r}: the model already has values named {clash}")
        kept += [numpy_helper.from_array(q, qname), numpy_helper.from_array(scale, sname)]
        out_names += [qname, sname]
        if bits == 4:
            constants.update({c.name: c for c in _int4_constants(int(t.dims[1]), block)})
        if _gathered_only(t.name, readers, outputs):
            for g in readers[t.name]:
                if bits == 8:
                    kept.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{g.output[0]}.axes"))
                    replaced[id(g)] = _gather_then_dequantize(g, qname, sname)
                else:
                    out, base = g.output[0], g.name or f"gather/{g.output[0]}"
                    replaced[id(g)] = [
                        helper.make_node("Gather", [qname, g.input[1]], [f"{out}.packed"], axis=0, name=f"{base}/int4"),
                        helper.make_node("Gather", [sname, g.input[1]], [f"{out}.scale"], axis=0, name=f"{base}/scale"),
                        *_unpack_int4(f"{out}.packed", f"{out}.scale", out, int(t.dims[1]), block)]
        elif bits == 8:
            head.append(helper.make_node("DequantizeLinear", [qname, sname], [t.name], axis=0, name=f"dequantize/{t.name}"))
        else:
            head += _unpack_int4(qname, sname, t.name, int(t.dims[1]), block)
    del graph.initializer[:]
    graph.initializer.extend(kept + list(constants.values()))
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(head)  # the dequantized values are ready before any reader
    for node in old:
        graph.node.extend(replaced.get(id(node), [node]))
    return model, out_names


def quantize_base_int8(model: onnx.ModelProto, names: Sequence[str]) -> tuple[onnx.ModelProto, list[str]]:
    """:func:`quantize_base` with ``bits=8``."""
    return quantize_base(model, names, bits=8)




def _forward_nodes(nodes: list[onnx.NodeProto], outputs: list[str]) -> set[int]:
    """Indices of the nodes that ``outputs`` (the loss and additional outputs) need."""
    producers = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        k = producers.get(stack.pop())
        if k is None or k in seen:
            continue
        seen.add(k)
        stack.extend(i for i in nodes[k].input if i)
    return seen


def _clone_for_backward(nodes: list[onnx.NodeProto], chain: list[int], sixteen: str) -> tuple[list[onnx.NodeProto], dict]:
    """Copies of ``nodes[chain]`` with new output names; a right shift of a packed weight becomes a Div."""
    clones, rename = [], {}
    for k in chain:
        maker = nodes[k]
        copy = onnx.NodeProto()
        copy.CopyFrom(maker)
        copy.name = f"{maker.name or maker.op_type}/again_in_backward"
        inputs = [rename.get(i, i) for i in maker.input]
        if maker.op_type == "BitShift" and maker.input[0] not in rename \
                and helper.get_attribute_value(maker.attribute[0]) == b"RIGHT":
            del copy.attribute[:]
            copy.op_type, inputs = "Div", [maker.input[0], sixteen]
        del copy.input[:]
        copy.input.extend(inputs)
        del copy.output[:]
        copy.output.extend(f"{o}/again_in_backward" for o in maker.output)
        rename.update(zip(maker.output, copy.output))
        clones.append(copy)
    return clones, rename


def unpack_again_in_backward(model: onnx.ModelProto, num_forward_outputs: int, parameters: Sequence[str]) -> int:
    """Give the gradient nodes their own unpacking of each int4 weight (in place); returns how many values.

    The backward of ``y = x W^T`` reads ``W`` again (``dx = dy W``). Without this, each unpacked float32
    weight would live from its forward product to its backward one: all of them at once at the turn from
    forward to backward (measured: a higher peak than the float32 base's). The pass clones, for each value
    that gradient nodes read and that only parameters and constants make (the unpacking, a weight's
    ``Transpose``), the nodes that make it, just before the first gradient node that reads it. The clone's
    first op shifts by ``Div(packed, 16)`` instead of ``BitShift``, so that onnxruntime's
    common-subexpression elimination does not merge it back into the forward one.
    """
    graph = model.graph
    nodes = list(graph.node)
    forward = _forward_nodes(nodes, [o.name for o in graph.output[:num_forward_outputs]])
    producers = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    made_of_weights = set(parameters) | {t.name for t in graph.initializer}
    for k, node in enumerate(nodes):  # in graph order: a node's inputs come before it
        if k in forward and (all(i in made_of_weights for i in node.input if i) if node.input
                             else node.op_type == "Constant"):
            made_of_weights.update(o for o in node.output if o)
    sixteen = f"{_C}16"
    renamed: dict[str, str] = {}
    before: dict[int, list[onnx.NodeProto]] = {}
    for k, node in enumerate(nodes):
        if k in forward:
            continue
        for j, name in enumerate(node.input):
            if name not in made_of_weights or name not in producers:
                continue
            if name not in renamed:
                chain, stack = set(), [name]
                while stack:  # the nodes that make ``name``
                    maker = producers.get(stack.pop())
                    if maker is not None and maker not in chain:
                        chain.add(maker)
                        stack.extend(nodes[maker].input)
                clones, rename = _clone_for_backward(nodes, sorted(chain), sixteen)
                renamed[name] = rename[name]
                before.setdefault(k, []).extend(clones)  # just before the first reader: still sorted
            node.input[j] = renamed[name]
    if renamed:
        del graph.node[:]
        graph.node.extend(n for k, node in enumerate(nodes) for n in (*before.get(k, []), node))
        graph.initializer.append(numpy_helper.from_array(np.array(16, dtype=np.uint8), sixteen))
    return len(renamed)

def dequantize_where_read(model: onnx.ModelProto, num_forward_outputs: int, parameters: Sequence[str]) -> int:
    """int8 base: give each product its own dequantized copy of its weight, made just before it runs, in a
    buffer of its own (in place); returns how many values the gradient nodes got copies of.

    Two onnxruntime behaviours otherwise keep dequantized float32 weights resident (measured on the
    139M-parameter bench model at 1 x 4 tokens: 73 MB of them in a step, 37 MB after this; the float32
    base has none):

    - its topological order visits a node's inputs from the highest node index down, so a
      ``DequantizeLinear`` that reads only graph inputs and sits late in the node list (the copies its
      QDQ transformers make for each reader, ``.../duplicated``, are new nodes) runs long before its
      product. Here the gradient nodes get their own copies (:func:`unpack_again_in_backward`) and every
      node made of weights alone moves to the front of the list: each then runs just before its reader.
    - its memory planner hands a freed buffer to the next value of the same static shape, so the
      dequantized weights of each shape (q, o, gate/up, down, lm_head) share one buffer that stays
      allocated for the whole step. The int8 inputs' dims and the dequantized values' shapes are
      therefore left unknown to it (the checkpoint still fixes them; the runtime checks their rank).
    """
    count = unpack_again_in_backward(model, num_forward_outputs, parameters)
    graph = model.graph
    made = set(parameters) | {t.name for t in graph.initializer}
    early, rest = [], []
    for node in graph.node:  # in graph order: a node's inputs come before it
        if all(i in made for i in node.input if i) if node.input else node.op_type == "Constant":
            made.update(o for o in node.output if o)
            early.append(node)
        else:
            rest.append(node)
    del graph.node[:]
    graph.node.extend(early + rest)
    weights = {o for n in early for o in n.output}
    kept = [v for v in graph.value_info if v.name not in weights]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    quantized = {n.input[0] for n in early if n.op_type == "DequantizeLinear"}
    for value in graph.input:
        if value.name in quantized:
            for dim in value.type.tensor_type.shape.dim:
                dim.Clear()
    return count


__all__ = ["dequantize_blocks_int4", "dequantize_where_read", "quantize_base", "quantize_base_int8", "quantize_blocks_int4", "quantize_rows_int8",
           "unpack_again_in_backward"]
