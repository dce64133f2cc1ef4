"""benchmarks/ortmodule_bench.py --rounds: the summary of N rounds (per-round ratios and their median), on
results made up here whose ratios are worked out by hand."""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # ortmodule_bench imports ondevice_bench beside it
    import ortmodule_bench

    yield ortmodule_bench
    sys.modules.pop("ortmodule_bench", None)


def _round(eager_ms: float, compile_ms: float, ours_ms: float, optimizer: str = "fused") -> dict:
    return {("bert", mode): {"workload": "bert", "mode": mode, "median_s": ms / 1e3, "optimizer": optimizer}
            for mode, ms in (("eager-bf16", eager_ms), ("compile-bf16", compile_ms), ("ortmodule-bf16", ours_ms))}


def test_round_ratios_are_per_round(bench):
    rounds = [_round(60.0, 50.0, 40.0), _round(70.0, 45.0, 50.0), _round(66.0, 60.0, 44.0)]
    per = bench.round_ratios(rounds)
    assert per[("bert", "ortmodule-bf16", "eager")] == pytest.approx([1.5, 1.4, 1.5])
    assert per[("bert", "ortmodule-bf16", "compile")] == pytest.approx([1.25, 0.9, 60 / 44])
    assert ("bert", "eager-bf16", "eager") not in per  # no ratio of a mode against itself


def test_rounds_summary_decides_targets_by_the_median_ratio(bench):
    # against eager: 1.5, 1.3, 1.45 -> median 1.45 (met, in 2 of 3 rounds); against compile: 1.25, 1.0, 1.1 -> 1.1
    rounds = [_round(60.0, 50.0, 40.0), _round(65.0, 50.0, 50.0), _round(58.0, 44.0, 40.0)]
    lines = bench.rounds_summary(rounds)
    eager = next(line for line in lines if "vs eager-bf16" in line)
    assert "median  1.45x" in eager and "1.50 1.30 1.45" in eager
    assert "met by the median (--optimizer fused); met in 2 of 3 rounds" in eager and "NOT" not in eager
    compiled = next(line for line in lines if "vs compile-bf16" in line)
    assert "median  1.10x" in compiled and "NOT met by the median" in compiled and "met in 1 of 3" in compiled
    ours = next(line for line in lines if line.startswith("bert      ortmodule-bf16"))
    assert "40.0 50.0 40.0 -> 40.0" in ours


def test_rounds_summary_ort_optimizer_decides_nothing(bench):
    lines = bench.rounds_summary([_round(60.0, 50.0, 40.0, "ort"), _round(60.0, 50.0, 40.0, "ort")])
    assert all("decides nothing" in line for line in lines if "vs eager-bf16" in line or "vs compile-bf16" in line)


def test_rounds_summary_skips_failed_rounds(bench):
    failed = {("bert", "ortmodule-bf16"): {"workload": "bert", "mode": "ortmodule-bf16", "error": "boom"},
              ("bert", "eager-bf16"): _round(60.0, 50.0, 40.0)[("bert", "eager-bf16")]}
    lines = bench.rounds_summary([_round(60.0, 50.0, 40.0), failed])
    eager = next(line for line in lines if "vs eager-bf16" in line)
    assert "of 1.50  " in eager and "met in 1 of 1 rounds" in eager


def test_target_rows_verdicts(bench):
    # one run: against eager 60 / 40 = 1.5x (target 1.4: met), against compile 44 / 40 = 1.1x (target 1.2: NOT met)
    by_key = _round(60.0, 44.0, 40.0, "adamw")
    by_key[("bert", "ortmodule-bf16")]["ran"] = [["openvino", "bf16"]]
    rows = bench.target_rows(by_key)
    eager = next(row for row in rows if "vs eager-bf16" in row)
    assert "1.50x  target >= 1.4x  met (--optimizer adamw)" in eager and eager.endswith("(--optimizer adamw)")
    compiled = next(row for row in rows if "vs compile-bf16" in row)
    assert "1.10x  target >= 1.2x  NOT met (--optimizer adamw)" in compiled
    ort = bench.target_rows(_round(60.0, 44.0, 40.0, "ort"))
    assert len(ort) == 2 and all("decides nothing: ORTModule's optimizer is not eager's" in row for row in ort)
    assert all(" met" not in row for row in ort)


def test_rounds_summary_mixed_optimizers_decide_nothing(bench):
    lines = bench.rounds_summary([_round(60.0, 50.0, 40.0, "fused"), _round(60.0, 50.0, 40.0, "adamw")])
    targets = [line for line in lines if "target >=" in line]
    assert len(targets) == 2 and all("decides nothing" in line and "rounds" not in line for line in targets)
