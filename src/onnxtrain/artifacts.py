"""Training artifacts for on-device training, as ``onnxruntime.training.artifacts``.

    from onnxtrain import artifacts
    artifacts.generate_artifacts("model.onnx", requires_grad=["fc.weight", "fc.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory="out")

Custom losses subclass :class:`Loss`; other optimizer hyperparameters: pass ``AdamW(...)``/``SGD(...)``.
"""

from onnxtrain.blocks.loss import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    L1Loss,
    Loss,
    LossInput,
    MSELoss,
)
from onnxtrain.blocks.loss_scale import LossScaler
from onnxtrain.blocks.optim import SGD, AdamW
from onnxtrain.ondevice.artifacts import (
    Artifacts,
    LossType,
    OptimType,
    generate_artifacts,
)

__all__ = [
    "SGD",
    "AdamW",
    "Artifacts",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "L1Loss",
    "Loss",
    "LossInput",
    "LossScaler",
    "LossType",
    "MSELoss",
    "OptimType",
    "generate_artifacts",
]
