"""The ServerApp: FedAvg weighted by examples; the global model is evaluated on a balanced test set."""

from __future__ import annotations

from onnxtrain.federated import OnDeviceClient, batches
from onnxtrain.federated.flower import server_app

from fedmlp.data import global_test


def initial_arrays(context):
    return OnDeviceClient(context.run_config["artifacts"]).initial_parameters()


def evaluate(context):
    client = OnDeviceClient(context.run_config["artifacts"])
    x, y = global_test()
    return lambda arrays: client.evaluate(arrays, batches(x, y, 500))[1]


app = server_app(initial_arrays, evaluate, report=lambda line: print(f"[global] {line}", flush=True))
