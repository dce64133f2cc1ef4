"""Models exported with torch.onnx (dynamo), the PyTorch reference loop and the on-device loop."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import torch

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer

STEPS = 20


def export(model: torch.nn.Module, example: tuple, path: Path, input_names, dynamic_batch=True) -> Path:
    """Export ``model`` (eval mode, so dropout is off) to ``path`` with a dynamic batch axis."""
    model.eval()
    dims = tuple({0: "batch"} if dynamic_batch else None for _ in example)
    program = torch.onnx.export(model, example, dynamo=True, input_names=list(input_names),
                                output_names=["logits"], dynamic_shapes=dims, verbose=False,
                                optimize=False)  # keep parameters as named initializers (no folding)
    program.save(str(path))
    return path


def generate(model_path, out_dir, **kwargs) -> artifacts.Artifacts:
    """generate_artifacts into ``out_dir`` (a missing gradient rule fails the test)."""
    return artifacts.generate_artifacts(model_path, artifact_directory=out_dir, **kwargs)


def load(paths: artifacts.Artifacts, lr: float):
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    optimizer = Optimizer(paths.optimizer_model, module) if paths.optimizer_model else None
    if optimizer is not None:
        optimizer.set_learning_rate(lr)
    return state, module, optimizer


def ondevice_losses(module, optimizer, batches) -> list[float]:
    losses = []
    for inputs in batches:
        out = module(*inputs)
        losses.append(float(out[0] if isinstance(out, list) else out))  # the loss comes first
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def torch_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn, batches) -> list[float]:
    model.train()
    losses = []
    for *inputs, target in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(*(torch.from_numpy(x) for x in inputs)), torch.from_numpy(target))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_losses_close(ours, theirs, rtol):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    rel = np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-6)
    assert rel.max() < rtol, f"max relative loss difference {rel.max():.2e} at step {rel.argmax()}:\n{ours}\n{theirs}"


class MLP(torch.nn.Module):
    def __init__(self, sizes=(16, 32, 32, 5)):
        super().__init__()
        layers = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class CNN(torch.nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(8 * 2 * 2, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def classification_batches(rng, n_batches, batch, shape, classes, distinct=4):
    """``n_batches`` steps cycling over ``distinct`` fixed batches (so that the loss goes down)."""
    fixed = [(rng.standard_normal((batch, *shape)).astype(np.float32),
              rng.integers(0, classes, size=batch).astype(np.int64)) for _ in range(min(distinct, n_batches))]
    return [fixed[i % len(fixed)] for i in range(n_batches)]


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)
