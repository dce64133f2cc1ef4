"""Backward in stages (``ONNXTRAIN_BACKWARD_STAGES``): the gradients stay PyTorch's, the stash is freed."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.ortmodule import function
from onnxtrain.ortmodule import graphs as graphs_module
from onnxtrain.ortmodule.options import BACKWARD_STAGES_ENV, backward_stages
from tests.ortmodule import models
from tests.ortmodule.conftest import trainings


@pytest.fixture
def any_size_stages(monkeypatch):
    """Cut stages for the test models' small stashes too."""
    monkeypatch.setattr(graphs_module, "MIN_STAGE_BYTES", 0)


@pytest.mark.parametrize("make, classify", [(models.bert, True), (models.gpt2, False)])
@pytest.mark.parametrize("stages", [1, 3])
def test_staged_backward_matches_eager(any_size_stages, monkeypatch, make, classify, stages):
    monkeypatch.setenv(BACKWARD_STAGES_ENV, str(stages))
    torch.manual_seed(0)
    reference = make()
    model = ORTModule(copy.deepcopy(reference))
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step reuses the sessions the first one made
        inputs = models.text_batch(3, 16, classify=classify, generator=generator)
        for m in (model, reference):
            m.zero_grad()
            m(**inputs).loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=name)
    (training,) = trainings(model)
    (session,) = training._backward.values()
    assert session.num_stages == stages


def test_the_stash_is_freed_while_backward_runs(any_size_stages, monkeypatch):
    """With 3 stages, the stashed values the first stage reads last are gone when the last stage runs."""
    monkeypatch.setenv(BACKWARD_STAGES_ENV, "3")
    torch.manual_seed(0)
    model = ORTModule(models.bert())
    refs: list[weakref.ref] = []
    forward = function.ORTFunction.forward

    def remembering(ctx, *args):
        out = forward(ctx, *args)
        refs.extend(weakref.ref(t) for t in ctx.stashed)
        return out

    monkeypatch.setattr(function.ORTFunction, "forward", staticmethod(remembering))
    inputs = models.text_batch(3, 16, classify=True)
    model(**inputs).loss.backward()  # makes the sessions
    refs.clear()
    loss = model(**inputs).loss
    (training,) = trainings(model)
    (session,) = training._backward.values()
    alive = []
    last = session.sessions[-1]
    run = last.run
    monkeypatch.setattr(last, "run", lambda feeds: (alive.append(sum(r() is not None for r in refs)), run(feeds))[1])
    loss.backward()
    assert len(refs) > 10
    assert 0 < alive[0] < len(refs), f"{alive[0]} of {len(refs)} stashed values alive in the last stage"
    assert all(r() is None for r in refs)  # and all of them after backward


def test_the_environment_variable_is_checked(monkeypatch):
    monkeypatch.delenv(BACKWARD_STAGES_ENV, raising=False)
    assert backward_stages() == 4 and backward_stages(budget=True) == 8
    monkeypatch.setenv(BACKWARD_STAGES_ENV, "2")
    assert backward_stages() == 2 and backward_stages(budget=True) == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(BACKWARD_STAGES_ENV, bad)
        with pytest.raises(ValueError, match=BACKWARD_STAGES_ENV):
            backward_stages()


def test_a_second_backward_through_the_same_graph_says_why_it_cannot():
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()))
    y = model(torch.randn(2, 4)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()
