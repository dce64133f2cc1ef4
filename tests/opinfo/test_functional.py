"""nn.functional ops translated in ``capture/`` or differentiated by rules added for the OpInfo sweep, against
eager PyTorch (forward and gradients) beyond op_db's samples: ``grid_sample`` (``capture/grid_sample.py``)
and rank-5 ``interpolate`` (the Resize rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onnxtrain import DebugOptions, ORTModule
from tests.opinfo.test_named_cases import assert_matches_eager


def _grid(*shape, spread=1.2, seed=0):
    """Grid coordinates in ``[-spread, spread]``: some fall outside the input (padding matters)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) * 2 - 1) * spread


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_2d(mode, padding_mode, align_corners):
    x = torch.randn(2, 3, 5, 6)
    grid = _grid(2, 4, 7, 2, spread=2.5 if padding_mode == "reflection" else 1.2)  # reflected more than once
    assert_matches_eager(lambda t, g: F.grid_sample(t, g, mode, padding_mode, align_corners), [x, grid])


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample_3d_trilinear(padding_mode):
    x = torch.randn(2, 2, 4, 5, 3)
    assert_matches_eager(lambda t, g: F.grid_sample(t, g, "bilinear", padding_mode, False),
                         [x, _grid(2, 3, 2, 4, 3)])


def test_grid_sample_3d_nearest_align_corners():
    assert_matches_eager(lambda t, g: F.grid_sample(t, g, "nearest", "border", True),
                         [torch.randn(1, 2, 3, 4, 5), _grid(1, 2, 3, 2, 3)])


def test_grid_sample_grid_as_parameter():
    """The grid a parameter (static shapes): its two coordinates are two Slices that the optimizer turns into
    one Split; before the optimizer's topological sort, the y coordinate's gradient was lost (all zeros)."""
    assert_matches_eager(lambda t, g: F.grid_sample(t, g, "bilinear", "zeros", False), [torch.randn(2, 3, 5, 5)],
                         params=[_grid(2, 5, 5, 2)])


def test_grid_sample_bicubic_falls_back_naming_grid_sample():
    model = ORTModule(_Bicubic(), DebugOptions(fallback=True))
    x, grid = torch.randn(1, 1, 4, 4, requires_grad=True), _grid(1, 3, 3, 2)
    with pytest.warns(UserWarning):
        out = model(x, grid)
    assert "GridSample" in model.fallback_reason
    torch.testing.assert_close(out, F.grid_sample(x, grid, "bicubic", align_corners=False))


class _Bicubic(torch.nn.Module):
    def forward(self, x, grid):
        return F.grid_sample(x, grid, "bicubic", align_corners=False)


@pytest.mark.parametrize("mode,align_corners", [("trilinear", False), ("trilinear", True), ("nearest", None)])
def test_interpolate_rank5(mode, align_corners):
    x = torch.randn(2, 3, 3, 4, 2)
    assert_matches_eager(lambda t: F.interpolate(t, size=(5, 3, 4), mode=mode, align_corners=align_corners), [x])
    assert_matches_eager(lambda t: F.interpolate(t, scale_factor=(1.5, 2.0, 0.5), mode=mode,
                                                 align_corners=align_corners), [x])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_class_indices_label_smoothing(smoothing, weighted, reduction):
    """label_smoothing was dropped by the exporter's translation (0.886 for eager's 1.217, no fallback)."""
    x = torch.randn(4, 5, 3)
    target = torch.tensor([[0, 3, 1], [4, -100, 2], [1, 1, -100], [2, 0, 4]])  # with ignore_index's default
    weight = torch.rand(5) + 0.5 if weighted else None
    assert_matches_eager(lambda t, y: F.cross_entropy(t, y, weight=weight, reduction=reduction,
                                                      label_smoothing=smoothing), [x, target])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_probability_targets(smoothing, weighted, reduction):
    """Probability targets made an invalid graph; the target's gradient is compared too."""
    x = torch.randn(3, 4, 2)
    target = torch.softmax(torch.randn(3, 4, 2), dim=1)
    weight = torch.rand(4) + 0.5 if weighted else None
    assert_matches_eager(lambda t, p: F.cross_entropy(t, p, weight=weight, reduction=reduction,
                                                      label_smoothing=smoothing), [x, target])


@pytest.mark.parametrize("probabilities", [False, True])
def test_cross_entropy_unbatched_with_smoothing(probabilities):
    target = torch.softmax(torch.randn(6), dim=0) if probabilities else torch.tensor(2)
    assert_matches_eager(lambda t, y: F.cross_entropy(t, y, reduction="none", label_smoothing=0.1),
                         [torch.randn(6), target])
