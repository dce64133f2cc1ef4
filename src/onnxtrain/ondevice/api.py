"""The on-device training runtime: onnxruntime and numpy only (no torch, no onnx on the training path).

    state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    model = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
    optimizer = Optimizer("artifacts/optimizer_model.onnx", model)
    for x, y in batches:
        loss = model(x, y)          # forward + backward; gradients add up until lazy_reset_grad()
        optimizer.step()
        model.lazy_reset_grad()

The pieces, one file each along the format (docs/format.md): :mod:`.format` (names and versions),
:mod:`.state` (CheckpointState), :mod:`.buffers` (the flat parameter, gradient and optimizer-state
vectors, each parameter a view), :mod:`.session` (session creation and binding), :mod:`.inputs`
(checks of a step's inputs), :mod:`.module`, :mod:`.optimizer` and :mod:`.lr_scheduler`.

Memory: the flat vectors are bound to the onnxruntime sessions once, as OrtValues sharing their memory
(IO binding), so a training step copies nothing but the batch: the training session writes gradients
straight into the gradient vectors, and the optimizer session reads one copy of the parameters and
states and writes the other.
"""

from onnxtrain.ondevice.format import (
    OPTIMIZER_METADATA_KEY,
    TRAINING_METADATA_KEY,
    TRAINING_MODEL_FORMAT,
)
from onnxtrain.ondevice.lr_scheduler import LinearLRScheduler
from onnxtrain.ondevice.module import Module
from onnxtrain.ondevice.optimizer import Optimizer
from onnxtrain.ondevice.state import CheckpointState, Parameter

__all__ = ["OPTIMIZER_METADATA_KEY", "TRAINING_METADATA_KEY", "TRAINING_MODEL_FORMAT", "CheckpointState",
           "LinearLRScheduler", "Module", "Optimizer", "Parameter"]
