"""The cases issue 15 names, each against eager PyTorch (forward and gradients), outside op_db's samples.

Each case that runs in onnxruntime must not fall back (the fallback is off here); each case ORTModule
cannot run must fall back before the first step, with a reason that names the op and the argument.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from onnxtrain import DebugOptions, ORTModule


class Fn(torch.nn.Module):
    def __init__(self, fn, *params):
        super().__init__()
        self.fn = fn
        self.params = torch.nn.ParameterList([torch.nn.Parameter(p) for p in params])

    def forward(self, *inputs):
        return self.fn(*inputs, *self.params)


def _step(model, inputs, weight):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = model(*inputs)
    (out * weight).sum().backward()
    grads = [t.grad for t in inputs if t.requires_grad] + [p.grad for p in model.parameters()]
    return out.detach(), grads


def assert_matches_eager(fn, inputs, params=(), atol=1e-5, rtol=1e-4):
    """``fn`` under ORTModule (fallback off: it must run in onnxruntime) against eager, for two steps."""
    eager = Fn(fn, *[p.clone() for p in params])
    ort = ORTModule(Fn(fn, *[p.clone() for p in params]), DebugOptions(fallback=False))
    for step in range(2):
        batch = [t + step if t.is_floating_point() else t for t in inputs]
        with torch.no_grad():
            shape = eager(*batch).shape
        weight = torch.rand(shape, generator=torch.Generator().manual_seed(step)) + 0.5
        expected, expected_grads = _step(eager, batch, weight)
        actual, actual_grads = _step(ort, batch, weight)
        assert ort.fallback_reason is None
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
        assert len(actual_grads) == len(expected_grads)
        for a, e in zip(actual_grads, expected_grads):
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True)
        eager.zero_grad()
        ort.zero_grad()


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("batched", [True, False])
def test_avg_pool2d_divisor_override(ceil_mode, batched):
    x = torch.randn(2, 3, 9, 8) if batched else torch.randn(3, 9, 8)
    assert_matches_eager(lambda t: F.avg_pool2d(t, (3, 2), (2, 3), 1, ceil_mode, False, 2), [x])


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_avg_pool3d_divisor_override(ceil_mode):
    x = torch.randn(2, 2, 5, 6, 7)
    assert_matches_eager(lambda t: F.avg_pool3d(t, 3, 2, 1, ceil_mode, True, 5), [x])


def test_native_batch_norm_training_uses_batch_statistics():
    def fn(x, w, b):
        return torch.native_batch_norm(x, w, b, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)[0]

    assert_matches_eager(fn, [torch.randn(4, 3, 5) * 3 + 2], params=(torch.rand(3) + 0.5, torch.randn(3)))


def test_native_batch_norm_statistics_pass_no_gradient():
    """PyTorch's backward ignores the saved mean's and invstd's gradients; so must the graph."""
    def fn(x, w, b):
        out, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
        return out.sum(dim=(0, 2)) + mean * 2 + invstd * 3

    assert_matches_eager(fn, [torch.randn(4, 3, 5) * 3 + 2], params=(torch.rand(3) + 0.5, torch.randn(3)))


@pytest.mark.parametrize("op", ["index_select", "squeeze"])
def test_output_shape_disagreement_falls_back_before_the_step(op):
    """Shape inference that gives an output another rank than onnxruntime's kernel (a 0-d index_select, a
    squeeze() of an axis exported as dynamic) made the backward run raise mid-training; now ORTModule falls
    back on the forward, before its outputs are used, and the step matches eager."""
    if op == "index_select":
        fn, x, extra = (lambda t, i: torch.index_select(t, 0, i) * 2), torch.randn(()), [torch.tensor([0])]
    else:
        fn, x, extra = (lambda t: t.squeeze() * 2), torch.randn(5, 1, 5, 1), []
    model = ORTModule(Fn(fn), DebugOptions(fallback=True))
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(xa, *extra)
    assert model.fallback_reason is not None and "OutputShapeError" in model.fallback_reason
    expected = fn(xe, *extra)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(xa.grad, xe.grad)


def test_safe_softmax_masked_rows_have_zero_gradients():
    """A row of only -inf: zeros out and zero gradients, as in PyTorch (the exporter's gave NaN gradients)."""
    x = torch.randn(3, 4, 5)
    x[0, 1] = float("-inf")
    x[1, 2, :3] = float("-inf")
    assert_matches_eager(lambda t: torch.ops.aten._safe_softmax(t, -1) * 3, [x])


