"""ORTModule on OpenVINO where its CPU plugin cannot compile a graph: decided before the graph runs, that mode runs
in PyTorch with a one-line reason naming the node, never an OpenVINO error in the middle of the user's script.

The graph the plugin refuses here is a ``Squeeze`` of dynamic rank (``squeeze()`` without dims, which OpenVINO
cannot resolve: its output rank depends on which sizes are 1), made by turning off the pass that gives such a
Squeeze its axes (passes/squeeze_axes.py) for the cases it cannot handle. Each test compares with eager PyTorch
under the same autocast.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.passes import squeeze_axes
from onnxtrain.runtime import backends

bf16_runs = pytest.mark.skipif(not (backends.openvino_installed() and backends.openvino_has_bf16()),
                               reason="autocast bfloat16 needs onnxtrain[openvino] and a CPU with bfloat16")


class _SqueezeAll(torch.nn.Module):
    """``squeeze()`` over ``[N, S, 8]`` with both sizes dynamic: at the traced sizes (never 1) it removes nothing."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).squeeze().sum(-1)


def _step(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def _no_grad(model, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


def _graphs(model):
    (entries,) = model._cache.values()
    return entries[0]


def _kinds(model) -> set[str]:
    """The session kinds of every graph made, training and inference."""
    kinds = set()
    for entries in model._cache.values():
        for graphs in entries:
            if graphs.inference is not None:
                kinds.add(type(graphs.inference._session).__name__)
            for training in graphs.training.values():
                kinds.add(type(training.forward._session).__name__)
                if training.fused is not None:
                    kinds.add(type(training.fused.session._session).__name__)
    return kinds


def _trains_on_openvino_near_eager(model, reference, x, grad_tolerance=2e-2):
    """One step of each under autocast bf16: the model's on OpenVINO only, its output and gradients near eager's."""
    out, grads = _step(model, x)
    want_out, want = _step(reference, x)
    assert model.fallback_reason is None and _kinds(model) == {"OpenVINOSession"}
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=grad_tolerance, atol=grad_tolerance)


def _unresolved(monkeypatch):
    """Squeezes without axes stay so in the graphs for OpenVINO: a node its CPU plugin refuses."""
    monkeypatch.setattr(squeeze_axes, "_axes", lambda node: None)


@bf16_runs
def test_a_squeeze_that_removes_no_axis_runs_on_openvino(monkeypatch):
    """Before, the training graph fell back (OpenVINO's error) and the call under ``torch.no_grad()`` raised it;
    now the Squeeze becomes an Identity (exact: the traced sizes are never 1) and both run on OpenVINO, near
    eager autocast (fallback off: an error would fail the test)."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    torch.manual_seed(0)
    reference = _SqueezeAll()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(6, 5, 8)
    got = _no_grad(model, x)
    torch.testing.assert_close(got.float(), _no_grad(reference, x).float(), rtol=2e-2, atol=2e-2)
    _trains_on_openvino_near_eager(model, reference, x)


@bf16_runs
def test_an_inference_graph_openvino_refuses_runs_in_pytorch_between_training_steps(monkeypatch):
    """An eval call under ``torch.no_grad()`` between training steps makes the inference graph. Before, OpenVINO's
    compile error was raised from that call; now those calls run in PyTorch (eager's values exactly), with one
    warning naming the node, and training keeps running on the OpenVINO graphs it had."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    torch.manual_seed(0)
    reference = _SqueezeAll()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(6, 5, 8)
    _step(model, x)
    _step(reference, x)
    _unresolved(monkeypatch)  # the training graphs are made: only the inference graph keeps the Squeeze
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _no_grad(model, x)
        again = _no_grad(model, x)
    messages = [str(w.message) for w in caught if "ORTModule" in str(w.message)]
    assert len(messages) == 1, messages
    assert "calls without gradients" in messages[0] and "Squeeze 'node_squeeze'" in messages[0].splitlines()[0]
    assert _graphs(model).inference_refused is not None and "\n" not in _graphs(model).inference_refused
    want = _no_grad(reference, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    out, grads = _step(model, x)  # still on OpenVINO: near eager autocast, not equal to it
    want_out, want_grads = _step(reference, x)
    assert model.fallback_reason is None and _kinds(model) == {"OpenVINOSession"}
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=2e-2)


@bf16_runs
def test_an_inference_graph_openvino_refuses_raises_the_reason_with_fallback_off(monkeypatch):
    from onnxtrain.ortmodule.graphs import BackendRefusal

    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    _unresolved(monkeypatch)
    model = ORTModule(_SqueezeAll())
    with pytest.raises(BackendRefusal, match=r"inference graph: .*Squeeze 'node_squeeze'"):
        _no_grad(model, torch.randn(6, 5, 8))


@bf16_runs
def test_a_training_graph_openvino_refuses_falls_back_with_one_line_naming_the_node(monkeypatch):
    """Decided on the joint graph when the training graphs are built (the forward, the fused call and every
    backward graph are cut from it; a backward graph compiles only at its first backward): the step is eager's
    exactly, and the reason is one line naming the node (before: OpenVINO's multi-line compile error)."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    _unresolved(monkeypatch)
    torch.manual_seed(0)
    reference = _SqueezeAll()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(6, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, grads = _step(model, x)
    reason = model.fallback_reason
    assert reason is not None and "\n" not in reason, reason
    assert "training graph" in reason and "Squeeze 'node_squeeze'" in reason, reason
    want_out, want = _step(reference, x)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0)


@bf16_runs
def test_a_backward_graph_openvino_refuses_falls_back_before_the_forward_runs(monkeypatch):
    """A node OpenVINO refuses in the backward graph only (here a Squeeze without axes put on the input's gradient,
    whose batch size is dynamic, of a linear layer), with the forward and the loss's gradients as two graphs: before, the forward ran
    and the backward graph failed to compile at the first backward, OpenVINO's error raised from
    ``loss.backward()`` after the outputs were used; now the joint graph is refused when the graphs are built, and
    the step is eager's exactly."""
    import onnx_ir as ir

    from onnxtrain.ortmodule import graphs as graphs_module

    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    monkeypatch.setenv("ONNXTRAIN_FUSED_STEP", "0")
    _unresolved(monkeypatch)
    differentiate = graphs_module.add_gradient_outputs

    def squeezed_input_gradient(model, wrt, *args, **kwargs):
        differentiate(model, wrt, *args, **kwargs)
        k = len(model.graph.outputs) - len(wrt)  # the gradients come last, in wrt's order: the input's first
        grad = model.graph.outputs[k]
        squeeze = ir.Node("", "Squeeze", [grad], name="backward_only")
        squeeze.outputs[0].name, squeeze.outputs[0].type, squeeze.outputs[0].shape = "squeezed", grad.type, grad.shape
        model.graph.append(squeeze)
        model.graph.outputs[k] = squeeze.outputs[0]

    monkeypatch.setattr(graphs_module, "add_gradient_outputs", squeezed_input_gradient)
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 8)  # no Squeeze in the forward
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(6, 5, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
    reason = model.fallback_reason
    # OpenVINO names the op that makes a graph output by that output
    assert reason is not None and "\n" not in reason and "Squeeze 'squeezed'" in reason, reason
    x_ref = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(x_ref)
    want.float().square().mean().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.skipif(not backends.openvino_installed(), reason="needs onnxtrain[openvino]")
def test_openvino_errors_are_one_line():
    from onnxtrain.runtime.openvino import one_line

    error = RuntimeError("Exception from src/inference/src/cpp/core.cpp:117:\nException from src/plugin.cpp:54:\n"
                         "Check '!shape.rank().is_dynamic()' failed at src/node.cpp:108:\nUnexpected: CPU plug-in "
                         "doesn't support Squeeze operation with dynamic rank. Operation name: node_squeeze\n\n\n")
    assert one_line(error) == ("Unexpected: CPU plug-in doesn't support Squeeze operation with dynamic rank. "
                               "Operation name: node_squeeze")


class _Pooled(torch.nn.Module):
    """A convolution, then average pooling (its gradient convolves with a kernel of ones, and with
    ``count_include_pad=False`` its window counts are a convolution of ones too), then a linear layer."""

    def __init__(self, pool: torch.nn.Module, dims: int):
        super().__init__()
        conv = torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d
        self.conv, self.pool = conv(3, 4, 3, padding=1), pool
        self.head = torch.nn.LazyLinear(5)

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


@bf16_runs
@pytest.mark.parametrize("pool, shape", [
    (torch.nn.AvgPool2d(2), (2, 3, 8, 8)),
    (torch.nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), (2, 3, 8, 8)),
    (torch.nn.AvgPool1d(3, stride=2, padding=1), (2, 3, 12)),
], ids=["2d", "2d-padded-exclusive", "1d-padded"])
@pytest.mark.parametrize("fused", ["1", "0"])
def test_average_pooling_trains_on_openvino(pool, shape, fused, monkeypatch):
    """Average pooling's gradient convolves with a constant kernel of ones whose shape the graph did not state:
    the dynamic-kernel check refused every such training graph ("no convolution with a kernel of dynamic size,
    which 'node_avg_pool2d_Grad/Conv' is"), and the model ran in PyTorch. Now the kernel's shape is in the graph
    and the step runs on OpenVINO (fallback off: a refusal fails the test), near eager autocast."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    monkeypatch.setenv("ONNXTRAIN_FUSED_STEP", fused)
    torch.manual_seed(0)
    x = torch.randn(*shape)
    reference = _Pooled(pool, len(shape) - 2)
    reference(x)  # the lazy layer takes its size
    model = ORTModule(copy.deepcopy(reference))
    _trains_on_openvino_near_eager(model, reference, x, grad_tolerance=3e-2)


class _TwoOutputs(torch.nn.Module):
    """Two differentiable outputs of which a step uses one (its backward graph without the other's gradient:
    passes/zero_inputs.py), LayerNorm and GELU (row sums and erf), a linear layer used transposed."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.inp(x)))
        return self.out(h), h.sum(-1)


@bf16_runs
def test_the_backward_pipeline_adds_nothing_openvino_refuses(monkeypatch):
    """The refusal check reads the joint graph; a backward graph is cut from it, then pruned of absent output
    gradients, rewritten by the backward pipeline (row sums as products, transposed products) and staged, and
    compiled at its first backward, too late to fall back. Those steps only remove nodes or add ones of known
    rank and no convolution (docs/design.md, "OpenVINO refusals"); here each runs (an absent gradient, a recompute
    budget that stages backward) and the stages compile and train, with fallback off."""
    from onnxtrain.ortmodule import graphs as graphs_module
    from onnxtrain.ortmodule.options import DebugOptions

    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    monkeypatch.setenv("ONNXTRAIN_FUSED_STEP", "0")
    monkeypatch.setattr(graphs_module, "MIN_STAGE_BYTES", 0)  # stages even for this small model
    torch.manual_seed(0)
    reference = _TwoOutputs()
    model = ORTModule(copy.deepcopy(reference), debug_options=DebugOptions(recompute=0.0))
    x = torch.randn(6, 5, 8)
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = m(x)
        y.float().square().mean().backward()
    assert model.fallback_reason is None and _kinds(model) == {"OpenVINOSession"}
    (training,) = _graphs(model).training.values()
    assert list(training._backward) == [(True, False)]  # the second output's gradient absent: pruned
    (staged,) = training._backward.values()
    assert staged is not None and staged.num_stages > 1
    assert {type(s._session).__name__ for s in staged.sessions} == {"OpenVINOSession"}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2)
