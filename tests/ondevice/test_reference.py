"""The artifacts are standard ONNX: onnx.reference.ReferenceEvaluator runs them and agrees with onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx.reference import ReferenceEvaluator

from onnxtrain.api import CheckpointState, Module
from tests.ondevice.helpers import MLP, classification_batches, export, generate


def test_training_step_in_reference_evaluator_matches_onnxruntime(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    path = export(model, (torch.randn(4, 16),), tmp_path / "mlp.onnx", ["x"])
    names = [n for n, _ in model.named_parameters()]
    paths = generate(path, tmp_path, requires_grad=names, loss="crossentropy", optimizer="adamw")
    (x, y), = classification_batches(np.random.default_rng(0), 1, 8, (16,), 5)

    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state)
    loss = module(x, y)
    grads = {n: state.parameters[n].grad for n in names}

    training = onnx.load(str(paths.training_model))
    assert {op.domain for op in training.opset_import} <= {"", "ai.onnx"}  # no contrib ops
    feeds = {"x": x, "labels": y, **{n: state.parameters[n].data for n in names}}
    ref_loss, *ref_grads = ReferenceEvaluator(training).run(None, feeds)
    np.testing.assert_allclose(ref_loss, loss, rtol=1e-5)
    for name, g in zip(names, ref_grads):
        np.testing.assert_allclose(g, grads[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_optimizer_model_in_reference_evaluator_matches_torch_adamw():
    from onnxtrain.blocks import AdamW, build_optimizer_model

    rng = np.random.default_rng(1)
    p, g = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    proto = build_optimizer_model(AdamW(max_grad_norm=1.0), [("w", np.float32, (2, 5))])
    m, v = np.zeros(10, np.float32), np.zeros(10, np.float32)
    evaluator = ReferenceEvaluator(proto)
    tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
    topt = torch.optim.AdamW([tp], lr=0.01)
    for step in (1, 2, 3):
        p, m, v = evaluator.run(None, {"learning_rate": np.array(0.01, np.float32), "step": np.array(step, np.int64),
                                       "params.float32": p, "gradients.float32": g, "exp_avg.float32": m,
                                       "exp_avg_sq.float32": v})
        tp.grad = torch.from_numpy(g.copy())
        torch.nn.utils.clip_grad_norm_([tp], 1.0)
        topt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_sgd_variants_in_reference_evaluator_match_torch():
    import pytest

    from onnxtrain.blocks import SGD, build_optimizer_model

    rng = np.random.default_rng(2)
    for kwargs in ({}, {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}, {"momentum": 0.8, "nesterov": True}):
        proto = build_optimizer_model(SGD(**kwargs), [("w", np.float32, (6,))])
        evaluator = ReferenceEvaluator(proto)
        p = rng.standard_normal(6).astype(np.float32)
        tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
        topt = torch.optim.SGD([tp], lr=0.1, **kwargs)
        buf = np.zeros(6, np.float32)
        for step in (1, 2, 3):
            g = rng.standard_normal(6).astype(np.float32)
            feeds = {"learning_rate": np.array(0.1, np.float32), "step": np.array(step, np.int64),
                     "params.float32": p, "gradients.float32": g}
            if kwargs.get("momentum"):
                p, buf = evaluator.run(None, {**feeds, "momentum_buffer.float32": buf})
            else:
                (p,) = evaluator.run(None, feeds)
            tp.grad = torch.from_numpy(g)
            topt.step()
        np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=str(kwargs))
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(nesterov=True)
