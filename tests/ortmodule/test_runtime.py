"""Tensors cross between torch and onnxruntime without copies; sessions take and return torch tensors."""

from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from onnxtrain.runtime.dlpack import to_ortvalue, to_torch
from onnxtrain.runtime.session import TorchSession, session_options


def test_dlpack_shares_memory_both_ways():
    for tensor in (torch.randn(3, 4), torch.arange(6), torch.tensor(2.5)):
        value = to_ortvalue(tensor)
        assert value.data_ptr() == tensor.data_ptr()
        back = to_torch(value)
        assert back.data_ptr() == tensor.data_ptr() and back.dtype == tensor.dtype
        assert torch.equal(back, tensor)


def test_bool_tensors_cross_too():
    mask = torch.tensor([True, False, True])
    assert torch.equal(to_torch(to_ortvalue(mask)), mask)


def test_session_runs_on_torch_tensors_and_sees_in_place_updates():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Greater", ["y", "zero"], ["pos"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2]),
         helper.make_tensor_value_info("pos", TensorProto.BOOL, ["b", 2])],
        initializer=[helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    session = TorchSession(model, torch.device("cpu"), session_options(threads=1))
    x, w = torch.randn(5, 4), torch.randn(4, 2)
    y, pos = session.run([x, w])
    torch.testing.assert_close(y, x @ w)
    assert pos.dtype == torch.bool and torch.equal(pos, (x @ w) > 0)
    w.mul_(3)  # like an optimizer step: the next run reads the new values
    torch.testing.assert_close(session.run([x, w])[0], x @ w)
    transposed = torch.randn(4, 5).t()  # non-contiguous inputs are made contiguous
    torch.testing.assert_close(session.run([transposed, w])[0], transposed @ w)


def test_parameter_values_follow_in_place_updates_and_replaced_storage():
    """Parameter OrtValues are made once and reused; in-place updates and new storage are both seen."""
    from onnxtrain import ORTModule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    wrapped = ORTModule(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), model(x))  # makes the parameters' OrtValues
        model[0].weight.mul_(0.5)  # in place: the cached OrtValue reads the same memory
        torch.testing.assert_close(wrapped(x), model(x))
        model[2].weight.data = torch.randn(2, 16)  # new storage behind the same Parameter object
        torch.testing.assert_close(wrapped(x), model(x))
    assert wrapped.export_count == 1
