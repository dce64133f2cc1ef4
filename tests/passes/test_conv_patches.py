"""passes/conv_patches.py: convolution weight gradients as products over input windows, against PyTorch autograd.

Each case differentiates one convolution node with dynamic batch and image sizes (so the weight gradient's
kernel, the output gradient, has a dynamic size), rewrites the gradient graph, and runs it: in onnxruntime
(float32) against ``torch.autograd`` in float64, and on OpenVINO's CPU plugin, which compiles the rewritten graph
and not the original (its convolutions need a kernel of static size).
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
from onnxtrain.passes.conv_patches import ConvColumnsPass, ConvPatchesPass
from onnxtrain.runtime import backends

RNG = np.random.default_rng(7)
openvino = pytest.mark.skipif(not backends.openvino_installed(), reason="needs onnxtrain[openvino]")

# (op, input shape, weight shape, attributes, torch function of (x, w) with those attributes)
CASES = {
    "conv2d": ("Conv", (2, 4, 9, 8), (6, 4, 3, 2), dict(strides=[1, 1], pads=[1, 1, 1, 1]),
               lambda x, w: TF.conv2d(x, w, padding=1)),
    "conv2d-stride-dilation": ("Conv", (3, 2, 11, 10), (4, 2, 3, 3), dict(strides=[2, 3], dilations=[2, 1]),
                               lambda x, w: TF.conv2d(x, w, stride=(2, 3), dilation=(2, 1))),
    "conv2d-groups": ("Conv", (2, 6, 8, 8), (9, 2, 3, 3), dict(group=3, strides=[2, 2], pads=[1, 0, 1, 0]),
                      lambda x, w: TF.conv2d(TF.pad(x, (0, 0, 1, 1)), w, stride=2, groups=3)),
    "depthwise-7x7": ("Conv", (2, 4, 10, 10), (4, 1, 7, 7), dict(group=4, pads=[3, 3, 3, 3]),
                      lambda x, w: TF.conv2d(x, w, padding=3, groups=4)),
    "patchify": ("Conv", (2, 3, 16, 16), (5, 3, 4, 4), dict(strides=[4, 4]),
                 lambda x, w: TF.conv2d(x, w, stride=4)),
    "conv1d": ("Conv", (2, 3, 13), (4, 3, 5), dict(strides=[2], dilations=[2]),
               lambda x, w: TF.conv1d(x, w, stride=2, dilation=2)),
    "conv3d": ("Conv", (1, 2, 5, 6, 5), (3, 2, 2, 3, 2), dict(),
               lambda x, w: TF.conv3d(x, w)),
    "conv-transpose2d": ("ConvTranspose", (2, 4, 5, 4), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1]),
                         lambda x, w: TF.conv_transpose2d(x, w, stride=2, padding=1)),
}


def _gradient_graph(case: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The gradient model of ``sum(conv(x, w) * seed)`` (batch and image sizes dynamic), its inputs, and
    torch's float64 gradients."""
    op, x_shape, w_shape, attributes, fn = CASES[case]
    x = RNG.uniform(-1, 1, x_shape).astype(np.float32)
    w = RNG.uniform(-1, 1, w_shape).astype(np.float32)
    dynamic = ["N", "C", *(f"S{i}" for i in range(len(x_shape) - 2))]
    dynamic[1] = x_shape[1]
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, dynamic),
              helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, list(w_shape))]
    node = helper.make_node(op, ["x", "w"], ["y"], **attributes)
    graph = helper.make_graph([node], case, inputs, [helper.make_value_info("y", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    xt, wt = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, w))
    y = fn(xt, wt)
    seed = RNG.standard_normal(tuple(y.shape)).astype(np.float32)
    (y * torch.tensor(seed, dtype=torch.float64)).sum().backward()
    feeds = {"x": x, "w": w, "y_grad": seed}
    return gradient_model(model, wrt=["x", "w"], outputs=["y"]), feeds, {"x": xt.grad.numpy(), "w": wt.grad.numpy()}


def _rewritten(model: onnx.ModelProto, rewrite=ConvPatchesPass) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    assert rewrite()(graph).modified
    return ir.to_proto(graph)


def _grads(session, feeds) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def _dynamic_kernels(model: onnx.ModelProto) -> list[str]:
    graph = ir.from_proto(model).graph
    return [n.name for n in graph if n.op_type in ("Conv", "ConvTranspose")
            and not all(isinstance(d, int) for d in (n.inputs[1].shape or [None]))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_weight_gradient_as_patches_matches_torch(case):
    model, feeds, want = _gradient_graph(case)
    assert _dynamic_kernels(model)  # what OpenVINO refuses
    rewritten = _rewritten(model)
    assert _dynamic_kernels(rewritten) == []
    got = _grads(ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]), feeds)
    for name in ("x", "w"):
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"conv2d-groups", "depthwise-7x7"}))
def test_weight_gradient_as_stacked_columns_matches_torch(case):
    """ConvColumnsPass (onnxruntime): every window stacked, one Gemm; ungrouped kernels of at most 16 positions."""
    model, feeds, want = _gradient_graph(case)
    rewritten = _rewritten(model, ConvColumnsPass)
    assert _dynamic_kernels(rewritten) == []
    assert any(n.op_type == "Gemm" for n in rewritten.graph.node)
    got = _grads(ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]), feeds)
    for name in ("x", "w"):
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("case", ["conv2d-groups", "depthwise-7x7"])
def test_columns_leave_groups_and_large_kernels_alone(case):
    graph = ir.from_proto(_gradient_graph(case)[0])
    assert not ConvColumnsPass()(graph).modified


