"""The quantized frozen base of LoRA artifacts: int8 per row.

``quantize_base_int8`` replaces each frozen float32 matrix ``W`` by ``<W>.int8`` (int8) and ``<W>.scale``
(one float32 per row, symmetric: ``W ~= q * scale[:, None]``):

- a matrix that only ``Gather`` reads along axis 0 (an embedding table) is gathered as int8 first and
  only the gathered rows are dequantized (``Cast(Gather(q)) * Unsqueeze(Gather(scale))``), so no float32
  copy of the table is ever made;
- any other matrix (a linear weight ``[out, in]``) is read through a standard ``DequantizeLinear(axis=0)``.

No float32 copy of a weight lives from forward to backward: the backward of ``y = x W^T`` reads ``W``
again (``dx = dy W``), and onnxruntime's QDQ transformers give each reader of a ``DequantizeLinear`` its
own copy of the node (``.../duplicated`` in its optimized model), so each float32 weight exists only
around the product that reads it (checked on the optimized training model of a 63M-parameter Llama: the
longest-lived dequantized weight spans one decoder layer's backward). What remains of a step's peak is
the activations kept for backward, as with a float32 base.
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


def quantize_base_int8(model: onnx.ModelProto, names: Sequence[str]) -> tuple[onnx.ModelProto, list[str]]:
    """Replace each named float32 matrix initializer ``W`` by ``<W>.int8`` and ``<W>.scale`` (see the module
    docstring for how they are read).

    Returns the model and the names of the new initializers in place of the quantized ones; initializers
    that are not float32 matrices are left as they are and keep their names.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    opset = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset.version < 13:
        raise ValueError(f"int8 base weights need opset >= 13 (DequantizeLinear with axis); the model has {opset.version}")
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    readers = _readers(graph)
    outputs = {o.name for o in graph.output}
    head, kept, out_names, replaced = [], [], [], {}
    for t in list(graph.initializer):
        if t.name not in names or t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2:
            kept.append(t)
            if t.name in names:
                out_names.append(t.name)
            continue
        q, scale = quantize_rows_int8(numpy_helper.to_array(t))
        qname, sname = f"{t.name}.int8", f"{t.name}.scale"
        clash = [n for n in (qname, sname) if n in taken]
        if clash:
            raise ValueError(f"cannot quantize {t.name!r}: the model already has values named {clash}")
        kept += [numpy_helper.from_array(q, qname), numpy_helper.from_array(scale, sname)]
        out_names += [qname, sname]
        if _gathered_only(t.name, readers, outputs):
            for g in readers[t.name]:
                kept.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{g.output[0]}.axes"))
                replaced[id(g)] = _gather_then_dequantize(g, qname, sname)
        else:
            head.append(helper.make_node("DequantizeLinear", [qname, sname], [t.name], axis=0, name=f"dequantize/{t.name}"))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(head)  # the dequantized values are ready before any reader
    for node in old:
        graph.node.extend(replaced.get(id(node), [node]))
    return model, out_names


__all__ = ["quantize_base_int8", "quantize_rows_int8"]
