"""The model families of test_families.py through ORTModule under ``torch.autocast("cpu", dtype=torch.bfloat16)``
(the ``families`` tier of scripts/test.sh).

Under autocast bf16 ORTModule runs its float32 graphs on OpenVINO with the bfloat16 hint and its precision
policy (docs/precision.md); eager autocast rounds elsewhere, so the two are compared by how far each is from
the truth: the same model in float64, eager, on the same batches. For each family, over ``BATCHES`` batches
(one parameter state: the float32 tier checks the second step), the loss and every parameter's gradient of
ORTModule and of eager autocast are measured against float64, and:

- **per gradient**, ORTModule's norm-relative error (root of the summed squares over the batches, over the
  float64 gradient's) is at most ``GRAD_RATIO`` (2) times eager autocast's, the project's bound
  (test_autocast_policy.py), plus ``FLOOR``: a gradient float64 makes near zero (a key projection's bias: its
  gradient is zero, softmax does not see a constant added to a row of scores) is pure rounding noise on both
  sides, so each gradient's error is taken relative to at least 1e-2 of the model's largest gradient norm,
  and differences below 1e-3 of that (a quarter of a bfloat16 step) are not counted;
- **overall** (every gradient of every batch as one vector), ORTModule's error is at most ``OVERALL_RATIO``
  (1.5) times eager's: a policy decision that costs every gradient a little (a reduction left in bfloat16, a
  loss region lost) shows here before any one gradient reaches 2x;
- the **loss** is within 2x eager's distance from float64, or 1e-3 of it.

Why several batches: in a family with ReLU (OPT) a gradient's error on one batch is dominated by the few
pre-activations whose sign the rounding flips, each passing a whole entry of the output gradient; the ratio on
a single batch ranged 0.45-4.8 over 8 batches for OPT, and 1.06 summed over them (docs/precision.md).

A family that cannot run in the graph under bf16 must fall back with the reason in ``FALLS_BACK``. About 4
minutes on torch 2.13 and 8 on 2.15, loaded (load average 8).
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from onnxtrain import ORTModule  # noqa: E402
from onnxtrain.ortmodule.graphs import PRODUCTS_BF16  # noqa: E402
from onnxtrain.ortmodule.options import ATTENTION_FLOAT32_ENV  # noqa: E402
from onnxtrain.runtime import backends  # noqa: E402

from .test_families import FALLS_BACK as FLOAT32_FALLS_BACK  # noqa: E402
from .test_autocast_policy import _sessions  # noqa: E402
from .test_families import FAMILIES, _batch, _model  # noqa: E402

pytestmark = [pytest.mark.families,
              pytest.mark.skipif(not (backends.openvino_installed() and backends.openvino_has_bf16()),
                                 reason="autocast bfloat16 needs onnxtrain[openvino] and a CPU with bfloat16")]

BATCHES = 4
GRAD_RATIO = 2.0
OVERALL_RATIO = 1.5
SCALE_FLOOR = 1e-2  # of the model's largest float64 gradient norm: the least a gradient's error is relative to
FLOOR = 1e-3  # error differences below this (relative to that scale) are rounding noise on both sides

#: family -> what its fallback reason must say (a regular expression), under autocast bf16
FALLS_BACK = {
    **FLOAT32_FALLS_BACK,
    # its experts' grouped matmul runs float32 in eager (the input cast to the float32 weights' type); bf16 on
    # OpenVINO their gradients were 20x further from float64 than eager autocast's (down_proj). torch 2.13 has
    # no fake kernel for it in float32, so the products cannot be checked at all there.
    "mixtral": "products (that autocast does not lower|cannot be checked)",
}


#: families that fell back before (every convolution's weight gradient, mBART's Squeeze without axes), and
#: whose every graph must now run on OpenVINO (passes/conv_patches.py, passes/squeeze_axes.py)
ON_OPENVINO = {"resnet", "vit", "convnext", "mbart"}

#: families that fall back on torch older than the given version only (measured on 2.13 and 2.15)
FALLS_BACK_BEFORE: dict[str, tuple[int, int]] = {}

#: families whose attention eager computes in float32 (torch 2.13: scaled_dot_product_attention's math kernel on
#: CPU, with dropout 0 too): the products in the graph, attention's float32, on OpenVINO at its float32 hint
#: (PRODUCTS_BF16; before, they fell back). On torch 2.15 Falcon's takes the bf16 kernel, and runs on the hint.
ATTENTION_FLOAT32 = {"falcon", "swin"}


def _gradients(model, batch, bf16: bool, double: bool = False, seed: int | None = None):
    """``seed``: torch's, set before the forward (the same dropout masks for each side)."""
    if double:
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    if seed is not None:
        torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.double().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return float(loss), grads


def _reference(model):
    """The float64 copy (Mixtral's grouped matmul has no float64 kernel: its experts run one by one there)."""
    reference = copy.deepcopy(model).double()
    for module in reference.modules():
        if getattr(getattr(module, "config", None), "_experts_implementation", None) not in (None, "eager"):
            module.config._experts_implementation = "eager"
    return reference