@openvino
@pytest.mark.parametrize("case", ["conv2d-groups", "patchify", "conv-transpose2d"])
def test_openvino_compiles_the_patches_and_not_the_kernel_of_dynamic_size(case):
    from onnxtrain.runtime.openvino import OpenVINOSession

    model, feeds, want = _gradient_graph(case)
    with pytest.raises(ValueError, match="cannot compile"):
        OpenVINOSession(model.SerializeToString()).run(None, feeds)
    got = _grads(OpenVINOSession(_rewritten(model).SerializeToString()), feeds)
    for name in ("x", "w"):
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_conv_read_by_anything_but_a_crop_is_left_alone():
    """A kernel of dynamic size whose output positions are not fixed by a Slice: not rewritten."""
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 2, 8]),
              helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [3, 2, "K"])]
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g", inputs,
                              [helper.make_value_info("y", onnx.TypeProto())])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    assert not ConvPatchesPass()(model).modified


def _constant_kernel_model(kind: str, w: np.ndarray) -> onnx.ModelProto:
    """``Conv(x, kernel)`` over ``[N, 3, H, W]``, the kernel a constant whose shape no value_info states."""
    flat = helper.make_tensor("flat", onnx.TensorProto.FLOAT, [w.size], w.ravel().tolist())
    nodes, initializers = [], []
    if kind == "Constant":
        nodes.append(helper.make_node("Constant", [], ["kernel"], value=helper.make_tensor(
            "w", onnx.TensorProto.FLOAT, list(w.shape), w.ravel().tolist())))
    else:  # a Constant reshaped by a constant shape (an initializer): OpenVINO infers the shape from both
        nodes.append(helper.make_node("Constant", [], ["flat"], value=flat))
        initializers.append(helper.make_tensor("shape", onnx.TensorProto.INT64, [4], list(w.shape)))
        nodes.append(helper.make_node("Reshape", ["flat", "shape"], ["kernel"]))
    nodes.append(helper.make_node("Conv", ["x", "kernel"], ["y"], name="conv", pads=[1, 1, 1, 1]))
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                          ["N", 3, "H", "W"])],
                              [helper.make_value_info("y", onnx.TypeProto())], initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


@openvino
@pytest.mark.parametrize("kind", ["Constant", "Reshape"])
def test_a_constant_kernel_of_unstated_shape_is_not_refused_and_openvino_compiles_it(kind):
    """Before: any kernel without a stated shape counted as dynamic (a false refusal: a fallback to PyTorch)."""
    from onnxtrain.runtime.openvino import OpenVINOSession, _read_dynamic_kernel, core, dynamic_kernel

    w = RNG.uniform(-1, 1, (4, 3, 3, 3)).astype(np.float32)
    model = _constant_kernel_model(kind, w)
    graph = ir.from_proto(model).graph
    assert graph.node("conv").inputs[1].shape is None  # nothing states it
    assert dynamic_kernel(graph) is None
    assert _read_dynamic_kernel(core().read_model(model.SerializeToString())) is None  # OpenVINO's own reading
    x = RNG.uniform(-1, 1, (2, 3, 7, 5)).astype(np.float32)
    (got,) = OpenVINOSession(model.SerializeToString()).run(None, {"x": x})
    want = TF.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64), padding=1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


@openvino
@pytest.mark.parametrize("case", ["conv2d", "conv-transpose2d"])
def test_a_weight_gradients_kernel_is_still_refused(case):
    """Its kernel is the output gradient, whose size follows the batch: OpenVINO refuses it too."""
    from onnxtrain.runtime.openvino import _read_dynamic_kernel, core, dynamic_kernel

    model = _gradient_graph(case)[0]
    assert "kernel of dynamic size" in dynamic_kernel(ir.from_proto(model).graph)
    assert _read_dynamic_kernel(core().read_model(model.SerializeToString())) is not None
