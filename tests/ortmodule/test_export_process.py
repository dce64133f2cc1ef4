"""ORTModule's export in a child process (``ONNXTRAIN_EXPORT_PROCESS=spawn``, ortmodule/export_process.py):
the graphs it sends back train as eager PyTorch, what the export changed on the model is changed in the
training process too, a later input schema and a changed guard still export, an export error keeps its class,
and the training process never imports the exporter nor keeps an exported program or IR model."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.capture.export import ExportError
from onnxtrain.ortmodule import DebugOptions, export_process
from onnxtrain.passes.recompute import Recompute

SPAWN = {export_process.EXPORT_PROCESS_ENV: "spawn"}


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def test_a_spawned_export_trains_as_eager_and_sets_what_the_export_changed(monkeypatch):
    monkeypatch.setenv(export_process.EXPORT_PROCESS_ENV, "spawn")
    eager = _bert()
    model = ORTModule(copy.deepcopy(eager), DebugOptions(recompute=0.5))
    assert eager.config.problem_type is None
    ids, labels = torch.randint(0, 100, (4, 16)), torch.tensor([0, 1, 1, 0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for _ in range(2):
        losses = []
        for net, opt in zip((eager, model), opts):
            opt.zero_grad()
            loss = net(input_ids=ids, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for got, want in zip(_grads(model), _grads(eager)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        for opt in opts:
            opt.step()
    assert model.fallback_reason is None
    # Hugging Face's classifier set config.problem_type during the export, in the child: set here too
    assert model.config.problem_type == eager.config.problem_type == "single_label_classification"
    assert model.export_count == 1
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    assert graphs.captured.model is None  # made in the child: no exported IR here
    (training,) = graphs.training.values()
    assert training.recompute.saved_bytes > 0 and all(c.pattern for c in training.recompute.candidates)


def test_a_second_input_signature_and_a_changed_guard_export_and_train_as_eager(monkeypatch):
    monkeypatch.setenv(export_process.EXPORT_PROCESS_ENV, "spawn")
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.LeakyReLU(0.1), torch.nn.Linear(6, 1))
    model = ORTModule(copy.deepcopy(eager))

    def check(x):
        for net in (eager, model):
            net.zero_grad()
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for _ in range(2)]
        want, got = eager(xs[0]).sum(), model(xs[1]).sum()
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(_grads(model), _grads(eager)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        if x.requires_grad:
            torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-6)

    check(torch.randn(4, 5))
    check(torch.randn(3, 5).requires_grad_())  # another schema (the input takes a gradient): another child
    assert model.export_count == 2
    assert all(g.captured.model is None for entries in model._cache.values() for g in entries)
    for net in (eager, model.module):
        net[1].negative_slope = 0.3  # a guarded value: the graph holds 0.1, so it exports again (here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        check(torch.randn(4, 5))
    assert model.export_count == 3 and model.fallback_reason is None


def test_an_export_error_keeps_its_class_and_message():
    error = export_process._error("onnxtrain.capture.export", "ExportError", "the forward returns a set")
    assert type(error) is ExportError and str(error) == "the forward returns a set"
    other = export_process._error("no_such_module", "Oops", "it broke")
    assert isinstance(other, export_process.ChildExportError) and str(other) == "Oops: it broke"


def test_what_keeps_the_export_in_this_process(monkeypatch):
    cls = type("Local", (torch.nn.Linear,), {"__module__": "__main__"})
    model = ORTModule(cls(2, 2))
    assert "__main__" in export_process.why_not(model, [torch.randn(1, 2)])
    assert export_process.why_not(ORTModule(torch.nn.Linear(2, 2)), [torch.randn(1, 2)]) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in export_process.why_not(ORTModule(torch.nn.Linear(2, 2)), [torch.randn(1, 2)])
    monkeypatch.setenv(export_process.EXPORT_PROCESS_ENV, "fork")
    with pytest.raises(ValueError, match="spawn"):
        export_process.decide(None, Recompute())


def test_debug_options_choose_the_child_over_the_environment(monkeypatch):
    """``DebugOptions(export_process=...)`` decides where the environment says otherwise; a bad value is refused
    when the options are made. (The child is stood in for: it records the call and declines, so the export
    runs here and trains as eager.)"""
    asked = []

    def declined(ortmodule, args, kwargs, tensors):
        asked.append(type(ortmodule.module).__name__)
        raise export_process.ChildUnavailable("declined by the test")

    monkeypatch.setattr(export_process, "export", declined)
    x = torch.randn(3, 4)
    for option, env, child in (("spawn", "0", True), ("in-process", "spawn", False), (None, "spawn", True),
                               (None, "0", False)):
        monkeypatch.setenv(export_process.EXPORT_PROCESS_ENV, env)
        asked.clear()
        torch.manual_seed(0)
        eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model = ORTModule(copy.deepcopy(eager), DebugOptions(export_process=option))
        for net in (eager, model):
            net(x).sum().backward()
        assert asked == (["Sequential"] if child else []), (option, env)
        assert model.fallback_reason is None and model.export_count == 1
        for got, want in zip(_grads(model), _grads(eager)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="export_process"):
        DebugOptions(export_process="fork")


def test_a_memory_budget_exports_in_a_child_by_default(monkeypatch, caplog):
    """With neither the option nor the environment set, a schema's first export runs in the child where the
    recompute plan asks for memory savings (a budget, patterns; the option or ONNX Runtime
    Training's variables), in this process otherwise; one INFO line says which and why. (The child is stood in
    for as above: it declines, the export runs here and trains as eager.)"""
    asked = []

    def declined(ortmodule, args, kwargs, tensors):
        asked.append(type(ortmodule.module).__name__)
        raise export_process.ChildUnavailable("declined by the test")

    monkeypatch.setattr(export_process, "export", declined)
    monkeypatch.delenv(export_process.EXPORT_PROCESS_ENV, raising=False)
    x = torch.randn(3, 4)
    cases = [({"recompute": 0.5}, {}, True, "a memory budget is set (recompute budget 0.5)"),
             ({"recompute": "300MB"}, {}, True, "recompute budget 300000000"),
             ({}, {"ORTMODULE_MEMORY_OPT_LEVEL": "1"}, True, "recompute budget 0.0"),
             ({}, {"ORTMODULE_MEMORY_OPT_CONFIG": "Gelu+:1:-1"}, True, "recompute patterns ['Gelu+']"),
             ({}, {}, False, "no memory budget is set"),
             ({"recompute": "off"}, {}, False, "no memory budget is set"),
             ({"recompute": 0.5, "export_process": "in-process"}, {}, False,
              "DebugOptions(export_process=...) is 'in-process'"),
             ({"export_process": "auto"}, {export_process.EXPORT_PROCESS_ENV: "spawn"}, False,
              "no memory budget is set")]
    for options, env, child, why in cases:
        for name in ("ORTMODULE_MEMORY_OPT_LEVEL", "ORTMODULE_MEMORY_OPT_CONFIG"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        asked.clear()
        caplog.clear()
        torch.manual_seed(0)
        eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model = ORTModule(copy.deepcopy(eager), DebugOptions(log_level="INFO", **options))
        with caplog.at_level(logging.INFO, logger="onnxtrain.ortmodule"):
            for net in (eager, model):
                net(x).sum().backward()
        assert asked == (["Sequential"] if child else []), (options, env)
        lines = [r.getMessage() for r in caplog.records if "process:" in r.getMessage()]
        where = "in a child process" if child else "in this process"
        start = f"exporting Sequential for a new input schema (s0_0) {where}: "
        assert len([line for line in lines if line.startswith(start)]) == 1, lines
        assert any(why in line for line in lines), (why, lines)
        assert model.fallback_reason is None and model.export_count == 1
        for got, want in zip(_grads(model), _grads(eager)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_child_builds_the_graphs_this_process_would(monkeypatch):
    """The same model and batch under a budget, exported by default (in the child) and in this process: the same
    backward graph, the same recompute plan, and bitwise the same losses and gradients over two steps."""
    monkeypatch.delenv(export_process.EXPORT_PROCESS_ENV, raising=False)
    ids, labels = torch.randint(0, 100, (4, 16)), torch.tensor([0, 1, 1, 0])
    runs = {}
    for mode in (None, "in-process"):
        model = ORTModule(_bert(), DebugOptions(recompute=0.25, export_process=mode))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        values = []
        for _ in range(2):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            values += [loss.detach().clone(), *[g.clone() for g in _grads(model)]]
            opt.step()
        (graphs,) = [g for entries in model._cache.values() for g in entries]
        (training,) = graphs.training.values()
        plan = training.recompute
        runs[mode] = (graphs.captured.model is None, values, training.backward_proto.SerializeToString(),
                      (plan.stashed_bytes, plan.saved_bytes, plan.kept_bytes,
                       [(c.pattern, c.on) for c in plan.candidates]))
    (child, values, backward, plan), (here, values_here, backward_here, plan_here) = runs[None], runs["in-process"]
    assert child and not here  # the default exported in the child, the option here
    assert backward == backward_here
    assert plan == plan_here
    assert len(values) == len(values_here)
    for got, want in zip(values, values_here):
        assert torch.equal(got, want)


_SCRIPT = textwrap.dedent("""
    import copy, gc, sys
    import torch
    from onnxtrain import ORTModule
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    for net in (eager, model):
        net(x).sum().backward()
    gc.collect()
    import onnx_ir
    alive = sorted({type(o).__name__ for o in gc.get_objects()
                    if isinstance(o, onnx_ir.Model) or type(o).__name__ == "ExportedProgram"})
    heavy = [m for m in ("onnxscript", "torch.onnx._internal.exporter._core", "onnxtrain.capture.export")
             if m in sys.modules]
    same = all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
               for p, q in zip(eager.parameters(), model.parameters()))
    print("RESULT", model.export_count, model.fallback_reason, heavy, alive, same)
