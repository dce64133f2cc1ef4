"""onnxtrain: train PyTorch and ONNX models on the standard onnxruntime (no training build).

Where to start:

- ``onnxtrain.ORTModule`` (with ``DebugOptions``, ``LogLevel``): ``model = ORTModule(model)`` runs a
  ``torch.nn.Module``'s forward and backward in onnxruntime; the rest of the training script is unchanged.
- ``onnxtrain.artifacts``: ``generate_artifacts(model, requires_grad=[...], loss=..., optimizer=...)``
  writes on-device training artifacts (training, eval and optimizer models, checkpoint).
- ``onnxtrain.api``: the torch-free runtime that trains those artifacts (``CheckpointState``, ``Module``,
  ``Optimizer``, ``LinearLRScheduler``), with onnxruntime and numpy only.
- ``onnxtrain.hf``: ``ORTTrainer`` and ``ORTTrainingArguments`` for Hugging Face ``transformers``.
- ``onnxtrain.optim``: ``FusedAdam``.
- ``onnxtrain.autodiff``: ``gradient_model``, the gradient of any ONNX model in standard ONNX ops.
- The command line: ``onnxtrain grad ...`` and ``onnxtrain artifacts ...`` (or ``python -m onnxtrain``).

The names follow ONNX Runtime Training's, so a script migrates by changing its imports. The torch front
end is imported lazily, so that ``import onnxtrain`` and ``onnxtrain.api`` never import torch.
"""

from onnxtrain._version import __version__

__all__ = ["__version__", "ORTModule", "DebugOptions", "LogLevel"]


def __getattr__(name):
    if name in ("ORTModule", "DebugOptions", "LogLevel"):
        from onnxtrain import ortmodule

        return getattr(ortmodule, name)
    raise AttributeError(f"module 'onnxtrain' has no attribute {name!r}")
