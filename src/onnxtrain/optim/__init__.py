"""Optimizers for training with onnxtrain.

``FusedAdam`` is ONNX Runtime Training's fused Adam/AdamW optimizer, rebuilt on PyTorch's multi-tensor
(``torch._foreach_*``) kernels so that it runs on any device PyTorch supports, without a CUDA extension.
"""

from onnxtrain.optim.fused_adam import AdamWMode, FusedAdam

__all__ = ["AdamWMode", "FusedAdam"]
