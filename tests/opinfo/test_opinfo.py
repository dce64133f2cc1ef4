"""PyTorch's OpInfo samples through ORTModule against eager (see ``harness``).

The subset (the families training graphs use) runs in the default suite: each of its samples must run in
onnxruntime and match eager, or be skipped as incomparable (random, ties), or fall back where
``EXPECTED_FALLBACK`` names the reason. The whole sweep (``-m opinfo_full``) requires no sample to be wrong
or to raise: every sample runs in onnxruntime with parity or falls back, decided before it runs.
"""

from __future__ import annotations

import warnings

import pytest

from tests.opinfo import harness

# (op, way) -> what in the fallback reason shows the fallback is the expected one.
# Each is a gap to close (issue 15): remove the entry when the op runs in onnxruntime.
_BOTH = {
    "squeeze": "OutputShapeError",  # squeeze() of a size-1 axis exported as dynamic
    "index_select": "OutputShapeError",  # a 0-d input
}
EXPECTED_FALLBACK: dict[tuple[str, str], str] = {
    **{(op, mode): why for op, why in _BOTH.items() for mode in harness.MODES},
}


def _op(name: str):
    try:
        ops = harness.swept_ops([name])
    except ModuleNotFoundError as exc:  # torch.testing._internal needs expecttest
        pytest.skip(f"op_db cannot be imported: {exc}")
    if not ops:
        pytest.skip(f"{name} is not in this torch's op_db (or not differentiable in float32 on CPU)")
    return ops[0]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", harness.SUBSET)
def test_subset_matches_eager(name, mode):
    op = _op(name)
    results = [harness.run_sample(op, s, mode, i) for i, s in enumerate(harness.samples(op))]
    assert results, f"{name} has no samples"
    bad = []
    for r in results:
        expected = EXPECTED_FALLBACK.get((name, mode))
        if r.status == "skip" or r.status == "pass":
            continue
        if r.status == "fallback" and expected is not None and expected in r.reason:
            continue
        bad.append(f"sample {r.index}: {r.status}: {r.reason}")
    assert not bad, f"{name} ({mode}):\n" + "\n".join(bad)


# Samples that draw random numbers (op_db's index; training mode, 0 < p <= 1): from the same seed ORTModule
# draws eager's (dropout's masks, feature and alpha dropout's included) or makes none (p = 1) ...
DRAWS_EAGERS = [("nn.functional.dropout", 2), ("nn.functional.dropout", 4), ("nn.functional.dropout2d", 2),
                ("nn.functional.dropout3d", 2), ("nn.functional.alpha_dropout", 2),
                ("nn.functional.feature_alpha_dropout.with_train", 1)]
# ... or falls back before running (a dropout whose shape the inputs do not tell, other random ops).
CANNOT_DRAW_EAGERS = [("nn.functional.multi_head_attention_forward", 0, "inputs"), ("nn.functional.rrelu", 0, "inputs"),
                      ("normal", 0, "inputs")]


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name,index", DRAWS_EAGERS)
def test_random_samples_draw_eagers(name, index, mode):
    op = _op(name)
    sample = harness.samples(op, index + 1)[index]
    assert sample.kwargs.get("training", True) and sample.kwargs["p"] > 0  # it draws in eager
    result = harness.run_sample(op, sample, mode, index)
    assert result.status == "pass", f"{result.status}: {result.reason}"


@pytest.mark.parametrize("name,index,mode", CANNOT_DRAW_EAGERS)
def test_random_samples_torch_cannot_draw_fall_back(name, index, mode):
    op = _op(name)
    result = harness.run_sample(op, harness.samples(op, index + 1)[index], mode, index)
    assert result.status == "fallback" and result.reason.startswith("RandomDrawsError"), \
        f"{result.status}: {result.reason}"


@pytest.mark.opinfo_full
def test_full_sweep_has_no_error_and_nothing_wrong():
    try:
        results = list(harness.sweep())
    except ModuleNotFoundError as exc:
        pytest.skip(f"op_db cannot be imported: {exc}")
    from tests.opinfo.table import table

    print("\n" + table(results))  # the log of the tier shows docs/opinfo.md's table as it is now (pytest -s)
    bad = [f"{r.status} {r.op} #{r.index} ({r.mode}): {r.reason}" for r in results if r.status in ("error", "wrong")]
    assert not bad, f"{len(bad)} samples wrong or raising:\n" + "\n".join(bad)
