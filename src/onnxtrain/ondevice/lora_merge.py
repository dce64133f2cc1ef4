"""Merge LoRA adapters into their base weights for inference (torch-free: onnx and numpy).

A LoRA layer as PEFT exports it (``torch.onnx.export(..., optimize=False)``) computes

    y = x W^T + s * (x A^T) B^T            (W [out, in], A [r, in], B [out, r], s = alpha / r)

as ``Add(MatMul(x, Transpose(W)) [+ bias], Mul(MatMul(MatMul(x, Transpose(A)), Transpose(B)), s))``; the
base product may also be ``Gemm(x, W, bias, transB=1)`` (a 2-D input).
Merging sets ``W' = W + s B A`` and replaces the ``Add`` by the base product alone, so the exported graph
has one product per layer and no adapters. PEFT's embedding adapters (``lora_embedding_A`` [r, vocab],
``lora_embedding_B`` [dim, r]: ``Gather(W, ids) + s Gather(A^T, ids) B^T``) merge as ``W' = W + s (B A)^T``
where the table is float32 and read by that Gather alone; over an int8 or int4 table (gathered
quantized) they stay separate. With an int8 base (``W = DequantizeLinear(W.int8, W.scale)``)
the merged ``W'`` is stored as float32 (it is no longer on the int8 grid); the other matrices stay int8.
A graph that does not compute this pattern for an adapter is refused with the adapter's name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

LORA_A, LORA_B = "lora_A", "lora_B"
EMBEDDING_A, EMBEDDING_B = "lora_embedding_A", "lora_embedding_B"  # PEFT's, on embedding layers


class _Graph:
    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        self.initializers = {t.name: t for t in graph.initializer}

    def only_reader(self, value: str, op: str) -> onnx.NodeProto | None:
        nodes = self.readers.get(value, [])
        return nodes[0] if len(nodes) == 1 and nodes[0].op_type == op else None

    def transposed_by(self, value: str) -> onnx.NodeProto | None:
        """The producer of ``value`` if it is a 2-D transpose, else None."""
        node = self.producer.get(value)
        if node is None or node.op_type != "Transpose":
            return None
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        return node if perm == [1, 0] else None

    def scalar(self, value: str) -> float | None:
        if value in self.initializers:
            array = numpy_helper.to_array(self.initializers[value])
        else:
            node = self.producer.get(value)
            if node is None or node.op_type != "Constant":
                return None
            array = numpy_helper.to_array(node.attribute[0].t) if node.attribute[0].type == onnx.AttributeProto.TENSOR \
                else np.asarray(helper.get_attribute_value(node.attribute[0]))
        return float(array.reshape(())) if array.size == 1 else None


def _branch(g: _Graph, a_name: str, b_name: str):
    """(Add node, index of its base input, base weight name, scaling) of the adapter pair, or a reason."""
    found = _adapter_product(g, a_name, b_name, "MatMul")
    if isinstance(found, str):
        return found
    mm_a, add, base_index, scaling = found
    x = mm_a.input[0]
    base = g.producer.get(add.input[base_index])
    if base is not None and base.op_type == "Add":  # a bias after the product
        base = next((g.producer[i] for i in base.input if i in g.producer and g.producer[i].op_type == "MatMul"), None)
    w_name = base is not None and base.input[0] == x and _base_weight(g, base)
    if not w_name:
        return "the base layer is not MatMul(x, Transpose(W)) or Gemm(x, W, transB=1) of the adapters' input x"
    return add, base_index, w_name, scaling


def _adapter_product(g: _Graph, a_name: str, b_name: str, op: str):
    """(the ``op`` node reading ``Transpose(A)``, then :func:`_scaled_sum`'s three) for the adapters'
    product ``s * op(x, A^T) B^T`` (``op``: "MatMul" ``x A^T``, or "Gather" the rows ``ids`` of ``A^T``),
    or a reason."""
    t_a = g.only_reader(a_name, "Transpose")
    first = t_a and g.only_reader(t_a.output[0], op)
    if not first or first.input[1 if op == "MatMul" else 0] != t_a.output[0]:
        return f"{a_name} is not read as " + ("MatMul(x, Transpose(A))" if op == "MatMul" else "Gather(Transpose(A), ids)")
    mm = g.only_reader(first.output[0], "MatMul")
    t_b = mm and g.transposed_by(mm.input[1])
    if not mm or not t_b or t_b.input[0] != b_name or mm.input[0] != first.output[0]:
        what = "x A^T" if op == "MatMul" else "the gathered rows of A^T"
        return f"{what} is not multiplied by Transpose({b_name})"
    found = _scaled_sum(g, mm.output[0])
    return found if isinstance(found, str) else (first, *found)


def _scaled_sum(g: _Graph, out: str):
    """(the Add of the base output and ``s * out``, the index of the base input, s) or a reason."""
    scaling = 1.0
    mul = g.only_reader(out, "Mul")
    if mul is not None:
        scaling = g.scalar(mul.input[1] if mul.input[0] == out else mul.input[0])
        if scaling is None:
            return "the adapters' product is scaled by a value that is not a constant scalar"
        out = mul.output[0]
    add = g.only_reader(out, "Add")
    if add is None:
        return "the adapters' product is not added to the base layer's output"
    return add, 1 - list(add.input).index(out), scaling


def _embedding_branch(g: _Graph, a_name: str, b_name: str):
    """As :func:`_branch` for PEFT's embedding adapters: ``Gather(W, ids) + s * Gather(A^T, ids) B^T``."""
    found = _adapter_product(g, a_name, b_name, "Gather")
    if isinstance(found, str):
        return found
    gather_a, add, base_index, scaling = found
    base = g.producer.get(add.input[base_index])
    axis = base is not None and next((helper.get_attribute_value(a) for a in base.attribute if a.name == "axis"), 0)
    if base is None or base.op_type != "Gather" or axis != 0 or base.input[1] != gather_a.input[1]:
        return "the base output is not Gather(W, ids) of the adapters' ids"
    if len(g.readers.get(base.input[0], [])) > 1:
        return f"the table {base.input[0]!r} is read elsewhere too (tied weights), so merging would change that reader"
    return add, base_index, base.input[0], scaling


def _base_weight(g: _Graph, base: onnx.NodeProto) -> str | None:
    """``W`` of a base product ``x W^T``: ``MatMul(x, Transpose(W))``, or ``Gemm(x, W)`` with ``transB=1``
    (``Gemm(x, Transpose(W))`` with ``transB=0``), ``alpha=1`` and ``transA=0``; else None."""
    if base.op_type == "MatMul":
        t_w = g.transposed_by(base.input[1])
        return t_w.input[0] if t_w else None
    if base.op_type != "Gemm":
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in base.attribute}
    if attrs.get("alpha", 1.0) != 1.0 or attrs.get("transA", 0):
        return None
    if attrs.get("transB", 0):
        return base.input[1]
    t_w = g.transposed_by(base.input[1])
    return t_w.input[0] if t_w else None


