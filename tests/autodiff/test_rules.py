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


def test_every_rule_has_a_case():
    """The table covers every differentiable rule; non-differentiable ops are checked to cut the path."""
    tested = {(c.domain, c.op) for c in CASES}
    missing = [
        f"{d or 'ai.onnx'}::{op}" for d, op in REGISTRY.op_types()
        if (d, op) not in tested and REGISTRY.lookup(d, op, 20) is not None
        and REGISTRY.lookup(d, op, 20).differentiable
    ]
    assert not missing, f"rules without a finite-difference case: {missing}"
