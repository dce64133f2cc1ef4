"""Optimizers for training with onnxtrain.

``FusedAdam`` is ONNX Runtime Training's fused Adam/AdamW optimizer, rebuilt without a CUDA extension: the
ADAMW_TORCH mode runs PyTorch's one-pass AdamW kernel (``torch._fused_adamw_``), the other modes
PyTorch's multi-tensor (``torch._foreach_*``) kernels, on any device PyTorch supports.
"""

from onnxtrain.optim.fused_adam import AdamWMode, FusedAdam

__all__ = ["AdamWMode", "FusedAdam"]