def _quantized_table(a_name: str, params: Mapping[str, np.ndarray]) -> bool:
    """Whether the table under PEFT's embedding adapter ``a_name`` is stored int8 or int4."""
    table = f"{a_name.split('.' + EMBEDDING_A)[0]}.base_layer.weight"
    return any(f"{table}.{kind}" in params for kind in ("int8", "int4"))


def merge_adapters(model: onnx.ModelProto, parameters: Mapping[str, np.ndarray],
                   markers: Sequence[str] = (LORA_A, LORA_B)) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model and parameters with each ``A``/``B`` pair merged into its base weight (see the module
    docstring); ``parameters`` maps the model's parameter inputs to values and is not changed."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    params = dict(parameters)
    g = _Graph(model.graph)
    mark_a, mark_b = markers
    pairs = [(n, n.replace(mark_a, mark_b), False) for n in params if mark_a in n]
    pairs += [(n, n.replace(EMBEDDING_A, EMBEDDING_B), True) for n in params if EMBEDDING_A in n]
    if not pairs:
        raise ValueError(f"merge_adapters=True, but the model has no LoRA adapters (parameters named with {mark_a!r})")
    drop = []
    for a_name, b_name, embedding in pairs:
        if b_name not in params:
            raise ValueError(f"cannot merge {a_name!r}: its pair {b_name!r} is not a parameter")
        if embedding and _quantized_table(a_name, params):
            continue  # gathered as int8/int4 rows: the adapters stay separate
        found = (_embedding_branch if embedding else _branch)(g, a_name, b_name)
        if isinstance(found, str):
            raise ValueError(f"cannot merge LoRA adapter {a_name!r}: {found}; export with merge_adapters=False "
                             "to keep the adapters separate")
        add, base_index, w_name, scaling = found
        a, b = (np.asarray(params[n], dtype=np.float32) for n in (a_name, b_name))
        delta = scaling * (b @ a).T if embedding else scaling * (b @ a)  # W [vocab, dim] or [out, in]
        if w_name in params:
            params[w_name] = (np.asarray(params[w_name], dtype=np.float32) + delta).astype(np.float32)
        else:
            dq = g.producer.get(w_name)
            if dq is None or dq.op_type != "DequantizeLinear" or not all(i in params for i in dq.input[:2]):
                raise ValueError(f"cannot merge LoRA adapter {a_name!r}: its base weight {w_name!r} is neither a "
                                 "parameter nor DequantizeLinear of parameters")
            q, s = (np.asarray(params[i]) for i in dq.input[:2])
            merged = (q.astype(np.float32) * s.reshape(-1, 1) + delta).astype(np.float32)
            drop.append(dq)
            model.graph.initializer.append(numpy_helper.from_array(merged, w_name))
        base_out = add.input[base_index]
        add.op_type, add.domain = "Identity", ""
        del add.input[:]
        add.input.append(base_out)
        del add.attribute[:]
    kept = [n for n in model.graph.node if not any(n is d for d in drop)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model, params


__all__ = ["merge_adapters"]
