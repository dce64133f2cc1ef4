"""One federated client's work on the device: load the artifacts, take the global parameters, train, return.

numpy and onnxruntime only (the on-device runtime, ``onnxtrain.api``): no torch, no onnx, no flwr, so
the same class serves a Flower ClientApp (``onnxtrain.federated.flower``) or any other transport.

    client = OnDeviceClient("artifacts")
    arrays, n, metrics = client.fit(global_arrays, batches(x, y, 32, seed=round))
    n, metrics = client.evaluate(global_arrays, batches(x_test, y_test, 256))

Each call starts from the artifacts' checkpoint, so a client keeps nothing between rounds but what
the server sends (the optimizer state starts fresh each round, as in FedAvg); the parameters not
exchanged (frozen ones, or the base weights under LoRA adapters) come from the client's checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.federated.parameters import get_parameters, set_parameters


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int | None = None) -> Iterator[tuple]:
    """Mini-batches ``(x, y)`` in order, or shuffled with ``seed``; the last one may be smaller."""
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows and y {len(y)}")
    order = np.arange(len(x)) if seed is None else np.random.default_rng(seed).permutation(len(x))
    for lo in range(0, len(x), batch_size):
        rows = order[lo:lo + batch_size]
        yield x[rows], y[rows]


class OnDeviceClient:
    """Trains and evaluates one set of on-device artifacts with parameters received by name."""

    def __init__(self, artifact_directory: str | os.PathLike, prefix: str = "", trainable_only: bool = True):
        root = Path(artifact_directory)
        self.checkpoint = root / f"{prefix}checkpoint"
        self.training_model = root / f"{prefix}training_model.onnx"
        self.eval_model = root / f"{prefix}eval_model.onnx"
        self.optimizer_model = root / f"{prefix}optimizer_model.onnx"
        missing = [p.name for p in (self.checkpoint, self.training_model, self.eval_model, self.optimizer_model)
                   if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{root} lacks {missing}; generate_artifacts(..., optimizer=...) writes them")
        self.trainable_only = trainable_only

    def initial_parameters(self) -> dict[str, np.ndarray]:
        """The checkpoint's (trainable) parameters by name: the server's starting point."""
        return get_parameters(CheckpointState.load_checkpoint(self.checkpoint), self.trainable_only)

    def _load(self, arrays: Mapping[str, np.ndarray] | None, train: bool):
        state = CheckpointState.load_checkpoint(self.checkpoint)
        module = Module(self.training_model, state, self.eval_model)
        if arrays is not None:
            set_parameters(state, arrays, self.trainable_only)  # checks names, order, shapes, types
        optimizer = Optimizer(self.optimizer_model, module) if train else None
        return state, module, optimizer

    def fit(self, arrays: Mapping[str, np.ndarray] | None, batches: Iterable[tuple], epochs: int = 1,
            learning_rate: float | None = None) -> tuple[dict[str, np.ndarray], int, dict[str, float]]:
        """Train from ``arrays`` over ``batches`` (re-iterable when ``epochs`` > 1).

        Returns the new parameters by name, the number of examples seen in one epoch (FedAvg's weight)
        and ``{"train_loss": mean loss of the last epoch}``.
        """
        state, module, optimizer = self._load(arrays, train=True)
        if learning_rate is not None:
            optimizer.set_learning_rate(learning_rate)
        module.train()
        examples, losses = 0, []
        for epoch in range(epochs):
            examples, losses = 0, []
            for batch in batches:
                out = module(*batch)
                losses.append(float(out[0] if isinstance(out, list) else out))
                optimizer.step()
                module.lazy_reset_grad()
                examples += len(batch[0])
        if not examples:
            raise ValueError("fit got no batches to train on")
        return get_parameters(state, self.trainable_only), examples, {"train_loss": float(np.mean(losses))}

    def evaluate(self, arrays: Mapping[str, np.ndarray] | None, batches: Iterable[tuple]) -> tuple[int, dict[str, float]]:
        """Mean loss over ``batches`` (weighted by batch size) and, when the eval model returns logits
        after the loss and the last input is class labels, accuracy."""
        _, module, _ = self._load(arrays, train=False)
        module.eval()
        examples, loss_sum, correct, has_logits = 0, 0.0, 0, False
        for batch in batches:
            out = module(*batch)
            n = len(batch[0])
            loss = out[0] if isinstance(out, list) else out
            loss_sum += float(loss) * n
            examples += n
            if isinstance(out, list) and len(out) > 1 and out[1].ndim == 2:
                has_logits = True
                correct += int((out[1].argmax(axis=1) == np.asarray(batch[-1])).sum())
        if not examples:
            raise ValueError("evaluate got no batches")
        metrics = {"loss": loss_sum / examples}
        if has_logits:
            metrics["accuracy"] = correct / examples
        return examples, metrics


__all__ = ["OnDeviceClient", "batches"]
