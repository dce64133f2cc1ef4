"""Federated learning with the on-device runtime: parameters exchanged by name, one client's round.

numpy and onnxruntime only here; the Flower apps are in :mod:`onnxtrain.federated.flower`
(``pip install onnxtrain[flower]``).
"""

from onnxtrain.federated.client import OnDeviceClient, batches
from onnxtrain.federated.parameters import (
    ParameterMismatchError,
    ParameterSpec,
    get_parameters,
    set_parameters,
)

__all__ = ["OnDeviceClient", "ParameterMismatchError", "ParameterSpec", "batches", "get_parameters",
           "set_parameters"]
