"""ORTModule never silently trains a different function than PyTorch: what it cannot run exactly, it runs in
PyTorch, with the reason decided before training starts (issue 15)."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.autodiff.rules import REGISTRY
from onnxtrain.capture import custom_backward
from onnxtrain.capture import export as capture_export
from onnxtrain.ortmodule import declare_forward_gradient


class ReturnsNothingTensor(torch.nn.Module):
    """A forward whose result holds no tensor: ``kind`` None, a string, or a tuple of both."""

    def __init__(self, result):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.result = result

    def forward(self, x):
        self.fc(x)
        return self.result


@pytest.mark.parametrize("result", [None, "done", (None, "done")], ids=["none", "str", "tuple"])
def test_a_forward_without_tensor_outputs_falls_back_and_returns_its_value(monkeypatch, result):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    model = ORTModule(ReturnsNothingTensor(result))
    with pytest.warns(UserWarning, match="returns no tensor"):
        assert model(torch.randn(2, 3)) == result
    assert "returns no tensor" in model.fallback_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(torch.randn(2, 3)) == result  # no second export, no second warning


class Branches(torch.nn.Module):
    """Data-dependent control flow: torch.export refuses it, and a TorchScript trace would freeze the branch
    the first batch takes."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3, bias=False)  # odd in x: -x takes the other branch

    def forward(self, x):
        y = self.fc(x)
        return y if y.sum() > 0 else -y


def test_a_data_dependent_branch_falls_back_and_trains_the_branch_each_batch_takes(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    torch.manual_seed(0)
    reference = Branches()
    model = ORTModule(Branches())
    model.module.load_state_dict(reference.state_dict())
    x = torch.randn(4, 3)
    if reference(x).sum() <= 0:
        x = -x
    with pytest.warns(UserWarning, match="trace depends on the example input.*test_trust.py:.*Python boolean"):
        model(x).sum().backward()
    assert "TraceDependsOnExample" in model.fallback_reason and "\n" not in model.fallback_reason
    reference(x).sum().backward()
    other = -x  # the other branch
    out, want = model(other), reference(other)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(model.module.fc.weight.grad, reference.fc.weight.grad)


class SizeBranches(torch.nn.Module):
    """A Python branch on the batch size: torch.export traces one branch and bounds the size (``[5, oo)``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if x.shape[0] > 4 else y * 3


def test_a_branch_on_a_size_exports_a_graph_per_side_and_trains_each_batchs_branch():
    torch.manual_seed(0)
    reference = SizeBranches()
    model = ORTModule(SizeBranches())
    model.module.load_state_dict(reference.state_dict())
    for rows in (8, 3, 6, 2):  # both sides of the branch, each side twice, after the other side's graph exists
        x = torch.randn(rows, 3)
        out, want = model(x), reference(x)
        torch.testing.assert_close(out, want)
        out.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(model.module.fc.weight.grad, reference.fc.weight.grad)
        assert model.fallback_reason is None
    captured = capture_export.capture(SizeBranches(), (torch.randn(8, 3),), {})
    assert captured.dim_ranges[0][0] == (5, None)  # rows >= 5: the side the example took


CALLS = {"count": 0}


class Counter(torch.nn.Module):
    """Scales by a Python number that changes on every call (kept outside the module, which torch.export
    restores after tracing): the export freezes the value it saw."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        CALLS["count"] += 1
        return self.fc(x) * CALLS["count"]


def _tanh_mlp():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_verify_passes_a_matching_model_and_leaves_gradients_as_one_step_makes_them():
    torch.manual_seed(0)
    reference = _tanh_mlp()
    model = ORTModule(_tanh_mlp(), DebugOptions(verify=True))
    model.module.load_state_dict(reference.state_dict())
    x = torch.randn(5, 3, requires_grad=True)
    model(x).square().sum().backward()
    assert model.fallback_reason is None
    assert model._cache  # ran in onnxruntime
    reference(x).square().sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)  # not doubled by the check


