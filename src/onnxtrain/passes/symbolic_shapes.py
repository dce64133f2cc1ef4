"""Fill in the symbolic shapes the exporter and ONNX shape inference leave unknown.

The gradient engine un-broadcasts at build time when it can prove two dims equal (same symbol) and
otherwise emits a run-time Shape/Equal/NonZero/ReduceSum chain for every such op. onnxruntime's symbolic
shape inference names nearly every dim of a transformer (batch, sequence, heads), which removes most of
those chains. ``auto_merge=True`` names two dims equal where the graph broadcasts one against the
other; that is sound for graphs from ``torch.export``, which assumes dynamic dims are not 1 and guards
broadcasts between them as equalities. A failure leaves the model as it was; so does an inference that
turns a dim the exporter wrote as an expression into a number: torch.export's expressions are exact, and
the tool's are not always (it gave a sliding-window cache ``k[:, :, -4095:]``, exported as
``Max(0, s - Max(0, s - 4095))``, the size 4095, and backward then rejected tensors of length s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading

import onnx
import onnx_ir as ir

from onnxtrain.autodiff.stop_gradient import shapes_as_identity

logger = logging.getLogger("onnxtrain.passes")


_CWD_LOCK = threading.Lock()


class SymbolicShapesPass(ir.passes.FunctionalPass):
    """:func:`infer_symbolic_shapes` as a pass: the tool reads and writes protos, so the model comes back
    as a new one (with the same graph when the inference failed or was dropped)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        proto = ir.to_proto(model)
        inferred = infer_symbolic_shapes(proto)
        return ir.passes.PassResult(ir.from_proto(inferred), modified=inferred is not proto)


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

    def infer(proto: onnx.ModelProto) -> onnx.ModelProto | None:
        return SymbolicShapeInference.infer_shapes(proto, auto_merge=True, guess_output_rank=False)

    try:
        with _in_scratch_directory():
            inferred = shapes_as_identity(model, infer)  # the tool knows no StopGradient
    except Exception as exc:  # noqa: BLE001 - the inference is an optimization only
        logger.info("symbolic shape inference failed, shapes stay as they are: %s", exc)
        return model
    if inferred is None:
        return model
    contradiction = _contradiction(model, inferred)
    if contradiction:
        logger.info("symbolic shape inference dropped: %s", contradiction)
        return model
    return inferred


def _dims(model: onnx.ModelProto) -> dict[str, list]:
    graph = model.graph
    dims = {}
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            dims[info.name] = [d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value")
                               else None for d in info.type.tensor_type.shape.dim]
    return dims


def _contradiction(before: onnx.ModelProto, after: onnx.ModelProto) -> str | None:
    """A dim that ``before`` names by a symbol or an expression and ``after`` makes a number, if any."""
    inferred = _dims(after)
    for name, dims in _dims(before).items():
        new = inferred.get(name)
        if new is None or len(new) != len(dims):
            continue
        for old, dim in zip(dims, new):
            if isinstance(old, str) and old and isinstance(dim, int):
                return f"{name!r}: {old} became {dim}"
    return None
