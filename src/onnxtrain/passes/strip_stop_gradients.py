"""Make each ``StopGradient`` an ``Identity``: the IR twin of
:func:`onnxtrain.autodiff.stop_gradient.strip_stop_gradients`, for graphs bound for a session or a file.

onnxruntime knows no ``onnxtrain`` domain; once no node of it is left, its opset import goes too.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN
from onnxtrain.autodiff.stop_gradient import is_stop_gradient


class StripStopGradientsPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        domains = set()
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if is_stop_gradient(node):
                node.op_type, node.domain = "Identity", ""
                modified = True
            domains.add(node.domain)
        if modified and ONNXTRAIN_DOMAIN not in domains:
            model.opset_imports.pop(ONNXTRAIN_DOMAIN, None)
        return ir.passes.PassResult(model, modified=modified)
