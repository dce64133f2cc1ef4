"""Under a recompute budget, each backward ends by handing onnxruntime's shared arena back to the system
(onnxtrain.utils.ort_options.release_arena), after the step's onnxruntime values are dropped; without a budget,
or with ONNXTRAIN_CPU_ARENA=keep, it does not. Gradients stay PyTorch's either way."""

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


@pytest.mark.parametrize("recompute, arena, releases", [(0.5, "1", 1), (1.0, "1", 1), (None, "1", 0),
                                                        (None, "release", 1), (0.5, "keep", 0), (0.5, "0", 0)])
def test_backward_releases_the_arena_under_a_budget(monkeypatch, recompute, arena, releases):
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
