"""The checkpoint format: round trips, resuming training, nominal checkpoints, damaged and foreign files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from onnxtrain.api import (
    CheckpointError,
    CheckpointState,
    LinearLRScheduler,
    Module,
    Optimizer,
)
from onnxtrain.ondevice import checkpoint as ckpt
from tests.ondevice.helpers import classification_batches, load, ondevice_losses


def _batches(n=6):
    return classification_batches(np.random.default_rng(0), n, 8, (16,), 5)


def test_save_load_continue_gives_the_same_losses_as_not_stopping(mlp_artifacts, tmp_path):
    batches = _batches(6)
    _, module, optimizer = load(mlp_artifacts, lr=1e-2)
    straight = ondevice_losses(module, optimizer, batches)

    state, module, optimizer = load(mlp_artifacts, lr=1e-2)
    first = ondevice_losses(module, optimizer, batches[:3])
    state.properties["epoch"] = 3
    state.properties["best"] = 0.25
    state.properties["note"] = "halfway"
    CheckpointState.save_checkpoint(state, tmp_path / "resume.ckpt", include_optimizer_state=True)
    del state, module, optimizer

    state = CheckpointState.load_checkpoint(tmp_path / "resume.ckpt")
    module = Module(mlp_artifacts.training_model, state, mlp_artifacts.eval_model)
    optimizer = Optimizer(mlp_artifacts.optimizer_model, module)
    assert optimizer.get_learning_rate() == pytest.approx(1e-2)
    assert dict(state.properties) == {"epoch": 3, "best": 0.25, "note": "halfway"}
    assert first + ondevice_losses(module, optimizer, batches[3:]) == straight  # bit for bit


def test_without_optimizer_state_moments_restart(mlp_artifacts, tmp_path):
    state, module, optimizer = load(mlp_artifacts, lr=1e-2)
    ondevice_losses(module, optimizer, _batches(2))
    CheckpointState.save_checkpoint(state, tmp_path / "params_only")  # include_optimizer_state=False
    data = ckpt.load(tmp_path / "params_only")
    assert data.optimizer_states == {} and data.optimizer_step == 0
    for name in state.parameters:
        np.testing.assert_array_equal(data.parameters[name], state.parameters[name].data)
        assert data.requires_grad[name] == state.parameters[name].requires_grad


def test_parameter_data_assignment_reaches_the_sessions(mlp_artifacts):
    state, module, _ = load(mlp_artifacts, lr=1e-2)
    x, y = _batches(1)[0]
    module.eval()
    before = module(x, y)
    for name in state.parameters:
        state.parameters[name].data = np.zeros_like(state.parameters[name].data)
    assert module(x, y) == pytest.approx(np.log(5.0))  # all-zero logits: uniform over 5 classes
    assert before != pytest.approx(np.log(5.0))
    with pytest.raises(ValueError, match="shape"):
        state.parameters["net.0.weight"].data = np.zeros(3, np.float32)


def test_nominal_checkpoint_holds_shapes_only(mlp_onnx, mlp_artifacts, tmp_path):
    from tests.ondevice.helpers import generate

    model, path = mlp_onnx
    names = [n for n, _ in model.named_parameters()]
    nominal = generate(path, tmp_path / "nominal", requires_grad=names, loss="crossentropy", optimizer="adamw",
                       nominal_checkpoint=True)
    assert os.path.getsize(nominal.checkpoint) < 4096 < os.path.getsize(mlp_artifacts.checkpoint)
    state = CheckpointState.load_checkpoint(nominal.checkpoint)
    assert state.is_nominal
    assert not state.parameters["net.0.weight"].data.any()
    full = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    module = Module(nominal.training_model, state)
    reference = Module(mlp_artifacts.training_model, full)
    module.copy_buffer_to_parameters(reference.get_contiguous_parameters(trainable_only=True))
    x, y = _batches(1)[0]
    assert module(x, y) == reference(x, y)


def test_contiguous_parameters(mlp_artifacts):
    state, module, _ = load(mlp_artifacts, lr=1e-2)
    flat = module.get_contiguous_parameters(trainable_only=True).numpy()
    assert flat.size == module.get_parameters_size(True) == sum(state.parameters[n].data.size for n in state.parameters)
    np.testing.assert_array_equal(flat, np.concatenate([state.parameters[n].data.ravel() for n in state.parameters]))
    module.copy_buffer_to_parameters(flat * 2)
    np.testing.assert_array_equal(state.parameters["net.0.bias"].data, 2 * flat[16 * 32:16 * 32 + 32])
    with pytest.raises(ValueError, match="elements"):
        module.copy_buffer_to_parameters(flat[:-1])


def test_linear_lr_scheduler_matches_the_transformers_schedule(mlp_artifacts):
    _, _module, optimizer = load(mlp_artifacts, lr=0.0)
    scheduler = LinearLRScheduler(optimizer, warmup_step_count=3, total_step_count=8, initial_lr=0.1)
    seen = [optimizer.get_learning_rate()]
    for _ in range(9):
        scheduler.step()
        seen.append(optimizer.get_learning_rate())
    expected = [0.1 * (s / 3 if s < 3 else max(0.0, (8 - s) / 5)) for s in range(10)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6, atol=1e-9)


# -- damaged, foreign and unusual files ---------------------------------------------------------------


def test_truncated_file_is_a_clear_error(mlp_artifacts, tmp_path):
    data = mlp_artifacts.checkpoint.read_bytes()
    for cut in (4, 20, len(data) // 2, len(data) - 1):
        (tmp_path / "cut").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            CheckpointState.load_checkpoint(tmp_path / "cut")


def test_foreign_and_damaged_files_are_clear_errors(mlp_artifacts, tmp_path):
    foreign = tmp_path / "model.onnx"
    foreign.write_bytes(mlp_artifacts.training_model.read_bytes())
    with pytest.raises(CheckpointError, match="not an onnxtrain checkpoint"):
        CheckpointState.load_checkpoint(foreign)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not an onnxtrain checkpoint"):
        CheckpointState.load_checkpoint(tmp_path / "empty")
    data = bytearray(mlp_artifacts.checkpoint.read_bytes())
    header = bytearray(data)
    header[40] ^= 0xFF
    (tmp_path / "header").write_bytes(bytes(header))
    with pytest.raises(CheckpointError, match="header checksum"):
        CheckpointState.load_checkpoint(tmp_path / "header")
    tensor = bytearray(data)
    tensor[-3] ^= 0xFF
    (tmp_path / "tensor").write_bytes(bytes(tensor))
    with pytest.raises(CheckpointError, match="checksum of parameter 'net.4.bias'"):
        CheckpointState.load_checkpoint(tmp_path / "tensor")
    future = bytearray(data)
    future[8:12] = (99).to_bytes(4, "little")
    (tmp_path / "future").write_bytes(bytes(future))
    with pytest.raises(CheckpointError, match="version 99"):
        CheckpointState.load_checkpoint(tmp_path / "future")
    with pytest.raises(FileNotFoundError, match="missing"):
        CheckpointState.load_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="directory"):
        CheckpointState.load_checkpoint(tmp_path)


def test_properties_accept_int_float_str_only(mlp_artifacts):
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.raises(CheckpointError, match="int, float or str"):
        state.properties["bad"] = [1, 2]
    with pytest.raises(CheckpointError, match="int, float or str"):
        state.properties["flag"] = True


def test_save_is_atomic_and_leaves_no_temporary_files(mlp_artifacts, tmp_path, monkeypatch):
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    target = tmp_path / "out" / "ckpt"
    CheckpointState.save_checkpoint(state, target)
    good = target.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        CheckpointState.save_checkpoint(state, target)
    assert target.read_bytes() == good  # the old file is intact
    assert os.listdir(target.parent) == ["ckpt"]


def test_round_trip_of_every_supported_dtype_and_edge_values(tmp_path):
    data = ckpt.CheckpointData(
        parameters={"f16": np.arange(6, dtype=np.float16).reshape(2, 3), "f64": np.array([np.inf, -0.0, np.nan]),
                    "scalar": np.array(3.5, np.float32), "empty": np.zeros((0, 4), np.float32),
                    "i64": np.array([-(2**62)], np.int64)},
        requires_grad={"f16": True, "f64": False, "scalar": True, "empty": False, "i64": False},
        properties={"a": 1, "b": float("inf"), "c": "ünïcode"})
    ckpt.save(data, tmp_path / "c")
    back = ckpt.load(tmp_path / "c")
    for name, array in data.parameters.items():
        assert back.parameters[name].dtype == array.dtype
        np.testing.assert_array_equal(back.parameters[name], array)
    assert back.requires_grad == data.requires_grad and back.properties == data.properties
