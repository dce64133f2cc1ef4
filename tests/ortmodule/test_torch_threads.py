"""onnxtrain's torch work between OpenVINO graph calls at one OpenMP thread (onnxtrain.runtime.torch_threads).

Where torch runs on libgomp (PyTorch's CPU wheels), ORTModule's backward glue and FusedAdam's update run at one
OpenMP thread on the calling thread once graphs run on OpenVINO, so that no idle torch worker spins into the next
call; the results must be bit for bit those at torch's thread count (FusedAdam's against
``torch.optim.AdamW(fused=True)``), and nothing changes for FusedAdam in eager PyTorch or for other threads.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.optim import FusedAdam
from onnxtrain.optim import fused_adam
from onnxtrain.ortmodule import function
from onnxtrain.runtime import backends, torch_threads

pytestmark = pytest.mark.skipif(not torch_threads._functions(), reason="torch does not run on libgomp here")


@pytest.fixture
def two_threads(monkeypatch):
    """torch at two threads, the process not yet running OpenVINO graphs; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(torch_threads, "_graph_calls", False)
    monkeypatch.setattr(torch_threads, "enabled", True)
    yield
    torch.set_num_threads(before)


def _record_threads(monkeypatch, module, name):
    """Wrap ``module.name`` to record torch's thread count on each call."""
    seen: list[int] = []
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return seen


def _net():
    torch.manual_seed(0)
    # large enough that AdamW's kernel splits every tensor among two threads
    return torch.nn.Sequential(torch.nn.Embedding(3000, 64), torch.nn.Linear(64, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 10))


def _adam_steps(model, optimizer, steps=4):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 3000, (32, 7), generator=g)
        optimizer.zero_grad()
        model(ids).square().mean().backward()
        optimizer.step()


def test_fused_adam_at_one_thread_is_torch_fused_adamw_bit_for_bit(two_threads, monkeypatch):
    torch_threads.note_graph_threads()
    seen = _record_threads(monkeypatch, fused_adam, "_adam_update")
    ours, ref = _net(), _net()
    _adam_steps(ours, FusedAdam(ours.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01))
    _adam_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, fused=True))
    assert seen and set(seen) == {1}, f"FusedAdam's update ran at {seen} threads"
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert torch.get_num_threads() == 2  # restored


def test_fused_adam_in_eager_pytorch_keeps_torchs_threads(two_threads, monkeypatch):
    seen = _record_threads(monkeypatch, fused_adam, "_adam_update")
    model = _net()
    _adam_steps(model, FusedAdam(model.parameters(), lr=1e-2), steps=1)
    assert seen == [2]


def test_other_threads_keep_their_count(two_threads):
    torch_threads.note_graph_threads()
    inside, other = [], []
    entered, leave = threading.Event(), threading.Event()

    def elsewhere():
        entered.wait()
        other.append(torch.get_num_threads())
        leave.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with torch_threads.one_thread():
        inside.append(torch.get_num_threads())
        entered.set()
        leave.wait()
    thread.join()
    assert inside == [1] and other == [2] and torch.get_num_threads() == 2


def test_switched_off_keeps_torchs_threads(two_threads, monkeypatch):
    monkeypatch.setattr(torch_threads, "enabled", False)
    with torch_threads.one_thread():
        assert torch.get_num_threads() == 2


@pytest.mark.skipif(not backends.openvino_installed(), reason="onnxtrain[openvino] not installed")
def test_ortmodule_backward_on_openvino_at_one_thread_gives_the_same_step(two_threads, monkeypatch):
    """BERT-like embeddings (rows added in the backward glue) under autocast bf16 on OpenVINO with FusedAdam:
    the glue and the update at one thread, parameters bit for bit those of the run at two threads."""
    seen = _record_threads(monkeypatch, function, "_add_rows")
    adam_seen = _record_threads(monkeypatch, fused_adam, "_adam_update")
    torch.manual_seed(0)
    eager = _net()
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(torch_threads, "enabled", enabled)
        model = ORTModule(copy.deepcopy(eager), backend="openvino")
        optimizer = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 3000, (32, 7), generator=g)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids).float().square().mean()
            loss.backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert seen[:3] == [1, 1, 1] and seen[3:] == [2, 2, 2], seen
    assert adam_seen[:3] == [1, 1, 1] and adam_seen[3:] == [2, 2, 2], adam_seen
    for a, b in zip(*results):
        assert torch.equal(a, b)
