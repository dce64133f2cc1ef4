"""Graph passes over ``onnx_ir`` models, one per file, each tested by running onnxruntime before and after."""

from onnxtrain.passes.expand_cross_entropy import ExpandCrossEntropyPass
from onnxtrain.passes.initializers_to_inputs import InitializersToInputsPass
from onnxtrain.passes.optimize import OptimizePass
from onnxtrain.passes.split_forward_backward import Split, split_forward_backward
from onnxtrain.passes.symbolic_shapes import infer_symbolic_shapes
from onnxtrain.passes import pipeline

__all__ = ["ExpandCrossEntropyPass", "InitializersToInputsPass", "OptimizePass", "Split", "infer_symbolic_shapes", "split_forward_backward"]
