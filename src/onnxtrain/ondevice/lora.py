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

import json
import os
from collections.abc import Sequence

import onnx

from onnxtrain.ondevice.artifacts import Artifacts, generate_artifacts
from onnxtrain.ondevice.lora_add import add_lora_adapters
from onnxtrain.ondevice.format import TRAINING_METADATA_KEY
from onnxtrain.ondevice.lora_quant import (
    dequantize_where_read,
    quantize_base,
    quantize_base_int8,
    quantize_rows_int8,
    unpack_again_in_backward,
)
from onnxtrain.utils.io import load_model, save_model_atomic

ADAPTER_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
BASE_FORMATS = ("float32", "int8", "int4")


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


def generate_lora_artifacts(model: onnx.ModelProto | str | os.PathLike, base: str = "float32",
                            adapter_markers: Sequence[str] = ADAPTER_MARKERS, target_modules: Sequence[str] | None = None,
                            r: int = 8, alpha: float = 16, seed: int = 0, **kwargs) -> Artifacts:
    """:func:`generate_artifacts` training the LoRA adapters only; the base frozen, stored once, as
    ``base`` ("float32"; "int8": per-row int8 matrices; "int4": int4 blocks of 32 along each row, two
    values a byte, read by standard ONNX ops: :mod:`onnxtrain.ondevice.lora_quant`). ``target_modules`` (a model without adapters):
    onnxtrain adds rank-``r`` adapters scaled by ``alpha / r`` to these linear layers itself
    (:func:`onnxtrain.ondevice.lora_add.add_lora_adapters`, A drawn with ``seed``, B zero). Other arguments
    go to generate_artifacts (``loss``, ``optimizer``, ``artifact_directory``, ...)."""
    if base not in BASE_FORMATS:
        raise ValueError(f"base must be one of {BASE_FORMATS}, got {base!r}")
    for key in ("requires_grad", "frozen_params"):
        if key in kwargs:
            raise TypeError(f"generate_lora_artifacts chooses {key} itself (adapters train, the base is frozen); "
                            "call generate_artifacts to choose them")
    proto = load_model(model)
    if target_modules is not None:
        proto = add_lora_adapters(proto, target_modules, r=r, alpha=alpha, seed=seed)
    adapters, frozen = split_parameters(proto, adapter_markers)
    if base != "float32":
        proto, frozen = quantize_base(proto, frozen, bits=8 if base == "int8" else 4)
    artifacts = generate_artifacts(proto, requires_grad=adapters, frozen_params=frozen, **kwargs)
    if base != "float32":
        _read_weights_where_used(artifacts.training_model, frozen,
                                 dequantize_where_read if base == "int8" else unpack_again_in_backward)
    return artifacts


def _read_weights_where_used(path, frozen: Sequence[str], rewrite) -> None:
    """Rewrite the training model so that no dequantized (or unpacked) weight lives from forward to
    backward: ``rewrite`` is :func:`~onnxtrain.ondevice.lora_quant.dequantize_where_read` (int8) or
    :func:`~onnxtrain.ondevice.lora_quant.unpack_again_in_backward` (int4)."""
    model = load_model(path)
    meta = json.loads(next(p.value for p in model.metadata_props if p.key == TRAINING_METADATA_KEY))
    rewrite(model, len(meta["outputs"]), frozen)
    save_model_atomic(model, path)


__all__ = ["generate_lora_artifacts", "quantize_base_int8", "quantize_rows_int8", "split_parameters"]
