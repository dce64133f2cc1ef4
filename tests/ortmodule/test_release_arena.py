"""With ONNXTRAIN_CPU_ARENA=release, each training step starts and ends (once its onnxruntime values are
dropped) by handing onnxruntime's shared arena back to the system (onnxtrain.utils.ort_options.release_arena);
by default it does not. Gradients stay PyTorch's either way."""

from __future__ import annotations

import copy

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.ortmodule import DebugOptions, function
from onnxtrain.utils.ort_options import ARENA_ENV


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


@pytest.mark.parametrize("recompute, arena, releases", [(None, "release", 2), (0.5, "release", 2), (0.5, "1", 0),
                                                        (None, "0", 0)])
def test_a_step_releases_the_arena_on_request(monkeypatch, recompute, arena, releases):
    monkeypatch.setenv(ARENA_ENV, arena)
    calls = []
    monkeypatch.setattr(function, "release_arena", lambda: calls.append(1))
    reference = _mlp()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(recompute=recompute))
    x = torch.randn(8, 16)
    for m in (model, reference):
        m(x).square().mean().backward()
    assert model.fallback_reason is None
    assert len(calls) == releases
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
