"""Gradient rules: the reduce family."""

from __future__ import annotations

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("reduce")
r = rules.register
