"""Training-mode BatchNorm for the dynamo exporter, in differentiable primitive ONNX ops.

The exporter's own translation of ``aten._native_batch_norm_legit_functional`` always emits an
inference-mode ``BatchNormalization`` (running statistics, no update), which is wrong for training. This
translation normalizes with the batch statistics and returns the running statistics updated the way
PyTorch does (unbiased variance, PyTorch's momentum), so ORTModule can copy them into the module's buffers.
It uses only ReduceMean/Sub/Mul/Add/Sqrt/Reciprocal/Reshape, which have gradient rules.
"""

from __future__ import annotations

from onnxscript import opset18 as op

from onnxtrain.capture.stop_gradient import translate_stop_gradient


def batch_norm_functional(input, weight=None, bias=None, running_mean=None, running_var=None,
                          training: bool = False, momentum: float = 0.1, eps: float = 1e-5):
    rank = len(input.shape)
    axes = op.Constant(value_ints=[0, *range(2, rank)])
    stat_shape = op.Constant(value_ints=[1, -1] + [1] * (rank - 2))
    if training or running_mean is None:
        mean = op.ReduceMean(input, axes, keepdims=1)
        centered = op.Sub(input, mean)
        var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)
    else:
        mean = op.Reshape(running_mean, stat_shape)
        centered = op.Sub(input, mean)
        var = op.Reshape(running_var, stat_shape)
    eps_value = op.CastLike(op.Constant(value_float=eps), input)
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, eps_value)))
    out = op.Mul(centered, rstd)
    if weight is not None:
        out = op.Mul(out, op.Reshape(weight, stat_shape))
    if bias is not None:
        out = op.Add(out, op.Reshape(bias, stat_shape))
    flat = op.Constant(value_ints=[-1])
    save_mean = op.Reshape(mean, flat)
    save_rstd = op.Reshape(rstd, flat)
    if running_mean is not None and not training:  # PyTorch returns no statistics in inference mode
        empty = op.Slice(save_mean, op.Constant(value_ints=[0]), op.Constant(value_ints=[0]))
        return out, empty, empty, running_mean, running_var
    # PyTorch's backward takes the output's gradient only: none flows back from the saved statistics.
    saved = translate_stop_gradient(save_mean), translate_stop_gradient(save_rstd)
    if running_mean is None:
        return out, *saved, running_mean, running_var
    keep = op.CastLike(op.Constant(value_float=1.0 - momentum), input)
    take = op.CastLike(op.Constant(value_float=momentum), input)
    count = op.CastLike(op.Div(op.Size(input), op.Shape(input, start=1, end=2)), input)
    one = op.CastLike(op.Constant(value_float=1.0), input)
    unbiased = op.Mul(op.Reshape(var, flat), op.Div(count, op.Sub(count, one)))
    new_mean = op.Add(op.Mul(running_mean, keep), op.Mul(save_mean, take))
    new_var = op.Add(op.Mul(running_var, keep), op.Mul(unbiased, take))
    return out, *saved, new_mean, new_var


def native_batch_norm(input, weight=None, bias=None, running_mean=None, running_var=None, training: bool = False,
                      momentum: float = 0.1, eps: float = 1e-5):
    """``aten.native_batch_norm``, which the training IR keeps when it is called directly (its in-place update
    of ``running_mean``/``running_var`` hidden in the op): the exporter's translation normalizes with the
    running statistics even for ``training=True``. Returns ``(out, save_mean, save_invstd)``."""
    return batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps)[:3]
