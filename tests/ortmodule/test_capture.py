"""Capture: the translations that spare the exporter its decomposition re-trace, checked against PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.capture import export as capture_export


class UsesTranslatedOps(torch.nn.Module):
    """``Tensor.to`` (dtype and device overloads; BERT's masks use the dtype_layout one, see the HF tests),
    ``&`` on booleans and integers, and ``torch.diff`` with prepend/append, n=2 and on booleans."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x, mask):
        h = self.fc(x)
        keep = (mask > 0) & (h.detach().abs() < 1e6)
        both = mask.to(torch.int64) & (mask + 1).to(x.device, torch.int64)
        h = h * keep.to(dtype=h.dtype, device=h.device) + both.to(torch.float32)
        d2 = torch.diff(h, n=2, dim=1, prepend=h[:, :1], append=h[:, -1:])
        flips = torch.diff(mask > 0, dim=-1).to(h.dtype)
        return d2.sum(dim=1) + flips.sum(dim=1) + torch.diff(h, dim=0).sum()


class UsesSquare(torch.nn.Module):
    """``torch.square`` has no translation: the exporter must decompose it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x, mask):
        return torch.square(self.fc(x)).sum(dim=1) + mask.sum(dim=1)


def _decomposition_record(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    original = capture_export._needs_decomposition

    def record(program, translated):
        seen.append(original(program, translated))
        return seen[-1]

    monkeypatch.setattr(capture_export, "_needs_decomposition", record)
    return seen


@pytest.mark.parametrize("module, decomposed", [(UsesTranslatedOps, False), (UsesSquare, True)])
def test_decomposition_runs_only_when_an_op_needs_it_and_results_match_torch(monkeypatch, module, decomposed):
    seen = _decomposition_record(monkeypatch)
    torch.manual_seed(0)
    reference = module()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    x = torch.randn(4, 6)
    mask = torch.randint(0, 3, (4, 6))
    out, want = model(x, mask), reference(x, mask)
    assert seen == [decomposed]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # other batch sizes reuse the graph
    x2, mask2 = torch.randn(7, 6), torch.randint(0, 3, (7, 6))
    torch.testing.assert_close(model(x2, mask2), reference(x2, mask2), rtol=1e-5, atol=1e-5)
    assert model.export_count == 1
