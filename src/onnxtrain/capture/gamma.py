"""``lgamma``, ``digamma`` and ``polygamma`` (and ``mvlgamma``, a sum of ``lgamma``) from ordinary ops.

``torch.export`` lowers them to prims (``prims.lgamma``, ``prims.digamma``) or keeps ``aten.polygamma``, none
of which has an ONNX function. Each is written here the way libraries compute it, so its gradient (the next
function of the family: ``digamma`` for ``lgamma``, ``polygamma(n + 1)`` for ``polygamma(n)``) is the
derivative of the same formula:

- for ``x >= 0.5``, the recurrence moves the argument up by ``SHIFT``: ``lgamma(x) = lgamma(x + 8) -
  sum_k log(x + k)`` and ``psi_n(x) = psi_n(x + 8) + (-1)^(n+1) n! sum_k (x + k)^-(n+1)`` (``k < 8``), and at
  ``w = x + 8 >= 8.5`` the asymptotic (Stirling) series with Bernoulli numbers up to ``B_10`` is exact to
  float32 precision;
- for ``x < 0.5``, the reflection formulas: ``lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x)`` and
  ``psi_n(x) = (-1)^n psi_n(1 - x) - pi d^n/dx^n cot(pi x)``, the derivative of the cotangent a polynomial
  in ``cot(pi x)`` (``P_{k+1}(c) = -(1 + c^2) P_k'(c)``, built here once per ``n``); ``sin`` and ``cot`` of
  ``pi`` times ``f = x - round(x)``, which is exact, so large negative arguments keep their precision.

Each branch computes on an argument that is valid in every lane (the other branch's lanes get a harmless
stand-in), so the ``Where`` that picks one never multiplies a zero gradient by an infinite one. At the poles (0, -1, -2, ...):
``lgamma`` is ``inf`` and ``digamma`` ``-inf`` at 0 and NaN at the negative integers, as in PyTorch; not
matched there are the gradients (NaN here, +-inf in PyTorch) and ``polygamma(n >= 1)`` (inf here, an
arbitrary large number in PyTorch).
"""

from __future__ import annotations

import math

import numpy as np
from onnxscript import opset18 as op

from onnxtrain.capture.constants import scalar_like as _like

SHIFT = 8
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66)  # B_2, B_4, ..., B_10


def lgamma(self):
    """``lgamma(Tensor self)``"""
    reflect = op.Less(self, _like(0.5, self))
    z = op.Where(reflect, op.Sub(_like(1.0, self), self), self)  # >= 0.5 everywhere: lgamma(1 - x) or lgamma(x)
    w = op.Add(z, _like(float(SHIFT), z))
    inv = op.Reciprocal(w)
    series = _odd_series(inv, [b / (2 * k * (2 * k - 1)) for k, b in enumerate(_BERNOULLI, 1)])
    stirling = op.Add(op.Sub(op.Mul(op.Sub(w, _like(0.5, w)), op.Log(w)), w),
                      op.Add(_like(0.5 * math.log(2 * math.pi), w), series))
    direct = op.Sub(stirling, _sum(op.Log(op.Add(z, _like(float(k), z))) for k in range(SHIFT)))
    sine = op.Abs(op.Sin(op.Mul(_like(math.pi, self), _safe_fraction(self, reflect))))
    reflected = op.Sub(op.Sub(_like(math.log(math.pi), self), op.Log(sine)), direct)
    return op.Where(reflect, reflected, direct)


def digamma(self):
    """``digamma(Tensor self)``"""
    return _polygamma(0, self)


def polygamma(n: int, self):
    """``polygamma(int n, Tensor self)``"""
    return _polygamma(n, self)


def mvlgamma(self, p: int):
    """``mvlgamma(Tensor self, int p)``: ``p (p - 1) / 4 log(pi) + sum_{i < p} lgamma(x - i / 2)``."""
    terms = [lgamma(op.Sub(self, _like(i / 2, self))) for i in range(p)]
    return op.Add(_like(p * (p - 1) / 4 * math.log(math.pi), self), _sum(terms))


