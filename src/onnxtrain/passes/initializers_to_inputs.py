"""Turn named initializers (a module's parameters and buffers) into graph inputs.

ORTModule feeds parameters from the user's ``torch.nn.Parameter``s on every run, so that in-place
optimizer updates are seen without a new export, and so that no optimization may fold them into constants.
The new inputs are appended after the existing ones, in the order of ``names``.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir


class InitializersToInputsPass(ir.passes.InPlacePass):
    def __init__(self, names: Sequence[str]):
        super().__init__()
        self.names = list(names)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        missing = [n for n in self.names if n not in graph.initializers]
        if missing:
            raise KeyError(
                f"initializers {missing[:5]} are not in the graph (it has {list(graph.initializers)[:5]}...); "
                "the exporter may have renamed or folded them"
            )
        for name in self.names:
            value = graph.initializers.pop(name)
            tensor = value.const_value
            if tensor is not None:
                value.dtype = value.dtype or tensor.dtype
                value.shape = value.shape or ir.Shape(tensor.shape)
            value.const_value = None
            graph.inputs.append(value)
        return ir.passes.PassResult(model, modified=bool(self.names))
