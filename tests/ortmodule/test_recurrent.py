"""Recurrent layers through ORTModule: the LSTM/GRU gradients (Scan bodies that read main-graph values)
survive the forward/backward split and match PyTorch."""

import copy

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule


class Tagger(torch.nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(8, 16, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU], ids=["LSTM", "GRU"])
def test_bidirectional_recurrent_gradients_match_torch(cell):
    torch.manual_seed(0)
    model = Tagger(cell)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, DebugOptions(fallback=False))
    x, labels = torch.randn(4, 5, 8), torch.randint(0, 3, (4,))
    for m in (reference, wrapped):
        torch.nn.functional.cross_entropy(m(x), labels).backward()
    for (name, want), (_, got) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # a new sequence length reuses the graphs
    torch.nn.functional.cross_entropy(wrapped(torch.randn(2, 9, 8)), labels[:2]).backward()
    assert wrapped.export_count == 1
