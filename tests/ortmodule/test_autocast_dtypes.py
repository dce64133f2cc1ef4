"""ORTModule's outputs under torch.autocast have eager autocast's dtypes (bfloat16 logits, a float32 loss), their
values and the gradients through them against eager autocast and float64 PyTorch.

Fallback is off in this folder (conftest): a test that expects OpenVINO or onnxruntime fails when the path
falls back to PyTorch.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from onnxtrain import ORTModule
from onnxtrain.runtime import backends
from tests.ortmodule.conftest import trainings
from tests.ortmodule.test_autocast import _rel, _tiny_transformer

bf16_needed = [pytest.mark.skipif(not backends.openvino_installed(), reason="onnxtrain[openvino] not installed"),
               pytest.mark.skipif(not backends.openvino_has_bf16(), reason="this CPU has no bfloat16 arithmetic")]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _run(model, x, y, dtype, enabled=True):
    """(output, loss, {name: gradient as float64}) of a cross-entropy over ``model(x)`` under autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=enabled):
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out.double() if out.dtype == torch.float64 else out.float(), y)
    loss.backward()
    return out.detach(), loss.item(), {n: p.grad.double().numpy() for n, p in model.named_parameters()}


def _check_against_autocast(model, reference, x, y, dtype, output_tol):
    """Output dtype and values as eager autocast's; each gradient's error against float64 within 2x autocast's
    (test_autocast.py's tolerance)."""
    ours, loss, grads = _run(model, x, y, dtype)
    eager, eager_loss, eager_grads = _run(copy.deepcopy(reference), x, y, dtype)
    _, ref_loss, ref_grads = _run(copy.deepcopy(reference).double(), x.double(), y, dtype, enabled=False)
    assert ours.dtype == eager.dtype == dtype
    torch.testing.assert_close(ours.float(), eager.float(), rtol=output_tol, atol=output_tol)
    assert abs(loss - ref_loss) <= max(2 * abs(eager_loss - ref_loss), 1e-3 * ref_loss)
    for name, want in ref_grads.items():
        assert _rel(grads[name], want) <= 2 * _rel(eager_grads[name], want), name


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=bf16_needed), torch.float16])
def test_mlp_output_in_autocast_dtype_with_its_gradients(dtype):
    """bfloat16 on OpenVINO (the Cast inside the graph, so its output leaves the call in bfloat16), float16 on
    onnxruntime (the precision pass); the gradient of the low-type output comes back in it and enters backward."""
    reference = _mlp()
    model = ORTModule(copy.deepcopy(reference))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
    _check_against_autocast(model, reference, x, y, dtype, output_tol=2e-2 if dtype == torch.bfloat16 else 2e-3)
    (training,) = trainings(model)
    assert not training.torch_casts  # cast inside the forward graph
    low = {torch.bfloat16: "tensor(bfloat16)", torch.float16: "tensor(float16)"}[dtype]
    assert training.forward._session.get_outputs()[0].type == low
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert model(x).dtype == dtype  # the inference graph too


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=bf16_needed), torch.float16])
def test_output_that_backward_reads_is_cast_after_the_graph(dtype):
    """A ReLU's output is both the model's output and what its gradient reads: the forward graph returns it
    once, in float32 for backward, and ORTModule casts the user's copy."""
    reference = torch.nn.Sequential(torch.nn.Linear(32, 10), torch.nn.ReLU())
    model = ORTModule(copy.deepcopy(reference))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
    _check_against_autocast(model, reference, x, y, dtype, output_tol=2e-2 if dtype == torch.bfloat16 else 2e-3)
    (training,) = trainings(model)
    assert training.torch_casts == {0: dtype}


