"""onnxtrain: training on the standard onnxruntime.

The torch front end (``ORTModule``, ``DebugOptions``) is imported lazily so that
``import onnxtrain`` and the torch-free on-device runtime (``onnxtrain.api``)
never import torch.
"""

from onnxtrain._version import __version__

__all__ = ["__version__", "ORTModule", "DebugOptions", "LogLevel"]


def __getattr__(name):
    if name in ("ORTModule", "DebugOptions", "LogLevel"):
        from onnxtrain import ortmodule

        return getattr(ortmodule, name)
    raise AttributeError(f"module 'onnxtrain' has no attribute {name!r}")
