"""Regenerating artifacts: refused over existing ones unless asked, and then one whole new generation."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState
from onnxtrain.cli import main as cli_main
from onnxtrain.utils.atomic import FileSetExistsError

PARAMS = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


def _trained_checkpoint(path):
    state = CheckpointState.load_checkpoint(path)
    state.properties["epoch"] = 1
    CheckpointState.save_checkpoint(state, path)


def test_existing_artifacts_are_refused_and_kept(mlp_onnx, mlp_artifacts):
    _, model = mlp_onnx
    out = mlp_artifacts.checkpoint.parent
    _trained_checkpoint(mlp_artifacts.checkpoint)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileSetExistsError, match=r"already holds artifacts \(training_model.onnx.*overwrite=True"):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, loss="crossentropy", artifact_directory=out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert CheckpointState.load_checkpoint(mlp_artifacts.checkpoint).properties["epoch"] == 1


def test_overwrite_replaces_the_whole_set_without_stale_files(mlp_onnx, mlp_artifacts):
    _, model = mlp_onnx
    out = mlp_artifacts.checkpoint.parent
    _trained_checkpoint(mlp_artifacts.checkpoint)
    if sys.platform != "win32":
        os.chmod(mlp_artifacts.checkpoint, 0o640)
    paths = artifacts.generate_artifacts(model, requires_grad=PARAMS[2:], loss="crossentropy",
                                         artifact_directory=out, overwrite=True)  # no optimizer this time
    assert paths.optimizer_model is None
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "eval_model.onnx", "training_model.onnx"]
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    assert dict(state.properties) == {}
    assert [n for n in state.parameters if state.parameters[n].requires_grad] == PARAMS[2:]
    if sys.platform != "win32":
        assert stat.S_IMODE(os.stat(paths.checkpoint).st_mode) == 0o640


def test_other_prefixes_and_files_are_not_artifacts_of_this_set(mlp_onnx, tmp_path):
    _, model = mlp_onnx
    (tmp_path / "notes.txt").write_text("mine")
    artifacts.generate_artifacts(model, requires_grad=PARAMS, loss="mse", artifact_directory=tmp_path, prefix="a_")
    artifacts.generate_artifacts(model, requires_grad=PARAMS, loss="mse", artifact_directory=tmp_path, prefix="b_")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a_checkpoint", "a_eval_model.onnx", "a_training_model.onnx",
        "b_checkpoint", "b_eval_model.onnx", "b_training_model.onnx", "notes.txt"]


def test_cli_refuses_without_force(mlp_onnx, tmp_path, capsys):
    _, model = mlp_onnx
    args = ["artifacts", str(model), "--requires-grad", *PARAMS, "--loss", "crossentropy", "-o", str(tmp_path)]
    assert cli_main(args) == 0
    _trained_checkpoint(tmp_path / "checkpoint")
    capsys.readouterr()
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert "already holds artifacts" in err and "--force" in err
    assert CheckpointState.load_checkpoint(tmp_path / "checkpoint").properties["epoch"] == 1
    assert cli_main([*args, "--force"]) == 0
    assert dict(CheckpointState.load_checkpoint(tmp_path / "checkpoint").properties) == {}
