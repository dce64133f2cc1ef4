"""Finite-difference cases for rules/rnn.py."""

from tests.autodiff.gradcheck import Case, F, I  # noqa: F401

CASES: list[Case] = []