@pytest.fixture(autouse=True)
def _attention_float32(monkeypatch):
    """Falcon's and Swin's attention (float32 in eager on torch 2.13) runs in PRODUCTS_BF16, the default (the switch
    unset)."""
    monkeypatch.delenv(ATTENTION_FLOAT32_ENV, raising=False)


def _errors(family):
    """{parameter: [ORTModule's squared error, eager autocast's, float64's squared norm]} and the losses."""
    model = _model(family)
    ort = ORTModule(copy.deepcopy(model))
    sq, losses = errors_against_float64(ort, model, [_batch(model, seed) for seed in range(BATCHES)])
    ran = [(g.backend, g.precision) for entries in ort._cache.values() for g in entries]
    allowed = {"bf16", PRODUCTS_BF16} if family in ATTENTION_FLOAT32 else {"bf16"}
    assert len(ran) == 1 and ran[0][0] == "openvino" and ran[0][1] in allowed, ran
    if family in ON_OPENVINO:
        assert _sessions(ort) == {"OpenVINOSession"}
    return sq, losses


def errors_against_float64(ort, model, batches, seeds=None):
    """({parameter: [ORTModule's squared error, eager autocast's, float64's squared norm], summed over the
    batches}, [(ORTModule's loss, eager autocast's, float64's) per batch]); ``seeds``: torch's seed before each
    side's forward of each batch (dropout: the same masks for all three)."""
    reference = _reference(model)
    sq = {}
    losses = []
    for k, batch in enumerate(batches):
        seed = None if seeds is None else seeds[k]
        ort_loss, ort_grads = _gradients(ort, batch, bf16=True, seed=seed)
        eager_loss, eager_grads = _gradients(model, batch, bf16=True, seed=seed)
        with torch.autocast("cpu", enabled=False):
            exact_loss, exact = _gradients(reference, batch, bf16=False, double=True, seed=seed)
        assert set(ort_grads) == set(exact), f"gradients of {sorted(set(ort_grads) ^ set(exact))}"
        losses.append((ort_loss, eager_loss, exact_loss))
        for name, want in exact.items():
            acc = sq.setdefault(name, [0.0, 0.0, 0.0])
            acc[0] += float((ort_grads[name] - want).square().sum())
            acc[1] += float((eager_grads[name] - want).square().sum())
            acc[2] += float(want.square().sum())
    return sq, losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_under_autocast_bf16_is_as_close_to_float64_as_eager_autocast(family, monkeypatch):
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if family in FALLS_BACK and version < FALLS_BACK_BEFORE.get(family, (99, 0)):
        monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
        model = _model(family)
        ort = ORTModule(copy.deepcopy(model))
        with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("always")
            ort(**_batch(model, 0))
        assert ort.fallback_reason is not None and re.search(FALLS_BACK[family], ort.fallback_reason), \
            ort.fallback_reason
        assert any("falls back to PyTorch" in str(w.message) for w in caught)
        return
    sq, losses = _errors(family)
    assert_as_close_as_eager(family, sq, losses)


def assert_as_close_as_eager(name, sq, losses):
    """The bounds (the module's doc) on :func:`errors_against_float64`'s measures; prints the report line."""
    for step, (ort_loss, eager_loss, exact_loss) in enumerate(losses):
        assert abs(ort_loss - exact_loss) <= max(2 * abs(eager_loss - exact_loss), 1e-3 * abs(exact_loss)), \
            f"batch {step}: loss {ort_loss} against float64 {exact_loss}, eager autocast {eager_loss}"
    largest = max(math.sqrt(norm) for _, _, norm in sq.values())
    _report(name, sq, losses, largest)
    for name, (ort_sq, eager_sq, norm) in sq.items():
        scale = max(math.sqrt(norm), SCALE_FLOOR * largest)
        ort_err, eager_err = math.sqrt(ort_sq) / scale, math.sqrt(eager_sq) / scale
        assert ort_err <= GRAD_RATIO * eager_err + FLOOR, \
            f"{name}: {ort_err:.2e} from float64, eager autocast {eager_err:.2e} ({ort_err / eager_err:.2f}x)"
    total = sum(norm for _, _, norm in sq.values())
    ort_all = math.sqrt(sum(o for o, _, _ in sq.values()) / total)
    eager_all = math.sqrt(sum(e for _, e, _ in sq.values()) / total)
    assert ort_all <= OVERALL_RATIO * eager_all, f"overall {ort_all:.2e} against eager autocast's {eager_all:.2e}"


def _report(family, sq, losses, largest):
    """One line per family (shown with ``-s``): the table of docs/precision.md."""
    ratios = {name: math.sqrt(o) / math.sqrt(e) for name, (o, e, n) in sq.items()
              if math.sqrt(n) >= SCALE_FLOOR * largest and e > 0}
    worst = max(ratios, key=ratios.get)
    total = sum(n for _, _, n in sq.values())
    overall = math.sqrt(sum(o for o, _, _ in sq.values()) / sum(e for _, e, _ in sq.values()))
    loss = max(abs(o - x) for o, _, x in losses), max(abs(e - x) for _, e, x in losses)
    print(f"\nbf16 {family}: worst gradient {ratios[worst]:.2f}x ({worst}), overall {overall:.2f}x, "
          f"loss from float64 {loss[0]:.1e} (eager autocast {loss[1]:.1e})")
