"""generate_artifacts(recompute=...): the training model gives PyTorch's loss and gradients at every budget,
and a smaller budget recomputes more."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxtrain.ondevice.format import TRAINING_METADATA_KEY
from onnxtrain.passes.recompute import KINDS, Recompute
from tests.ondevice.helpers import generate


def _gradients(paths, model, x, labels):
    session = ort.InferenceSession(str(paths.training_model), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "labels": labels, **{n: p.detach().numpy() for n, p in model.named_parameters()}}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))


@pytest.mark.parametrize("budget", [None, 0.5, 0.0])
def test_training_model_matches_torch_at_every_budget(mlp_onnx, tmp_path, caplog, budget):
    model, path = mlp_onnx
    params = [n for n, _ in model.named_parameters()]
    # The MLP's activations come out of Gemms: recomputing them takes the matrix products too.
    plan = None if budget is None else Recompute(budget=budget, kinds=KINDS, dims={"batch": 8})
    with caplog.at_level(logging.INFO, logger="onnxtrain.passes"):
        paths = generate(path, tmp_path, requires_grad=params, loss="crossentropy", recompute=plan)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    labels = rng.integers(0, 4, 8).astype(np.int64)
    got = _gradients(paths, model, x, labels)
    model.train()
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(got[f"{name}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    recomputed = [n for n in onnx.load(str(paths.training_model)).graph.node if n.name.endswith("recomputed")
                  or "/recomputed" in n.name]
    if budget == 0.0:
        assert recomputed and "recompute plan:" in caplog.text
    if budget is None:
        assert not recomputed


class _TanhNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * torch.sigmoid(self.a(x)))


def test_the_runtime_keeps_the_recomputed_clones(tmp_path):
    """onnxruntime's common subexpression elimination would merge each clone back into the forward node it
    copies (the values then stay alive from forward to backward; 85 of 89 on BERT-small): the runtime turns
    it off for artifacts that recompute, and its training step still gives PyTorch's gradients."""
    from onnxtrain.api import CheckpointState, Module
    from onnxtrain.utils.ort_options import for_training
    from tests.ondevice.helpers import export

    torch.manual_seed(0)
    model = _TanhNet()
    path = export(model, (torch.randn(8, 16),), tmp_path / "tanh.onnx", ["x"])
    params = [n for n, _ in model.named_parameters()]
    paths = generate(path, tmp_path / "art", requires_grad=params, loss="crossentropy",
                     recompute=Recompute(budget=0.0, dims={"batch": 8}))
    in_file = [n.name for n in onnx.load(str(paths.training_model)).graph.node if "recomputed" in n.name]
    assert any("tanh" in n.lower() for n in in_file), in_file
    meta = json.loads({p.key: p.value for p in onnx.load(str(paths.training_model)).metadata_props}[TRAINING_METADATA_KEY])
    assert meta["recomputed"] is True
    options = for_training()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, session_options=options)
    kept = [n.name for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node if "recomputed" in n.name]
    assert all(any(name in k for k in kept) for name in in_file if "tanh" in name.lower()), (in_file, kept)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    labels = rng.integers(0, 4, 8).astype(np.int64)
    loss = module(x, labels)
    model.zero_grad()
    expected = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
    expected.backward()
    np.testing.assert_allclose(np.asarray(loss), expected.item(), rtol=1e-5)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
