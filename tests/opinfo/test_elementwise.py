"""Elementwise ops translated in ``capture/`` for the OpInfo sweep, against eager PyTorch (forward and
gradients) beyond op_db's samples: ``lgamma``, ``digamma``, ``polygamma``, ``mvlgamma`` (``capture/gamma.py``)."""

from __future__ import annotations

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule
from tests.opinfo.test_named_cases import assert_matches_eager


def _points():
    """Negative (reflected), small, moderate and large arguments, none within 0.05 of a pole: there
    PyTorch's float32 kernels lose digits themselves (``sin(pi * x)`` of a float32 ``pi * x``)."""
    x = torch.cat([torch.linspace(-12.4, 0.4, 97), torch.linspace(0.5, 40.0, 80),
                   torch.tensor([1.0, 2.0, 3.5, 1e-3, -1e-3 - 0.5, 1234.5, 3.0e5])])
    far = (x - x.round()).abs() > 0.05
    return x[far | (x > 0)].reshape(-1, 1)


@pytest.mark.parametrize("fn", [torch.lgamma, torch.digamma], ids=["lgamma", "digamma"])
def test_lgamma_digamma(fn):
    # the step's second batch is x + 1: the recurrence's other side
    assert_matches_eager(fn, [_points()], atol=1e-4, rtol=2e-4)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_polygamma(n):
    assert_matches_eager(lambda t: torch.polygamma(n, t), [_points()], atol=1e-4, rtol=2e-4)


@pytest.mark.parametrize("p", [1, 3, 5])
def test_mvlgamma(p):
    x = torch.linspace(0.01, 30.0, 64).reshape(8, 8) + (p - 1) / 2  # its domain: x > (p - 1) / 2
    assert_matches_eager(lambda t: torch.mvlgamma(t, p), [x], atol=1e-4, rtol=2e-4)


class _Polygamma(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return torch.polygamma(self.n, x)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_polygamma_near_poles_against_float64(n):
    """Near a pole the translation keeps float32's precision (the reflection reads ``x - round(x)``, exact);
    checked against float64, where PyTorch's float32 kernel is itself off (by 4e-4 at -18.0039 for n=1)."""
    x = torch.tensor([-18.0039, -7.998, -2.5, -0.5, -0.003, 0.004])
    model = ORTModule(_Polygamma(n), DebugOptions(fallback=False))
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, torch.polygamma(n, x.double()).float(), rtol=1e-5, atol=1e-5)


def test_poles():
    """lgamma is inf at the poles; digamma -inf at 0 and NaN at the negative integers, as in PyTorch."""
    x = torch.tensor([0.0, -1.0, -4.0, 1.0, 2.0])
    for fn in (torch.lgamma, torch.digamma):
        model = ORTModule(_Fn(fn), DebugOptions(fallback=False))
        with torch.no_grad():
            torch.testing.assert_close(model(x), fn(x), equal_nan=True)


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_hypot_gradient_at_zero_is_nan_as_in_pytorch():
    """PyTorch's gradient ``a / hypot(a, b)`` is 0 / 0 = NaN at a = b = 0 (it was 0 here); tiny values,
    whose squares underflow, keep finite gradients."""
    a = torch.tensor([[0.0, -0.0, 1e-30, 0.0, 3.0], [0.0, 2e-25, -1e-30, 0.0, 0.0]])
    b = torch.tensor([0.0, 0.0, 1e-30, 1e-31, 4.0])
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    torch.hypot(x, y).sum().backward()
    assert x.grad.isnan().any() and not x.grad[:, 2:].isnan().any()  # the premise: eager's NaNs and not
    assert_matches_eager(lambda s, t: torch.hypot(s, t), [a, b], atol=1e-5, rtol=1e-5)
