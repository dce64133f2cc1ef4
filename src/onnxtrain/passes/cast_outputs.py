"""Graph outputs cast to the dtypes the caller wants, by a ``Cast`` in the graph (ORTModule under autocast).

Eager ``torch.autocast`` returns a linear layer's output in bfloat16 (or float16); ORTModule's graphs are
float32 and run their products in the low type on the backend. ``CastOutputsPass({position: dtype})`` makes
graph output ``position`` a ``Cast`` of the float32 value, so the backend writes it in the low type (OpenVINO:
GPT-2-small's ``[4, 128, 50257]`` logits leave the call as 51 MB of bfloat16, not 103 MB of float32) and the
float32 value inside the graph still feeds every other node and output (a value backward reads is stashed
in float32). Positions that are not float32 outputs are refused: the caller's dtypes are for float32 values.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from onnxtrain.passes.rewrite import free_name


class CastOutputsPass(ir.passes.InPlacePass):
    def __init__(self, casts: Mapping[int, ir.DataType]):
        super().__init__()
        self.casts = dict(casts)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        taken = {v.name for v in graph.inputs} | {v.name for n in graph for v in n.outputs}
        for position, dtype in sorted(self.casts.items()):
            value = graph.outputs[position]
            if value.dtype != ir.DataType.FLOAT:
                raise ValueError(f"graph output {position} ({value.name!r}) is {value.dtype}, not float32: "
                                 f"cannot cast it to {dtype}")
            name = free_name(f"{value.name}_output_{dtype.name.lower()}", taken)  # passes.precision names its casts <name>_<dtype>
            out = ir.Value(name=name, type=ir.TensorType(dtype), shape=value.shape)
            graph.append(ir.Node("", "Cast", [value], attributes=[ir.AttrInt64("to", dtype)], outputs=[out],
                                 name=f"{name}/cast"))
            graph.outputs[position] = out
        return ir.passes.PassResult(model, modified=bool(self.casts))


def cast_outputs(model: ir.Model, casts: Mapping[int, ir.DataType]) -> ir.Model:
    """``model`` with its outputs at the positions of ``casts`` cast (in place; returned for chaining)."""
    return CastOutputsPass(casts)(model).model

