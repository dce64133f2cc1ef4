"""With ONNXTRAIN_CPU_ARENA=release (or backward), each training step starts and ends (once its onnxruntime
values are dropped) by handing onnxruntime's shared arena back to the system
(onnxtrain.utils.ort_options.release_arena); by default it does not. With backward, the forward graph's session
takes no memory from the arena and backward's stages do. Gradients stay PyTorch's either way."""

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


# backward: also once before backward's four gradients are copied out of the arena and once after each copy
@pytest.mark.parametrize("recompute, arena, releases", [(None, "release", 2), (0.5, "release", 2), (0.5, "1", 0),
                                                        (None, "0", 0), (None, "backward", 7), (0.5, "backward", 7)])
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


def _arena_options(session) -> tuple[bool, str]:
    """Whether an onnxruntime session has a CPU arena, and whether it takes the shared one (env allocators)."""
    options = session._session.get_session_options()
    try:
        shared = options.get_session_config_entry("session.use_env_allocators")
    except RuntimeError:  # onnxruntime raises for an entry never set
        shared = "0"
    return options.enable_cpu_mem_arena, shared


@pytest.mark.parametrize("arena, forward, backward", [("backward", (False, "0"), (True, "1")),
                                                      ("release", (True, "1"), (True, "1")),
                                                      ("0", (False, "0"), (False, "0"))])
def test_which_sessions_take_the_shared_arena(monkeypatch, arena, forward, backward):
    """backward: the forward graph's freed transients go back to the system as they are freed (none sits in
    the arena beside the stash), while backward's stages reuse each other's freed buffers."""
    monkeypatch.setenv(ARENA_ENV, arena)
    reference = _mlp()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(recompute=0.5))
    x = torch.randn(8, 16)
    for m in (model, reference):
        m(x).square().mean().backward()
    assert model.fallback_reason is None
    trainings = [t for entries in model._cache.values() for g in entries for t in g.training.values()]
    assert len(trainings) == 1
    training = trainings[0]
    assert _arena_options(training.forward) == forward
    stages = [s for staged in training._backward.values() if staged is not None for s in staged.sessions]
    assert stages and all(_arena_options(s) == backward for s in stages)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    # backward: the gradients are copies in torch's memory (an arena chunk kept as .grad holds its region);
    # memory onnxruntime allocated reaches torch by DLPack, whose storage torch cannot resize
    assert all(p.grad.untyped_storage().resizable() == (arena == "backward") for p in model.parameters())
