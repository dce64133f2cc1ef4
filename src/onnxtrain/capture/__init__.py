"""torch module -> ONNX: export with dynamic batch/sequence axes, input/output flattening.

The exporter (``capture``, ``ExportError``, ``FlatModule``: torch's ONNX exporter and onnxscript's
op library, about 45 MB of modules) is imported on first use, so that ``onnxtrain.capture.flatten`` alone stays
light (ORTModule with ``DebugOptions(export_process="spawn")`` never imports the exporter where it trains).
"""

from onnxtrain.capture.captured import Captured
from onnxtrain.capture.flatten import flatten, leaf_paths, unflatten

__all__ = ["Captured", "ExportError", "FlatModule", "capture", "flatten", "leaf_paths", "unflatten"]
_EXPORT = ("ExportError", "FlatModule", "capture")


def __getattr__(name):
    if name in _EXPORT:
        from onnxtrain.capture import export

        return getattr(export, name)
    raise AttributeError(f"module 'onnxtrain.capture' has no attribute {name!r}")
