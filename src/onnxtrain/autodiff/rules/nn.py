"""Gradient rules: the nn family."""

from __future__ import annotations

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("nn")
r = rules.register