def test_unfold_of_an_empty_batch_falls_back_on_its_first_run():
    """onnxruntime's Reshape in the exporter's im2col refuses an empty batch: the first forward raises inside
    onnxruntime, before any output is used, so ORTModule falls back there instead of failing."""
    fn = lambda t: F.unfold(t, 2, 1, 0, 1) * 2  # noqa: E731
    model = ORTModule(Fn(fn), DebugOptions(fallback=True))
    x = torch.randn(0, 1, 5, 5)
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(xa)
    assert model.fallback_reason is not None and "Reshape" in model.fallback_reason
    expected = fn(xe)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(xa.grad, xe.grad)


@pytest.mark.parametrize("mode,pads", [
    *[("replicate", p) for p in [(-4, 5, 0, 0), (-2, -1, 4, 6), (8, -1, -1, -3), (2, 3, 1, 0)]],
    *[(m, p) for m in ("circular", "reflect") for p in [(-2, -1, 3, 2), (2, -3, -1, 1), (2, 3, 1, 0)]],
])
def test_pad_with_negative_pads(mode, pads):
    """Negative pads crop; onnxruntime's edge Pad failed where the crop left nothing, its wrap Pad is not
    implemented, and the Pad gradient's border folding raised in backward (capture/padding.py, the Pad rule)."""
    x = torch.randn(2, 3, 5, 5)
    assert_matches_eager(lambda t: F.pad(t, pads, mode=mode) * 2, [x])


def test_circular_pad_of_an_empty_batch_runs_in_onnxruntime():
    assert_matches_eager(lambda t: F.pad(t, (1, 2), mode="circular"), [torch.randn(0, 3, 3)])


def test_replicate_pad_3d_unbatched():
    assert_matches_eager(lambda t: F.pad(t, (1, -1, 2, 0, -1, 3), mode="replicate"), [torch.randn(2, 4, 5, 3)])


@pytest.mark.parametrize("shape", [(2, 3, 7, 5), (3, 7, 5), (4, 4, 4)])
@pytest.mark.parametrize("size", [(2, 3), (3, 3), (7, 1), (4, 2)])
def test_adaptive_max_pool2d(shape, size):
    """Unbatched inputs came out with another shape (the TorchScript exporter's 1-D reading)."""
    x = torch.randn(shape)
    assert_matches_eager(lambda t: F.adaptive_max_pool2d(t, size) * 2, [x])


@pytest.mark.parametrize("shape", [(2, 3, 7, 5), (3, 7, 5)])
def test_adaptive_max_pool2d_indices(shape):
    x = torch.randn(shape)
    model = ORTModule(Fn(lambda t: F.adaptive_max_pool2d(t, (3, 2), return_indices=True)),
                      DebugOptions(fallback=False))
    values, indices = model(x.clone().requires_grad_())
    expected_values, expected_indices = F.adaptive_max_pool2d(x, (3, 2), return_indices=True)
    torch.testing.assert_close(values, expected_values)
    torch.testing.assert_close(indices, expected_indices)


@pytest.mark.parametrize("shape", [(2, 3, 7), (3, 10)])
def test_adaptive_max_pool1d(shape):
    assert_matches_eager(lambda t: F.adaptive_max_pool1d(t, 4) * 2, [torch.randn(shape)])


@pytest.mark.parametrize("shape", [(2, 2, 5, 7, 6), (2, 5, 7, 6)])
def test_adaptive_avg_pool3d(shape):
    assert_matches_eager(lambda t: F.adaptive_avg_pool3d(t, (2, 3, 4)) * 2, [torch.randn(shape)])


