"""Sliding-window adjoints shared by Conv, ConvTranspose and the pooling rules.

Padding is made explicit once (``Pads``: static ints, or int64 values computed from the input's shape
when ``auto_pad=SAME_*`` meets dynamic spatial sizes), so every gradient is built from pad-free
windows and stays valid for dynamic batch and spatial sizes:
- the adjoint of a window op is a pad-free ConvTranspose whose result is padded at the end (by at most
  ``stride - 1``, what the forward's floor division dropped) and cropped at the begin pads;
- a convolution's weight gradient is a convolution of the padded input with the output gradient,
  batch and channels swapped, strides and dilations swapped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext


@dataclass
class Window:
    kernel: list[int]
    strides: list[int]
    dilations: list[int]

    @property
    def extent(self) -> list[int]:  # the span of one dilated window
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations)]


@dataclass
class Pads:
    begin: list[int] | ir.Value  # ints, or an int64 value of length n
    end: list[int] | ir.Value

    @property
    def static(self) -> bool:
        return isinstance(self.begin, list) and isinstance(self.end, list)

    @property
    def zero(self) -> bool:
        return self.static and not any(self.begin) and not any(self.end)


def _fail(g: GradContext, message: str) -> ValueError:
    return ValueError(f"{g.node.op_type} node {g.node.name!r}: {message}")


def spatial_rank(g: GradContext, x: ir.Value) -> int:
    rank = g.rank(x)
    if rank is None or rank < 3:
        raise _fail(g, f"the gradient needs the rank (>= 3) of input {x.name!r}; run onnx shape inference")
    return rank - 2


def window_of(g: GradContext, n: int, kernel: list[int]) -> Window:
    """The node's window: ``kernel`` with its strides and dilations."""
    return Window(list(kernel), g.attr("strides", [1] * n), g.attr("dilations", [1] * n))


def spatial_shape(g: GradContext, x: ir.Value, n: int) -> ir.Value:
    return g.b.Slice(g.b.Shape(x), g.b.ints([2]), g.b.ints([2 + n]))


