"""passes/conv_batch_gemm.py: convolutions over small images as one product over the batch, against PyTorch.

Each case differentiates one node (batch dynamic, image sizes static and small), rewrites the gradient graph
(the forward ``Conv`` and the input gradient's ``ConvTranspose``, or the forward ``ConvTranspose``), and runs it in
onnxruntime against ``torch.autograd`` in float64: the output and both gradients.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as TF
from onnx import helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.passes.conv_batch_gemm import ConvBatchGemmPass

RNG = np.random.default_rng(11)

# (op, input shape, weight shape, bias, attributes, torch function of (x, w, b) with those attributes)
CASES = {
    "conv2d-pads-bias": ("Conv", (3, 5, 4, 4), (6, 5, 3, 3), True, dict(pads=[1, 1, 1, 1]),
                         lambda x, w, b: TF.conv2d(x, w, b, padding=1)),
    "conv2d-stride-dilation": ("Conv", (2, 3, 7, 6), (4, 3, 2, 3), False,
                               dict(strides=[2, 1], dilations=[2, 1], pads=[0, 1, 1, 0]),
                               lambda x, w, b: TF.conv2d(TF.pad(x, (1, 0, 0, 1)), w, stride=(2, 1), dilation=(2, 1))),
    "conv2d-1x1-stride": ("Conv", (2, 4, 5, 5), (7, 4, 1, 1), True, dict(strides=[2, 2]),
                          lambda x, w, b: TF.conv2d(x, w, b, stride=2)),
    "conv1d": ("Conv", (2, 3, 9), (4, 3, 3), False, dict(strides=[2]), lambda x, w, b: TF.conv1d(x, w, stride=2)),
    "conv3d": ("Conv", (1, 2, 3, 3, 2), (3, 2, 2, 2, 2), True, dict(pads=[0, 1, 0, 0, 0, 1]),
               lambda x, w, b: TF.conv3d(TF.pad(x, (0, 1, 1, 0)), w, b)),
    "conv-transpose2d": ("ConvTranspose", (2, 4, 3, 2), (4, 3, 3, 2), True, dict(strides=[2, 3], dilations=[1, 2]),
                         lambda x, w, b: TF.conv_transpose2d(x, w, b, stride=(2, 3), dilation=(1, 2))),
}


def _model(case: str):
    op, x_shape, w_shape, bias, attributes, fn = CASES[case]
    x = RNG.uniform(-1, 1, x_shape).astype(np.float32)
    w = RNG.uniform(-1, 1, w_shape).astype(np.float32)
    b = RNG.uniform(-1, 1, w_shape[1 if op == "ConvTranspose" else 0]).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", *x_shape[1:]]),
              helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, list(w_shape))]
    if bias:
        inputs.append(helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, list(b.shape)))
    names = ["x", "w", "b"][: len(inputs)]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attributes)], case, inputs,
                              [helper.make_value_info("y", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    model = onnx.shape_inference.infer_shapes(model)
    tensors = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, w, b)]
    y = fn(tensors[0], tensors[1], tensors[2] if bias else None)
    seed = RNG.standard_normal(tuple(y.shape)).astype(np.float32)
    (y * torch.tensor(seed, dtype=torch.float64)).sum().backward()
    feeds = {"x": x, "w": w, "y_grad": seed, **({"b": b} if bias else {})}
    want = {"y": y.detach().numpy(), **{f"{n}_grad": t.grad.numpy() for n, t in zip(names, tensors)}}
    grads = gradient_model(model, wrt=names, outputs=["y"])
    return grads, feeds, want


def _run(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_gemm_matches_torch(case):
    model, feeds, want = _model(case)
    graph = ir.from_proto(model)
    assert ConvBatchGemmPass()(graph).modified
    rewritten = ir.to_proto(graph)
    op = CASES[case][0]
    assert not [n for n in rewritten.graph.node if n.op_type == op and "x" in n.input]  # the forward node
    if op == "Conv":  # and the input gradient's ConvTranspose, whose input (the output gradient) has static sizes
        assert "ConvTranspose" not in [n.op_type for n in rewritten.graph.node]
    got = _run(rewritten, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_large_images_groups_and_dynamic_sizes_are_left_alone():
    """Over 16 output positions per image (the node is faster there), grouped, or image sizes not static."""
    for shape, group in (([None, 4, 5, 5], 1), ([None, 4, 3, 3], 2), ([None, 4, "H", 3], 1)):
        shape[0] = "N"
        inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape),
                  helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [4, 4 // group, 1, 1])]
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], group=group)], "g", inputs,
                                  [helper.make_value_info("y", onnx.TypeProto())])
        model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
        assert not ConvBatchGemmPass()(ir.from_proto(model)).modified, (shape, group)
