"""Constant folding and basic clean-ups (onnxscript's optimizer) on a graph whose weights are inputs.

Gradient rules need shape arguments (Slice starts/axes, Reshape shapes, Unsqueeze axes) as constants;
the exporter computes many of them from ``Shape`` ops at run time. Folding them is safe for training only
once the parameters are graph inputs (see ``initializers_to_inputs``): nothing derived from a weight can be
folded into a constant then.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnxscript.optimizer

# The folder logs a warning for each node it cannot evaluate (and leaves it as is): not the user's concern.
_FOLDING_LOG = logging.getLogger("onnxscript.optimizer._constant_folding")


class OptimizePass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        level = _FOLDING_LOG.level
        _FOLDING_LOG.setLevel(logging.ERROR)
        try:
            onnxscript.optimizer.optimize_ir(model, num_iterations=2)
        finally:
            _FOLDING_LOG.setLevel(level)
        return ir.passes.PassResult(model, modified=True)
