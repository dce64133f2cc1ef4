"""torch module -> ONNX: export with dynamic batch/sequence axes, input/output flattening."""

from onnxtrain.capture.export import Captured, ExportError, FlatModule, capture
from onnxtrain.capture.flatten import flatten, leaf_paths, unflatten

__all__ = ["Captured", "ExportError", "FlatModule", "capture", "flatten", "leaf_paths", "unflatten"]
