"""The exporter's type-promotion pass is skipped exactly when it would change nothing."""

from __future__ import annotations

import pytest
import torch
from torch.onnx._internal.exporter import _fx_passes

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.capture import export as capture_export


class Program(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, ids):
        h = self.linear(x)
        if self.kind == "float only":
            return torch.relu(h) * 0.5 + 1.0
        if self.kind == "int times float scalar":
            return h + ids * 0.5
        if self.kind == "bool cumsum":  # GPT-2's position ids from the attention mask
            return h + (ids > 1).cumsum(-1)
        if self.kind == "int true division":
            return h + ids / (ids + 1)
        if self.kind == "float plus int tensor":
            return h + ids
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["float only", "int times float scalar", "bool cumsum", "int true division",
                                  "float plus int tensor"])
def test_the_check_agrees_with_the_pass_and_training_matches_pytorch(kind, monkeypatch):
    answers, changed = [], []
    check = capture_export.needs_type_promotion
    monkeypatch.setattr(capture_export, "needs_type_promotion",
                        lambda gm: answers.append(check(gm)) or True)  # record, then always run the pass
    original = _fx_passes.insert_type_promotion_nodes

    def counting_pass(gm):
        before = sum(len(m.graph.nodes) for m in gm.modules())
        original(gm)
        changed.append(sum(len(m.graph.nodes) for m in gm.modules()) != before)

    monkeypatch.setattr(_fx_passes, "insert_type_promotion_nodes", counting_pass)
    torch.manual_seed(0)
    reference = Program(kind)
    model = ORTModule(Program(kind), DebugOptions(fallback=False))
    model.module.load_state_dict(reference.state_dict())
    x, ids = torch.randn(3, 4), torch.randint(0, 4, (3, 4))
    got, want = model(x, ids), reference(x, ids)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(reference.parameters(), model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    assert answers == changed and len(answers) == 1
    assert answers[0] == (kind != "float only")
