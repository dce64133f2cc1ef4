"""Reductions and masked ops that used to fall back, against eager PyTorch (forward and input gradients),
beyond the OpInfo sweep's samples: each must run in onnxruntime (a fallback fails the test)."""

from __future__ import annotations

import warnings

import pytest
import torch

from onnxtrain import ORTModule


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, *rest):
        return self.fn(x, *rest)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _check(fn, x: torch.Tensor, *rest):
    """``fn(x, *rest)`` under ORTModule against eager: outputs (NaN where eager has NaN) and x's gradient."""
    model = ORTModule(_Fn(fn))
    x = x.detach().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    out, ref = model(x, *rest), fn(ref_x, *rest)
    assert model.fallback_reason is None, model.fallback_reason
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    weights = [torch.randn_like(r) for r in refs]
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, equal_nan=True)
    grad, = torch.autograd.grad(sum((o.nan_to_num() * w).sum() for o, w in zip(outs, weights)), x)
    expected, = torch.autograd.grad(sum((r.nan_to_num() * w).sum() for r, w in zip(refs, weights)), ref_x)
    torch.testing.assert_close(grad, expected, equal_nan=True)  # an emptied row: NaN in eager too


@pytest.mark.parametrize("reduce", [torch.amax, torch.amin], ids=["amax", "amin"])
@pytest.mark.parametrize(("shape", "kwargs"), [
    ((), {"dim": 0, "keepdim": True}), ((), {"dim": -1}), ((), {}), ((3, 4), {"dim": 1}),
    ((3, 4, 5), {"dim": (0, 2), "keepdim": True}), ((2, 3), {}),
], ids=["0d_dim0_keepdim", "0d_dim-1", "0d_all", "2d_dim1", "3d_dims_keepdim", "2d_all"])
def test_amax_amin(reduce, shape, kwargs):
    torch.manual_seed(0)
    _check(lambda x: reduce(x, **kwargs), torch.randn(shape))  # no ties: randn values are distinct


@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize(("dim", "unbiased", "keepdim"), [(None, True, False), (1, False, True), ((0, 2), True, False)])
def test_masked_var_std(name, dim, unbiased, keepdim):
    """The mean divides a float sum by an int64 count (``aten.divide.Tensor``); rows that the mask empties
    give NaN in both."""
    torch.manual_seed(1)
    x, mask = torch.randn(4, 6, 3), torch.rand(4, 6, 3) > 0.4
    mask[0, :, 0] = False
    fn = getattr(torch.masked, name)
    _check(lambda x, m: fn(x, dim, unbiased=unbiased, keepdim=keepdim, mask=m), x, mask)


@pytest.mark.parametrize("divide", [torch.divide, torch.true_divide], ids=["divide", "true_divide"])
def test_float_divided_by_integer_tensor(divide):
    counts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _check(lambda x, c: (divide(x, c), divide(c, x + 3.0)), torch.randn(2, 3), counts)
