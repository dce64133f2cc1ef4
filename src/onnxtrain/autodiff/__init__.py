"""Reverse-mode automatic differentiation over ONNX graphs, emitting standard ONNX ops.

    from onnxtrain.autodiff import gradient_model
    grad = gradient_model(model, wrt=["fc1.weight", "x"])
"""

from onnxtrain.autodiff.engine import (
    UnsupportedOpError,
    build_gradients,
    grad_name,
    gradient_model,
    prepare_model,
)
from onnxtrain.autodiff.registry import GradContext, Registry, Rule, RuleTable

__all__ = [
    "GradContext",
    "Registry",
    "Rule",
    "RuleTable",
    "UnsupportedOpError",
    "build_gradients",
    "grad_name",
    "gradient_model",
    "prepare_model",
]
