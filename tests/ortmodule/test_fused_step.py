"""The fused forward + backward call (onnxtrain.ortmodule.fused) against eager PyTorch autograd.

OpenVINO in float32 (``backend="openvino"``), so that outputs and gradients are compared tightly: the fused
path must give what the two-graph path and eager give, for a loss alone, a loss used twice, and outputs
other than the loss taking gradients (the exact path). Fallback is off in this folder (conftest).
"""

from __future__ import annotations

import copy

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.ortmodule import fused
from onnxtrain.ortmodule.graphs import RandomDrawsError
from onnxtrain.ortmodule.options import FUSED_STEP_ENV
from onnxtrain.runtime import backends

pytestmark = pytest.mark.skipif(not backends.openvino_installed(), reason="onnxtrain[openvino] not installed")


class LossNet(torch.nn.Module):
    """An embedding with a padding row, Linear, LayerNorm; returns (loss, logits) as Hugging Face models do."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, padding_idx=0)
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, ids, labels):
        h = self.drop(self.norm(torch.tanh(self.inp(self.emb(ids)))))
        logits = self.out(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (4, 12), generator=g)
    ids[:, -2:] = 0  # padding lookups: their rows get no gradient in PyTorch
    return ids, torch.randint(0, 8, (4, 12), generator=g)


def _training(model: ORTModule):
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    (training,) = graphs.training.values()
    return training


def _compare(objective, steps: int = 2, dropout: float = 0.0, **ort_kwargs):
    """Run ``objective(loss, logits)`` backward and an SGD step ``steps`` times on eager and on ORTModule
    (OpenVINO float32), each from the same RNG state; outputs, gradients and parameters must agree at every
    step."""
    torch.manual_seed(0)
    eager = LossNet(dropout)
    ort = ORTModule(copy.deepcopy(eager), backend="openvino", **ort_kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, ort)]
    for step in range(steps):
        ids, labels = _batch(step)
        results = []
        for model, opt in zip((eager, ort), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # the same dropout masks (passes/dropout_masks.py)
            loss, logits = model(ids, labels)
            objective(loss, logits).backward()
            results.append((loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        (loss_e, logits_e, grads_e), (loss_o, logits_o, grads_o) = results
        torch.testing.assert_close(loss_o, loss_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits_o, logits_e, rtol=1e-5, atol=1e-5)
        assert grads_o.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_o[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)
        assert float(grads_o["emb.weight"][0].abs().max()) == 0.0  # the padding row, as in eager
    return ort


def test_loss_alone_runs_one_call_and_matches_eager():
    model = _compare(lambda loss, logits: loss)
    training = _training(model)
    assert training.fused is not None
    assert not training._backward  # no backward graph was made


def test_loss_used_twice_scales_the_fused_gradients():
    model = _compare(lambda loss, logits: 2 * loss + loss * loss)  # the loss's gradient is 2 + 2 loss, not 1
    assert not _training(model)._backward


def test_two_outputs_both_taking_gradients_take_the_exact_path():
    model = _compare(lambda loss, logits: loss + (logits * logits).mean())
    training = _training(model)
    assert training.fused is not None and list(training._backward) == [(True, True)]


def test_only_the_other_output_taking_a_gradient_takes_the_exact_path():
    model = _compare(lambda loss, logits: logits.square().mean())
    assert (False, True) in _training(model)._backward  # (or the full graph with a zero seed, if unprunable)


def test_switched_off_runs_the_two_graphs(monkeypatch):
    monkeypatch.setenv(FUSED_STEP_ENV, "0")
    model = _compare(lambda loss, logits: loss)
    assert _training(model).fused is None


def test_second_backward_is_refused():
    torch.manual_seed(0)
    model = ORTModule(LossNet(), backend="openvino")
    loss, _ = model(*_batch(0))
    loss.backward(retain_graph=True)
    assert _training(model).fused is not None
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_in_place_change_before_the_exact_path_is_refused():
    """The exact path runs forward again on the saved inputs; autograd refuses them once changed in place."""
    torch.manual_seed(0)
    model = ORTModule(LossNet(), backend="openvino")
    loss, logits = model(*_batch(0))
    with torch.no_grad():
        model.module.inp.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + logits.sum()).backward()


class NoisyNet(LossNet):
    """Noise from ``torch.rand_like``: a random op in the graph, which the engine would draw."""

    def forward(self, ids, labels):
        h = torch.tanh(self.inp(self.emb(ids)))
        logits = self.out(h + 0.01 * torch.rand_like(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def test_not_fused_where_a_second_forward_could_differ_or_on_onnxruntime():
    """A graph that draws random numbers itself is refused before any graph is built (graphs.RandomDrawsError:
    its draws would not be eager's, and OpenVINO's a fixed seed's), so none reaches the fused call."""
    torch.manual_seed(0)
    with pytest.raises(RandomDrawsError, match="RandomUniformLike from aten.rand_like"):
        ORTModule(NoisyNet(), backend="openvino", debug_options=DebugOptions(fallback=False))(*_batch(0))
    assert "draws random numbers" in fused.why_not("openvino", True, [], [], [])
    assert fused.why_not("onnxruntime", False, [], [], []) == "the graphs run on onnxruntime"
    assert "buffers" in fused.why_not("openvino", False, ["bn.running_mean"], [], [])
    assert "0 differentiable outputs are scalars" in fused.why_not("openvino", False, [], [], [])


@pytest.mark.parametrize("objective", ["loss", "loss_and_logits"])
def test_dropout_is_fused_and_draws_eager_masks(objective):
    """Dropout's keep-masks are drawn by torch as eager draws them (passes/dropout_masks.py): the fused call runs,
    and both it and the exact path (a second forward on the saved masks) give eager's loss and gradients."""
    model = _compare((lambda loss, logits: loss) if objective == "loss" else
                     (lambda loss, logits: loss + 0.1 * logits.square().mean()), steps=3, dropout=0.5)
    assert _training(model).fused is not None


def test_the_fused_loss_is_a_log_sum_exp_and_matches_eager():
    """The fused graph's cross-entropy has no LogSoftmax (passes/log_sum_exp_loss.py); loss, logits and
    gradients agree with eager's (``_compare``)."""
    model = _compare(lambda loss, logits: loss)
    ops = {op.get_type_name() for op in _training(model).fused.session._session._model.get_ordered_ops()}
    assert "LogSoftmax" not in ops and "NegativeLogLikelihoodLoss" not in ops  # OpenVINO's names of the ONNX ops
    assert "ReduceMax" in ops


def test_the_loss_gradient_is_read_by_both_products_as_one_row_view(monkeypatch):
    """The fused graph's logits gradient (float32 loss region) is read by the output layer's input gradient and
    weight gradient as one row view (passes/shared_rows.py: OpenVINO converts it to bf16 once); loss, logits
    and gradients agree with eager's (``_compare``)."""
    from onnxtrain.passes.shared_rows import SharedRowsPass

    results = []
    call = SharedRowsPass.call
    monkeypatch.setattr(SharedRowsPass, "call", lambda self, model: results.append(call(self, model)) or results[-1])
    _compare(lambda loss, logits: loss)
    assert any(result.modified for result in results)
