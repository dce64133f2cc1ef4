"""Flower (``flwr`` 1.41, the Message API) around :class:`OnDeviceClient`: install ``onnxtrain[flower]``.

    # client_app.py                                  # server_app.py
    app = flower.client_app(make_client, data)       app = flower.server_app(initial_arrays, evaluate)

The ClientApp imports flwr, numpy and onnxruntime (``onnxtrain.api``), never torch. Only the parameters
the client trains (or only the LoRA adapters) travel, as a Flower ``ArrayRecord`` keyed by parameter
name, so a client that receives another model's weights fails with an error naming the parameter
(:class:`onnxtrain.federated.ParameterMismatchError`). The ServerApp runs Flower's FedAvg weighted by
each client's number of training examples (``num-examples``), evaluates the global model centrally after
every round when given ``evaluate``, and prints one line per round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from onnxtrain.federated.client import OnDeviceClient, batches

ARRAYS = "arrays"  # FedAvg's default keys for the parameters and the client's metrics
METRICS = "metrics"
WEIGHT = "num-examples"


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Parameters by name -> an ArrayRecord (the names and their order travel with it)."""
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in arrays.items()})


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


# A client's data: (x_train, y_train, x_test, y_test) for this node, from its node config.
DataFn = Callable[[Context], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


def client_app(make_client: Callable[[Context], OnDeviceClient], data: DataFn) -> ClientApp:
    """A ClientApp whose ``train`` runs ``local-epochs`` epochs (run config, default 1) of
    ``batch-size`` (default 32) batches at ``learning-rate`` (default: the artifacts'), and whose
    ``evaluate`` reports loss and accuracy on the node's test split."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        client = make_client(context)
        x, y, _, _ = data(context)
        cfg = context.run_config
        server_round = int(msg.content["config"].get("server-round", 0)) if "config" in msg.content else 0
        seed = int(context.node_config.get("partition-id", 0)) * 100_003 + server_round
        epoch_batches = _Reiterable(x, y, int(cfg.get("batch-size", 32)), seed)
        lr = cfg.get("learning-rate")
        arrays, examples, metrics = client.fit(from_record(msg.content[ARRAYS]), epoch_batches,
                                               epochs=int(cfg.get("local-epochs", 1)),
                                               learning_rate=None if lr is None else float(lr))
        reply = RecordDict({ARRAYS: to_record(arrays), METRICS: MetricRecord({**metrics, WEIGHT: examples})})
        return Message(content=reply, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        client = make_client(context)
        _, _, x, y = data(context)
        examples, metrics = client.evaluate(from_record(msg.content[ARRAYS]), batches(x, y, 256))
        reply = RecordDict({METRICS: MetricRecord({**metrics, WEIGHT: examples})})
        return Message(content=reply, reply_to=msg)

    return app


class _Reiterable:
    """Shuffled batches, a new order each epoch (the seed moves on)."""

    def __init__(self, x, y, batch_size, seed):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed

    def __iter__(self):
        self.seed += 1
        return batches(self.x, self.y, self.batch_size, self.seed)


def server_app(initial_arrays: Callable[[Context], Mapping[str, np.ndarray]],
               evaluate: Callable[[Context], Callable[[Mapping[str, np.ndarray]], dict]] | None = None,
               report: Callable[[str], None] = print) -> ServerApp:
    """A ServerApp running FedAvg weighted by examples for ``num-server-rounds`` rounds (run config,
    default 10) over ``min-nodes`` nodes (default 2), all of which train every round.

    ``evaluate(context)`` returns a function of the global parameters giving metrics (say
    ``{"loss": ..., "accuracy": ...}``); it runs before the first round and after each, and every
    result is passed to ``report`` as one line ``round N: accuracy=... loss=...``.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = context.run_config
        nodes = int(cfg.get("min-nodes", 2))
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes,
                          min_available_nodes=nodes, weighted_by_key=WEIGHT)
        evaluate_fn = None
        if evaluate is not None:
            score = evaluate(context)

            def evaluate_fn(server_round: int, record: ArrayRecord) -> MetricRecord:
                metrics = score(from_record(record))
                report(f"round {server_round}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                return MetricRecord(metrics)

        strategy.start(grid=grid, initial_arrays=to_record(initial_arrays(context)),
                       num_rounds=int(cfg.get("num-server-rounds", 10)), evaluate_fn=evaluate_fn)

    return app


__all__ = ["client_app", "from_record", "server_app", "to_record"]
