"""rules/nn.py against PyTorch autograd, plus the checks a finite-difference case cannot make.

Each test builds a one-node ONNX model by hand, asks ``gradient_model`` for its gradients, runs the
result in onnxruntime (float32) and compares with ``torch.autograd`` on the same inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as TF
from onnx import helper

from onnxtrain.autodiff import gradient_model

RNG = np.random.default_rng(42)


def f32(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, size=shape).astype(np.float32)


def run_grad(node: onnx.NodeProto, inputs: dict, wrt: list[str], consts: dict | None = None,
             opset: int = 20, dims: dict | None = None, diff: list[str] | None = None):
    """Build a one-node model (float inputs as graph inputs), differentiate ``sum(out * seed)`` and
    run it in onnxruntime. ``dims`` makes input dims symbolic. Returns (outputs, seeds, grads)."""
    consts = consts or {}
    dims = dims or {}
    graph_inputs = []
    for name, value in inputs.items():
        shape = [dims.get((name, i), d) for i, d in enumerate(value.shape)]
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        graph_inputs.append(helper.make_tensor_value_info(name, elem, shape))
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()]
    outs = [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o]
    graph = helper.make_graph([node], "one_node", graph_inputs, outs, initializer=inits)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    forward = _session(model).run(None, inputs)
    diff = diff or [node.output[0]]
    seeds = {f"{o}_grad": RNG.standard_normal(forward[list(node.output).index(o)].shape).astype(np.float32)
             for o in diff}
    grad = gradient_model(model, wrt=wrt, outputs=diff)
    results = _session(grad).run(None, {**inputs, **seeds})
    n = len(outs)
    return results[:n], seeds, dict(zip(wrt, results[n:]))


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def torch_grads(fn, seed: np.ndarray, **tensors):
    """Gradients of sum(fn(**tensors) * seed) for the float tensors."""
    leaves = {k: torch.tensor(v, requires_grad=v.dtype.kind == "f") for k, v in tensors.items()}
    out = fn(**leaves)
    (out * torch.tensor(seed)).sum().backward()
    return {k: v.grad.numpy() for k, v in leaves.items() if v.requires_grad}


def assert_close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=what)


# -- PyTorch autograd --------------------------------------------------------------------------------
@pytest.mark.parametrize("group,stride,pad,dilation", [(1, 1, 1, 1), (2, 2, 1, 1), (4, 1, 2, 2), (1, 2, 0, 3)])
def test_conv2d_matches_torch_with_dynamic_sizes(group, stride, pad, dilation):
    x, w, b = f32(2, 4, 9, 8), f32(8, 4 // group, 3, 2), f32(8)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=group, strides=[stride] * 2,
                            pads=[pad] * 4, dilations=[dilation] * 2)
    dims = {("x", 0): "N", ("x", 2): "H", ("x", 3): "W"}
    (y,), seeds, got = run_grad(node, {"x": x, "w": w, "b": b}, ["x", "w", "b"], dims=dims)
    conv = lambda x, w, b: TF.conv2d(x, w, b, stride, pad, dilation, group)  # noqa: E731
    want = torch_grads(conv, seeds["y_grad"], x=x, w=w, b=b)
    for name in ("x", "w", "b"):
        assert_close(got[name], want[name], f"Conv grad of {name}")


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_conv_same_padding_with_dynamic_spatial_sizes(auto_pad):
    """The pads are computed at run time from the input's shape."""
    x, w = f32(1, 2, 7, 6), f32(3, 2, 3, 4)
    node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=auto_pad, strides=[2, 3])
    (y,), seeds, got = run_grad(node, {"x": x, "w": w}, ["x", "w"], dims={("x", 2): "H", ("x", 3): "W"})

    def conv(x, w):  # total pad = (ceil(size / s) - 1) * s + k - size, the odd pixel at the end (UPPER)
        pads = []
        for size, k, s in ((6, 4, 3), (7, 3, 2)):  # torch's F.pad lists the last axis first
            total = max(0, (-(-size // s) - 1) * s + k - size)
            small, large = total // 2, total - total // 2
            pads += [small, large] if auto_pad == "SAME_UPPER" else [large, small]
        return TF.conv2d(TF.pad(x, pads), w, stride=(2, 3))

    want = torch_grads(conv, seeds["y_grad"], x=x, w=w)
    assert y.shape == conv(torch.tensor(x), torch.tensor(w)).shape
    for name in ("x", "w"):
        assert_close(got[name], want[name], f"Conv {auto_pad} grad of {name}")


@pytest.mark.parametrize("group,stride,pad,out_pad", [(1, 1, 0, 0), (1, 2, 1, 1), (2, 3, 1, 2)])
def test_conv_transpose2d_matches_torch(group, stride, pad, out_pad):
    x, w, b = f32(2, 4, 4, 3), f32(4, 6 // group, 3, 3), f32(6)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=group, strides=[stride] * 2,
                            pads=[pad] * 4, output_padding=[out_pad] * 2)
    (y,), seeds, got = run_grad(node, {"x": x, "w": w, "b": b}, ["x", "w", "b"], dims={("x", 0): "N"})
    deconv = lambda x, w, b: TF.conv_transpose2d(x, w, b, stride, pad, out_pad, group)  # noqa: E731
    want = torch_grads(deconv, seeds["y_grad"], x=x, w=w, b=b)
    for name in ("x", "w", "b"):
        assert_close(got[name], want[name], f"ConvTranspose grad of {name}")


def test_batch_norm_training_matches_torch():
    x, s, b = f32(6, 3, 4, 5), f32(3), f32(3)
    mean, var = np.zeros(3, np.float32), np.ones(3, np.float32)
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                            training_mode=1, epsilon=1e-5)
    (y, _, _), seeds, got = run_grad(node, {"x": x, "s": s, "b": b}, ["x", "s", "b"],
                                     consts={"m": mean, "v": var}, opset=15, dims={("x", 0): "N"})
    bn = lambda x, s, b: TF.batch_norm(x, torch.tensor(mean), torch.tensor(var), s, b, training=True)  # noqa: E731
    want = torch_grads(bn, seeds["y_grad"], x=x, s=s, b=b)
    for name in ("x", "s", "b"):
        assert_close(got[name], want[name], f"BatchNormalization grad of {name}")


def test_layer_norm_matches_torch():
    x, s, b = f32(2, 5, 3, 4), f32(3, 4), f32(3, 4)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-2, epsilon=1e-5)
    (y,), seeds, got = run_grad(node, {"x": x, "s": s, "b": b}, ["x", "s", "b"],
                                dims={("x", 0): "N", ("x", 1): "T"})
    ln = lambda x, s, b: TF.layer_norm(x, (3, 4), s, b, eps=1e-5)  # noqa: E731
    want = torch_grads(ln, seeds["y_grad"], x=x, s=s, b=b)
    for name in ("x", "s", "b"):
        assert_close(got[name], want[name], f"LayerNormalization grad of {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(6, 5), (3, 5, 4)])
def test_cross_entropy_with_ignore_index_and_weights_matches_torch(reduction, shape):
    x = f32(*shape, low=-3, high=3)
    labels = RNG.integers(0, 5, size=(shape[0], *shape[2:])).astype(np.int64)
    labels.flat[::4] = -100
    weight = f32(5, low=0.2, high=2.0)
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t", "w"], ["loss"], reduction=reduction,
                            ignore_index=-100)
    (loss,), seeds, got = run_grad(node, {"x": x, "t": labels}, ["x"], consts={"w": weight},
                                   dims={("x", 0): "N", ("t", 0): "N"})
    ce = lambda x, t: TF.cross_entropy(x, t, torch.tensor(weight), ignore_index=-100,  # noqa: E731
                                       reduction=reduction)
    want = torch_grads(ce, seeds["loss_grad"], x=x, t=labels)
    assert_close(loss, ce(torch.tensor(x), torch.tensor(labels)).detach().numpy(), "loss")
    assert_close(got["x"], want["x"], "SoftmaxCrossEntropyLoss grad of x")


def test_cross_entropy_mean_with_every_label_ignored_has_zero_gradient():
    """The loss is 0/0 = NaN (as in PyTorch); the gradient is zero rather than NaN."""
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss"], ignore_index=1)
    _, _, got = run_grad(node, {"x": f32(3, 4), "t": np.ones(3, np.int64)}, ["x"])
    np.testing.assert_array_equal(got["x"], np.zeros((3, 4), np.float32))


@pytest.mark.parametrize("kernel,stride,pad,dilation,ceil", [(2, 2, 0, 1, False), (3, 2, 1, 1, True),
                                                             (3, 1, 1, 2, False), (2, 3, 1, 1, True)])
def test_max_pool2d_matches_torch(kernel, stride, pad, dilation, ceil):
    x = f32(2, 3, 7, 6)
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[kernel] * 2, strides=[stride] * 2,
                            pads=[pad] * 4, dilations=[dilation] * 2, ceil_mode=int(ceil))
    (y,), seeds, got = run_grad(node, {"x": x}, ["x"], dims={("x", 0): "N", ("x", 2): "H"})
    pool = lambda x: TF.max_pool2d(x, kernel, stride, pad, dilation, ceil_mode=ceil)  # noqa: E731
    want = torch_grads(pool, seeds["y_grad"], x=x)
    assert_close(got["x"], want["x"], "MaxPool grad of x")