""")


def test_the_training_process_never_imports_the_exporter():
    import os

    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=False,
                         env={**os.environ, **SPAWN}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert line == "RESULT 1 None [] [] True", out.stderr[-3000:]


def test_the_childs_log_records_reach_this_process_loggers(monkeypatch, caplog):
    """What the export logs in the child (the recompute plan, on ``onnxtrain.passes``) is logged by this process's
    loggers, so that their levels and handlers (here pytest's) take it as an in-process export's; the child's own
    line on where it exports is left out (this process logs that line)."""
    monkeypatch.delenv(export_process.EXPORT_PROCESS_ENV, raising=False)
    ids, labels = torch.randint(0, 100, (4, 16)), torch.tensor([0, 1, 1, 0])
    model = ORTModule(_bert(), DebugOptions(recompute=0.5, log_level="INFO"))
    with caplog.at_level(logging.INFO, logger="onnxtrain"):
        model(input_ids=ids, labels=labels).loss.backward()
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert [m for name, m in messages if m.startswith("recompute plan:")], messages
    assert [name for name, m in messages if m.startswith("recompute plan:")] == ["onnxtrain.passes"]
    exporting = [m for _, m in messages if m.startswith("exporting BertForSequenceClassification")]
    assert len(exporting) == 1 and "in a child process: a memory budget is set" in exporting[0], exporting
