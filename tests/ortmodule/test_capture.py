"""Capture: the shortcuts through torch.onnx's exporter (lazy translation registry, translations that spare
it the decomposition re-trace), checked against the exporter's own registry and against PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.capture import export as capture_export
from onnxtrain.capture.moe import moe_translations
from onnxtrain.capture.registry import lazy_registry, registry_key
from onnxtrain.capture.translations import TRANSLATIONS


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

    def record(program, registry):
        seen.append(original(program, registry))
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


def _contents(registry) -> dict:
    return {key: [(m.onnx_function, m.fx_target, m.is_custom, m.is_complex, m.opset_introduced) for m in metas]
            for key, metas in registry.functions.items()}


@pytest.mark.parametrize("opset", [capture_export.OPSET, 23])
def test_lazy_registry_holds_what_the_exporters_registry_holds(opset):
    """Every op: the same translations, in the same order, as ``ONNXRegistry.from_torchlib`` builds."""
    from torch.onnx._internal.exporter import _registration

    lazy = lazy_registry(_registration.ONNXRegistry, opset)
    assert lazy.get_decomps(torch.ops.aten.addmm.default)  # a lookup builds only that op's entries
    assert len(lazy.functions._pending) == len(lazy.functions) - 1
    eager = _registration.ONNXRegistry.from_torchlib(opset)
    assert lazy.opset_version == eager.opset_version == opset
    want, got = _contents(eager), _contents(lazy)
    assert len(want) > 300
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key
        assert [m.signature for m in lazy.get_decomps(key)] == [m.signature for m in eager.get_decomps(key)]


def test_export_uses_the_lazy_registry_and_builds_only_the_ops_it_translates(monkeypatch):
    from torch.onnx._internal.exporter import _registration

    made = []
    original = capture_export.lazy_registry

    def record(cls, opset):
        made.append(original(cls, opset))
        return made[-1]

    monkeypatch.setattr(capture_export, "lazy_registry", record)
    torch.manual_seed(0)
    reference = UsesTranslatedOps()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    x, mask = torch.randn(4, 6), torch.randint(0, 3, (4, 6))
    torch.testing.assert_close(model(x, mask), reference(x, mask), rtol=1e-5, atol=1e-5)
    assert len(made) == 1
    functions = made[0].functions
    # onnxtrain's own translations are registered whole (their number grows with every one added); what must
    # stay lazy is torchlib's: only the ops this model uses are built
    ours = {registry_key(target) for target in {**TRANSLATIONS, **moe_translations()}}
    built = [key for key in functions if key not in functions._pending and key not in ours]
    assert 0 < len(built) < 60 < len(functions)
    # outside an export the exporter's own registry is back
    assert not isinstance(_registration.ONNXRegistry.from_torchlib(capture_export.OPSET).functions,
                          type(functions))


class ShiftsAndFlattens(torch.nn.Module):
    """What seq2seq models do with their labels: shift them right and flatten them for the loss."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        return self.emb(shifted).sum() + (ids.reshape(-1) * 1.0).sum()


def test_a_non_contiguous_input_exports_as_the_contiguous_tensor_onnxruntime_gets():
    """A slice's symbolic strides put aten.sym_stride in the program, which the exporter cannot translate
    (Whisper given labels[:, :8] fell back to PyTorch)."""
    torch.manual_seed(0)
    reference = ShiftsAndFlattens()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    for batch in (3, 2):
        ids = torch.randint(0, 20, (batch, 12))[:, :8]
        assert not ids.is_contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # by torch.export, not the TorchScript fallback
            got = model(ids)
        want = reference(ids)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
    torch.testing.assert_close(model.module.emb.weight.grad, reference.emb.weight.grad)
    assert model.export_count == 1
