"""The on-device training runtime, as ``onnxruntime.training.api``: onnxruntime and numpy only.

    from onnxtrain.api import CheckpointState, Module, Optimizer, LinearLRScheduler
"""

from onnxtrain.ondevice.api import (
    CheckpointState,
    LinearLRScheduler,
    Module,
    Optimizer,
    Parameter,
)
from onnxtrain.ondevice.checkpoint import CheckpointError

__all__ = ["CheckpointError", "CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter"]
