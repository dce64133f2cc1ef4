"""The Python runtime reproduces the conformance fixtures (the ones every onnxtrain runtime checks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onnxtrain.ondevice import checkpoint as ckpt
from tests.conformance.loop import run_case

HERE = Path(__file__).parent
CASES = ["mlp", "cnn", "transformer"]
RTOL = 1e-5


def assert_close(ours, expected, what: str) -> None:
    """Relative to the largest magnitude of ``expected`` (parameters near zero do not blow the ratio up)."""
    ours, expected = np.asarray(ours, np.float64), np.asarray(expected, np.float64)
    assert ours.shape == expected.shape, f"{what}: shape {ours.shape} != {expected.shape}"
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-12)
    err = float(np.abs(ours - expected).max(initial=0.0)) / scale
    assert err <= RTOL, f"{what}: max difference {err:.2e} of the largest value (tolerance {RTOL})"


@pytest.mark.parametrize("graphs", ["default", "web"])
@pytest.mark.parametrize("name", CASES)
def test_python_runtime_reproduces_fixture(name, graphs, tmp_path):
    """The case's artifacts, and its ``web/`` graphs (``target="web"``) with the same checkpoint, give the
    recorded numbers."""
    folder = HERE / name
    case = json.loads((folder / "case.json").read_text())
    losses, final = run_case(folder, case, tmp_path / "checkpoint", folder / "web" if graphs == "web" else None)
    for i, (ours, theirs) in enumerate(zip(losses, case["losses"], strict=True)):
        assert abs(ours - theirs) <= RTOL * abs(theirs), f"{name} loss {i}: {ours} != {theirs}"
    assert abs(final["eval_loss"] - case["eval_loss"]) <= RTOL * abs(case["eval_loss"])
    ours, expected = ckpt.load(final["checkpoint"]), ckpt.load(folder / "expected_checkpoint")
    assert list(ours.parameters) == list(expected.parameters)
    for pname, array in expected.parameters.items():
        assert_close(ours.parameters[pname], array, f"{name} parameter {pname}")
        for sname, state in expected.optimizer_states.get(pname, {}).items():
            assert_close(ours.optimizer_states[pname][sname], state, f"{name} {sname} of {pname}")
    assert ours.optimizer_step == expected.optimizer_step == case["steps"]


def test_fixture_losses_follow_pytorch():
    """The fixtures were checked against PyTorch when written (make_fixtures.py); the record says so."""
    for name in CASES:
        case = json.loads((HERE / name / "case.json").read_text())
        rel = np.abs(np.subtract(case["losses"], case["torch_losses"])) / np.abs(case["torch_losses"])
        assert rel.max() < 1e-4, name
        assert case["losses"][-1] < case["losses"][0], f"{name} does not learn"
