"""Python values a forward reads from its modules are constants in the exported graph: a change gives a new
graph (or, past a limit, PyTorch with the reason), never a stale one (ortmodule/guards.py)."""

from __future__ import annotations

import copy
import dataclasses
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


class Act(torch.nn.Module):
    """A forward that calls a submodule and a function kept as an attribute."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.act = torch.nn.ReLU()
        self.fn = torch.sin

    def forward(self, x):
        return self.fn(self.act(self.fc(x))).pow(2).sum()


def _train_alongside(eager, model, opt_e, opt_m, x, change, steps=3):
    """Steps of both, with ``change(net)`` applied to each before the second; losses and parameters equal."""
    for k in range(steps):
        if k == 1:
            change(eager)
            change(model.module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _step(model, opt_m, x)
        torch.testing.assert_close(got, _step(eager, opt_e, x), rtol=1e-5, atol=1e-6)
        _close(model, eager)


@pytest.mark.parametrize("change", [
    lambda net: setattr(net, "act", torch.nn.Tanh()),  # a parameter-free submodule replaced
    lambda net: setattr(net, "fn", torch.cos),  # a function kept as an attribute replaced
    lambda net: net.fc.register_forward_hook(lambda m, args, out: out * 2),  # a forward hook added
    lambda net: net.act.register_forward_pre_hook(lambda m, args: (args[0] - 0.1,)),
], ids=["submodule", "function", "forward_hook", "forward_pre_hook"])
def test_what_export_traced_through_is_guarded_like_a_value(change):
    eager, model, opt_e, opt_m = _pair(Act)
    _train_alongside(eager, model, opt_e, opt_m, torch.randn(5, 3), change)
    assert model.export_count == 2 and model.fallback_reason is None


def test_a_removed_forward_hook_goes_back_to_the_first_graph():
    model = ORTModule(Act())
    x = torch.randn(5, 3)
    plain = model(x)
    handle = model.module.fc.register_forward_hook(lambda m, args, out: out * 2)
    with pytest.warns(UserWarning, match=r"again: .*fc's hooks"):
        hooked = model(x)
    assert not torch.allclose(hooked, plain)
    handle.remove()
    torch.testing.assert_close(model(x), plain)
    assert model.export_count == 2


def test_a_module_appended_to_a_sequential_is_run():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    model = ORTModule(copy.deepcopy(eager))
    opt_e, opt_m = (torch.optim.SGD(n.parameters(), lr=0.1) for n in (eager, model))
    head = torch.nn.Linear(4, 2)

    def loss_of(net):
        return lambda x: net(x).pow(2).sum()

    x = torch.randn(5, 3)
    for k in range(3):
        if k == 1:
            eager.append(copy.deepcopy(head))
            model.module.append(copy.deepcopy(head))
        for net, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss_of(net)(x).backward()
            opt.step()
        _close(model, eager)
    assert model.export_count == 2 and model.fallback_reason is None


@pytest.mark.parametrize("where", ["submodule", "wrapped", "pre", "after_first_step"])
def test_a_module_backward_hook_runs_the_module_in_pytorch(where, monkeypatch):
    # The hook changes the gradient: were it skipped inside the graph, fc.weight's gradient would differ.
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")

    def register(net):
        if where == "wrapped":
            return net.register_full_backward_hook(lambda m, gin, gout: None)  # observes only
        if where == "pre":
            return net.act.register_full_backward_pre_hook(lambda m, gout: (gout[0] * 3,))
        return net.act.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 3,))

    eager, model, opt_e, opt_m = _pair(Act)
    if where != "after_first_step":
        register(eager), register(model.module)
    _train_alongside(eager, model, opt_e, opt_m, torch.randn(5, 3),
                     register if where == "after_first_step" else (lambda net: None))
    assert model.fallback_reason is not None and "backward hook" in model.fallback_reason
    assert ("the wrapped module" if where == "wrapped" else "submodule 'act'") in model.fallback_reason


TEMPERATURE = 1.0  # a module-level value the forward below reads: a constant in its graph


class Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)

    def forward(self, x):
        return (self.fc(x) / TEMPERATURE).tanh().pow(2).sum()


def test_a_changed_global_the_forward_reads_gives_a_graph_of_its_own(monkeypatch):
    eager, model, opt_e, opt_m = _pair(Tempered)
    x = torch.randn(5, 3)

    def warmer(net):
        monkeypatch.setitem(globals(), "TEMPERATURE", 4.0)

    _train_alongside(eager, model, opt_e, opt_m, x, warmer)
    assert model.export_count == 2 and model.fallback_reason is None
    monkeypatch.setitem(globals(), "TEMPERATURE", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # back to the first value: the first graph, no export, no warning
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)


@dataclasses.dataclass
class Options:
    squash: str = "tanh"
    gain: float = 1.0


class Configured(torch.nn.Module):
    """A forward reading its options through a held object, as Hugging Face models read ``self.config``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.options = Options()

    def forward(self, x):
        h = self.fc(x) * self.options.gain
        return (h.tanh() if self.options.squash == "tanh" else h.sigmoid()).pow(2).sum()


