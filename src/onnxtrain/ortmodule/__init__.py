"""ORTModule: train a torch.nn.Module with onnxruntime running its forward and backward graphs."""

from onnxtrain.ortmodule.module import ORTModule
from onnxtrain.ortmodule.options import (
    FALLBACK_ENV,
    LOG_LEVEL_ENV,
    DebugOptions,
    LogLevel,
)

__all__ = ["FALLBACK_ENV", "LOG_LEVEL_ENV", "DebugOptions", "LogLevel", "ORTModule"]