class _Mixed(torch.nn.Module):
    """Outputs eager autocast returns in bfloat16 (a linear layer, a softmax of it) and in float32 (a LayerNorm
    of the float32 input, an MSE loss)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.lin(x)
        return {"h": h, "p": torch.softmax(h, -1), "n": self.norm(x), "mse": torch.nn.functional.mse_loss(h, x)}


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=bf16_needed), torch.float16])
def test_float32_kept_outputs_stay_float32(dtype):
    torch.manual_seed(0)
    reference = _Mixed()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=dtype):
        ours, eager = model(x), copy.deepcopy(reference)(x)
        (ours["h"].float().square().mean() + ours["p"].float().sum() + ours["n"].sum() + ours["mse"]).backward()
    dtypes = {k: v.dtype for k, v in eager.items()}
    assert dtypes == {"h": dtype, "p": dtype, "n": torch.float32, "mse": torch.float32}
    assert {k: v.dtype for k, v in ours.items()} == dtypes
    for k in eager:
        torch.testing.assert_close(ours[k].float(), eager[k].float(), rtol=3e-2, atol=3e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("kind", [pytest.param("bert", marks=bf16_needed), pytest.param("gpt2", marks=bf16_needed)])
def test_transformer_loss_float32_logits_bfloat16(kind):
    """BERT (a classifier with labels) and GPT-2 (a language model with labels): the loss float32 and the logits
    bfloat16, as eager autocast's; the fused OpenVINO call writes the logits in bfloat16; the loss and every
    gradient against float64 within test_autocast.py's tolerances."""
    model, call = _tiny_transformer(kind, full=True)
    reference = copy.deepcopy(model)
    auto, double = copy.deepcopy(reference), copy.deepcopy(reference).double()
    outputs = []
    wrapped = ORTModule(model)
    for m, enabled in ((wrapped, True), (auto, True), (double, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            outputs.append(call(m))
        outputs[-1].loss.backward()
    ours, eager, ref = outputs
    assert (ours.loss.dtype, ours.logits.dtype) == (eager.loss.dtype, eager.logits.dtype) == (torch.float32,
                                                                                              torch.bfloat16)
    (training,) = trainings(wrapped)
    assert training.fused is not None
    logits_type = training.fused.session._session.get_outputs()[1].type  # the graph's outputs: loss, logits
    assert logits_type == "tensor(bfloat16)"
    assert abs(ours.loss.item() - ref.loss.item()) <= max(2 * abs(eager.loss.item() - ref.loss.item()), 2e-3)
    torch.testing.assert_close(ours.logits.float(), eager.logits.float(), rtol=5e-2, atol=5e-2)
    ratios = {}
    for (name, p), a, r in zip(model.named_parameters(), auto.parameters(), double.parameters()):
        if r.grad is not None and float(r.grad.norm()) > 0:
            ratios[name] = _rel(p.grad.double().numpy(), r.grad.numpy()) / _rel(a.grad.double().numpy(), r.grad.numpy())
    worst = max(ratios, key=ratios.get)
    assert float(np.median(list(ratios.values()))) < 2.0 and ratios[worst] < 3.5, (worst, ratios[worst])


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=bf16_needed), torch.float16])
def test_eager_ops_after_export_in_the_same_region_see_real_parameters(dtype):
    """The dtype query runs the forward on fake tensors; autocast's cache of cast parameters must not keep its
    fake casts, where the module's next eager call in the same autocast region would read them."""
    reference = _mlp()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=dtype):
        model(x)
        eager = model.module(x)
        want = reference(x)
    assert type(eager) is torch.Tensor
    torch.testing.assert_close(eager, want)


def test_output_tails_keep_a_bias_add_and_its_product_float32():
    """runtime.openvino_float32.output_tails on (name, op type, float32 output, inputs) graphs: a bfloat16 output
    made by a product and a bias Add keeps both float32 (one rounding, at the Convert, as eager's addmm); a product
    reaching the output through moves only (a Reshape), or directly, keeps its bfloat16; float32 outputs mark
    nothing."""
    from onnxtrain.runtime.openvino_float32 import output_tails

    graph = [
        ("x", "Parameter", True, []), ("w", "Parameter", True, []), ("b", "Parameter", True, []),
        ("h", "MatMul", True, ["x", "w"]),
        ("norm", "MVN", True, ["x"]),  # before the product: not in the output's tail
        ("logits", "Add", True, ["h", "b"]), ("logits_bf16", "Convert", False, ["logits"]),
        ("out", "Result", False, ["logits_bf16"]),
        ("g", "MatMul", True, ["norm", "w"]), ("g_view", "Reshape", True, ["g"]),
        ("g_bf16", "Convert", False, ["g_view"]), ("out2", "Result", False, ["g_bf16"]),
        ("k", "MatMul", True, ["x", "w"]), ("k_bf16", "Convert", False, ["k"]), ("out3", "Result", False, ["k_bf16"]),
        ("f", "Add", True, ["k", "b"]), ("out4", "Result", True, ["f"]),
    ]
    assert output_tails(graph) == {"logits", "h", "g_view"}
