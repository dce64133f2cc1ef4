"""``generate_artifacts(target="web")``: artifacts for onnxruntime-web (docs/web.md, "Artifacts for the web").

The same files, inputs, outputs and layout as the default artifacts, built without a ``Scan`` in the
optimizer and without the row-of-ones ``MatMul`` for bias gradients; trained here by the Python runtime
against PyTorch (tolerance as test_parity.py: relative 1e-4 on each of the 20 losses).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from onnxtrain import artifacts
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


def test_unknown_target_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"target must be one of \['default', 'web'\], got 'wasm'"):
        artifacts.generate_artifacts(tmp_path / "absent.onnx", requires_grad=["w"], target="wasm",
                                     artifact_directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
