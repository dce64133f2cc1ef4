"""The ClientApp: trains with onnxtrain.api (onnxruntime and numpy; never torch)."""

from __future__ import annotations

from onnxtrain.federated import OnDeviceClient
from onnxtrain.federated.flower import client_app

from fedmlp.data import partition


def make_client(context):
    return OnDeviceClient(context.run_config["artifacts"])


def data(context):
    return partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))


app = client_app(make_client, data)