def test_a_value_read_through_a_held_object_is_guarded():
    eager, model, opt_e, opt_m = _pair(Configured)
    x = torch.randn(5, 3)
    for squash, gain in (("tanh", 1.0), ("sigmoid", 1.0), ("sigmoid", 3.0)):
        eager.options.squash, eager.options.gain = squash, gain
        model.module.options.squash, model.module.options.gain = squash, gain
        torch.testing.assert_close(_step(model, opt_m, x), _step(eager, opt_e, x), rtol=1e-5, atol=1e-6)
        _close(model, eager)
    assert model.export_count == 3
    with pytest.warns(UserWarning, match=r"options.gain: 3.0 -> 0.5"):
        model.module.options.gain = 0.5
        model(x)


@dataclasses.dataclass(frozen=True)
class FrozenOptions:
    squash: str = "tanh"
    gain: float = 1.0


class FrozenConfigured(Configured):
    def __init__(self):
        super().__init__()
        self.options = FrozenOptions()


def test_a_held_object_replaced_by_another_is_guarded():
    # A frozen dataclass cannot be changed, only replaced: the held object is guarded by identity too.
    eager, model, opt_e, opt_m = _pair(FrozenConfigured)
    x = torch.randn(5, 3)
    for gain in (1.0, 3.0):
        for net in (eager, model.module):
            net.options = dataclasses.replace(net.options, gain=gain)
        torch.testing.assert_close(_step(model, opt_m, x), _step(eager, opt_e, x), rtol=1e-5, atol=1e-6)
        _close(model, eager)
    assert model.export_count == 2 and isinstance(model.module.options, FrozenOptions)
    assert type(model.module.options) is FrozenOptions  # lent a recording class during export only


def _classifier(problem_type):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50, num_labels=3, problem_type=problem_type,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def test_a_hugging_face_problem_type_set_by_the_first_call_and_then_changed_trains_as_pytorch():
    # The classifier's first call sets config.problem_type (None -> multi-label for float labels): the next
    # call traces again from the value it left (as torch.compile recompiles), without a warning, and keeps
    # the first graph, which that trace gives again; a change the user makes later (to regression: an MSE
    # loss) is a new graph, where it was frozen before.
    eager = _classifier(None)
    model = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(1, 50, (2, 8))
    labels = torch.nn.functional.one_hot(torch.randint(0, 3, (2,)), 3).float()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(3):
            model(input_ids=ids, labels=labels).loss.backward()
    assert model.module.config.problem_type == "multi_label_classification" and model.export_count == 1
    assert len(next(iter(model._cache.values()))) == 1  # one graph, its guards from the second trace
    for net in (eager, model.module):
        net.config.problem_type = "regression"
    with pytest.warns(UserWarning, match="config.problem_type: 'multi_label_classification' -> 'regression'"):
        got = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, eager(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    assert model.export_count == 2


def test_a_retrace_that_gives_another_graph_is_a_graph_of_its_own():
    # A forward whose first call changes what it computes later (a one-time warm-up scale): the second
    # trace differs, so the first graph is not reused for it, and every step matches PyTorch.
    eager, model, opt_e, opt_m = _pair(WarmUp)
    x = torch.randn(5, 3)
    for _ in range(3):
        torch.testing.assert_close(_step(model, opt_m, x), _step(eager, opt_e, x), rtol=1e-5, atol=1e-6)
        _close(model, eager)
    assert model.export_count == 2 and model.module.options.gain == 1.0


class WarmUp(Configured):
    def __init__(self):
        super().__init__()
        self.options.gain = None

    def forward(self, x):
        if self.options.gain is None:  # the first call only: doubled, then the gain settles at 1
            x = x * 2
            self.options.gain = 1.0
        return super().forward(x)


def test_a_problem_type_given_in_the_config_exports_once():
    model = ORTModule(_classifier("multi_label_classification"))
    ids = torch.randint(1, 50, (2, 8))
    labels = torch.nn.functional.one_hot(torch.randint(0, 3, (2,)), 3).float()
    for _ in range(3):
        model(input_ids=ids, labels=labels).loss.backward()
    assert model.export_count == 1
