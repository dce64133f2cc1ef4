"""Fill in the symbolic shapes the exporter and ONNX shape inference leave unknown.

The gradient engine un-broadcasts at build time when it can prove two dims equal (same symbol) and
otherwise emits a run-time Shape/Equal/NonZero/ReduceSum chain for every such op. onnxruntime's symbolic
shape inference names nearly every dim of a transformer (batch, sequence, heads), which removes most of
those chains. ``auto_merge=True`` names two dims equal where the graph broadcasts one against the
other; that is sound for graphs from ``torch.export``, which assumes dynamic dims are not 1 and guards
broadcasts between them as equalities. A failure leaves the model as it was.
"""

from __future__ import annotations

import logging

import onnx

logger = logging.getLogger("onnxtrain.passes")


def infer_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=False)
    except Exception as exc:  # noqa: BLE001 - the inference is an optimization only
        logger.info("symbolic shape inference failed, shapes stay as they are: %s", exc)
        return model
    return inferred if inferred is not None else model
