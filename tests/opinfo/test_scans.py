"""``cumprod``, ``cummax`` and ``cummin`` (``capture/scans.py``) against eager PyTorch, forward (values and
indices) and gradients, beyond the OpInfo sweep's samples: zeros in ``cumprod`` (one and several in a prefix),
every axis, NaN and infinities, and ties (the CPU kernel's choice: the last of equal values)."""

from __future__ import annotations

import warnings

import pytest
import torch

from onnxtrain import ORTModule
from tests.opinfo.test_shape_indexing import _Fn  # the function as a module, its tensors as inputs


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def check(fn, x):
    """One step of ``ORTModule(fn)`` against eager on ``x``: every output (values, indices) and the gradient."""
    model = ORTModule(_Fn(fn))
    mine, ref = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    out, expected = model(mine), fn(ref)
    assert model.fallback_reason is None, model.fallback_reason
    out = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for o, e in zip(out, expected, strict=True):
        torch.testing.assert_close(o, e, equal_nan=True)
    weight = torch.rand(expected[0].shape, generator=torch.Generator().manual_seed(5)) + 0.5
    (out[0] * weight).sum().backward()
    (expected[0] * weight).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, equal_nan=True)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumprod_with_zeros(dim):
    x = _x(4, 5, 3, seed=1)
    x[1, 2, 0] = 0.0  # one zero in a prefix
    x[2, 1, 1] = x[3, 1, 1] = x[2, 3, 1] = 0.0  # several
    x[0, 4, 2] = 0.0
    check(lambda t: torch.cumprod(t, dim), x)


def test_cumprod_dtype_and_single_element_axis():
    check(lambda t: torch.cumprod(t, 1, dtype=torch.float64), _x(3, 4, seed=2))
    check(lambda t: torch.cumprod(t, 0), _x(1, 4, seed=3))


@pytest.mark.parametrize("fn", [torch.cummax, torch.cummin], ids=["cummax", "cummin"])
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_cummax_cummin(fn, dim):
    check(lambda t: fn(t, dim), _x(3, 6, 4, seed=4))


@pytest.mark.parametrize("fn", [torch.cummax, torch.cummin], ids=["cummax", "cummin"])
def test_cummax_cummin_nan_inf_and_ties(fn):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0, -1.0],  # ties: the last one wins
                      [-inf, -inf, 2.0, inf, 1.0, inf, 0.5],  # infinities, leading and tied
                      [inf, inf, -2.0, -inf, -inf, 4.0, -5.0],
                      [0.5, nan, 2.0, nan, -3.0, 7.0, -7.0]])  # a NaN stays, the last NaN is the index
    check(lambda t: fn(t, 1), x)
    check(lambda t: fn(t, 0), x.T.contiguous())