def test_verify_falls_back_naming_the_first_wrong_gradient(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    lookup = REGISTRY.lookup

    def wrong_tanh(domain, op_type, opset):  # a gradient rule with a bug: dy instead of dy * (1 - y^2)
        rule = lookup(domain, op_type, opset)
        if op_type != "Tanh":
            return rule
        return dataclasses.replace(rule, fn=lambda g: (g.dy[0],))

    monkeypatch.setattr(REGISTRY, "lookup", wrong_tanh)
    torch.manual_seed(0)
    reference = _tanh_mlp()
    model = ORTModule(_tanh_mlp(), DebugOptions(verify=True))
    model.module.load_state_dict(reference.state_dict())
    x = torch.randn(5, 3)
    with pytest.warns(UserWarning, match=r"VerificationError: verify: gradient of 0.weight: off by"):
        model(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.module[0].weight.grad, reference[0].weight.grad)  # trained in PyTorch


def test_verify_from_the_environment_catches_a_frozen_python_value(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    monkeypatch.setenv("ONNXTRAIN_VERIFY", "1")
    model = ORTModule(Counter())
    assert model.debug_options.verify
    with pytest.warns(UserWarning, match=r"verify: output output: off by"):
        model(torch.randn(4, 3))
    monkeypatch.setenv("ONNXTRAIN_VERIFY", "maybe")
    with pytest.raises(ValueError, match="ONNXTRAIN_VERIFY='maybe'"):
        DebugOptions()


def test_an_exporter_without_the_stop_gradient_hook_is_not_used_silently(monkeypatch):
    from torch.onnx._internal.exporter import _fx_passes

    from onnxtrain.capture import capture

    monkeypatch.delattr(_fx_passes, "decompose_with_registry")  # as a torch version that renamed it would
    with pytest.warns(UserWarning, match="lacks the hook where onnxtrain marks detach"):
        captured = capture(torch.nn.Linear(3, 2), (torch.randn(4, 3),), {})
    assert captured.exporter == "torchscript"  # which says, in that warning, that it ignores detach()


class DetachWhereTorchExportFails(torch.nn.Module):
    """Where torch.export fails (made to, below), the TorchScript exporter would drop the detach()."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        return y * y.detach()


def test_the_torchscript_exporter_is_refused_where_it_would_drop_a_detach(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    monkeypatch.setattr(capture_export, "_export_dynamo", _broken_dynamo)
    torch.manual_seed(0)
    reference = DetachWhereTorchExportFails()
    model = ORTModule(DetachWhereTorchExportFails())
    model.module.load_state_dict(reference.state_dict())
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"calls detach\(\), which the TorchScript exporter does not keep"):
        model(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.module.fc.weight.grad, reference.fc.weight.grad)


class NoGradBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        with torch.no_grad():
            scale = self.fc(x).abs().mean()
        return self.fc(x) * scale


def test_the_torchscript_exporter_is_refused_where_it_would_drop_a_no_grad_block(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    monkeypatch.setattr(capture_export, "_export_dynamo", _broken_dynamo)
    model = ORTModule(NoGradBlock())
    with pytest.warns(UserWarning, match=r"with gradients off \(a torch.no_grad\(\) block\)"):
        model(torch.randn(4, 3))
    assert model.fallback_reason is not None


def _broken_dynamo(*args, **kwargs):
    raise RuntimeError("dynamo export refused (as for data-dependent control flow)")


class TransposedWeight(torch.nn.Module):
    """A parameter that is a transposed view (``nn.Parameter(w.t())``): not contiguous."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3).t())

    def forward(self, x):
        return (x @ self.w).tanh().pow(2).sum()


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_non_contiguous_parameter_is_read_afresh_at_every_step(backend):
    # The graph reads a contiguous copy of such a parameter; a copy made once would miss the optimizer's
    # in-place updates and train on the first step's weights for ever.
    if backend == "openvino":
        pytest.importorskip("openvino")
    torch.manual_seed(0)
    eager = TransposedWeight()
    model = ORTModule(copy.deepcopy(eager), backend=backend)
    assert not model.w.is_contiguous()
    x = torch.randn(5, 3)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        for net, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            net(x).backward()
            opt.step()
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.w, eager.w, rtol=1e-5, atol=1e-6)
    assert model.fallback_reason is None


class ScalesItsInput(torch.nn.Module):
    """A forward that changes the caller's tensor in place (``x.mul_(2)``), which no ONNX graph does."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x, keep):
        x.mul_(2)
        return self.fc(x + keep).sum()


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_forward_that_changes_its_input_in_place_falls_back_and_changes_it_once(monkeypatch, exporter):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    if exporter == "torchscript":
        monkeypatch.setattr(capture_export, "_export_dynamo", _broken_dynamo)
    torch.manual_seed(0)
    eager = ScalesItsInput()
    model = ORTModule(copy.deepcopy(eager))
    x, keep = torch.randn(2, 3), torch.randn(2, 3)
    x_eager, keep_before = x.clone(), keep.clone()
    with pytest.warns(UserWarning, match=r"changes its input tensor\(s\) \[0\]"):
        loss = model(x, keep)
    want = eager(x_eager, keep)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(x, x_eager)  # doubled once, by the forward that PyTorch ran, as in eager
    torch.testing.assert_close(keep, keep_before)
    assert "changes its input tensor(s) [0]" in model.fallback_reason


class ReverseGradient(torch.autograd.Function):
    """Identity forward, negated gradient (domain-adversarial training's layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class StraightThrough(torch.autograd.Function):
    """Rounding forward, identity backward (quantization-aware training)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomBackward(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 6), torch.nn.Linear(6, 1)
        self.kind = kind

    def forward(self, x):
        h = self.a(x) * 4
        if self.kind == "tensor_hook":
            if h.requires_grad:
                h.register_hook(lambda grad: grad * 10)
        else:
            h = {"reverse": ReverseGradient, "straight_through": StraightThrough}[self.kind].apply(h)
        return self.b(h.tanh()).sum()


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("kind", ["reverse", "straight_through", "tensor_hook"])
def test_a_backward_the_forward_ops_do_not_give_runs_in_pytorch(monkeypatch, kind, exporter):
    # The exporters trace a custom Function's forward and drop its backward (and drop tensor hooks): the
    # graph's gradient would be the forward ops' (zero through round, the wrong sign through the reversal).
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    if exporter == "torchscript":
        monkeypatch.setattr(capture_export, "_export_dynamo", _broken_dynamo)
    torch.manual_seed(0)
    eager = CustomBackward(kind)
    model = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="falls back"):
        model(x).backward()
    eager(x).backward()
    for (name, got), want in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    what = "a hook" if kind == "tensor_hook" else "autograd.Function"
    assert what in model.fallback_reason and "it runs in PyTorch" in model.fallback_reason


def test_a_second_order_backward_is_a_clear_error():
    # A gradient penalty differentiates the gradient; the graph's backward is first order only.
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))
    x = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(model(x).sum(), x)  # first order stays as it was
    assert grad.shape == x.shape and model.fallback_reason is None


class SavingTanh(torch.autograd.Function):
    """tanh that saves its output and differentiates it by hand: its backward is its forward's gradient."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class UsesSavingTanh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 6), torch.nn.Linear(6, 1)

    def forward(self, x):
        return self.b(SavingTanh.apply(self.a(x))).sum()


def test_a_function_declared_to_have_its_forwards_gradient_runs_in_the_graph(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    monkeypatch.setattr(custom_backward, "FORWARD_GRADIENT", set())
    torch.manual_seed(0)
    eager, x = UsesSavingTanh(), torch.randn(4, 3)
    undeclared = ORTModule(copy.deepcopy(eager))
    with pytest.warns(UserWarning, match="falls back"):
        undeclared(x)
    assert "SavingTanh" in undeclared.fallback_reason and "declare_forward_gradient" in undeclared.fallback_reason

    assert declare_forward_gradient(SavingTanh) is SavingTanh
    model = ORTModule(copy.deepcopy(eager))
    model(x).backward()
    eager(x).backward()
    assert model.fallback_reason is None and model.export_count == 1
    for (name, got), want in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    with pytest.raises(TypeError, match="autograd.Function subclass"):
        declare_forward_gradient(torch.nn.Linear)
