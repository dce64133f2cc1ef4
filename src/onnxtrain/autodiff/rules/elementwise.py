"""Elementwise ops: arithmetic, activations, comparisons and casts.

Binary ops are registered with ``broadcast=True``: they return gradients shaped like the output and the
engine reduces them to each input's shape.
"""

from __future__ import annotations

import math

from onnxtrain.autodiff.registry import (
    ONNXTRAIN_DOMAIN,
    STOP_GRADIENT,
    GradContext,
    RuleTable,
)

rules = RuleTable("elementwise")
r = rules.register


# -- non-differentiable and piecewise-constant --------------------------------------------------
rules.no_grad(
    "Shape", "Size", "ConstantOfShape", "Range", "EyeLike", "OneHot", "NonZero",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
    "BitwiseNot", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
    "Bernoulli", "Multinomial", "Constant",
)
rules.no_grad(STOP_GRADIENT, domain=ONNXTRAIN_DOMAIN)  # detach(), no_grad blocks
# Their gradient is zero almost everywhere (PyTorch agrees): documented in docs/gradients.md.
rules.zero_grad("Round", "Floor", "Ceil", "Sign")


# -- unary: y = f(x), dx = dy * f'(x) ----------------------------------------------------------
def _one(g: GradContext, like):
    return g.b.scalar(1.0, like)


rules.elementwise("Exp", lambda g, x, y: y)
rules.elementwise("Log", lambda g, x, y: g.b.Reciprocal(x))
rules.elementwise("Sqrt", lambda g, x, y: g.b.Div(g.b.scalar(0.5, x), y))
rules.elementwise("Reciprocal", lambda g, x, y: g.b.Neg(g.b.Mul(y, y)))
rules.elementwise("Sin", lambda g, x, y: g.b.Cos(x))
rules.elementwise("Cos", lambda g, x, y: g.b.Neg(g.b.Sin(x)))
rules.elementwise("Tan", lambda g, x, y: g.b.Add(_one(g, x), g.b.Mul(y, y)))
rules.elementwise("Sinh", lambda g, x, y: g.b.Cosh(x))
rules.elementwise("Cosh", lambda g, x, y: g.b.Sinh(x))
rules.elementwise("Tanh", lambda g, x, y: g.b.Sub(_one(g, x), g.b.Mul(y, y)))
rules.elementwise("Asin", lambda g, x, y: g.b.Reciprocal(g.b.Sqrt(g.b.Sub(_one(g, x), g.b.Mul(x, x)))))
rules.elementwise("Acos", lambda g, x, y: g.b.Neg(g.b.Reciprocal(g.b.Sqrt(g.b.Sub(_one(g, x), g.b.Mul(x, x))))))
rules.elementwise("Atan", lambda g, x, y: g.b.Reciprocal(g.b.Add(_one(g, x), g.b.Mul(x, x))))
rules.elementwise("Asinh", lambda g, x, y: g.b.Reciprocal(g.b.Sqrt(g.b.Add(g.b.Mul(x, x), _one(g, x)))))
rules.elementwise("Acosh", lambda g, x, y: g.b.Reciprocal(g.b.Sqrt(g.b.Sub(g.b.Mul(x, x), _one(g, x)))))
rules.elementwise("Atanh", lambda g, x, y: g.b.Reciprocal(g.b.Sub(_one(g, x), g.b.Mul(x, x))))
rules.elementwise("Sigmoid", lambda g, x, y: g.b.Mul(y, g.b.Sub(_one(g, x), y)))
rules.elementwise("Softplus", lambda g, x, y: g.b.Sigmoid(x))
rules.elementwise("Softsign", lambda g, x, y: g.b.Reciprocal(g.b.Pow(g.b.Add(_one(g, x), g.b.Abs(x)), g.b.scalar(2.0, x))))
rules.elementwise("Abs", lambda g, x, y: g.b.Sign(x))
rules.elementwise(
    "Erf",
    lambda g, x, y: g.b.Mul(g.b.scalar(2.0 / math.sqrt(math.pi), x), g.b.Exp(g.b.Neg(g.b.Mul(x, x)))),
)
rules.elementwise(
    "Mish",  # y = x * tanh(softplus(x)); dy/dx = t + x * sigmoid(x) * (1 - t^2)
    lambda g, x, y: (lambda t: g.b.Add(t, g.b.Mul(g.b.Mul(x, g.b.Sigmoid(x)), g.b.Sub(_one(g, x), g.b.Mul(t, t)))))(
        g.b.Tanh(g.b.Softplus(x))
    ),
)


