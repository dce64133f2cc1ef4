"""Fill in the symbolic shapes the exporter and ONNX shape inference leave unknown.

The gradient engine un-broadcasts at build time when it can prove two dims equal (same symbol) and
otherwise emits a run-time Shape/Equal/NonZero/ReduceSum chain for every such op. onnxruntime's symbolic
shape inference names nearly every dim of a transformer (batch, sequence, heads), which removes most of
those chains. ``auto_merge=True`` names two dims equal where the graph broadcasts one against the
other; that is sound for graphs from ``torch.export``, which assumes dynamic dims are not 1 and guards
broadcasts between them as equalities. A failure leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading

import onnx

logger = logging.getLogger("onnxtrain.passes")


_CWD_LOCK = threading.Lock()


@contextlib.contextmanager
def _in_scratch_directory():
    """onnxruntime's tool saves a debug model into the working directory when inference is incomplete
    (and has no switch for it): run it in a temporary directory so nothing lands in the user's."""
    with _CWD_LOCK, tempfile.TemporaryDirectory(prefix="onnxtrain_shapes_") as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(cwd)


def infer_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        with _in_scratch_directory():
            inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=False)
    except Exception as exc:  # noqa: BLE001 - the inference is an optimization only
        logger.info("symbolic shape inference failed, shapes stay as they are: %s", exc)
        return model
    return inferred if inferred is not None else model
