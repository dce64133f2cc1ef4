"""A synthetic non-IID classification task: numpy only (the clients import it).

Ten classes of 20-dimensional points around random centres, pushed through a fixed nonlinearity so a
linear model is not enough. Partition k of K draws 90% of its examples from the classes c with
c % K == k and 10% from the others (label skew); the global test set is balanced.
"""

from __future__ import annotations

import numpy as np

CLASSES, FEATURES = 10, 20
TRAIN_PER_NODE, TEST_PER_NODE, GLOBAL_TEST = 1200, 300, 3000


def _sample(n: int, probs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    centres = np.random.default_rng(1234).normal(size=(CLASSES, FEATURES)) * 0.5
    y = rng.choice(CLASSES, size=n, p=probs)
    z = centres[y] + rng.normal(size=(n, FEATURES))
    x = np.tanh(z) + 0.1 * z  # a fixed nonlinearity shared by every node
    return x.astype(np.float32), y.astype(np.int64)


def class_probs(partition: int, partitions: int) -> np.ndarray:
    own = np.arange(CLASSES) % partitions == partition
    probs = np.where(own, 0.9 / own.sum(), 0.1 / max(1, (~own).sum()))
    return probs / probs.sum()


def partition(partition_id: int, num_partitions: int):
    """(x_train, y_train, x_test, y_test) of one node."""
    rng = np.random.default_rng(10_000 + partition_id)
    probs = class_probs(partition_id, num_partitions)
    return (*_sample(TRAIN_PER_NODE, probs, rng), *_sample(TEST_PER_NODE, probs, rng))


def global_test():
    return _sample(GLOBAL_TEST, np.full(CLASSES, 1 / CLASSES), np.random.default_rng(99))


def pooled_train(num_partitions: int):
    """Every node's training data in one set: what centralised training sees."""
    parts = [partition(k, num_partitions)[:2] for k in range(num_partitions)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
