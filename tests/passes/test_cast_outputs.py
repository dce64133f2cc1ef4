"""CastOutputsPass: chosen graph outputs come out cast, the float32 value still feeds the rest (onnxruntime
before and after, against numpy's rounding of the same values)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain.passes.cast_outputs import cast_outputs
from onnxtrain.runtime.dlpack import to_torch


def _model():
    """y = x @ w (an output, also read by r = relu(y), the second output); an int64 shape as a third."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("Shape", ["y"], ["s"])]
    graph = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("s", TensorProto.INT64, [2])])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10))


def _run(model: ir.Model, feeds: dict) -> list[torch.Tensor]:
    """The outputs as torch tensors (numpy has no bfloat16; onnxruntime's run cannot return one)."""
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    for output in session.get_outputs():
        binding.bind_output(output.name, "cpu")
    session.run_with_iobinding(binding)
    return [to_torch(v) for v in binding.get_outputs()]


@pytest.mark.parametrize("dtype", [ir.DataType.BFLOAT16, ir.DataType.FLOAT16])
def test_cast_output_in_the_low_type_others_unchanged(dtype):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 8)).astype(np.float32), "w": rng.standard_normal((8, 4)).astype(np.float32)}
    before = _run(_model(), feeds)
    model = cast_outputs(_model(), {0: dtype})
    assert [v.dtype for v in model.graph.outputs] == [dtype, ir.DataType.FLOAT, ir.DataType.INT64]
    assert model.graph.outputs[0].shape == model.graph.outputs[1].shape  # the symbolic dims kept
    after = _run(model, feeds)
    want = torch.from_numpy(feeds["x"].astype(np.float64) @ feeds["w"])
    low = torch.bfloat16 if dtype == ir.DataType.BFLOAT16 else torch.float16
    torch.testing.assert_close(before[0].double(), want, rtol=1e-5, atol=1e-5)
    assert after[0].dtype == low
    assert torch.equal(after[0], before[0].to(low))  # rounded once, to nearest, as torch rounds
    assert torch.equal(after[1], before[1])  # relu still reads the float32 product
    assert torch.equal(after[2], before[2])


def test_refuses_a_non_float32_output():
    with pytest.raises(ValueError, match="output 2 .* INT64, not float32"):
        cast_outputs(_model(), {2: ir.DataType.BFLOAT16})