def _polygamma(n: int, x):
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"polygamma: order n={n!r} must be a non-negative Python int")
    reflect = op.Less(x, _like(0.5, x))
    z = op.Where(reflect, op.Sub(_like(1.0, x), x), x)
    direct = _psi(n, z)  # psi_n(x), or psi_n(1 - x) where x < 0.5
    fraction = _safe_fraction(x, reflect)
    # cos(pi f) as sin(pi (0.5 - |f|)): exactly 0 at f = 0.5 (float32's cos(pi / 2) is 4.4e-8, which
    # polygamma(4, -2.5) amplifies to an error of 3e-3)
    complement = op.Sub(_like(0.5, x), op.Abs(fraction))
    cot = op.Div(op.Sin(op.Mul(_like(math.pi, x), complement)), op.Sin(op.Mul(_like(math.pi, x), fraction)))
    derivative = _horner(_cot_derivative(n), cot)  # d^n/dx^n cot(pi x) / pi^n
    reflected = op.Sub(op.Mul(_like(float((-1) ** n), x), direct),
                       op.Mul(_like(math.pi ** (n + 1), x), derivative))
    out = op.Where(reflect, reflected, direct)
    if n == 0:  # PyTorch: NaN at the negative integers (the cotangent's sign there is rounding's)
        pole = op.And(op.Less(x, _like(0.0, x)), op.Equal(x, op.Floor(x)))
        out = op.Where(pole, _like(float("nan"), x), out)
    return out


def _psi(n: int, z):
    """``psi_n(z)`` for ``z >= 0.5``: the recurrence up to ``w = z + SHIFT``, then the asymptotic series."""
    w = op.Add(z, _like(float(SHIFT), z))
    inv = op.Reciprocal(w)
    if n == 0:
        asymptotic = op.Sub(op.Sub(op.Log(w), op.Mul(_like(0.5, w), inv)),
                            _even_series(inv, [b / (2 * k) for k, b in enumerate(_BERNOULLI, 1)]))
    else:
        # (-1)^(n+1) [(n-1)! / w^n + n! / (2 w^(n+1)) + sum_k B_2k (2k+n-1)! / (2k)! / w^(2k+n)]
        coefficients = {n: math.factorial(n - 1), n + 1: math.factorial(n) / 2}
        for k, b in enumerate(_BERNOULLI, 1):
            coefficients[2 * k + n] = b * math.factorial(2 * k + n - 1) / math.factorial(2 * k)
        asymptotic = op.Mul(_like(float((-1) ** (n + 1)), w), _power_series(inv, coefficients))
    recurrence = _sum(_power(op.Reciprocal(op.Add(z, _like(float(k), z))), n + 1) for k in range(SHIFT))
    return op.Add(asymptotic, op.Mul(_like(float((-1) ** (n + 1) * math.factorial(n)), z), recurrence))


def _cot_derivative(n: int) -> np.ndarray:
    """Coefficients (lowest first) of ``P_n`` with ``d^n/dx^n cot(pi x) = pi^n P_n(cot(pi x))``."""
    poly = np.polynomial.Polynomial([0.0, 1.0])  # P_0(c) = c
    for _ in range(n):
        poly = -np.polynomial.Polynomial([1.0, 0.0, 1.0]) * poly.deriv()
    return poly.coef


def _safe_fraction(x, reflect):
    """``x - round(x)`` where ``reflect``, else 0.5 (``sin = 1``, ``cot = 0``: finite values and gradients in
    the lanes the other branch answers)."""
    return op.Where(reflect, op.Sub(x, op.Round(x)), _like(0.5, x))


def _odd_series(inv, coefficients):
    """``sum_k c_k inv^(2k - 1)``."""
    return _power_series(inv, {2 * k - 1: c for k, c in enumerate(coefficients, 1)})


def _even_series(inv, coefficients):
    """``sum_k c_k inv^(2k)``."""
    return _power_series(inv, {2 * k: c for k, c in enumerate(coefficients, 1)})


def _power_series(inv, coefficients: dict[int, float]):
    """``sum_p c_p inv^p`` over the powers given (each power from the one before)."""
    terms, power, at = [], None, 0
    for p, c in sorted(coefficients.items()):
        step = _power(inv, p - at)
        power = step if power is None else op.Mul(power, step)
        at = p
        terms.append(op.Mul(_like(float(c), inv), power))
    return _sum(terms)


def _power(x, p: int):
    """``x^p`` (``p >= 1``) by repeated products."""
    out = x
    for _ in range(p - 1):
        out = op.Mul(out, x)
    return out


def _horner(coefficients: np.ndarray, x):
    out = _like(float(coefficients[-1]), x)
    for c in coefficients[-2::-1]:
        out = op.Add(op.Mul(out, x), _like(float(c), x))
    return out


def _sum(terms):
    out = None
    for t in terms:
        out = t if out is None else op.Add(out, t)
    return out
