"""Loss and optimizer graph builders, in standard ONNX ops (used by :mod:`onnxtrain.artifacts`)."""

from onnxtrain.blocks.loss import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    L1Loss,
    Loss,
    LossInput,
    MSELoss,
)
from onnxtrain.blocks.optim import SGD, AdamW, build_optimizer_model

__all__ = [
    "SGD",
    "AdamW",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "L1Loss",
    "Loss",
    "LossInput",
    "MSELoss",
    "build_optimizer_model",
]
