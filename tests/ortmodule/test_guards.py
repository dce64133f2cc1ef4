"""Python values a forward reads from its modules are constants in the exported graph: a change gives a new
graph (or, past a limit, PyTorch with the reason), never a stale one (ortmodule/guards.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.ortmodule.guards import MAX_VARIANTS


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.scale = 0.5

    def forward(self, x):
        return (self.fc(x) * self.scale).tanh().pow(2).sum()


def _step(net, opt, x):
    opt.zero_grad()
    loss = net(x)
    loss.backward()
    opt.step()
    return loss


def _pair(cls):
    """A module, an ORTModule of a copy of it, and an SGD for each."""
    torch.manual_seed(0)
    eager = cls()
    model = ORTModule(copy.deepcopy(eager))
    return eager, model, *(torch.optim.SGD(n.parameters(), lr=0.1) for n in (eager, model))


def _close(model, eager):
    for (name, got), want in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_changed_attribute_gives_a_graph_of_its_own_and_trains_as_pytorch():
    eager, model, opt_e, opt_m = _pair(Scaled)
    x = torch.randn(5, 3)
    for scale in (0.5, 2.0, 0.5):
        if scale != model.module.scale:
            eager.scale = scale
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.module.scale = scale
                got = _step(model, opt_m, x)
        else:
            got = _step(model, opt_m, x)
        torch.testing.assert_close(got, _step(eager, opt_e, x), rtol=1e-5, atol=1e-6)
        _close(model, eager)
    assert not any("again" in str(w.message) for w in caught)  # back to 0.5: the first graph, no export
    assert model.export_count == 2
    assert model.fallback_reason is None


def test_the_re_export_names_the_value_that_changed():
    model = ORTModule(Scaled())
    x = torch.randn(5, 3)
    model(x)
    model.module.scale = 2.0
    with pytest.warns(UserWarning, match=r"exports Scaled again: .*scale: 0.5 -> 2.0"):
        model(x)


def test_setting_an_attribute_on_the_wrapper_sets_it_on_the_wrapped_module():
    torch.manual_seed(0)
    eager = Scaled()
    model = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 3)
    model(x)
    fc = torch.nn.Linear(3, 4)
    for net in (model, eager):
        net.scale = 3.0  # the forward reads self.scale of the wrapped module
        net.fc = copy.deepcopy(fc)  # a new submodule, where the forward looks for it
    assert model.module.scale == 3.0 and model.module.fc is model.fc
    assert [name for name, _ in model.named_children()] == ["module"]
    with pytest.warns(UserWarning, match="again"):
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
    model.note = "mine"  # not an attribute of the wrapped module: the wrapper's own
    assert model.note == "mine" and not hasattr(model.module, "note")


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x)).pow(2).sum()


def test_a_submodule_switched_to_eval_alone_uses_its_running_statistics():
    # Freezing BatchNorm while the rest trains (common in fine-tuning) changes bn.training only.
    eager, model, opt_e, opt_m = _pair(Norm)
    x = torch.randn(6, 3)
    for frozen in (False, True, True):
        if frozen:
            eager.bn.eval()
            model.module.bn.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _step(model, opt_m, x)
        torch.testing.assert_close(got, _step(eager, opt_e, x), rtol=1e-5, atol=1e-5)
        _close(model, eager)
        torch.testing.assert_close(model.module.bn.running_mean, eager.bn.running_mean)
    assert model.export_count == 2 and model.fallback_reason is None


def test_a_value_that_keeps_changing_runs_in_pytorch_with_its_name(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    torch.manual_seed(0)
    eager = Scaled()
    model = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(MAX_VARIANTS + 1):
            model.module.scale = eager.scale = 0.1 * (k + 1)
            torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
    assert model.export_count == MAX_VARIANTS
    assert "keep changing (scale: " in model.fallback_reason


def test_a_counter_kept_by_a_hook_is_not_a_guard():
    # Hooks (DeepSpeed's among them) keep counters on modules and read them; the forward never does.
    inner = Scaled()
    inner.calls = 0

    def count(module, args):
        module.calls = module.calls + 1

    inner.register_forward_pre_hook(count)  # runs while the forward is exported
    model = ORTModule(inner)
    x = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model(x).backward()
            inner.calls += 1  # as a hook on the wrapper would, every step
    assert model.export_count == 1
