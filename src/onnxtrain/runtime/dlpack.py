"""Zero-copy conversion between torch tensors and ``onnxruntime.OrtValue`` through DLPack.

Both directions share memory: an OrtValue made from a tensor reads the tensor's storage (so an in-place
optimizer update is seen by the next run), and a tensor made from an OrtValue keeps it alive. onnxruntime's
DLPack import rejects ``bool`` (DLPack's kDLBool); CPU bools go through numpy, which also shares memory.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch


def to_ortvalue(tensor: torch.Tensor) -> ort.OrtValue:
    """An OrtValue sharing ``tensor``'s memory (made contiguous first if it is not)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bool:
        if tensor.device.type != "cpu":
            raise TypeError("bool tensors on accelerators cannot cross to onnxruntime; cast them to uint8")
        return ort.OrtValue.ortvalue_from_numpy(tensor.numpy())
    return ort.OrtValue.from_dlpack(tensor)


def to_torch(value: ort.OrtValue) -> torch.Tensor:
    """A torch tensor sharing ``value``'s memory."""
    if value.data_type() == "tensor(bool)":
        return torch.from_numpy(np.asarray(value.numpy(), dtype=np.bool_))
    return torch.from_dlpack(value)
