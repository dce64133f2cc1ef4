"""generate_artifacts(precision="fp16"): dynamic loss scaling in the training and optimizer models, against
torch.amp.GradScaler on the same model, batches and gradient sequence (an injected overflow included)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import jsonschema
import numpy as np
import onnx
import pytest
import torch

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.ondevice.format import LOSS_SCALING_FORMAT, OPTIMIZER_METADATA_KEY, TRAINING_METADATA_KEY
from tests.conformance.test_schemas import SCHEMAS
from tests.ondevice.helpers import assert_losses_close, clone, generate
from tests.ondevice.test_torch_free import SCRIPT

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 16)).astype(np.float32)
Y = RNG.integers(0, 5, 16).astype(np.int64)
OVERFLOW = 4  # this step's batch has rows of 1e37 (one per class): the loss stays finite, the weight
# gradients overflow (a row whose label is its argmax would give no gradient at all)
LR = 1e-2


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.roll(X, step, axis=0), Y.copy()
    if step == OVERFLOW:
        x[:5], y[:5] = 1e37, np.arange(5)
    return x, y


def _fp16(mlp_onnx, tmp_path, **kwargs):
    model, path = mlp_onnx
    return generate(path, tmp_path / "fp16", requires_grad=[n for n, _ in model.named_parameters()],
                    loss="crossentropy", optimizer="adamw", precision="fp16", **kwargs)


def _load(paths):
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(LR)
    return state, module, optimizer


def test_loss_scaling_follows_grad_scaler(mlp_onnx, tmp_path):
    """The same gradient sequence (ours, scaled, an overflow included) through torch.amp.GradScaler and
    torch's AdamW: the same scale after every step (growth interval 3: it grows twice, halves at the
    overflow, then grows back), the same skipped step, the same parameters."""
    model, _ = mlp_onnx
    paths = _fp16(mlp_onnx, tmp_path, loss_scaler=artifacts.LossScaler(growth_interval=3))
    state, module, optimizer = _load(paths)
    assert state.loss_scale == 2.0**16

    ref = clone(model).train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    scaler.scale(torch.zeros(()))  # the scaler makes its scale tensor on first use
    scales, skipped = [], []
    for step in range(12):
        x, y = _batch(step)
        before = {n: state.parameters[n].data for n in state.names()}
        loss = float(module(x, y))
        assert state.loss_scale == scaler.get_scale()
        for name, p in ref.named_parameters():  # the scaled gradients the training model returned
            p.grad = torch.from_numpy(state.parameters[name].grad)
        optimizer.step()
        module.lazy_reset_grad()
        ref_scale = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        skipped.append(scaler.get_scale() < ref_scale)
        scales.append(state.loss_scale)
        assert state.loss_scale == scaler.get_scale(), f"step {step}"
        assert np.isfinite(loss)
        for name, p in ref.named_parameters():
            got = state.parameters[name].data
            if skipped[-1]:
                assert np.array_equal(got, before[name]), f"step {step} was skipped but {name} changed"
            np.testing.assert_allclose(got, p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{name} step {step}")
    assert skipped == [s == OVERFLOW for s in range(12)], "the injected batch must overflow, and only it"
    assert scales[OVERFLOW] == scales[OVERFLOW - 1] / 2 and scales[-1] > scales[OVERFLOW - 1]
    assert state.optimizer_step == 11  # the skipped step is not counted (AdamW's bias correction)


def test_fp16_mlp_trains_close_to_float32(mlp_onnx, tmp_path):
    model, path = mlp_onnx
    names = [n for n, _ in model.named_parameters()]
    fp32 = generate(path, tmp_path / "fp32", requires_grad=names, loss="crossentropy", optimizer="adamw")
    losses = []
    for paths in (fp32, _fp16(mlp_onnx, tmp_path)):
        _, module, optimizer = _load(paths)
        run = []
        for step in range(25):
            run.append(float(module(np.roll(X, step, axis=0), Y)))
            optimizer.step()
            module.lazy_reset_grad()
        losses.append(run)
    assert losses[0][-1] < 0.9 * losses[0][0]  # it trains
    assert_losses_close(losses[1], losses[0], rtol=0.02)


def test_fp16_artifacts_format_and_checkpoint(mlp_onnx, tmp_path):
    paths = _fp16(mlp_onnx, tmp_path, loss_scaler=artifacts.LossScaler(init_scale=1024.0, growth_interval=7))
    training = onnx.load(paths.training_model)
    meta = json.loads({p.key: p.value for p in training.metadata_props}[TRAINING_METADATA_KEY])
    assert meta["format"] == LOSS_SCALING_FORMAT and meta["precision"] == "fp16"
    assert meta["loss_scaling"] == {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                    "growth_interval": 7}
    assert training.graph.input[-1].name == "loss_scale"
    assert any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16 for n in training.graph.node)
    opt_meta = json.loads({p.key: p.value for p in onnx.load(paths.optimizer_model).metadata_props}[OPTIMIZER_METADATA_KEY])
    for name, value in (("training-metadata", meta), ("optimizer-metadata", opt_meta)):
        jsonschema.Draft202012Validator(json.loads((SCHEMAS / f"{name}.schema.json").read_text())).validate(value)

    state, module, optimizer = _load(paths)
    module(X, Y)
    optimizer.step()
    CheckpointState.save_checkpoint(state, tmp_path / "saved")
    raw = (tmp_path / "saved").read_bytes()
    header = json.loads(raw[24:24 + struct.unpack("<Q", raw[16:24])[0]])
    jsonschema.Draft202012Validator(json.loads((SCHEMAS / "checkpoint-header.schema.json").read_text())).validate(header)
    assert header["loss_scale"] == {"scale": 1024.0, "good_steps": 1}
    again = CheckpointState.load_checkpoint(tmp_path / "saved")
    assert again.loss_scale == 1024.0 and int(again.loss_scale_arrays[1]) == 1


def test_loss_scaler_errors(mlp_onnx, tmp_path):
    with pytest.raises(ValueError, match="backoff_factor"):
        artifacts.LossScaler(backoff_factor=1.0)
    with pytest.raises(ValueError, match="growth_interval"):
        artifacts.LossScaler(growth_interval=0)
    model, path = mlp_onnx
    with pytest.raises(ValueError, match="loss_scaler is for precision='fp16'"):
        generate(path, tmp_path, requires_grad=[n for n, _ in model.named_parameters()], loss="crossentropy",
                 loss_scaler=artifacts.LossScaler())


def test_torch_free_runtime_trains_fp16_artifacts(mlp_onnx, tmp_path):
    paths = _fp16(mlp_onnx, tmp_path)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(paths.checkpoint.parent), "onnxruntime"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
    assert CheckpointState.load_checkpoint(paths.checkpoint.parent / "resumed").loss_scale == 2.0**16
