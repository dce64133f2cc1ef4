"""Graph passes over ``onnx_ir`` models, one per file, each tested by running onnxruntime before and after.

The names below are imported on first use: ``OptimizePass`` imports onnxscript's optimizer (about 30 MB of
modules), which a process that only stages and runs built graphs never needs.
"""

# eager: a function named as its module (the module, once imported, would shadow a lazy name)
from onnxtrain.passes.split_forward_backward import Split, split_forward_backward

__all__ = ["ExpandCrossEntropyPass", "InitializersToInputsPass", "OptimizePass", "Split", "infer_symbolic_shapes", "split_forward_backward"]
_WHERE = {"ExpandCrossEntropyPass": "expand_cross_entropy", "InitializersToInputsPass": "initializers_to_inputs",
          "OptimizePass": "optimize", "infer_symbolic_shapes": "symbolic_shapes"}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"onnxtrain.passes.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'onnxtrain.passes' has no attribute {name!r}")
