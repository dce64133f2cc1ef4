"""LoRA training artifacts: only the adapters train; the frozen base is stored once, optionally as int8.

    from onnxtrain.ondevice.lora import generate_lora_artifacts
    generate_lora_artifacts("peft_model.onnx", base="int8", loss=None, optimizer="adamw",
                            artifact_directory="lora_artifacts")

The model is an ONNX export of a model with LoRA adapters (a PEFT-wrapped model exported with
``torch.onnx.export(..., optimize=False)``: the adapter weights are initializers whose names hold
``lora_A``/``lora_B``, as PEFT names them). The adapters are the trainable parameters: they alone are in
the per-step state (the flat parameter, gradient and optimizer-state vectors). Every other floating-point
initializer is the frozen base: a frozen checkpoint parameter, stored once in the checkpoint and bound
to the training and eval sessions as the same buffer (never copied into the model files, never in the
optimizer's state).

``base="int8"`` stores each frozen matrix (rank 2: linear weights, embedding tables) as int8 with one
float32 scale per row (symmetric, per output channel for a linear weight ``[out, in]``, per token for an
embedding table), read through a standard ``DequantizeLinear`` node. The gradient flows through the
dequantized weight to the adapters as through any constant; the int8 values themselves never change.
Vectors (norm weights, biases) stay float32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ondevice.artifacts import Artifacts, generate_artifacts
from onnxtrain.utils.io import load_model

ADAPTER_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
BASE_FORMATS = ("float32", "int8")


def split_parameters(model: onnx.ModelProto, adapter_markers: Sequence[str] = ADAPTER_MARKERS) -> tuple[list[str], list[str]]:
    """(adapters, base): the float initializers whose names hold an adapter marker, and the others."""
    floats = [t.name for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                                         onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)]
    adapters = [n for n in floats if any(m in n for m in adapter_markers)]
    if not adapters:
        raise ValueError(f"the model has no LoRA adapter initializers (names holding one of {list(adapter_markers)}); "
                         "export a PEFT-wrapped model with torch.onnx.export(..., optimize=False), which keeps "
                         f"parameter names (float initializers: {floats[:6]})")
    return adapters, [n for n in floats if n not in adapters]


def quantize_rows_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: ``weight ~= q * scale[:, None]``, q in [-127, 127]."""
    w = np.asarray(weight, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def quantize_base_int8(model: onnx.ModelProto, names: Sequence[str]) -> tuple[onnx.ModelProto, list[str]]:
    """Replace each named float32 matrix initializer ``W`` by ``DequantizeLinear(W.int8, W.scale, axis=0)``.

    Returns the model and the names of the new initializers (``<W>.int8``, ``<W>.scale``) in place of the
    quantized ones; initializers that are not float32 matrices are left as they are and keep their names.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    by_name = {t.name: t for t in graph.initializer}
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    nodes, kept, out_names = [], [], []
    for t in list(graph.initializer):
        if t.name not in names:
            kept.append(t)
            continue
        if t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2:
            kept.append(t)
            out_names.append(t.name)
            continue
        q, scale = quantize_rows_int8(numpy_helper.to_array(t))
        qname, sname = f"{t.name}.int8", f"{t.name}.scale"
        clash = [n for n in (qname, sname) if n in taken]
        if clash:
            raise ValueError(f"cannot quantize {t.name!r}: the model already has values named {clash}")
        kept += [numpy_helper.from_array(q, qname), numpy_helper.from_array(scale, sname)]
        nodes.append(helper.make_node("DequantizeLinear", [qname, sname], [t.name], axis=0,
                                      name=f"dequantize/{t.name}"))
        out_names += [qname, sname]
        del by_name[t.name]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + old)  # the dequantized values are ready before any reader
    opset = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset.version < 13:
        raise ValueError(f"int8 base weights need opset >= 13 (DequantizeLinear with axis); the model has {opset.version}")
    return model, out_names


def generate_lora_artifacts(model: onnx.ModelProto | str | os.PathLike, base: str = "float32",
                            adapter_markers: Sequence[str] = ADAPTER_MARKERS, **kwargs) -> Artifacts:
    """:func:`generate_artifacts` training the LoRA adapters only; the base frozen, stored once, as
    ``base`` ("float32", or "int8": per-row int8 matrices). Other arguments go to generate_artifacts
    (``loss``, ``optimizer``, ``artifact_directory``, ...)."""
    if base not in BASE_FORMATS:
        raise ValueError(f"base must be one of {BASE_FORMATS}, got {base!r}")
    for key in ("requires_grad", "frozen_params"):
        if key in kwargs:
            raise TypeError(f"generate_lora_artifacts chooses {key} itself (adapters train, the base is frozen); "
                            "call generate_artifacts to choose them")
    proto = load_model(model)
    adapters, frozen = split_parameters(proto, adapter_markers)
    if base == "int8":
        proto, frozen = quantize_base_int8(proto, frozen)
    return generate_artifacts(proto, requires_grad=adapters, frozen_params=frozen, **kwargs)


__all__ = ["generate_lora_artifacts", "quantize_base_int8", "quantize_rows_int8", "split_parameters"]