@pytest.mark.parametrize("kernel,stride,pad,ceil,include_pad", [(2, 2, 0, False, True), (3, 2, 1, False, False),
                                                                (3, 2, 1, True, True), (3, 2, 0, True, False)])
def test_avg_pool2d_matches_torch(kernel, stride, pad, ceil, include_pad):
    x = f32(2, 3, 7, 6)
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[kernel] * 2, strides=[stride] * 2,
                            pads=[pad] * 4, ceil_mode=int(ceil), count_include_pad=int(include_pad))
    (y,), seeds, got = run_grad(node, {"x": x}, ["x"], dims={("x", 0): "N", ("x", 3): "W"})
    pool = lambda x: TF.avg_pool2d(x, kernel, stride, pad, ceil_mode=ceil,  # noqa: E731
                                   count_include_pad=include_pad)
    assert_close(y, pool(torch.tensor(x)).numpy(), "AveragePool forward agrees with torch")
    want = torch_grads(pool, seeds["y_grad"], x=x)
    assert_close(got["x"], want["x"], "AveragePool grad of x")


# -- Dropout: random masks, checked through the mask the forward returns ------------------------------
@pytest.mark.parametrize("training", [True, False])
def test_dropout_with_dynamic_training_mode(training):
    x = f32(4, 50)
    node = helper.make_node("Dropout", ["x", "r", "training"], ["y", "mask"])
    (y, mask), seeds, got = run_grad(node, {"x": x, "training": np.array(training)}, ["x"],
                                     consts={"r": np.array(0.25, np.float32)})
    scale = 1 / 0.75 if training else 1.0
    assert_close(got["x"], seeds["y_grad"] * mask * scale, "Dropout grad of x")
    if training:
        assert 0 < mask.mean() < 1