def _where_positive(g: GradContext, x, then, otherwise):
    return g.b.Where(g.b.Greater(x, g.b.scalar(0.0, x)), then, otherwise)


@r("Relu")
def grad_relu(g: GradContext):
    y, dy = g.outputs[0], g.dy[0]
    return (_where_positive(g, y, dy, g.b.scalar(0.0, dy)),)


@r("LeakyRelu")
def grad_leaky_relu(g: GradContext):
    x, dy = g.inputs[0], g.dy[0]
    alpha = g.attr("alpha", 0.01)
    return (_where_positive(g, x, dy, g.b.Mul(dy, g.b.scalar(alpha, dy))),)


@r("ThresholdedRelu")
def grad_thresholded_relu(g: GradContext):
    x, dy = g.inputs[0], g.dy[0]
    return (g.b.Where(g.b.Greater(x, g.b.scalar(g.attr("alpha", 1.0), x)), dy, g.b.scalar(0.0, dy)),)


@r("Elu")
def grad_elu(g: GradContext):
    (x,), y, dy = g.inputs, g.outputs[0], g.dy[0]
    alpha = g.b.scalar(g.attr("alpha", 1.0), x)
    return (_where_positive(g, x, dy, g.b.Mul(dy, g.b.Add(y, alpha))),)


@r("Celu")
def grad_celu(g: GradContext):  # x<=0: y = alpha*(exp(x/alpha)-1), dy/dx = exp(x/alpha)
    (x,), dy = g.inputs, g.dy[0]
    alpha = g.b.scalar(g.attr("alpha", 1.0), x)
    return (_where_positive(g, x, dy, g.b.Mul(dy, g.b.Exp(g.b.Div(x, alpha)))),)


@r("Selu")
def grad_selu(g: GradContext):
    (x,), y, dy = g.inputs, g.outputs[0], g.dy[0]
    alpha = g.attr("alpha", 1.67326319217681884765625)
    gamma = g.attr("gamma", 1.05070102214813232421875)
    neg = g.b.Mul(dy, g.b.Add(y, g.b.scalar(alpha * gamma, x)))
    return (_where_positive(g, x, g.b.Mul(dy, g.b.scalar(gamma, x)), neg),)


@r("HardSigmoid")
def grad_hard_sigmoid(g: GradContext):
    (x,), dy = g.inputs, g.dy[0]
    alpha, beta = g.attr("alpha", 0.2), g.attr("beta", 0.5)
    z = g.b.Add(g.b.Mul(x, g.b.scalar(alpha, x)), g.b.scalar(beta, x))
    inside = g.b.And(g.b.Greater(z, g.b.scalar(0.0, x)), g.b.Less(z, g.b.scalar(1.0, x)))
    return (g.b.Where(inside, g.b.Mul(dy, g.b.scalar(alpha, x)), g.b.scalar(0.0, dy)),)


@r("HardSwish")
def grad_hard_swish(g: GradContext):  # y = x * clip(x/6 + 1/2, 0, 1)
    (x,), dy = g.inputs, g.dy[0]
    slope = g.b.Add(g.b.Div(x, g.b.scalar(3.0, x)), g.b.scalar(0.5, x))
    lo, hi = g.b.Less(x, g.b.scalar(-3.0, x)), g.b.Greater(x, g.b.scalar(3.0, x))
    d = g.b.Where(lo, g.b.scalar(0.0, x), g.b.Where(hi, g.b.scalar(1.0, x), slope))
    return (g.b.Mul(dy, d),)


@r("Clip")
def grad_clip(g: GradContext):
    x, dy = g.inputs[0], g.dy[0]
    zero = g.b.scalar(0.0, dy)
    keep = None
    grads = [None, None, None]
    for i, (cmp, outside) in ((1, ("GreaterOrEqual", "Less")), (2, ("LessOrEqual", "Greater"))):
        if not g.has_input(i):
            continue
        bound = g.inputs[i]
        inside = g.b.op(cmp, x, bound)
        keep = inside if keep is None else g.b.And(keep, inside)
        if g.needs[i]:
            grads[i] = g.sum_to(g.b.Where(g.b.op(outside, x, bound), dy, zero), bound)
    if keep is None:  # Clip without bounds is Identity
        return (dy,)
    grads[0] = g.b.Where(keep, dy, zero)
    return tuple(grads)


# -- binary and variadic (broadcasting) ------------------------------------------------------------
@r("Add", "Sum", broadcast=True)
def grad_add(g: GradContext):
    return (g.dy[0],) * len(g.inputs)


