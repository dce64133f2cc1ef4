"""``median``, ``nanmedian`` and ``kthvalue`` (``capture/order_stats.py``) against eager PyTorch, forward (values
and indices) and gradients, beyond the OpInfo sweep's samples: odd and even lengths, every axis, ``keepdim``,
0-d inputs, infinities and NaN (``median`` returns the first NaN of a slice; ``nanmedian`` skips them)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.opinfo.test_scans import check  # one step of ORTModule(fn) against eager: outputs and the gradient


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("fn", [torch.median, torch.nanmedian], ids=["median", "nanmedian"])
def test_median_dim(fn, dim, keepdim):
    check(lambda t: fn(t, dim, keepdim=keepdim), _x(4, 5, 6, seed=1))  # even and odd lengths


@pytest.mark.parametrize("fn", [torch.median, torch.nanmedian], ids=["median", "nanmedian"])
def test_median_of_all(fn):
    check(fn, _x(3, 4, seed=2))  # even count: the lower median
    check(fn, _x(5, seed=3))
    check(fn, torch.tensor(1.5))


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("k,dim", [(1, -1), (3, -1), (5, 0), (2, 1)])
def test_kthvalue(k, dim, keepdim):
    check(lambda t: torch.kthvalue(t, k, dim, keepdim=keepdim), _x(5, 4, 6, seed=4))


def test_kthvalue_of_0d():
    check(lambda t: torch.kthvalue(t, 1, 0), torch.tensor(-0.5))


NAN, INF = float("nan"), float("inf")
SPECIAL = torch.tensor([[1.0, NAN, -2.0, 4.0, NAN],  # two NaN: median is the first
                        [INF, -1.0, 3.0, -INF, 0.5],  # infinities
                        [NAN, 2.0, 0.25, -3.0, 1.5],
                        [2.5, -0.5, NAN, NAN, NAN]])  # nanmedian of two values: the lower


@pytest.mark.parametrize("fn", [torch.median, torch.nanmedian], ids=["median", "nanmedian"])
def test_median_nan_and_inf(fn):
    check(lambda t: fn(t, 1), SPECIAL)
    check(lambda t: fn(t, 0), SPECIAL.T.contiguous())
    check(fn, SPECIAL[1:3])  # every element: one NaN


def test_kthvalue_nan_sorts_last():
    x = SPECIAL[2:3].repeat(2, 1)
    for k in (1, 3, 5):
        check(lambda t: torch.kthvalue(t, k, 1), x)


def test_nanmedian_of_only_nan():
    check(lambda t: torch.nanmedian(t, 1), torch.tensor([[NAN, NAN, NAN], [1.0, NAN, 2.0]]))
