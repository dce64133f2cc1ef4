"""Fallback to PyTorch (warned once, with the reason), the switch that turns it off, and DebugOptions."""

from __future__ import annotations

import copy
import warnings

import onnx
import pytest
import torch

from onnxtrain import DebugOptions, LogLevel, ORTModule
from onnxtrain.autodiff import UnsupportedOpError
from onnxtrain.autodiff.rules import REGISTRY
from onnxtrain.capture import export as capture_export
from tests.ortmodule import models


class WithDeterminant(torch.nn.Module):
    """``torch.linalg.det`` exports to ONNX ``Det``, which has no gradient rule."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 9)

    def forward(self, x):
        return torch.linalg.det(self.fc(x).reshape(-1, 3, 3)).sum()


def test_the_module_chosen_needs_an_op_without_rule():
    assert REGISTRY.lookup("", "Det", 18) is None


def test_missing_rule_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    torch.manual_seed(0)
    reference = WithDeterminant()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="falls back to PyTorch") as caught:
        out = model(x)
    message = str(caught[0].message)
    assert "Det" in message and "node" in message and "ONNXTRAIN_FALLBACK=0" in message
    out.backward()
    reference(x).backward()
    torch.testing.assert_close(model.module.fc.weight.grad, reference.fc.weight.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        model(x)
    assert "Det" in model.fallback_reason


def test_fallback_off_raises_through_env_and_options(monkeypatch):
    x = torch.randn(4, 3)
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    with pytest.raises(UnsupportedOpError, match="Det"):
        ORTModule(WithDeterminant())(x)
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    with pytest.raises(UnsupportedOpError, match="Det"):
        ORTModule(WithDeterminant(), DebugOptions(fallback=False))(x)


def test_export_error_falls_back(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")

    model = ORTModule(models.Unexportable())
    # torch.export fails at the numpy call; the TorchScript trace warns that it freezes the example there
    with pytest.warns(UserWarning, match="falls back to PyTorch.*(ExportError|TraceDependsOnExample)"):
        out = model(torch.ones(1, 2))
    assert out.shape == (1, 2)


def test_torchscript_exporter_is_tried_when_dynamo_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("dynamo is broken here")

    monkeypatch.setattr(capture_export, "_export_dynamo", broken)
    torch.manual_seed(0)
    reference = models.MLP()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(5, 16)
    with pytest.warns(UserWarning, match="TorchScript exporter was used.*dynamo is broken here"):
        out = model(x)
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.module.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-4, atol=1e-6)
    model(torch.randn(9, 16))  # the TorchScript graph has dynamic axes too
    assert model.export_count == 1


def test_save_onnx_writes_every_graph(tmp_path):
    options = DebugOptions(log_level=LogLevel.WARNING, save_onnx=True, onnx_prefix="mlp", save_path=str(tmp_path))
    model = ORTModule(models.MLP(), options)
    model(torch.randn(3, 16)).sum().backward()
    names = sorted(p.name for p in tmp_path.iterdir())
    for kind in ("exported", "inference", "training", "forward", "backward"):
        assert any(n.startswith("mlp_") and n.endswith(f"_{kind}.onnx") for n in names), (kind, names)
    for path in tmp_path.iterdir():
        onnx.checker.check_model(onnx.load(str(path)))


def test_save_onnx_needs_a_prefix():
    with pytest.raises(ValueError, match="onnx_prefix"):
        DebugOptions(save_onnx=True)


def test_bad_fallback_env_value_is_explained(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "maybe")
    with pytest.raises(ValueError, match="ONNXTRAIN_FALLBACK"):
        DebugOptions()


def test_batchnorm_with_a_cumulative_average_runs_in_pytorch_not_frozen_in_a_graph(monkeypatch):
    """BatchNorm(momentum=None) updates its running statistics by 1 / num_batches_tracked, read as a Python
    float: torch.export stopped there and the TorchScript exporter froze the first step's factor into the
    graph (running mean off by 0.96 after 4 steps). Now ORTModule says why and runs the module in PyTorch."""
    make = lambda: torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6, momentum=None))
    with pytest.raises(capture_export.ExportError, match=r"1: BatchNorm with momentum=None"):
        ORTModule(make(), DebugOptions(fallback=False))(torch.randn(8, 4))

    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    torch.manual_seed(0)
    reference = make()
    model = ORTModule(copy.deepcopy(reference))
    for step in range(4):
        x = torch.randn(8, 4) * (step + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).sum().backward()
        assert step > 0 or any("momentum=None" in str(w.message) for w in caught)
        reference(x).sum().backward()
    torch.testing.assert_close(model.module[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model.module[1].running_var, reference[1].running_var)


def test_a_first_inference_run_that_fails_runs_in_pytorch_and_training_stays_on_the_graphs(monkeypatch):
    """The inference graph is made and first run at the first call without gradients, which may be an eval between
    training steps. Before, a failure there was raised from that call; now those calls run in PyTorch (eager's values
    exactly), with one warning, and training keeps its graphs (gradients as eager's, fallback_reason None)."""
    from onnxtrain.ortmodule.graphs import SchemaGraphs

    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(5, 6)
    made = SchemaGraphs.inference_session

    def failing(graphs):
        session = made(graphs)
        if session.runs == 0:
            def run(inputs):
                raise RuntimeError("the backend failed on its first run")
            session.run = run
        return session

    monkeypatch.setattr(SchemaGraphs, "inference_session", failing)
    for step in range(2):
        for m in (model, reference):
            m(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            got = model(x)
        assert len([w for w in caught if "calls without gradients" in str(w.message)]) == (step == 0)
        with torch.no_grad():
            torch.testing.assert_close(got, reference(x), rtol=0, atol=0)
    assert model.fallback_reason is None
    (entries,) = model._cache.values()
    assert "the backend failed on its first run" in entries[0].inference_refused
