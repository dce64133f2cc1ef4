"""Finite-difference cases for rules/shape.py."""

from tests.autodiff.gradcheck import Case, F, I  # noqa: F401

CASES: list[Case] = []