def test_adaptive_pool_gradient_matches_finite_differences():
    """Against a reference other than eager: central differences of the ORTModule's own forward (float32)."""
    # distinct values 0.1 apart: no window's maximum changes within a step of eps
    x = torch.randperm(20, generator=torch.Generator().manual_seed(0)).float().view(1, 1, 4, 5) * 0.1
    model = ORTModule(Fn(lambda t: F.adaptive_avg_pool2d(F.adaptive_max_pool2d(t, (3, 3)) ** 2, 2).sum()),
                      DebugOptions(fallback=False))
    xa = x.clone().requires_grad_()
    model(xa).backward()
    eps = 1e-2
    numeric = torch.zeros_like(x)
    for i in range(x.numel()):
        d = torch.zeros(x.numel())
        d[i] = eps
        d = d.view_as(x)
        with torch.no_grad():
            numeric.view(-1)[i] = (model(x + d) - model(x - d)) / (2 * eps)
    torch.testing.assert_close(xa.grad, numeric, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("as_param", [False, True])
def test_scatter_reduce_mean_is_the_mean(include_self, as_param):
    """The exporter translated reduce="mean" as a plain scatter (the last value won; 25 of 50 values off in
    the sweep's sample). Repeated indices, positions never reached, self as an input and as a parameter."""
    index = torch.tensor([[0, 1, 0, 3, 0], [0, 0, 2, 1, 1], [3, 3, 0, 1, 2]])
    src, base = torch.randn(3, 5), torch.randn(4, 5)

    def fn(s, i, *b):
        target = b[0] if b else s.new_ones(4, 5) * 0.5
        return target.scatter_reduce(0, i, s, reduce="mean", include_self=include_self)

    if as_param:
        assert_matches_eager(fn, [src, index], params=(base,))
    else:
        assert_matches_eager(lambda s, i, b: b.scatter_reduce(0, i, s, reduce="mean", include_self=include_self),
                             [src, index, base])


@pytest.mark.parametrize("name", ["log_ndtr", "erfcx"])
def test_special_functions_the_exporter_gets_wrong_fall_back_with_their_reason(name):
    """The exporter's log_ndtr gave -inf for large negative inputs where PyTorch is finite, and its erfcx was
    off by up to 0.13: both are refused at capture (the TorchScript exporter is not tried), so the module
    runs in PyTorch and says why."""
    fn = getattr(torch.special, name)
    model = ORTModule(Fn(fn), DebugOptions(fallback=True))
    x = torch.tensor([-40.0, -8.0, -1.0, 0.5, 30.0])
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(xa)
    assert model.fallback_reason is not None and f"special.{name}" in model.fallback_reason
    expected = fn(xe)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(xa.grad, xe.grad)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_with_the_weight_as_an_input(n, groups):
    """A weight passed to forward has dynamic leading axes (in export): the gradient reads its channels per
    group at run time instead of refusing (it needed them static)."""
    conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
    x, w, bias = torch.randn(2, 4, *[6] * n), torch.randn(6, 4 // groups, *[3] * n), torch.randn(6)
    assert_matches_eager(lambda t, k, c: conv(t, k, c, 2, 1, 1, groups), [x, w, bias])


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_with_the_weight_as_an_input(groups):
    x, w = torch.randn(2, 4, 5, 6), torch.randn(4, 6 // groups, 3, 2)
    assert_matches_eager(lambda t, k: F.conv_transpose2d(t, k, None, 2, 1, 1, groups), [x, w])


def _with_nans_and_ties(shape, seed):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::5] = float("nan")
    return t


@pytest.mark.parametrize("fn", [torch.fmax, torch.fmin])
def test_fmax_fmin_nan_and_ties(fn):
    """A NaN loses to a number (two NaNs give NaN); a tie's gradient goes to the first input, as in PyTorch."""
    a, b = _with_nans_and_ties((4, 5), 0), _with_nans_and_ties((5,), 1)
    a[1] = b  # ties
    b[2] = float("nan")
    assert_matches_eager(lambda x, y: fn(x, y) * 2, [a, b])


def test_copysign_negative_zero_and_broadcast():
    a = torch.randn(4, 5)
    a[0, 0] = 0.0
    b = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0])
    assert_matches_eager(lambda x, y: torch.copysign(x, y) * 2, [a, b])


def test_hypot_large_values_and_zeros():
    """sqrt(a^2 + b^2) overflows from about 1.8e19; PyTorch's hypot does not."""
    a = torch.tensor([[3e20, -1e-3, 0.0, 5.0], [1.0, 2.0, -3.0, 4e25]])
    b = torch.tensor([4e20, 2.0, 1.5, -12.0])
    assert_matches_eager(lambda x, y: torch.hypot(x, y), [a, b], atol=1e-5, rtol=1e-5)
