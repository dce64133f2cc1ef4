"""ORTModule: train a torch.nn.Module with onnxruntime running its forward and backward graphs."""

from onnxtrain.capture.custom_backward import declare_forward_gradient
from onnxtrain.ortmodule.module import ORTModule
from onnxtrain.ortmodule.options import (
    FALLBACK_ENV,
    LOG_LEVEL_ENV,
    DebugOptions,
    LogLevel,
)

__all__ = ["FALLBACK_ENV", "LOG_LEVEL_ENV", "DebugOptions", "LogLevel", "ORTModule", "declare_forward_gradient"]