def test_dropout_without_ratio_input_uses_one_half():
    node = helper.make_node("Dropout", ["x", "", "training"], ["y", "mask"])
    (y, mask), seeds, got = run_grad(node, {"x": f32(4, 50)}, ["x"], consts={"training": np.array(True)})
    assert_close(got["x"], seeds["y_grad"] * mask * 2.0, "Dropout grad of x")


def test_dropout_mask_added_when_the_forward_omits_it():
    x = f32(3, 40)
    node = helper.make_node("Dropout", ["x", "r", "training"], ["y"])
    (y,), seeds, got = run_grad(node, {"x": x}, ["x"], consts={"r": np.array(0.5, np.float32),
                                                               "training": np.array(True)})
    kept = y != 0  # y = x * mask * 2, and x has no zeros
    assert_close(got["x"], seeds["y_grad"] * kept * 2.0, "Dropout grad of x")


@pytest.mark.parametrize("kernel,stride,pad,ceil", [(3, 2, 1, False), (2, 2, 0, True), (3, 1, 1, False)])
def test_max_pool2d_ties_go_to_the_first_maximum_as_in_torch(kernel, stride, pad, ceil):
    """Without an Indices output the gradient finds each window's maximum again: where several elements tie
    (ReLU's zeros, rounded values), PyTorch's CPU kernel gives it to the first in the window's row-major order."""
    x = np.maximum(np.round(f32(2, 3, 7, 6) * 2), 0).astype(np.float32)  # many equal values, many zeros
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[kernel] * 2, strides=[stride] * 2,
                            pads=[pad] * 4, ceil_mode=int(ceil))
    (y,), seeds, got = run_grad(node, {"x": x}, ["x"], dims={("x", 0): "N", ("x", 2): "H"})
    pool = lambda x: TF.max_pool2d(x, kernel, stride, pad, ceil_mode=ceil)  # noqa: E731
    want = torch_grads(pool, seeds["y_grad"], x=x)
    assert_close(got["x"], want["x"], "MaxPool grad of x with ties")


@pytest.mark.parametrize("rank", [1, 3])
def test_max_pool_1d_3d_without_indices_matches_torch(rank):
    x = np.maximum(np.round(f32(2, 3, *[6] * rank) * 2), 0).astype(np.float32)  # ties included
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3] * rank, strides=[2] * rank, pads=[1] * 2 * rank)
    (y,), seeds, got = run_grad(node, {"x": x}, ["x"], dims={("x", 0): "N"})
    pool = getattr(TF, f"max_pool{rank}d")
    want = torch_grads(lambda x: pool(x, 3, 2, 1), seeds["y_grad"], x=x)
    assert_close(got["x"], want["x"], f"MaxPool{rank}d grad of x")
