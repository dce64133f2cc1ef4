"""Gradient rules: the nn family (softmax, losses, dropout, normalizations, GELUs, conv and pooling).

Shared math lives in private helpers: ``_nn_norm`` (moments and the normalization backward) and
``_nn_window`` (padding, window adjoints and the convolution weight gradient).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import MS_DOMAIN, GradContext, RuleTable
from onnxtrain.autodiff.rules import _nn_norm as norm
from onnxtrain.autodiff.rules import _nn_window as window

rules = RuleTable("nn")
r = rules.register

# Rules whose single-node finite-difference cases need typed outputs that onnx shape inference does not
# give (onnxruntime's contrib ops; GroupNormalization, a function op): staged in their own table, checked
# by tests/autodiff/test_nn_torch.py, until gradcheck types those outputs and rules/__init__.py lists it.
staged_rules = RuleTable("nn_staged")
rs = staged_rules.register


def _rank(g: GradContext, value: ir.Value, what: str) -> int:
    rank = g.rank(value)
    if rank is None:
        raise ValueError(
            f"{g.node.op_type} node {g.node.name!r}: the gradient needs the rank of {what} "
            f"({value.name!r}); run onnx shape inference on the model first (gradient_model does this)"
        )
    return rank


def _output_like(g: GradContext, i: int, like: ir.Value) -> ir.Value:
    return norm.forward_output(g, i, like.dtype, like.shape)


# -- softmax ------------------------------------------------------------------------------------
@r("Softmax", since=13)
def grad_softmax(g: GradContext):  # dx = y * (dy - sum(dy * y))
    y, dy = g.outputs[0], g.dy[0]
    dot = g.reduce("ReduceSum", g.b.Mul(dy, y), [g.attr("axis", -1)])
    return (g.b.Mul(y, g.b.Sub(dy, dot)),)


def _log_softmax_backward(g: GradContext, dlogp: ir.Value, logp: ir.Value, axis: int) -> ir.Value:
    """dx = dlogp - softmax * sum(dlogp) along ``axis``."""
    total = g.reduce("ReduceSum", dlogp, [axis])
    return g.b.Sub(dlogp, g.b.Mul(g.b.Exp(logp), total))


@r("LogSoftmax", since=13)
def grad_log_softmax(g: GradContext):
    return (_log_softmax_backward(g, g.dy[0], g.outputs[0], g.attr("axis", -1)),)


# -- losses -------------------------------------------------------------------------------------
def _one_hot(g: GradContext, target: ir.Value, scores: ir.Value) -> ir.Value:
    """A float mask shaped like ``scores`` [N, C, d...]: 1 where the class equals the target."""
    rank = _rank(g, scores, "the scores")
    depth = g.b.Gather(g.b.Shape(scores), g.b.ints(1))
    classes = g.b.Range(g.b.ints(0), depth, g.b.ints(1))
    classes = g.b.Reshape(classes, g.b.ints([1, -1] + [1] * (rank - 2)))
    target = target if target.dtype == ir.DataType.INT64 else g.b.Cast(target, to=ir.DataType.INT64)
    hit = g.b.Equal(g.b.Unsqueeze(target, g.b.ints([1])), classes)
    return g.b.Cast(hit, to=scores.dtype)


def _sample_weights(g: GradContext, target: ir.Value, weight_input: int, like: ir.Value):
    """(safe target, per-sample weight or None): weight[target], zero where target == ignore_index."""
    ignore = g.attr("ignore_index")
    safe, keep = target, None
    if ignore is not None:
        keep = g.b.Not(g.b.Equal(target, g.b.const(np.asarray(ignore, dtype=target.dtype.numpy()))))
        safe = g.b.Where(keep, target, g.b.const(np.zeros((), dtype=target.dtype.numpy())))
    w = None
    if g.has_input(weight_input):
        w = g.b.Gather(g.inputs[weight_input], safe)
        if w.dtype != like.dtype:
            w = g.b.Cast(w, to=like.dtype)
    if keep is not None:
        keep_f = g.b.Cast(keep, to=like.dtype)
        w = keep_f if w is None else g.b.Mul(w, keep_f)
    return safe, w


def _nll_coefficients(g: GradContext, dloss: ir.Value, scores: ir.Value, target: ir.Value,
                      weight_input: int) -> tuple[ir.Value, ir.Value, bool]:
    """NegativeLogLikelihoodLoss's gradient w.r.t. its scores is ``-coef`` at each sample's target class
    and zero elsewhere. Returns (safe target, coef, per_sample): coef is a scalar, or [N, d...] when
    ``per_sample``.

    A mean without class weights or ``ignore_index`` takes weights of one (``target == target``), so its count
    is a float ``ReduceSum`` and its scale per sample, as with weights: the same values (``n`` exact, ``g / n``
    times 1), but OpenVINO's CPU plugin rewrote ``g / Cast(Size(target))`` into a ``Multiply`` by a ``Power(n,
    -1)`` of its own, without the loss region's float32 marking, and under its bf16 hint the scale rounded to
    bfloat16 (on-device ``CrossEntropyLoss()``, 27 rows: every gradient 1.0013x float64's; docs/precision.md)."""
    reduction = g.attr("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"{g.node.op_type} node {g.node.name!r}: unknown reduction {reduction!r}")
    safe, w = _sample_weights(g, target, weight_input, scores)
    if w is None and reduction == "mean":  # weights of one: the count a float sum, the scale per sample
        w = g.b.Cast(g.b.Equal(target, target), to=scores.dtype)
    coef = dloss  # per sample for "none", a scalar otherwise
    if reduction == "mean":
        total = g.b.ReduceSum(w, keepdims=0)
        zero = g.b.scalar(0.0, scores)
        count = g.b.Where(g.b.Equal(total, zero), g.b.scalar(1.0, scores), total)  # all ignored: 0 grad
        coef = g.b.Div(coef, count)
    if w is not None:
        coef = g.b.Mul(coef, w)
    return safe, coef, reduction == "none" or w is not None


def _per_row(g: GradContext, coef: ir.Value, scores: ir.Value) -> ir.Value:
    """A per-sample ``coef`` [N, d...] as [N, 1, d...], to scale the scores' rows. A ``Reshape`` (to [-1, 1] for
    2-D scores; else to ``coef``'s shape with a 1 put after ``N``, zeros meant as sizes), not an ``Unsqueeze``:
    OpenVINO's CPU plugin rewrites an ``Unsqueeze`` into a ``Reshape`` of its own that loses the loss region's
    float32 marking, and under its bf16 hint the loss gradient's scale (``g / count``) was rounded to bfloat16,
    every gradient of the step with it (docs/precision.md). Scores of unknown rank, or opsets before 14 (no
    ``allowzero``): the ``Unsqueeze``."""
    if scores.shape is not None and len(scores.shape) == 2:
        return g.b.Reshape(coef, g.b.ints([-1, 1]))
    if scores.shape is None or g.onnx_opset < 14:
        return g.b.Unsqueeze(coef, g.b.ints([1]))
    shape = g.b.Shape(coef)
    head, tail = (g.b.Slice(shape, g.b.ints([a]), g.b.ints([b])) for a, b in ((0, 1), (1, len(scores.shape) - 1)))
    return g.b.Reshape(coef, g.b.Concat(head, g.b.ints([1]), tail, axis=0), allowzero=1)


def _scatter_targets(g: GradContext, data: ir.Value, safe: ir.Value, coef: ir.Value, per_sample: bool):
    """``data`` minus ``coef`` at each sample's target class (axis 1), elsewhere unchanged.

    From opset 16 a ScatterElements(reduction="add") touches N entries, where a one-hot mask would make
    four passes over all N x C scores (the bulk of a language model's loss backward); before, the mask.
    """
    if g.onnx_opset < 16:
        hit = _one_hot(g, safe, g.inputs[0])  # the scores: [N, C, d...] like data
        return g.b.Sub(data, g.b.Mul(hit, _per_row(g, coef, g.inputs[0]) if per_sample else coef))
    index = g.b.Unsqueeze(safe if safe.dtype == ir.DataType.INT64 else g.b.Cast(safe, to=ir.DataType.INT64),
                          g.b.ints([1]))
    if per_sample:  # [N, 1, d...], the index's shape; a Mul by -1, not a Neg: OpenVINO's CPU plugin rewrites a
        # Neg (and an Expand) into nodes of its own without the float32 marking, as it does an Unsqueeze
        updates = _per_row(g, g.b.Mul(coef, g.b.scalar(-1.0, g.inputs[0])), g.inputs[0])
    else:
        updates = g.b.Expand(g.b.Neg(coef), g.b.Shape(index))
    return g.b.ScatterElements(data, index, updates, axis=1, reduction="add")


def _no_weight_grad(g: GradContext, i: int) -> None:
    if len(g.needs) > i and g.needs[i]:
        raise NotImplementedError(
            f"{g.node.op_type} node {g.node.name!r}: no gradient w.r.t. the class weights "
            f"({g.inputs[i].name!r}); keep them constant (leave them out of wrt)"
        )


@r("NegativeLogLikelihoodLoss", since=12)
def grad_nll_loss(g: GradContext):
    _no_weight_grad(g, 2)
    scores = g.inputs[0]
    safe, coef, per_sample = _nll_coefficients(g, g.dy[0], scores, g.inputs[1], 2)
    return (_scatter_targets(g, g.zeros_like(scores), safe, coef, per_sample),)


@r("SoftmaxCrossEntropyLoss", since=12)
def grad_softmax_cross_entropy(g: GradContext):
    """Through the log-probabilities (output 1, added if the node omits it)."""
    _no_weight_grad(g, 2)
    scores, target = g.inputs[0], g.inputs[1]
    log_prob = _output_like(g, 1, scores)
    dlogp = g.dy[1] if len(g.dy) > 1 else None
    if g.dy[0] is None:
        return (_log_softmax_backward(g, dlogp, log_prob, 1),)
    safe, coef, per_sample = _nll_coefficients(g, g.dy[0], log_prob, target, 2)
    if dlogp is not None:  # the log-probabilities are used elsewhere too: the general route
        return (_log_softmax_backward(g, _scatter_targets(g, dlogp, safe, coef, per_sample), log_prob, 1),)
    # dlogp is -coef at the targets only, so its sum over classes is -coef: dx = p * coef - onehot * coef.
    probs = g.b.Exp(log_prob)
    scaled = g.b.Mul(probs, _per_row(g, coef, log_prob) if per_sample else coef)
    return (_scatter_targets(g, scaled, safe, coef, per_sample),)


# -- dropout ------------------------------------------------------------------------------------
@r("Dropout", since=12)
def grad_dropout(g: GradContext):
    """Training: dx = dy * mask / (1 - ratio); inference: dx = dy (``training_mode`` may be dynamic)."""
    x, dy = g.inputs[0], g.dy[0]
    training = g.const_input(2)
    if not g.has_input(2) or (training is not None and not bool(training)):
        return (dy,)
    mask = g.b.Cast(g.output(1), to=x.dtype)
    if g.has_input(1):
        ratio = g.inputs[1] if g.inputs[1].dtype == x.dtype else g.b.Cast(g.inputs[1], to=x.dtype)
        scale = g.b.Div(g.b.scalar(1.0, x), g.b.Sub(g.b.scalar(1.0, x), ratio))
    else:
        scale = g.b.scalar(2.0, x)  # default ratio 0.5
    if training is None:  # decided at run time; in inference mode the mask is all ones
        scale = g.b.Where(g.inputs[2], scale, g.b.scalar(1.0, x))
    return (g.b.Mul(g.b.Mul(dy, mask), scale),)


# -- GELU family ----------------------------------------------------------------------------------
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class _Typed:
    """A builder whose ``scalar(v, _)`` takes the element type of ``like`` (a forward value whose type
    is known) instead of that of its second argument, which may be a fresh value without one."""

    def __init__(self, b, like: ir.Value):
        self._b, self._like = b, like

    def scalar(self, value: float, _=None) -> ir.Value:
        return self._b.scalar(value, self._like)

    def __getattr__(self, name):
        return getattr(self._b, name)


def _gelu_erf_slope(g: GradContext, x: ir.Value) -> ir.Value:
    """d/dx [x * Phi(x)] = Phi(x) + x * phi(x), in 9 full-size ops (10 with the product by dy; torch's
    ``gelu_backward`` is one kernel, the standard onnxruntime wheel has no ``GeluGrad``). Phi(x) = 0.5 * erf
    + 0.5 is one ``HardSigmoid``, whose clamp to [0, 1] never bites since erf is in [-1, 1] (onnxruntime
    runs it in place; it has no float64 kernel, nor has ``Erf``). Each op is a pass over the whole tensor,
    which is what the gradient costs at BERT-small's 4x batch ([32, 128, 1024]): docs/memory.md.

    The ``x * phi(x)`` term is made first and Phi(x) last, so that Phi's ``x / sqrt 2`` is the last read of
    ``x``: run in this order, at most three full-size values are alive beside the incoming gradient (``x``
    and two temporaries, then the term and two), where Phi first kept it beside ``x`` and two of the
    Gaussian's temporaries: four (the on-device training graph's peak at budget 0, docs/memory.md)."""
    b = _Typed(g.b, g.inputs[0])
    pdf = b.Mul(b.Exp(b.Mul(b.Mul(x, x), b.scalar(-0.5, x))), b.scalar(1.0 / math.sqrt(2.0 * math.pi), x))
    x_pdf = b.Mul(x, pdf)
    cdf = b.HardSigmoid(b.Erf(b.Mul(x, b.scalar(1.0 / math.sqrt(2.0), x))), alpha=0.5, beta=0.5)
    return b.Add(cdf, x_pdf)


def _gelu_tanh_slope(g: GradContext, x: ir.Value) -> ir.Value:
    """d/dx [0.5 x (1 + tanh(z))], z = k (x + a x^3): with h = 0.5 (1 + t), since 0.5 (1 - t^2) = h (1 - t),
    the slope is h (1 + x (1 - t) z'), z' = k + 3 k a x^2, and z = x (k + k a x^2): 14 ops where the
    textbook form took 17 (float64 too: no HardSigmoid here)."""
    b = _Typed(g.b, g.inputs[0])
    k, a = _SQRT_2_OVER_PI, 0.044715
    x2 = b.Mul(x, x)
    t = b.Tanh(b.Mul(x, b.Add(b.Mul(x2, b.scalar(k * a, x)), b.scalar(k, x))))
    half = b.Mul(b.Add(t, b.scalar(1.0, x)), b.scalar(0.5, x))
    dinner = b.Add(b.Mul(x2, b.scalar(3.0 * k * a, x)), b.scalar(k, x))
    rest = b.Add(b.Mul(b.Mul(b.Sub(b.scalar(1.0, x), t), dinner), x), b.scalar(1.0, x))
    return b.Mul(half, rest)


@r("Gelu", since=20)
def grad_gelu(g: GradContext):
    approximate = g.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu node {g.node.name!r}: unknown approximate={approximate!r}")
    slope = _gelu_tanh_slope if approximate == "tanh" else _gelu_erf_slope
    return (g.b.Mul(g.dy[0], slope(g, g.inputs[0])),)


def _biased(g: GradContext, slope_fn):
    """y = f(x + bias): dx = dy * f'(x + bias), dbias = sum_to(dx, bias)."""
    x = g.inputs[0]
    z = g.b.Add(x, g.inputs[1]) if g.has_input(1) else x
    dz = g.b.Mul(g.dy[0], slope_fn(g, z))
    dbias = g.sum_to(dz, g.inputs[1]) if g.has_input(1) and g.needs[1] else None
    return dz, dbias


@rs("Gelu", domain=MS_DOMAIN)
def grad_ms_gelu(g: GradContext):
    return (g.b.Mul(g.dy[0], _gelu_erf_slope(g, g.inputs[0])),)


@rs("BiasGelu", domain=MS_DOMAIN)
def grad_bias_gelu(g: GradContext):
    return _biased(g, _gelu_erf_slope)


@rs("FastGelu", domain=MS_DOMAIN)
def grad_fast_gelu(g: GradContext):
    return _biased(g, _gelu_tanh_slope)


@rs("QuickGelu", domain=MS_DOMAIN)
def grad_quick_gelu(g: GradContext):  # y = x * sigmoid(a x); y' = s + a x s (1 - s)
    x, b = g.inputs[0], g.b
    alpha = b.scalar(g.attr("alpha", 1.702), x)
    s = b.Sigmoid(b.Mul(alpha, x))
    slope = b.Add(s, b.Mul(b.Mul(alpha, x), b.Mul(s, b.Sub(b.scalar(1.0, x), s))))
    return (b.Mul(g.dy[0], slope),)


# -- normalizations -------------------------------------------------------------------------------
def _trailing_axes(g: GradContext) -> list[int]:
    rank = _rank(g, g.inputs[0], "the input")
    return list(range(g.attr("axis", -1) % rank, rank))


@r("LayerNormalization", since=17)
def grad_layer_norm(g: GradContext):
    axes = _trailing_axes(g)
    stats = norm.saved_or_recomputed(g, axes, mean_output=1, invstd_output=2, rms=False)
    return norm.affine_norm_backward(g, stats, g.dy[0], axes, scale_input=1, bias_input=2)


@rs("SimplifiedLayerNormalization")
def grad_simplified_layer_norm(g: GradContext):
    axes = _trailing_axes(g)
    stats = norm.saved_or_recomputed(g, axes, mean_output=None, invstd_output=1, rms=True)
    return norm.affine_norm_backward(g, stats, g.dy[0], axes, scale_input=1, bias_input=None)


@r("RMSNormalization", since=23)
def grad_rms_norm(g: GradContext):
    axes = _trailing_axes(g)
    stats = norm.saved_or_recomputed(g, axes, mean_output=None, invstd_output=None, rms=True)
    return norm.affine_norm_backward(g, stats, g.dy[0], axes, scale_input=1, bias_input=None)


def _skip_norm(g: GradContext, rms: bool):
    """y = norm(s) * gamma [+ beta] over the last axis, s = input + skip [+ bias] (output 3)."""
    x = g.inputs[0]
    axes = [_rank(g, x, "the input") - 1]
    bias_input = 3 if rms else 4
    total = _output_like(g, 3, x)
    grads = [None] * len(g.inputs)
    ds = g.dy[3] if len(g.dy) > 3 else None
    if g.dy[0] is not None:
        stats = norm.saved_or_recomputed(g, axes, mean_output=None if rms else 1, invstd_output=2,
                                         rms=rms, x=total, default_eps=1e-12)
        grads = norm.affine_norm_backward(g, stats, g.dy[0], axes, scale_input=2,
                                          bias_input=None if rms else 3, x=total)
        ds = grads[0] if ds is None else g.b.Add(grads[0], ds)
    if ds is None:  # only the saved statistics are differentiated: they carry no gradient
        return ()
    grads[0] = ds
    if g.needs[1]:
        grads[1] = g.sum_to(ds, g.inputs[1])
    if g.has_input(bias_input) and g.needs[bias_input]:
        grads[bias_input] = g.sum_to(ds, g.inputs[bias_input])
    return grads


@rs("SkipLayerNormalization", domain=MS_DOMAIN)
def grad_skip_layer_norm(g: GradContext):
    return _skip_norm(g, rms=False)


@rs("SkipSimplifiedLayerNormalization", domain=MS_DOMAIN)
def grad_skip_simplified_layer_norm(g: GradContext):
    return _skip_norm(g, rms=True)


# -- per-channel normalizations: [N, C, spatial...] ------------------------------------------------
def _per_channel(g: GradContext, p: ir.Value, n: int, dtype: ir.DataType) -> ir.Value:
    """A [C] parameter as [C, 1, ...] (broadcasting against [N, C, spatial...]), in ``dtype``."""
    p = norm.cast(g, p, dtype)
    return g.b.Unsqueeze(p, g.b.ints(list(range(1, n + 1)))) if n else p


def _batch_norm_training(g: GradContext) -> bool:
    if g.opset >= 14:
        return bool(g.attr("training_mode", 0))
    return sum(1 for out in g.outputs if out.name) > 1  # before opset 14: statistics outputs = training


@r("BatchNormalization")
def grad_batch_norm(g: GradContext):
    """Training: through the batch statistics (the running statistics carry no gradient);
    inference: an affine map of x, with gradients for the input mean and variance too."""
    x, scale = g.inputs[0], g.inputs[1]
    dy, b = g.dy[0], g.b
    n = _rank(g, x, "the input") - 2
    axes = [0, *range(2, n + 2)]
    eps = g.attr("epsilon", 1e-5)
    dxhat = b.Mul(dy, _per_channel(g, scale, n, x.dtype))
    grads = [None] * 5
    if _batch_norm_training(g):
        mean, invstd = norm.moments(g, x, axes, eps, False, x.dtype)
        stats = norm.Stats(b.Mul(b.Sub(x, mean), invstd), invstd, False, x.dtype)
        grads[0] = norm.normalize_backward(g, stats, dxhat, axes)
        xhat = stats.xhat
    else:
        var = norm.cast(g, g.inputs[4], x.dtype)
        invstd_c = b.Reciprocal(b.Sqrt(b.Add(var, b.const(eps, dtype=x.dtype))))
        invstd = _per_channel(g, invstd_c, n, x.dtype)
        xhat = b.Mul(b.Sub(x, _per_channel(g, g.inputs[3], n, x.dtype)), invstd)
        grads[0] = b.Mul(dxhat, invstd)
        if g.needs[3]:
            grads[3] = norm.cast(g, b.Neg(b.ReduceSum(grads[0], b.ints(axes), keepdims=0)), g.inputs[3].dtype)
        if g.needs[4]:
            proj = b.ReduceSum(b.Mul(dxhat, xhat), b.ints(axes), keepdims=0)
            dvar = b.Mul(b.Mul(proj, b.Mul(invstd_c, invstd_c)), b.const(-0.5, dtype=x.dtype))
            grads[4] = norm.cast(g, dvar, g.inputs[4].dtype)
    if g.needs[1]:
        grads[1] = norm.cast(g, b.ReduceSum(b.Mul(dy, xhat), b.ints(axes), keepdims=0), scale.dtype)
    if g.needs[2]:
        grads[2] = norm.cast(g, b.ReduceSum(dy, b.ints(axes), keepdims=0), g.inputs[2].dtype)
    return grads


@r("InstanceNormalization")
def grad_instance_norm(g: GradContext):
    x, scale = g.inputs[0], g.inputs[1]
    dy, b = g.dy[0], g.b
    n = _rank(g, x, "the input") - 2
    axes = list(range(2, n + 2))
    mean, invstd = norm.moments(g, x, axes, g.attr("epsilon", 1e-5), False, x.dtype)
    stats = norm.Stats(b.Mul(b.Sub(x, mean), invstd), invstd, False, x.dtype)
    dx = norm.normalize_backward(g, stats, b.Mul(dy, _per_channel(g, scale, n, x.dtype)), axes)
    dscale = window.reduce_batch_spatial(g, b.Mul(dy, stats.xhat), n) if g.needs[1] else None
    dbias = window.reduce_batch_spatial(g, dy, n) if g.needs[2] else None
    return dx, dscale, dbias


@rs("GroupNormalization", since=21)
def grad_group_norm(g: GradContext):
    """x as [N, G, C/G * spatial], normalized over the last axis; scale and bias per channel."""
    x, scale = g.inputs[0], g.inputs[1]
    dy, b = g.dy[0], g.b
    n = _rank(g, x, "the input") - 2
    compute = x.dtype if x.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) else ir.DataType.FLOAT
    grouped = b.ints([0, g.attr("num_groups"), -1])
    xg = b.Reshape(norm.cast(g, x, compute), grouped)
    dyc = dy if x.dtype == compute else b.Cast(dy, to=compute)
    mean, invstd = norm.moments(g, xg, [2], g.attr("epsilon", 1e-5), False, compute)
    stats = norm.Stats(b.Mul(b.Sub(xg, mean), invstd), invstd, False, compute)
    dxhat = b.Reshape(b.Mul(dyc, _per_channel(g, scale, n, compute)), grouped)
    dx = b.Reshape(norm.normalize_backward(g, stats, dxhat, [2]), b.Shape(x))
    dscale = dbias = None
    if g.needs[1]:
        xhat = b.Reshape(stats.xhat, b.Shape(x))
        dscale = norm.cast(g, window.reduce_batch_spatial(g, b.Mul(dyc, xhat), n), scale.dtype)
    if g.needs[2]:
        dbias = window.reduce_batch_spatial(g, dy, n)
    return norm.cast(g, dx, x.dtype), dscale, dbias


# -- convolutions -----------------------------------------------------------------------------------
def _kernel(g: GradContext, w: ir.Value, n: int) -> list[int]:
    kernel = g.attr("kernel_shape")
    if kernel is None and w.shape is not None:
        kernel = list(w.shape[2:])
    if kernel is None or not all(isinstance(k, int) for k in kernel):
        raise ValueError(f"{g.node.op_type} node {g.node.name!r}: the gradient needs a static kernel "
                         f"shape; give the node a kernel_shape attribute or a weight of known shape")
    return list(kernel)


def _channels_per_group(g: GradContext, w: ir.Value) -> ir.Value:
    """Axis 1 of a Conv or ConvTranspose weight (channels per group) as a 1-D int64 value: a constant where
    the shape is static, else read at run time (a weight that is a graph input has dynamic leading axes)."""
    dim = None if w.shape is None else w.shape[1]
    if isinstance(dim, int):
        return g.b.ints([dim])
    return g.b.Slice(g.b.Shape(w), g.b.ints([1]), g.b.ints([2]))


@r("Conv")
def grad_conv(g: GradContext):
    x, w, dy = g.inputs[0], g.inputs[1], g.dy[0]
    n = window.spatial_rank(g, x)
    win = window.window_of(g, n, _kernel(g, w, n))
    group = g.attr("group", 1)
    pads = window.resolve_pads(g, x, win, n)
    dx = window.input_adjoint(g, dy, w, x, pads, win, group, n) if g.needs[0] else None
    dw = None
    if g.needs[1]:
        xp = window.pad(g, x, pads.begin, pads.end, n)
        dw = window.weight_gradient(g, xp, dy, win, group, _channels_per_group(g, w), n)
    db = window.reduce_batch_spatial(g, dy, n) if g.has_input(2) and g.needs[2] else None
    return dx, dw, db


@r("ConvTranspose")
def grad_conv_transpose(g: GradContext):
    """y = crop(full), full = the transposed convolution: x's gradient is a convolution of the padded dy,
    W's a correlation of the padded dy with x."""
    x, w, dy = g.inputs[0], g.inputs[1], g.dy[0]
    n = window.spatial_rank(g, x)
    win = window.window_of(g, n, _kernel(g, w, n))
    group = g.attr("group", 1)
    if g.attr("output_shape") is not None:
        raise ValueError(f"ConvTranspose node {g.node.name!r}: no gradient for attribute output_shape; "
                         "re-export the model with explicit pads and output_padding")
    if g.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ValueError(f"ConvTranspose node {g.node.name!r}: no gradient for auto_pad="
                         f"{g.attr('auto_pad')}; re-export the model with explicit pads")
    pads = window.resolve_pads(g, x, win, n)
    full = window.pad(g, dy, pads.begin, pads.end, n)
    dx = dw = None
    if g.needs[0]:
        dx = g.b.Conv(full, w, strides=win.strides, dilations=win.dilations, group=group,
                      kernel_shape=win.kernel)
        if any(g.attr("output_padding", [0] * n)):  # trailing rows no input reached
            dx = g.b.Slice(dx, g.b.ints([0] * n), window.spatial_shape(g, x, n), g.b.ints(list(range(2, n + 2))))
    if g.needs[1]:
        dw = window.weight_gradient(g, full, x, win, group, _channels_per_group(g, w), n)
    db = window.reduce_batch_spatial(g, dy, n) if g.has_input(2) and g.needs[2] else None
    return dx, dw, db


# -- pooling ------------------------------------------------------------------------------------------
@r("MaxPool")
def grad_max_pool(g: GradContext):
    """Scatter-add dy onto the argmax of each window, read from the Indices output where the model has it;
    else the first maximum of each window found again (:func:`window.first_max_adjoint`): a MaxPool with indices
    runs on a slow path in both backends (onnxruntime: 14 ms for ResNet-18's at 64x64, batch 16; OpenVINO: its
    reference implementation, most of the forward)."""
    x, dy, b = g.inputs[0], g.dy[0], g.b
    no_indices = len(g.node.outputs) < 2 or not g.node.outputs[1].name
    if no_indices and x.dtype != ir.DataType.DOUBLE:  # none made for the gradient either (onnxruntime has no
        # float64 ConvTranspose, which puts the values back: float64 adds the indices as before)
        n = window.spatial_rank(g, x)
        win = window.window_of(g, n, g.attr("kernel_shape"))
        return (window.first_max_adjoint(g, dy, x, g.outputs[0], window.resolve_pads(g, x, win, n), win, n),)
    if g.opset < 16:
        raise ValueError(f"MaxPool node {g.node.name!r}: the gradient needs ScatterElements with "
                         f"reduction='add' (opset 16); the model has opset {g.opset}. Convert it with "
                         "onnx.version_converter.convert_version(model, 17)")
    if g.attr("storage_order", 0) != 0:
        raise ValueError(f"MaxPool node {g.node.name!r}: no gradient for storage_order=1 (column-major "
                         "indices); re-export the model without it")
    indices = norm.forward_output(g, 1, ir.DataType.INT64, g.outputs[0].shape)
    flat = b.ints([-1])
    zeros = b.ConstantOfShape(b.Reshape(b.Size(x), flat), value=ir.tensor(np.zeros((1,), x.dtype.numpy())))
    dx = b.ScatterElements(zeros, b.Reshape(indices, flat), b.Reshape(dy, flat), axis=0, reduction="add")
    return (b.Reshape(dx, b.Shape(x)),)


@r("AveragePool")
def grad_average_pool(g: GradContext):
    """dx = windows^T (dy / divisor); divisor per window = counts of x in it / AveragePool(ones), which
    follows the runtime's own count_include_pad and ceil_mode conventions."""
    x, dy, b = g.inputs[0], g.dy[0], g.b
    n = window.spatial_rank(g, x)
    win = window.window_of(g, n, g.attr("kernel_shape"))
    pads = window.resolve_pads(g, x, win, n)
    ones = b.ConstantOfShape(b.Concat(b.ints([1, 1]), window.spatial_shape(g, x, n), axis=0),
                             value=ir.tensor(np.ones((1,), x.dtype.numpy())))
    attrs = {name: attr.value for name, attr in g.node.attributes.items()}
    averages = b.AveragePool(ones, **attrs)  # [1, 1, out...] = count / divisor
    weights = b.Div(averages, window.window_counts(g, x, dy, pads, win, n))
    return (window.window_sum_adjoint(g, b.Mul(dy, weights), x, pads, win, n),)


@r("GlobalAveragePool")
def grad_global_average_pool(g: GradContext):
    x, dy, b = g.inputs[0], g.dy[0], g.b
    share = b.Div(b.Cast(b.Size(dy), to=x.dtype), b.Cast(b.Size(x), to=x.dtype))  # 1 / spatial size
    return (b.Mul(b.Expand(dy, b.Shape(x)), share),)


@r("GlobalMaxPool")
def grad_global_max_pool(g: GradContext):
    """dy goes to the maximum of each map; ties share it equally."""
    x, y, dy, b = g.inputs[0], g.outputs[0], g.dy[0], g.b
    n = window.spatial_rank(g, x)
    hits = b.Cast(b.Equal(x, y), to=x.dtype)
    count = b.ReduceSum(hits, b.ints(list(range(2, n + 2))), keepdims=1)
    return (b.Mul(hits, b.Div(dy, count)),)


__all__ = ["rules", "staged_rules"]
