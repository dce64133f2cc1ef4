"""Parameters in and out by name: a client that receives another model's weights gets an error naming
what differs; a round of OnDeviceClient.fit equals the plain runtime loop; evaluate matches numpy; the
client runs with torch and onnx blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.federated import (
    OnDeviceClient,
    ParameterMismatchError,
    ParameterSpec,
    batches,
    get_parameters,
    set_parameters,
)
from tests.import_blocker import BLOCK_IMPORTS


def _state(fl_artifacts):
    return CheckpointState.load_checkpoint(fl_artifacts / "checkpoint")


def test_spec_and_round_trip(fl_artifacts):
    state = _state(fl_artifacts)
    spec = ParameterSpec.of(state)
    assert spec.names == ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert spec.shapes[0] == (20, 64) and set(spec.dtypes) == {"float32"}
    arrays = get_parameters(state)
    assert list(arrays) == list(spec.names) and spec.size == sum(a.size for a in arrays.values())
    doubled = {k: v * 2 for k, v in arrays.items()}
    set_parameters(state, doubled)
    for name, value in get_parameters(state).items():
        np.testing.assert_array_equal(value, doubled[name])
    # the runtime's flat buffer and the named arrays agree (checkpoint order)
    module = Module(fl_artifacts / "training_model.onnx", state)
    flat = module.get_contiguous_parameters(trainable_only=True).numpy()
    np.testing.assert_array_equal(flat, np.concatenate([v.reshape(-1) for v in doubled.values()]))


@pytest.mark.parametrize("change, message", [
    (lambda a: {k: a[k] for k in list(a)[:-1]}, r"received no \['fc2.bias'\], which this model has"),
    (lambda a: {**a, "head.weight": a["fc2.weight"]}, r"received parameters \['head.weight'\] that this model does not have \(7"),
    (lambda a: dict(reversed(list(a.items()))), r"another order: position 0 holds 'fc2.bias'"),
    (lambda a: {k: (v[:-1] if k == "fc1.weight" else v) for k, v in a.items()}, r"'fc1.weight' has shape \[64, 64\]"),
    (lambda a: {k: v.astype(np.float64) for k, v in a.items()}, r"'fc0.weight' is float32 .* float64"),
    (lambda a: list(a.values())[:3], r"received 3 arrays .* 6 parameters"),
])
def test_wrong_parameters_are_refused_by_name(fl_artifacts, change, message):
    state = _state(fl_artifacts)
    before = get_parameters(state)
    with pytest.raises(ParameterMismatchError, match=message):
        set_parameters(state, change({k: v + 1 for k, v in before.items()}))
    for name, value in get_parameters(state).items():  # all or nothing
        np.testing.assert_array_equal(value, before[name])


def test_fit_is_the_runtime_loop(fl_artifacts):
    """OnDeviceClient.fit from received parameters == load, copy the buffer in, train by hand."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((96, 20)).astype(np.float32), rng.integers(0, 10, 96)
    client = OnDeviceClient(fl_artifacts)
    start = {k: v * 0.5 for k, v in client.initial_parameters().items()}
    ours, examples, metrics = client.fit(start, list(batches(x, y, 32)), epochs=2, learning_rate=1e-2)

    state = _state(fl_artifacts)
    module = Module(fl_artifacts / "training_model.onnx", state, fl_artifacts / "eval_model.onnx")
    module.copy_buffer_to_parameters(np.concatenate([v.reshape(-1) for v in start.values()]))
    optimizer = Optimizer(fl_artifacts / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(1e-2)
    losses = []
    for _ in range(2):
        losses = []
        for xb, yb in batches(x, y, 32):
            losses.append(float(module(xb, yb)[0]))
            optimizer.step()
            module.lazy_reset_grad()
    assert examples == 96 and metrics["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    for name, value in get_parameters(state).items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-6, atol=1e-7)


def test_evaluate_accuracy_matches_numpy(fl_artifacts, example_path):
    from fedmlp.model import mlp
    from onnx import numpy_helper

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((50, 20)).astype(np.float32), rng.integers(0, 10, 50)
    weights = {t.name: numpy_helper.to_array(t) for t in mlp().graph.initializer}
    h = x
    for i in range(3):
        h = h @ weights[f"fc{i}.weight"] + weights[f"fc{i}.bias"]
        h = np.maximum(h, 0) if i < 2 else h
    logp = h - np.log(np.exp(h - h.max(1, keepdims=True)).sum(1, keepdims=True)) - h.max(1, keepdims=True)
    n, metrics = OnDeviceClient(fl_artifacts).evaluate(None, batches(x, y, 16))
    assert n == 50
    assert metrics["accuracy"] == pytest.approx((h.argmax(1) == y).mean())
    assert metrics["loss"] == pytest.approx(-logp[np.arange(50), y].mean(), rel=1e-5)


CLIENT_SCRIPT = BLOCK_IMPORTS + textwrap.dedent("""
    sys.path.insert(0, sys.argv[2])
    from fedmlp.data import partition
    from onnxtrain.federated import OnDeviceClient, batches

    client = OnDeviceClient(sys.argv[1])
    x, y, xt, yt = partition(0, 3)
    arrays, n, _ = client.fit(client.initial_parameters(), list(batches(x, y, 32, seed=0)))
    _, before = client.evaluate(None, batches(xt, yt, 100))
    _, after = client.evaluate(arrays, batches(xt, yt, 100))
    assert after["accuracy"] > before["accuracy"] + 0.2, (before, after)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok", n, before["accuracy"], after["accuracy"])
""")


def test_client_imports_no_torch(fl_artifacts, example_path):
    result = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, str(fl_artifacts), str(example_path)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok 1200")