def resolve_pads(g: GradContext, x: ir.Value, win: Window, n: int) -> Pads:
    """The begin/end pads the forward op applied to ``x`` (NOTSET, VALID or SAME_UPPER/LOWER)."""
    auto_pad = g.attr("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = g.attr("pads", [0] * (2 * n))
        return Pads(list(pads[:n]), list(pads[n:]))
    if auto_pad == "VALID":
        return Pads([0] * n, [0] * n)
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise _fail(g, f"unknown auto_pad={auto_pad!r}")
    upper = auto_pad == "SAME_UPPER"
    sizes = [None if x.shape is None else x.shape[2 + i] for i in range(n)]
    if all(isinstance(s, int) for s in sizes):
        begin, end = [], []
        for size, s, e in zip(sizes, win.strides, win.extent):
            total = max(0, (-(-size // s) - 1) * s + e - size)
            small, large = total // 2, total - total // 2
            begin.append(small if upper else large)
            end.append(large if upper else small)
        return Pads(begin, end)
    # Dynamic sizes: total = max(0, (ceil(size / s) - 1) * s + extent - size), computed at run time.
    b = g.b
    size = spatial_shape(g, x, n)
    strides = b.ints(win.strides)
    out = b.Div(b.Add(size, b.ints([s - 1 for s in win.strides])), strides)
    total = b.Max(b.Sub(b.Add(b.Mul(b.Sub(out, b.ints([1] * n)), strides), b.ints(win.extent)), size),
                  b.ints([0] * n))
    small = b.Div(total, b.ints([2] * n))
    large = b.Sub(total, small)
    return Pads(small, large) if upper else Pads(large, small)


def _as_value(g: GradContext, v) -> ir.Value:
    return v if isinstance(v, ir.Value) else g.b.ints(list(v))


def pad(g: GradContext, x: ir.Value, begin, end, n: int) -> ir.Value:
    """Zero-pad the spatial axes of ``x`` (rank n + 2)."""
    if isinstance(begin, list) and isinstance(end, list):
        if not any(begin) and not any(end):
            return x
        return g.b.Pad(x, g.b.ints([0, 0, *begin, 0, 0, *end]))
    two_zeros = g.b.ints([0, 0])
    pads = g.b.Concat(two_zeros, _as_value(g, begin), two_zeros, _as_value(g, end), axis=0)
    return g.b.Pad(x, pads)


def crop(g: GradContext, full: ir.Value, begin, like: ir.Value, win: Window, n: int) -> ir.Value:
    """``full[..., begin : begin + like.spatial]`` after padding ``full``'s end by ``stride - 1`` (the
    rows a strided window op never reached, whose gradient is zero)."""
    full = pad(g, full, [0] * n, [s - 1 for s in win.strides], n)
    starts = _as_value(g, begin)
    ends = g.b.Add(starts, spatial_shape(g, like, n))
    return g.b.Slice(full, starts, ends, g.b.ints(list(range(2, 2 + n))))


def reduce_batch_spatial(g: GradContext, dy: ir.Value, n: int) -> ir.Value:
    """Sum over every axis but the channel axis 1 (a bias or per-channel parameter gradient)."""
    return g.b.ReduceSum(dy, g.b.ints([0, *range(2, 2 + n)]), keepdims=0)


def input_adjoint(g: GradContext, dy: ir.Value, w: ir.Value, x: ir.Value, pads: Pads, win: Window,
                  group: int, n: int) -> ir.Value:
    """The gradient of a convolution's input: a pad-free ConvTranspose of ``dy``, cropped."""
    full = g.b.ConvTranspose(dy, w, strides=win.strides, dilations=win.dilations, group=group,
                             kernel_shape=win.kernel)
    return crop(g, full, pads.begin, x, win, n)


def weight_gradient(g: GradContext, xp: ir.Value, dy: ir.Value, win: Window, group: int,
                    in_per_group: ir.Value, n: int) -> ir.Value:
    """dW[m, c, k] = sum_{b,o} dy[b, m, o] * xp[b, group(m) * in_per_group + c, o * s + k * d] for an
    already padded ``xp``: a convolution with batch and channels swapped and strides <-> dilations.
    ``in_per_group`` is a 1-D int64 value of length 1."""
    b = g.b
    spatial = spatial_shape(g, xp, n)
    if group == 1:
        xt = b.Transpose(xp, perm=[1, 0, *range(2, 2 + n)])  # [C, N, S]
    else:  # [N, g*Cg, S] -> [Cg, g*N, S], group-major so that group i sees its own channels
        split = b.Concat(b.Slice(b.Shape(xp), b.ints([0]), b.ints([1])), b.ints([group]), in_per_group,
                         spatial, axis=0)
        xt = b.Transpose(b.Reshape(xp, split), perm=[2, 1, 0, *range(3, 3 + n)])
        xt = b.Reshape(xt, b.Concat(in_per_group, b.ints([-1]), spatial, axis=0))
    dyt = b.Transpose(dy, perm=[1, 0, *range(2, 2 + n)])  # [M, N, O]: a weight for group convolution
    corr = b.Conv(xt, dyt, strides=win.dilations, dilations=win.strides, group=group)  # [Cg, M, K']
    corr = b.Slice(corr, b.ints([0] * n), b.ints(win.kernel), b.ints(list(range(2, 2 + n))))
    return b.Transpose(corr, perm=[1, 0, *range(2, 2 + n)])


def window_sum_adjoint(g: GradContext, dy: ir.Value, x: ir.Value, pads: Pads, win: Window,
                       n: int) -> ir.Value:
    """The adjoint of summing every window of each channel of ``x``, applied to ``dy``."""
    b = g.b
    ones = ones_kernel(g, win, x)
    per_map = b.Concat(b.ints([-1, 1]), spatial_shape(g, dy, n), axis=0)
    full = b.ConvTranspose(b.Reshape(dy, per_map), ones, strides=win.strides, dilations=win.dilations)
    one_map_like_x = b.Reshape(x, b.Concat(b.ints([-1, 1]), spatial_shape(g, x, n), axis=0))
    dx = crop(g, full, pads.begin, one_map_like_x, win, n)
    return b.Reshape(dx, b.Shape(x))


def first_max_adjoint(g: GradContext, dy: ir.Value, x: ir.Value, y: ir.Value, pads: Pads, win: Window,
                      n: int) -> ir.Value:
    """The gradient of a max pooling without its indices: ``dy`` goes to the first element of each window (in
    the kernel's row-major order, as PyTorch's CPU kernel picks it) equal to the window's maximum ``y``. Per
    kernel offset ``p``, the strided window of the input padded with -inf, a mask of the elements equal to ``y``
    that no earlier offset took, and ``dy`` there; the ``P`` results go back to the input's positions by one
    pad-free ConvTranspose with a one-hot kernel per offset (a channel each), cropped as :func:`crop` does."""
    b = g.b
    extra = [s - 1 for s in win.strides]  # room for the last window of ceil_mode, as in window_counts
    end = [e + s for e, s in zip(pads.end, extra)] if isinstance(pads.end, list) else b.Add(pads.end, b.ints(extra))
    begin = pads.begin
    if isinstance(begin, list) and isinstance(end, list):
        pad_values = b.ints([0, 0, *begin, 0, 0, *end])
    else:
        two_zeros = b.ints([0, 0])
        pad_values = b.Concat(two_zeros, _as_value(g, begin), two_zeros, _as_value(g, end), axis=0)
    xp = b.Pad(x, pad_values, b.const(np.array(-np.inf, dtype=x.dtype.numpy())))
    axes, steps = b.ints(list(range(2, 2 + n))), b.ints(win.strides)
    span = b.Add(b.Mul(b.Sub(spatial_shape(g, dy, n), b.ints([1] * n)), steps), b.ints([1] * n))
    zero = b.const(np.zeros((), dtype=x.dtype.numpy()))  # dy (a sum of fan-ins) may carry no dtype
    offsets = list(itertools.product(*(range(k) for k in win.kernel)))
    taken, parts = None, []
    for k, p in enumerate(offsets):
        start = b.ints([q * d for q, d in zip(p, win.dilations)])
        hit = b.Equal(b.Slice(xp, start, b.Add(start, span), axes, steps), y)
        if taken is not None:
            hit = b.And(hit, b.Not(taken))
        if k < len(offsets) - 1:
            taken = hit if taken is None else b.Or(taken, hit)
        parts.append(b.Unsqueeze(b.Where(hit, dy, zero), b.ints([2])))  # [N, C, 1, O...]
    stacked = b.Concat(*parts, axis=2) if len(parts) > 1 else parts[0]  # [N, C, P, O...]
    per_map = b.Reshape(stacked, b.Concat(b.ints([-1, len(offsets)]), spatial_shape(g, dy, n), axis=0))
    one_hot = np.eye(len(offsets), dtype=x.dtype.numpy()).reshape(len(offsets), 1, *win.kernel)
    full = b.ConvTranspose(per_map, static_kernel(g, one_hot), strides=win.strides, dilations=win.dilations)
    one_map_like_x = b.Reshape(x, b.Concat(b.ints([-1, 1]), spatial_shape(g, x, n), axis=0))
    dx = b.Reshape(crop(g, full, pads.begin, one_map_like_x, win, n), b.Shape(x))
    dx.dtype = x.dtype  # dy (a sum of fan-ins) may carry none, and the rules after this one make constants like dx
    return dx


def ones_kernel(g: GradContext, win: Window, like: ir.Value) -> ir.Value:
    """A [1, 1, *kernel] kernel of ones (average pooling's gradient and window counts convolve with it)."""
    return static_kernel(g, np.ones([1, 1, *win.kernel], dtype=like.dtype.numpy()))


def static_kernel(g: GradContext, array: np.ndarray) -> ir.Value:
    """A constant kernel whose shape the graph states: OpenVINO compiles no convolution with a kernel of unknown
    size (:func:`onnxtrain.runtime.openvino.dynamic_kernel` refuses the graph before it runs)."""
    kernel = g.b.const(array)
    kernel.shape = ir.Shape(array.shape)
    return kernel


def window_counts(g: GradContext, x: ir.Value, out_like: ir.Value, pads: Pads, win: Window,
                  n: int) -> ir.Value:
    """[1, 1, *out]: how many elements of ``x`` (not padding) each output window covers."""
    b = g.b
    ones = b.ConstantOfShape(b.Concat(b.ints([1, 1]), spatial_shape(g, x, n), axis=0),
                             value=ir.tensor(np.ones((1,), dtype=x.dtype.numpy())))
    extra = [s - 1 for s in win.strides]  # room for the last window of ceil_mode
    if isinstance(pads.end, list):
        end = [e + s for e, s in zip(pads.end, extra)]
    else:
        end = b.Add(pads.end, b.ints(extra))
    counts = b.Conv(pad(g, ones, pads.begin, end, n), ones_kernel(g, win, x), strides=win.strides,
                    dilations=win.dilations)
    return b.Slice(counts, b.ints([0] * n), spatial_shape(g, out_like, n), b.ints(list(range(2, 2 + n))))
