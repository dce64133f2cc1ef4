"""Gradient rules: the rnn family."""

from __future__ import annotations

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("rnn")
r = rules.register
