"""detach(), detach_() and torch.no_grad() blocks stop gradients under ORTModule as they do in PyTorch."""

from __future__ import annotations

import copy

import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.capture import export as capture_export


class Detaches(torch.nn.Module):
    """Every way a value leaves the gradient: detach(), detach_() on a fresh tensor and on a computed one,
    a no_grad block (whose result is also returned), and the same parameters used with gradients too."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            gate = self.b(x).sigmoid()
        frozen = self.b(h)
        frozen.detach_()  # in place: later uses of frozen are detached too
        scale = torch.ones(1).detach_()
        loss = (h * gate + h.detach() * self.b(x) + frozen * h * scale).sum()
        return loss, gate


def test_gradients_do_not_flow_through_detach_or_no_grad_and_match_pytorch(monkeypatch):
    decomposed = []
    original = capture_export._needs_decomposition
    monkeypatch.setattr(capture_export, "_needs_decomposition",
                        lambda program, registry: decomposed.append(original(program, registry)) or decomposed[-1])
    torch.manual_seed(0)
    reference = Detaches()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        (loss, gate), (want_loss, want_gate) = model(x), reference(x)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gate, want_gate)
        assert not gate.requires_grad
        loss.backward()
        want_loss.backward()
    for (name, p), q in zip(reference.named_parameters(), model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert model.export_count == 1
    assert decomposed == [False]  # the no_grad block was inlined: no decomposition re-trace


def test_inputs_detached_inside_the_module_get_no_gradient():
    class UsesDetachedInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x, y):
            return (x * self.w + y.detach() * x).sum()

    torch.manual_seed(0)
    reference = UsesDetachedInput()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    grads = []
    x0, y0 = torch.randn(3, 4), torch.randn(3, 4)
    for m in (model, reference):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        m(x, y).backward()
        grads.append((x.grad, y.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    assert grads[0][1] is None and grads[1][1] is None
