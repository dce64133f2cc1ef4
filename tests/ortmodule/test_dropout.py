"""Dropout under ORTModule: the keep-masks are drawn by torch as eager draws them (passes/dropout_masks.py).

From the same RNG state ORTModule's masks are eager's: a dropout's output and its input gradient are eager's
bit for bit, a model's outputs and gradients agree with eager's to float32 rounding (so verify can check a
dropout model), and the masks reach OpenVINO, which converts no training-mode ``Dropout``, as graph inputs.
Statistics (keep rate, a new mask each step, ``torch.manual_seed``) are in test_ortmodule.py.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.ortmodule.graphs import RandomDrawsError
from onnxtrain.passes.dropout_masks import dropout_masks
from onnxtrain.runtime import backends
from tests.ortmodule import models
from tests.ortmodule.conftest import trainings


class Drop(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 24))

    def forward(self, x):
        h = torch.nn.functional.dropout(x * self.w, self.p, self.training)
        return torch.nn.functional.dropout(h * self.w, self.p / 2, self.training)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.3])
def test_dropout_is_eagers_bit_for_bit(p):
    """Products by a weight only (no op whose kernels round differently): the same masks make the same bits,
    forward and input gradient."""
    reference = Drop(p)
    model = ORTModule(copy.deepcopy(reference))
    for step in range(3):
        x = torch.randn(5, 7, 24, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        torch.manual_seed(step)
        got = model(x)
        torch.manual_seed(step)
        want = reference(x_ref)
        assert torch.equal(got, want)
        dy = torch.randn_like(want)
        got.backward(dy)
        want.backward(dy)
        assert torch.equal(x.grad, x_ref.grad)
        torch.testing.assert_close(model.w.grad, reference.w.grad, rtol=1e-5, atol=1e-5)  # sums in another order
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    assert len(graphs.masks) == 2 and not graphs.random


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bert_dropout_follows_eagers_masks_and_verify_checks_it(attn):
    torch.manual_seed(0)
    reference = models.bert(dropout=0.1)
    reference.config._attn_implementation = attn
    model = ORTModule(copy.deepcopy(reference), DebugOptions(verify=True))
    batch = models.text_batch(4, 16, classify=True, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        torch.manual_seed(10 + step)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # verify checks it: no "cannot check" warning
            got = model(**batch)
        torch.manual_seed(10 + step)
        want = reference(**batch)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        got.loss.backward()
        want.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert model.fallback_reason is None
    (graphs,) = [g for entries in model._cache.values() for g in entries][:1]
    assert len(graphs.masks) == 8  # embeddings, 3 per layer (attention weights among them), the pooler


@pytest.mark.skipif(not backends.openvino_installed() or not backends.openvino_has_bf16(),
                    reason="needs onnxtrain[openvino] and a CPU with bfloat16 arithmetic")
def test_dropout_runs_on_openvino_under_autocast_bf16():
    """Before: OpenVINO could not convert the Dropout and the forward ran on onnxruntime in float32."""
    torch.manual_seed(0)
    reference = models.bert(dropout=0.1)
    reference.config._attn_implementation = "eager"
    model = ORTModule(copy.deepcopy(reference))
    batch = models.text_batch(4, 16, classify=True, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "OpenVINO cannot convert a graph"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(3)
            got = model(**batch)
        got.loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(3)
        want = reference(**batch)
        torch.manual_seed(4)
        other = reference(**batch)  # another mask: farther from ORTModule's than eager's own mask is
    (training,) = trainings(model)
    assert training.fused is not None and training.fused.session.backend == "openvino"
    near = (got.logits.float() - want.logits.float()).abs().max()
    far = (other.logits.float() - want.logits.float()).abs().max()
    assert near < 0.25 * far, (near, far)


def _model(shape_of_x: list, dropouts: list[list]) -> ir.Model:
    """A graph whose input x has ``shape_of_x``; each dropout reads a value declared with the given shape."""
    nodes, infos, outputs = [], [], []
    nodes.append(helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("", TensorProto.FLOAT, [], [0.1])))
    nodes.append(helper.make_node("Constant", [], ["train"], value=helper.make_tensor("", TensorProto.BOOL, [], [True])))
    for k, shape in enumerate(dropouts):
        nodes.append(helper.make_node("Identity", ["x"], [f"h{k}"]))
        nodes.append(helper.make_node("Dropout", [f"h{k}", "ratio", "train"], [f"y{k}"], name=f"drop{k}"))
        infos.append(helper.make_tensor_value_info(f"h{k}", TensorProto.FLOAT, shape))
        outputs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape_of_x)],
                              outputs, value_info=infos)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_masks_are_drawn_in_the_exported_order_and_scale_as_eager():
    model = _model(["n", 4], [["n", 4], [2, "n", 4]])
    masks = dropout_masks(model, 1, ["drop1", "drop0"])  # the order the trace ran them in
    assert [m.dims for m in masks] == [(2, (0, 0), 4), ((0, 0), 4)]
    assert [m.keep for m in masks] == [0.9, 0.9]  # 1 - 0.1, not 1 - float32(0.1)
    assert "Dropout" not in {n.op_type for n in model.graph}
    assert [v.name for v in model.graph.inputs][1:] == [m.name for m in masks]
    scales = [n.attributes["value"].as_tensor().numpy() for n in model.graph if n.op_type == "Constant"]
    eager = torch.ones(3).div_(0.9)[0].item()
    assert any(float(s) == eager for s in scales if s.dtype == np.float32 and s.shape == ())


def test_no_dropout_is_rewritten_where_one_shape_is_unknown():
    """A partial rewrite would draw in another order than eager: the graph keeps onnxruntime's Dropout."""
    model = _model(["n", 4], [["n", 4], ["m", 4]])  # "m": no input axis has it (a data-dependent size)
    assert dropout_masks(model, 1, ["drop0", "drop1"]) == []
    assert [n.op_type for n in model.graph].count("Dropout") == 2
    onnx.checker.check_model(ir.to_proto(model))


