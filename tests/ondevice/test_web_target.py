"""``generate_artifacts(target="web")``: artifacts for onnxruntime-web (docs/web.md, "Artifacts for the web").

The same files, inputs, outputs and layout as the default artifacts, built without a ``Scan`` in the
optimizer and without the row-of-ones ``MatMul`` for bias gradients; trained here by the Python runtime
against PyTorch (tolerance as test_parity.py: relative 1e-4 on each of the 20 losses).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState
from onnxtrain.utils import chunks
from tests.ondevice.helpers import (
    MLP,
    STEPS,
    assert_losses_close,
    classification_batches,
    clone,
    export,
    generate,
    load,
    ondevice_losses,
    torch_losses,
)

RTOL = 1e-4


def _ops(path) -> set[str]:
    model = onnx.load(path)
    ops = {n.op_type for n in model.graph.node}
    for node in model.graph.node:  # and the bodies of control flow
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                ops |= {n.op_type for n in attr.g.node}
    return ops


@pytest.fixture(params=["one chunk", "many chunks"])
def chunk_size(request, monkeypatch):
    if request.param == "many chunks":  # the padded tail of the last chunk must stay zero
        monkeypatch.setattr(chunks, "CHUNK", 100)
    return request.param


def test_web_artifacts_avoid_scan_and_row_of_ones_matmul_and_train_as_torch(tmp_path, chunk_size):
    torch.manual_seed(0)
    model = MLP()
    path = export(clone(model), (torch.randn(4, 16),), tmp_path / "mlp.onnx", ["x"])
    opt = artifacts.AdamW(weight_decay=0.1, max_grad_norm=0.5)
    paths = generate(path, tmp_path / "web", requires_grad=[n for n, _ in model.named_parameters()],
                     loss="crossentropy", optimizer=opt, target="web")
    assert "Scan" not in _ops(paths.optimizer_model)
    assert "MatMul" not in _ops(paths.training_model)  # the MLP's products are Gemm; bias gradients ReduceSum
    default = generate(path, tmp_path / "default", requires_grad=[n for n, _ in model.named_parameters()],
                       loss="crossentropy", optimizer=opt)
    assert "Scan" in _ops(default.optimizer_model)  # the default is unchanged
    meta = {p.key: p.value for p in onnx.load(paths.optimizer_model).metadata_props}
    default_meta = {p.key: p.value for p in onnx.load(default.optimizer_model).metadata_props}
    assert json.loads(meta["onnxtrain.optimizer"]) == json.loads(default_meta["onnxtrain.optimizer"])  # same layout

    batches = classification_batches(np.random.default_rng(4), STEPS, 8, (16,), 5)
    state, module, optimizer = load(paths, lr=1e-2)
    ours = ondevice_losses(module, optimizer, batches)
    ref = clone(model)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    theirs = []
    for x, y in batches:
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        topt.step()
        theirs.append(loss.item())
    assert_losses_close(ours, theirs, RTOL)
    for name, param in ref.named_parameters():
        np.testing.assert_allclose(state.parameters[name].data, param.detach().numpy(), rtol=0, atol=1e-5)

    # The train-step model (one graph for both) trains the same: losses and parameters against PyTorch.
    assert default.train_step_model is None and not (tmp_path / "default" / "train_step_model.onnx").exists()
    step_losses, step_params = _train_step_run(paths, batches, lr=1e-2)
    assert_losses_close(step_losses, theirs, RTOL)
    for name, param in ref.named_parameters():
        np.testing.assert_allclose(step_params[name], param.detach().numpy(), rtol=0, atol=1e-5)


def _train_step_run(paths, batches, lr):
    """Train with ``train_step_model.onnx`` alone in onnxruntime: the flat vectors in, the new ones out."""
    model = onnx.load(paths.train_step_model)
    meta = {p.key: json.loads(p.value) for p in model.metadata_props}
    train_meta, opt_meta = meta["onnxtrain.training"], meta["onnxtrain.optimizer"]
    assert train_meta["kind"] == "train_step"
    (group,) = opt_meta["groups"]
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    flat = np.zeros(group["chunks"] * group["chunk"], np.float32)
    flat[:group["size"]] = np.concatenate([state.parameters[p["name"]].data.ravel() for p in group["params"]])
    vectors = {"params": flat.reshape(group["chunks"], group["chunk"])}
    vectors.update({s: np.zeros_like(vectors["params"]) for s in opt_meta["states"]})
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    frozen = {n: state.parameters[n].data for n in train_meta["frozen"]}
    names = [o.name for o in session.get_outputs()]
    losses = []
    for step, inputs in enumerate(batches, 1):
        feeds = dict(zip(train_meta["user_inputs"], inputs), **frozen, learning_rate=np.array(lr, np.float32),
                     step=np.array(step, np.int64), **{f"{k}.float32": v for k, v in vectors.items()})
        out = dict(zip(names, session.run(None, feeds)))
        losses.append(float(out["loss"]))
        vectors = {k: out[f"{k}.float32.out"] for k in vectors}
    assert not vectors["params"].ravel()[group["size"]:].any()  # the padding stays zero
    params, lo = {}, 0
    for p in group["params"]:
        size = int(np.prod(p["shape"], dtype=np.int64))
        params[p["name"]] = vectors["params"].ravel()[lo:lo + size].reshape(p["shape"])
        lo += size
    return losses, params


def test_web_artifacts_sgd_momentum_train_as_torch(tmp_path):
    torch.manual_seed(3)
    model = MLP((6, 16, 3))
    path = export(clone(model), (torch.randn(4, 6),), tmp_path / "reg.onnx", ["x"])
    sgd = artifacts.SGD(momentum=0.9, weight_decay=1e-3)
    paths = generate(path, tmp_path, requires_grad=[n for n, _ in model.named_parameters()], loss="mse",
                     optimizer=sgd, target="web")
    assert "Scan" not in _ops(paths.optimizer_model)
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32))
               for _ in range(STEPS)]
    _, module, optimizer = load(paths, lr=0.05)
    ours = ondevice_losses(module, optimizer, batches)
    ref = clone(model)
    theirs = torch_losses(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                          torch.nn.functional.mse_loss, batches)
    assert_losses_close(ours, theirs, RTOL)
    assert_losses_close(_train_step_run(paths, batches, lr=0.05)[0], theirs, RTOL)


def test_train_step_model_with_frozen_parameters_trains_as_torch(tmp_path):
    torch.manual_seed(5)
    model = MLP((6, 16, 3))
    path = export(clone(model), (torch.randn(4, 6),), tmp_path / "m.onnx", ["x"])
    trainable = [n for n, _ in model.named_parameters() if not n.startswith("net.0.")]
    paths = generate(path, tmp_path, requires_grad=trainable, frozen_params=["net.0.weight", "net.0.bias"],
                     loss="crossentropy", optimizer="adamw", target="web")
    step_model = onnx.load(paths.train_step_model)
    assert {"net.0.weight", "net.0.bias"} <= {i.name for i in step_model.graph.input}  # frozen: still inputs
    batches = classification_batches(np.random.default_rng(5), STEPS, 8, (6,), 3)
    ref = clone(model)
    for name, param in ref.named_parameters():
        param.requires_grad_(name in trainable)
    theirs = torch_losses(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2),
                          torch.nn.functional.cross_entropy, batches)
    losses, params = _train_step_run(paths, batches, lr=1e-2)
    assert_losses_close(losses, theirs, RTOL)
    for name in trainable:
        np.testing.assert_allclose(params[name], dict(ref.named_parameters())[name].detach().numpy(), rtol=0, atol=1e-5)


def test_no_train_step_model_for_loss_scaling(tmp_path):
    torch.manual_seed(0)
    model = MLP((6, 8, 3))
    path = export(clone(model), (torch.randn(4, 6),), tmp_path / "m.onnx", ["x"])
    paths = generate(path, tmp_path, requires_grad=[n for n, _ in model.named_parameters()], loss="crossentropy",
                     optimizer="adamw", target="web", precision="fp16")
    assert paths.train_step_model is None and not (tmp_path / "train_step_model.onnx").exists()


def test_unknown_target_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"target must be one of \['default', 'web'\], got 'wasm'"):
        artifacts.generate_artifacts(tmp_path / "absent.onnx", requires_grad=["w"], target="wasm",
                                     artifact_directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
