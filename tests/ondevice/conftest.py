"""One small exported MLP and its artifacts, shared by the checkpoint, error, CLI and runtime tests."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.ondevice.helpers import MLP, export, generate


@pytest.fixture(scope="session")
def mlp_onnx(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP()
    path = export(model, (torch.randn(4, 16),), tmp_path_factory.mktemp("mlp_onnx") / "mlp.onnx", ["x"])
    return model, path


@pytest.fixture(scope="session")
def _mlp_artifacts(mlp_onnx, tmp_path_factory):
    model, path = mlp_onnx
    out = tmp_path_factory.mktemp("mlp_artifacts")
    return generate(path, out, requires_grad=[n for n, _ in model.named_parameters()], loss="crossentropy",
                    optimizer="adamw")


@pytest.fixture
def mlp_artifacts(_mlp_artifacts, tmp_path):
    """A private copy per test (tests write checkpoints next to them)."""
    for p in (_mlp_artifacts.training_model, _mlp_artifacts.eval_model, _mlp_artifacts.optimizer_model,
              _mlp_artifacts.checkpoint):
        shutil.copy(p, tmp_path / p.name)
    from onnxtrain.artifacts import Artifacts

    return Artifacts(*(tmp_path / p.name for p in (_mlp_artifacts.training_model, _mlp_artifacts.eval_model,
                                                    _mlp_artifacts.optimizer_model, _mlp_artifacts.checkpoint)))