def test_masks_cross_from_the_export_process():
    """The schema's graphs made in a child process come back with their masks (SchemaGraphs.masks)."""
    reference = Drop(0.5)
    model = ORTModule(copy.deepcopy(reference), DebugOptions(export_process="spawn"))
    x = torch.randn(3, 4, 24)
    torch.manual_seed(1)
    got = model(x)
    torch.manual_seed(1)
    assert torch.equal(got, reference(x))
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    assert graphs.captured.model is None  # made in the child (export_process._ship)
    assert len(graphs.masks) == 2


def test_onnxruntime_dropout_on_request(monkeypatch):
    """ONNXTRAIN_TORCH_DROPOUT=0: the graph keeps onnxruntime's Dropout, seeded from torch's generator."""
    monkeypatch.setenv("ONNXTRAIN_TORCH_DROPOUT", "0")
    model = ORTModule(Drop(0.5))
    x = torch.ones(64, 24)
    torch.manual_seed(0)
    a, b = model(x), model(x)
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    assert graphs.masks == [] and graphs.random
    assert not torch.equal(a != 0, b != 0)  # a new mask each run
    torch.manual_seed(0)
    assert torch.equal(model(x), a)  # and the seed's


class Drops(torch.nn.Module):
    """Feature and alpha dropout (the exporter writes aten.bernoulli.p as RandomUniformLike < p), between plain
    dropouts, so the masks must come in eager's order."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        F = torch.nn.functional
        h = F.dropout2d(x * self.w, 0.3, self.training)
        h = F.dropout(h, 0.1, self.training)
        h = F.alpha_dropout(h * self.w, 0.2, self.training)
        h = F.feature_alpha_dropout(h, 0.4, self.training)
        return F.dropout3d(h.unsqueeze(0), 0.5, self.training) * self.w


def test_feature_and_alpha_dropout_are_eagers():
    """Before: onnxruntime drew their masks (other masks than eager's from the same seed)."""
    reference = Drops()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    for step in range(2):
        x = torch.randn(4, 5, 3, 6, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        torch.manual_seed(step)
        got = model(x)
        torch.manual_seed(step)
        want = reference(x_ref)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        dy = torch.randn_like(want)
        got.backward(dy)
        want.backward(dy)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.w.grad, reference.w.grad, rtol=1e-5, atol=1e-5)
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    assert len(graphs.masks) == 5 and not graphs.random


class DropAll(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 24))

    def forward(self, x):
        return torch.nn.functional.dropout(x * self.w, 1.0, self.training) + self.w


def test_dropout_of_ratio_one_is_eagers_zeros():
    """Eager returns x * 0 and draws nothing; before: onnxruntime's Dropout refused the ratio (a fallback)."""
    reference = DropAll()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    x = torch.randn(3, 24)
    x[0, 0] = float("inf")  # eager: inf * 0 = NaN
    x.requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    got = model(x)
    after = torch.randint(0, 2**31, (4,))
    torch.manual_seed(0)
    want = reference(x_ref)
    assert torch.equal(after, torch.randint(0, 2**31, (4,)))  # neither drew
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(got[0, 0])
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(model.w.grad, reference.w.grad, equal_nan=True, rtol=0, atol=0)  # NaN: inf * 0


class Noise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.w + torch.randn_like(x)


def test_draws_torch_cannot_give_fall_back_with_the_reason(monkeypatch):
    """A random op whose draws the graph would make itself (onnxruntime's generator): not eager's from the same
    seed, so ORTModule falls back before running it; with ONNXTRAIN_TORCH_DROPOUT=0 it runs on onnxruntime's."""
    x = torch.randn(4, 8)
    model = ORTModule(Noise(), DebugOptions(fallback=True))
    with pytest.warns(UserWarning, match="falls back"):
        model(x)
    assert model.fallback_reason.startswith("RandomDrawsError: the graph draws random numbers")
    assert "RandomNormalLike from aten.randn_like" in model.fallback_reason
    with pytest.raises(RandomDrawsError, match="RandomNormalLike"):
        ORTModule(Noise(), DebugOptions(fallback=False))(x)
    monkeypatch.setenv("ONNXTRAIN_TORCH_DROPOUT", "0")
    model = ORTModule(Noise(), DebugOptions(fallback=False))
    torch.manual_seed(0)
    a, b = model(x), model(x)
    assert model.fallback_reason is None and not torch.equal(a, b)
