"""Every registered gradient rule agrees with finite differences (see gradcheck.py)."""

import pytest

from onnxtrain.autodiff.rules import REGISTRY
from tests.autodiff.cases import elementwise, linalg, nn, reduce, resize, rnn, shape
from tests.autodiff.gradcheck import check_case

CASES = [*elementwise.CASES, *linalg.CASES, *reduce.CASES, *shape.CASES, *nn.CASES, *nn.STAGED_CASES,
         *rnn.CASES, *resize.CASES]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_finite_differences(case):
    check_case(case)


# Ops whose gradient cannot be probed by a single-node finite-difference case, each with the reason
# and the test that covers it instead.
NOT_FD_TESTABLE = {
    "Constant": "has no inputs",
    "RandomNormal": "no inputs (random)", "RandomUniform": "no inputs (random)",
    "RandomNormalLike": "random output", "RandomUniformLike": "random output",
    "Bernoulli": "random output", "Multinomial": "random output",
}


def _opset_of(case) -> int:
    """The opset a case's node is looked up at: its ai.onnx opset, or version 1 of another domain."""
    return case.opset if case.domain in ("", "ai.onnx") else 1


def test_every_case_has_a_rule():
    """A case whose op has no rule at the case's opset would test nothing."""
    orphans = [c.id for c in CASES if REGISTRY.lookup(c.domain, c.op, _opset_of(c)) is None]
    assert not orphans, f"cases without a rule at their opset: {orphans}"


def test_every_rule_has_a_case():
    """Every differentiable rule has a case at an opset inside its own range (a rule registered from
    opset 21 or up to opset 12 is checked there, not at one opset for all)."""
    covered = {id(REGISTRY.lookup(c.domain, c.op, _opset_of(c))) for c in CASES}
    missing = [
        f"{r.domain or 'ai.onnx'}::{r.op_type} (opsets {r.since}-{r.until or 'latest'})" for r in REGISTRY
        if r.differentiable and id(r) not in covered
    ]
    assert not missing, f"rules without a finite-difference case in their opset range: {missing}"