@r("Mean", broadcast=True)
def grad_mean(g: GradContext):
    share = g.b.Div(g.dy[0], g.b.scalar(float(len(g.inputs)), g.dy[0]))
    return (share,) * len(g.inputs)


@r("Sub", broadcast=True)
def grad_sub(g: GradContext):
    return g.dy[0], (g.b.Neg(g.dy[0]) if g.needs[1] else None)


@r("Mul", broadcast=True)
def grad_mul(g: GradContext):
    (a, b), dy = g.inputs, g.dy[0]
    return (g.b.Mul(dy, b) if g.needs[0] else None), (g.b.Mul(dy, a) if g.needs[1] else None)


@r("Div", broadcast=True)
def grad_div(g: GradContext):
    b, y, dy = g.inputs[1], g.outputs[0], g.dy[0]
    da = g.b.Div(dy, b) if g.needs[0] else None
    db = g.b.Neg(g.b.Div(g.b.Mul(dy, y), b)) if g.needs[1] else None
    return da, db


@r("Pow", broadcast=True)
def grad_pow(g: GradContext):
    (a, e), y, dy = g.inputs, g.outputs[0], g.dy[0]
    da = db = None
    if g.needs[0]:
        exponent = g.const_input(1)
        if exponent is not None and exponent.size == 1 and float(exponent) == 2.0:
            da = g.b.Mul(dy, g.b.Mul(a, g.b.scalar(2.0, a)))
        else:
            ef = e if e.dtype == a.dtype else g.b.Cast(e, to=a.dtype)
            da = g.b.Mul(dy, g.b.Mul(ef, g.b.Pow(a, g.b.Sub(ef, g.b.scalar(1.0, a)))))
    if g.needs[1]:
        af = a if a.dtype == e.dtype else g.b.Cast(a, to=e.dtype)
        yf = y if y.dtype == e.dtype else g.b.Cast(y, to=e.dtype)
        dyf = dy if dy.dtype == e.dtype else g.b.Cast(dy, to=e.dtype)
        db = g.b.Mul(dyf, g.b.Mul(yf, g.b.Log(af)))
    return da, db


@r("PRelu", broadcast=True)
def grad_prelu(g: GradContext):
    (x, slope), dy = g.inputs, g.dy[0]
    zero = g.b.scalar(0.0, dy)
    pos = g.b.Greater(x, g.b.scalar(0.0, x))
    dx = g.b.Where(pos, dy, g.b.Mul(dy, slope)) if g.needs[0] else None
    ds = g.b.Where(pos, zero, g.b.Mul(dy, x)) if g.needs[1] else None
    return dx, ds


@r("Min", "Max", broadcast=True)
def grad_min_max(g: GradContext):
    """The gradient goes to the input(s) equal to the result; ties share it equally (as PyTorch)."""
    y, dy = g.outputs[0], g.dy[0]
    if len(g.inputs) == 1:
        return (dy,)
    masks = [g.b.Cast(g.b.Equal(x, y), to=dy.dtype) for x in g.inputs]
    count = g.b.Sum(*masks)
    share = g.b.Div(dy, count)
    return tuple(g.b.Mul(share, m) if need else None for m, need in zip(masks, g.needs))


@r("Mod", broadcast=True)
def grad_mod(g: GradContext):  # float Mod (fmod=1): a - b * trunc(a / b)
    (a, b), dy = g.inputs, g.dy[0]
    db = None
    if g.needs[1]:
        q = g.b.Div(a, b)
        trunc = g.b.Mul(g.b.Sign(q), g.b.Floor(g.b.Abs(q)))
        db = g.b.Neg(g.b.Mul(dy, trunc))
    return dy, db


@r("Where", broadcast=True)
def grad_where(g: GradContext):
    cond, dy = g.inputs[0], g.dy[0]
    zero = g.b.scalar(0.0, dy)
    return (
        None,
        g.b.Where(cond, dy, zero) if g.needs[1] else None,
        g.b.Where(cond, zero, dy) if g.needs[2] else None,
    )


@r("Expand", broadcast=True)
def grad_expand(g: GradContext):
    return g.dy[0], None


# -- identity-like -----------------------------------------------------------------------------
rules.linear("Identity", lambda g, dy: dy)
rules.linear("Neg", lambda g, dy: g.b.Neg(dy))


@r("Cast", "CastLike")
def grad_cast(g: GradContext):
    x = g.inputs[0]
    return (g.b.Cast(g.dy[0], to=x.dtype),)
