"""Gradient rules: the shape family."""

from __future__ import annotations

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("shape")
r = rules.register
