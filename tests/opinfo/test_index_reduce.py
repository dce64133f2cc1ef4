"""``index_reduce`` (every reduction), ``scatter_reduce(reduce="prod")``, ``put`` and ``diagonal_scatter`` against
eager PyTorch, forward and gradients, beyond the OpInfo sweep's samples (whose first two are 0-d): zeros among the
factors (one and two at a position, and in ``self``), repeated and unreached indices, negative ``dim`` and
positions, both ``include_self``, diagonals of any two axes, off the main one and empty."""

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


def check(fn, *tensors):
    """One step of ``ORTModule(fn)`` against eager: the output and the gradients of the float tensors."""
    model = ORTModule(_Fn(fn))
    mine = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    ref = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out, expected = model(*mine), fn(*ref)
    assert model.fallback_reason is None, model.fallback_reason
    torch.testing.assert_close(out, expected)
    weight = torch.rand(expected.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    for m, r in zip(mine, ref):
        if r.is_floating_point():
            torch.testing.assert_close(m.grad, r.grad)


def _with_zeros(shape, zeros, seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    for position in zeros:
        x[position] = 0.0
    return x


INDEX = torch.tensor([0, 2, 2, 4, 2, 0])  # rows 1 and 3 unreached; row 2 reduced three times


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce_rows(reduce, include_self):
    self_ = _with_zeros((5, 3), [(2, 1)], seed=1)
    source = _with_zeros((6, 3), [(1, 0), (2, 2), (4, 2), (5, 1)], seed=2)  # row 2 col 2: two zeros; col 0: one
    check(lambda s, i, src: s.index_reduce(0, i, src, reduce, include_self=include_self), self_, INDEX, source)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax"])
def test_index_reduce_negative_dim(reduce):
    self_, source = torch.randn(2, 4, 5), torch.randn(2, 4, 3)
    index = torch.tensor([4, 0, 4])
    check(lambda s, i, src: s.index_reduce(-1, i, src, reduce, include_self=False), self_, index, source)


@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_prod_with_zeros(include_self):
    self_ = _with_zeros((4, 3), [(0, 0)], seed=4)
    src = _with_zeros((5, 3), [(0, 1), (3, 1), (2, 2)], seed=5)
    index = torch.tensor([[0, 1, 2], [1, 0, 2], [3, 0, 2], [0, 0, 1], [1, 2, 2]])
    check(lambda s, i, u: s.scatter_reduce(0, i, u, "prod", include_self=include_self), self_, index, src)


@pytest.mark.parametrize("accumulate", [False, True])
def test_put(accumulate):
    # 2-D index and source over a 3-D self; negative positions; repeats only where accumulating
    index = torch.tensor([[0, -2, 7], [23, 5, -20]]) if not accumulate else torch.tensor([[3, 3, -1], [23, 0, 3]])
    check(lambda s, i, src: s.put(i, src, accumulate=accumulate), torch.randn(2, 3, 4), index,
          torch.randn(2, 3))


@pytest.mark.parametrize("offset,dim1,dim2", [(0, 0, 1), (2, 0, 2), (-1, 2, 0), (1, -1, -3), (-3, 1, 2), (6, 0, 2)])
def test_diagonal_scatter(offset, dim1, dim2):
    self_ = torch.randn(3, 4, 5)
    src = torch.randn_like(torch.diagonal(self_, offset, dim1, dim2))  # empty for offset 6
    check(lambda s, d: torch.diagonal_scatter(s, d, offset, dim1, dim2), self_, src)
