"""Recompute to a memory budget under ORTModule: gradients stay PyTorch's at every budget, smaller budgets
stash fewer bytes, and the knobs (DebugOptions, ONNX Runtime Training's env vars) reach the plan."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.ortmodule import DebugOptions, function
from onnxtrain.passes.recompute import Recompute
from tests.ortmodule import models
from tests.ortmodule.conftest import trainings


def _train_and_compare(make, classify, recompute, steps=2):
    torch.manual_seed(0)
    reference = make()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(recompute=recompute))
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs = models.text_batch(3, 16, classify=classify, generator=generator)
        losses = []
        for m in (model, reference):
            m.zero_grad()
            loss = m(**inputs).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=name)
    return model


@pytest.mark.parametrize("make, classify", [(models.bert, True), (models.gpt2, False)])
@pytest.mark.parametrize("budget", [None, 1.0, 0.5, 0.0])
def test_gradients_match_eager_at_every_budget(make, classify, budget):
    model = _train_and_compare(make, classify, budget)
    assert model.fallback_reason is None


def test_smaller_budgets_stash_less(caplog, monkeypatch):
    """The bytes of the tensors forward hands to backward, measured on the tensors, fall with the budget."""
    stashed: list[int] = []
    forward = function.ORTFunction.forward

    def measuring(ctx, *args):
        out = forward(ctx, *args)
        stashed.append(sum(t.numel() * t.element_size() for t in ctx.stashed))
        return out

    monkeypatch.setattr(function.ORTFunction, "forward", staticmethod(measuring))
    sizes, plans = [], []
    for budget in (1.0, 0.6, 0.3, 0.0):
        torch.manual_seed(0)
        model = ORTModule(models.gpt2(), DebugOptions(recompute=budget))
        with caplog.at_level(logging.INFO, logger="onnxtrain.passes"):
            model(**models.text_batch(3, 16)).loss.backward()
        sizes.append(stashed[-1])
        (training,) = trainings(model)
        plans.append(training.recompute)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 0.5 * sizes[0], sizes
    assert plans[0].saved_bytes == 0 and plans[-1].saved_bytes > 0
    # The plan is printed: each pattern with how many are on and the bytes they save.
    assert "recompute plan:" in caplog.text and "MiB saved" in caplog.text


def test_env_level_reaches_the_plan(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    assert DebugOptions().recompute_plan() == Recompute(budget=0.0, kinds=("pointwise", "transcendental"))
    assert DebugOptions(recompute="0.5").recompute_plan().budget == 0.5  # the option wins
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "")
    assert DebugOptions().recompute_plan() == Recompute()


def test_a_bad_budget_is_refused_when_the_options_are_made():
    with pytest.raises(ValueError, match="fraction"):
        DebugOptions(recompute="lots")
