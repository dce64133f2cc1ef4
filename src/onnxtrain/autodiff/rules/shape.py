"""Shape and indexing ops: reshapes, permutations, joins and splits, slices, gathers and scatters, pads.

Shapes, axes, starts/ends, repeats and pads are passed through as graph values wherever the math
allows, so one gradient graph serves every batch and sequence length. Where an op truly needs a static
fact (a rank, a constant ``axes`` list) the rule says so in its error.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("shape")
r = rules.register

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
SCATTER_ADD_OPSET = 16  # ScatterND / ScatterElements take reduction="add" from opset 16


# -- helpers -------------------------------------------------------------------------------------
def _where(g: GradContext) -> str:
    return f"{g.node.op_type} node {g.node.name!r}"


def _rank(g: GradContext, x: ir.Value) -> int:
    rank = g.rank(x)
    if rank is None:
        raise ValueError(
            f"{_where(g)}: the gradient needs the rank of {x.name!r}, which is unknown. Run onnx shape "
            "inference on the model (gradient_model does) or give the model inputs shapes."
        )
    return rank


def _axis(g: GradContext, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"{_where(g)}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def _const_ints(g: GradContext, i: int, what: str) -> list[int]:
    value = g.const_input(i)
    if value is None:
        raise NotImplementedError(
            f"{_where(g)}: the gradient needs '{what}' (input {i}) as a constant or initializer, but it "
            "is computed at run time. Fold it to a constant (e.g. onnxscript's optimizer) first."
        )
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _zeros(g: GradContext, shape: ir.Value, like: ir.Value) -> ir.Value:
    """Zeros of ``shape`` with the element type of ``like`` (a forward value: those carry types)."""
    return g.b.ConstantOfShape(shape, value=ir.tensor(np.zeros((1,), dtype=like.dtype.numpy())))


def _dims(g: GradContext, x: ir.Value, start: int, end: int) -> ir.Value:
    """``Shape(x)[start:end]`` as a 1-D int64 value (Slice works at every opset, Shape's range from 15)."""
    return g.b.Slice(g.b.Shape(x), g.b.ints([start]), g.b.ints([end]))


def _dim(g: GradContext, x: ir.Value, axis: int) -> ir.Value:
    """The size of ``x`` along ``axis`` as a 1-D int64 value of length 1."""
    return g.b.Gather(g.b.Shape(x), g.b.ints([axis]))


def _like_input(g: GradContext, dy: ir.Value, i: int = 0) -> ir.Value:
    return g.b.Reshape(dy, g.b.Shape(g.inputs[i]))


def _pad_axis(g: GradContext, t: ir.Value, axis: int, rank: int, before: ir.Value, after: ir.Value):
    """Zero-pad ``t`` along one ``axis`` by 1-D length-1 int64 values ``before`` and ``after``."""
    parts = [g.b.ints([0] * axis)] if axis else []
    parts += [before]
    parts += [g.b.ints([0] * (rank - 1))] if rank > 1 else []
    parts += [after]
    parts += [g.b.ints([0] * (rank - 1 - axis))] if rank - 1 - axis else []
    return g.b.Pad(t, g.b.Concat(*parts, axis=0))


def _scatter_add_rows(g: GradContext, shape: ir.Value, rows: ir.Value, updates: ir.Value, like: ir.Value,
                      rank: int):
    """Zeros of ``shape`` (rank ``rank``) with ``updates[i]`` added into row ``rows[i, 0]``; repeated rows
    add up.

    ScatterElements, not ScatterND: onnxruntime's CPU ScatterND(reduction="add") updates rows from
    several threads at once, so rows that repeat (an embedding's token ids, BERT's all-zero token types)
    lose updates, differently from run to run (onnxruntime issue #18048). ScatterElements adds in one
    pass; its indices are the rows spread to ``updates``' shape (int64, twice the size of ``updates``).
    """
    b = g.b
    if g.opset >= SCATTER_ADD_OPSET:
        spread = b.Expand(b.Reshape(rows, b.ints([-1] + [1] * (rank - 1))), b.Shape(updates))
        return b.ScatterElements(_zeros(g, shape, like), spread, updates, axis=0, reduction="add")
    # Before opset 16 ScatterND cannot add: sum with a one-hot matrix (memory: rows x shape[0]).
    depth = b.Gather(shape, b.ints(0))
    onehot = b.OneHot(b.Reshape(rows, b.ints([-1])), depth,
                      b.const(np.array([0, 1], dtype=like.dtype.numpy())), axis=-1)
    flat = b.Reshape(updates, b.Concat(b.Gather(b.Shape(updates), b.ints([0])), b.ints([-1]), axis=0))
    return b.Reshape(b.MatMul(b.Transpose(onehot, perm=[1, 0]), flat), shape)


def _scatter_add_nd(g: GradContext, x: ir.Value, shape: ir.Value, rank: int, index: ir.Value, depth: int,
                    updates: ir.Value) -> ir.Value:
    """ScatterND(zeros of ``shape``, ``index`` [..., depth], ``updates``, reduction="add") made exact:
    the index tuples become row numbers of ``shape`` seen as [prod(shape[:depth]), *shape[depth:]] and
    go through :func:`_scatter_add_rows` (see there why not ScatterND)."""
    b = g.b
    row = None
    for j in range(depth):
        size = b.Gather(shape, b.ints([j]))
        column = _non_negative(g, b.Gather(index, b.ints([j]), axis=-1), size)  # [..., 1], int64
        row = column if row is None else b.Add(b.Mul(row, size), column)
    rows = b.Reshape(row, b.ints([-1, 1]))
    head = b.ReduceProd(b.Slice(shape, b.ints([0]), b.ints([depth])), keepdims=1)
    tail = b.Slice(shape, b.ints([depth]), b.ints([INT64_MAX]))
    flat_shape = b.Concat(head, tail, axis=0)
    flat_updates = b.Reshape(updates, b.Concat(b.ints([-1]), tail, axis=0))
    flat = _scatter_add_rows(g, flat_shape, rows, flat_updates, x, 1 + rank - depth)
    return b.Reshape(flat, shape)


def _require_scatter_add(g: GradContext) -> None:
    if g.opset < SCATTER_ADD_OPSET:
        raise NotImplementedError(
            f"{_where(g)}: the gradient needs ScatterElements with reduction='add' (opset "
            f"{SCATTER_ADD_OPSET}); the model uses opset {g.opset}. Convert it with "
            f"onnx.version_converter.convert_version(model, {SCATTER_ADD_OPSET}) first."
        )


def _static_last_dim(value: ir.Value) -> int | None:
    """The last dimension of ``value`` if it is a known integer (GatherND's index depth), else None.

    Without it the GatherND gradient keeps ScatterND, whose repeated indices may lose updates on CPU."""
    shape = value.shape
    if shape is None or len(shape) == 0 or not isinstance(shape[-1], int):
        return None
    return shape[-1]


def _non_negative(g: GradContext, indices: ir.Value, size: ir.Value) -> ir.Value:
    """int64 indices with those counted from the end (``-1``) made plain, given the axis ``size``."""
    b = g.b
    if indices.dtype != ir.DataType.INT64:
        indices = b.Cast(indices, to=ir.DataType.INT64)
    return b.Where(b.Less(indices, b.ints(0)), b.Add(indices, size), indices)


# -- pure reshapes: the gradient takes the input's shape back -----------------------------------
for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    rules.linear(_op, lambda g, dy: _like_input(g, dy))


@r("Transpose")
def grad_transpose(g: GradContext):
    perm = g.attr("perm")
    if perm is None:
        perm = list(reversed(range(_rank(g, g.inputs[0]))))
    return (g.b.Transpose(g.dy[0], perm=[int(i) for i in np.argsort(perm)]),)


# -- joins and splits -----------------------------------------------------------------------------
@r("Concat")
def grad_concat(g: GradContext):
    """Split ``dy`` back into the pieces, sized like the inputs along ``axis``."""
    dy, axis = g.dy[0], g.attr("axis")
    if len(g.inputs) == 1:
        return (dy,)
    rank = _rank(g, g.inputs[0])
    axis = _axis(g, axis, rank)
    static = [x.shape[axis] if x.shape is not None else None for x in g.inputs]
    if all(isinstance(d, int) for d in static):
        sizes = g.b.ints(static)
    else:
        sizes = g.b.Concat(*[_dim(g, x, axis) for x in g.inputs], axis=0)
    pieces = g.b.op("Split", dy, sizes, axis=axis, num_outputs=len(g.inputs))
    return tuple(p if need else None for p, need in zip(pieces, g.needs))


@r("Split")
def grad_split(g: GradContext):
    """Concatenate the output gradients; outputs that received none contribute zeros."""
    pieces = [g.dy_or_zeros(i) for i in range(len(g.outputs))]
    dx = pieces[0] if len(pieces) == 1 else g.b.Concat(*pieces, axis=g.attr("axis", 0))
    return (dx,)


@r("Tile")
def grad_tile(g: GradContext):
    """View ``dy`` as ``[r0, d0, r1, d1, ...]`` and sum over the repeat axes."""
    (x, repeats), dy = g.inputs, g.dy[0]
    rank = _rank(g, x)
    b = g.b
    column = b.ints([1])
    pairs = b.Concat(b.Unsqueeze(repeats, column), b.Unsqueeze(b.Shape(x), column), axis=1)
    split = b.Reshape(dy, b.Reshape(pairs, b.ints([-1])))
    return b.ReduceSum(split, b.ints(list(range(0, 2 * rank, 2))), keepdims=0), None


# -- slicing -------------------------------------------------------------------------------------
def _slice_axes(g: GradContext, rank: int) -> ir.Value:
    """The normalized (non-negative) sliced axes as a 1-D int64 value."""
    b = g.b
    if g.has_input(3):
        axes = g.inputs[3]
        if axes.dtype != ir.DataType.INT64:
            axes = b.Cast(axes, to=ir.DataType.INT64)
        return b.Where(b.Less(axes, b.ints(0)), b.Add(axes, b.ints(rank)), axes)
    starts = g.inputs[1]
    if starts.shape is not None and isinstance(starts.shape[0], int):
        return b.ints(list(range(starts.shape[0])))
    return b.Range(b.ints(0), b.Squeeze(b.Shape(starts), b.ints([0])), b.ints(1))


def _clamp_index(g: GradContext, index: ir.Value, dims: ir.Value) -> ir.Value:
    b = g.b
    index = _non_negative(g, index, dims)
    return b.Min(b.Max(index, b.ints(0)), dims)


def _grad_slice_unit_steps(g: GradContext, x: ir.Value, dy: ir.Value) -> ir.Value:
    """All steps are 1: zero-pad ``dy`` by ``start`` before and ``dim - end`` after on each axis."""
    b = g.b
    rank = _rank(g, x)
    axes = _slice_axes(g, rank)
    dims = b.Gather(b.Shape(x), axes)
    start = _clamp_index(g, g.inputs[1], dims)
    end = _clamp_index(g, g.inputs[2], dims)
    size = b.Max(b.Sub(end, start), b.ints(0))
    after = b.Sub(b.Sub(dims, start), size)
    where = b.Concat(axes, b.Add(axes, b.ints(rank)), axis=0)
    pads = b.ScatterElements(b.ints([0] * (2 * rank)), where, b.Concat(start, after, axis=0))
    return b.Pad(dy, pads)


def _grad_slice_any_steps(g: GradContext, x: ir.Value, dy: ir.Value) -> ir.Value:
    """Any steps: per sliced axis, scatter ``dy`` to the positions Slice took (Slice of a Range)."""
    b = g.b
    rank = _rank(g, x)
    if g.has_input(3):
        axes = [_axis(g, a, rank) for a in _const_ints(g, 3, "axes")]
    else:
        n = g.inputs[1].shape[0] if g.inputs[1].shape is not None else None
        if not isinstance(n, int):
            raise ValueError(f"{_where(g)}: the gradient needs the length of 'starts' (unknown here)")
        axes = list(range(n))
    def pick(k: int, i: int) -> ir.Value:  # entry i of Slice input k (starts, ends, steps)
        return b.Cast(b.Gather(g.inputs[k], b.ints([i])), to=ir.DataType.INT64)

    t = dy
    for i, axis in enumerate(axes):
        every = b.Range(b.ints(0), b.Gather(b.Shape(x), b.ints(axis)), b.ints(1))
        positions = b.Slice(every, pick(1, i), pick(2, i), b.ints([0]), pick(4, i))
        view = [1] * rank
        view[axis] = -1
        indices = b.Expand(b.Reshape(positions, b.ints(view)), b.Shape(t))
        on_axis = b.const(np.arange(rank) == axis)
        target = b.Where(on_axis, b.Shape(x), b.Shape(t))
        t = b.ScatterElements(_zeros(g, target, x), indices, t, axis=axis)
    return t


@r("Slice")
def grad_slice(g: GradContext):
    x, dy = g.inputs[0], g.dy[0]
    steps = g.const_input(4) if g.has_input(4) else np.ones(1)
    if steps is not None and np.all(steps == 1):
        return (_grad_slice_unit_steps(g, x, dy),)
    return (_grad_slice_any_steps(g, x, dy),)


# -- gathers --------------------------------------------------------------------------------------
@r("Gather")
def grad_gather(g: GradContext):
    """Scatter-add the rows of ``dy`` back to the gathered positions (embeddings repeat indices)."""
    (x, indices), dy = g.inputs, g.dy[0]
    b = g.b
    rank = _rank(g, x)
    axis = _axis(g, g.attr("axis", 0), rank)
    shape = b.Shape(x)
    rows = b.Reshape(_non_negative(g, indices, _dim(g, x, axis)), b.ints([-1, 1]))
    pre = [_dims(g, x, 0, axis)] if axis else []
    post = [_dims(g, x, axis + 1, rank)] if axis + 1 < rank else []
    count = b.Reshape(b.Size(indices), b.ints([1]))  # not -1: an empty batch leaves -1 undecidable
    updates = b.Reshape(dy, b.Concat(*pre, count, *post, axis=0))
    if axis == 0:
        return _scatter_add_rows(g, shape, rows, updates, x, rank), None
    perm = [axis] + [i for i in range(rank) if i != axis]
    moved = _scatter_add_rows(g, b.Gather(shape, b.ints(perm)), rows, b.Transpose(updates, perm=perm), x, rank)
    return b.Transpose(moved, perm=[int(i) for i in np.argsort(perm)]), None


@r("GatherElements")
def grad_gather_elements(g: GradContext):
    (x, indices), dy = g.inputs, g.dy[0]
    _require_scatter_add(g)
    dx = g.b.ScatterElements(g.zeros_like(x), indices, dy, axis=g.attr("axis", 0), reduction="add")
    return dx, None


@r("GatherND")
def grad_gather_nd(g: GradContext):
    """Scatter-add ``dy`` into zeros; ``batch_dims`` are folded into one leading index column."""
    (x, indices), dy = g.inputs, g.dy[0]
    b = g.b
    _require_scatter_add(g)
    batch = g.attr("batch_dims", 0)
    rank = _rank(g, x)
    depth = _static_last_dim(indices)
    if batch == 0:
        if depth is not None:
            return _scatter_add_nd(g, x, b.Shape(x), rank, indices, depth, dy), None
        return b.ScatterND(g.zeros_like(x), indices, dy, reduction="add"), None
    k = b.Gather(b.Shape(indices), b.ints([-1]))  # index tuple length
    n = b.ReduceProd(_dims(g, x, 0, batch), keepdims=1)  # no axes: all, at every opset
    flat_x_shape = b.Concat(n, _dims(g, x, batch, rank), axis=0)
    idx = b.Reshape(indices, b.Concat(n, b.ints([-1]), k, axis=0))  # [n, m, k]
    idx = b.Cast(idx, to=ir.DataType.INT64)
    batch_col = b.Reshape(b.Range(b.ints(0), b.Squeeze(n, b.ints([0])), b.ints(1)), b.ints([-1, 1, 1]))
    ones_col = b.Concat(b.Gather(b.Shape(idx), b.ints([0, 1])), b.ints([1]), axis=0)
    idx = b.Concat(b.Expand(batch_col, ones_col), idx, axis=-1)  # [n, m, 1 + k]
    slice_dims = b.Slice(b.Shape(x), b.Add(k, b.ints([batch])), b.ints([INT64_MAX]))
    updates = b.Reshape(dy, b.Concat(n, b.ints([-1]), slice_dims, axis=0))
    if depth is not None:
        flat = _scatter_add_nd(g, x, flat_x_shape, 1 + rank - batch, idx, 1 + depth, updates)
    else:
        flat = b.ScatterND(_zeros(g, flat_x_shape, x), idx, updates, reduction="add")
    return b.Reshape(flat, b.Shape(x)), None


# -- scatters -------------------------------------------------------------------------------------
def _scatter_reduction(g: GradContext, also: tuple[str, ...] = ()) -> str:
    reduction = g.attr("reduction", "none")
    if reduction not in ("none", "add"):
        supported = ", ".join(repr(r) for r in ("none", "add", *also))
        raise NotImplementedError(f"{_where(g)}: no gradient for reduction={reduction!r} (only {supported})")
    return reduction


@r("ScatterND")
def grad_scatter_nd(g: GradContext):
    """``none``: the overwritten positions take no gradient to ``data``; ``updates`` take theirs."""
    indices, updates, dy = g.inputs[1], g.inputs[2], g.dy[0]
    reduction = _scatter_reduction(g)
    d_data = d_updates = None
    if g.needs[0]:
        d_data = dy if reduction == "add" else g.b.ScatterND(dy, indices, g.zeros_like(updates))
    if g.needs[2]:
        d_updates = g.b.GatherND(dy, indices)
    return d_data, None, d_updates


@r("ScatterElements")
def grad_scatter_elements(g: GradContext):
    if g.attr("reduction", "none") in ("min", "max"):
        return _grad_scatter_elements_extreme(g)
    if g.attr("reduction", "none") == "mul":
        return _grad_scatter_elements_mul(g)
    indices, updates, dy = g.inputs[1], g.inputs[2], g.dy[0]
    reduction = _scatter_reduction(g, also=("min", "max"))
    axis = g.attr("axis", 0)
    d_data = d_updates = None
    if g.needs[0]:
        d_data = dy if reduction == "add" else \
            g.b.ScatterElements(dy, indices, g.zeros_like(updates), axis=axis)
    if g.needs[2]:
        d_updates = g.b.GatherElements(dy, indices, axis=axis)
    return d_data, None, d_updates


def _grad_scatter_elements_extreme(g: GradContext):
    """``reduction="min"``/``"max"`` as PyTorch's ``scatter_reduce(amin/amax)`` backward: each output's gradient
    is shared evenly by the entries (of ``data`` at that position, of ``updates`` scattered to it) equal to
    it. ``include_self=False`` is exported as ``data`` first scattered with the reduction's identity where
    ``updates`` land (so ``data`` takes nothing there); PyTorch still counts the original ``self`` among the
    entries that share the gradient where it equals the result, and so does this rule."""
    b, data, indices, updates, dy = g.b, g.inputs[0], g.inputs[1], g.inputs[2], g.dy[0]
    axis, y = g.attr("axis", 0), g.output(0)
    data_is = b.CastLike(b.Equal(data, y), data)
    counted = data_is
    source = data.producer()
    if (source is not None and source.op_type == "ScatterElements" and source.inputs[1] is indices
            and source.attributes.get_string("reduction", "none") == {"max": "min", "min": "max"}[g.attr("reduction")]):
        counted = b.CastLike(b.Equal(source.inputs[0], y), data)  # the original self (include_self=False)
    updates_is = b.CastLike(b.Equal(updates, b.GatherElements(y, indices, axis=axis)), updates)
    share = b.Div(dy, b.ScatterElements(counted, indices, updates_is, axis=axis, reduction="add"))
    d_data = b.Mul(data_is, share) if g.needs[0] else None
    d_updates = b.Mul(updates_is, b.GatherElements(share, indices, axis=axis)) if g.needs[2] else None
    return d_data, None, d_updates


def _grad_scatter_elements_mul(g: GradContext):
    """``reduction="mul"`` (``scatter_reduce``/``index_reduce`` with ``"prod"``): each factor's gradient is the
    output's times the product of the other factors at its position, exact with zeros (PyTorch's rule): an
    update that is the only zero at its position takes the product of the rest, any other update at a position
    with a zero takes 0, and the rest take ``y / update``. ``data`` takes the product of the updates."""
    b, data, indices, updates, dy = g.b, g.inputs[0], g.inputs[1], g.inputs[2], g.dy[0]
    axis = g.attr("axis", 0)
    zero, one = b.scalar(0.0, updates), b.scalar(1.0, updates)
    d_data = d_updates = None
    if g.needs[0]:
        ones = b.Add(g.zeros_like(data), one)
        d_data = b.Mul(dy, b.ScatterElements(ones, indices, updates, axis=axis, reduction="mul"))
    if g.needs[2]:
        is_zero = b.Equal(updates, zero)
        nonzero = b.Where(is_zero, one, updates)
        zeros = b.GatherElements(b.ScatterElements(g.zeros_like(data), indices, b.CastLike(is_zero, updates),
                                                   axis=axis, reduction="add"), indices, axis=axis)
        rest = b.GatherElements(b.ScatterElements(data, indices, nonzero, axis=axis, reduction="mul"), indices,
                                axis=axis)  # data times the non-zero updates at each update's position
        others = b.Where(is_zero, b.Where(b.Equal(zeros, one), rest, zero),
                         b.Where(b.Equal(zeros, zero), b.Div(rest, nonzero), zero))
        d_updates = b.Mul(b.GatherElements(dy, indices, axis=axis), others)
    return d_data, None, d_updates


@r("TopK")
def grad_topk(g: GradContext):
    """The values go back to the positions TopK returned (distinct, so no reduction is needed)."""
    x, dy = g.inputs[0], g.dy[0]
    dx = g.b.ScatterElements(g.zeros_like(x), g.output(1), dy, axis=g.attr("axis", -1))
    return dx, None


# -- pads -----------------------------------------------------------------------------------------
@r("Pad")
def grad_pad(g: GradContext):
    mode = g.attr("mode", "constant")
    if mode == "constant":
        return _grad_pad_constant(g)
    if mode in ("reflect", "edge", "wrap"):
        return (_grad_pad_mirrored(g, mode),)
    raise NotImplementedError(f"{_where(g)}: no gradient for Pad mode {mode!r}")


def _grad_pad_constant(g: GradContext):
    """Crop the padding off ``dy``; with negative (cropping) or run-time pads, pad by ``-pads``
    instead, which also zero-fills what the forward pad cropped."""
    b, dy, x = g.b, g.dy[0], g.inputs[0]
    pads = g.const_input(1)
    if pads is not None and np.all(pads >= 0):
        if g.has_input(3):
            axes = g.inputs[3]
        else:
            axes = b.ints(list(range(len(pads) // 2)))
        starts = b.ints([int(p) for p in pads[: len(pads) // 2]])
        dx = b.Slice(dy, starts, b.Add(starts, b.Gather(b.Shape(x), axes)), axes)
    else:
        axes = g.inputs[3] if g.has_input(3) else None
        dx = b.Pad(dy, b.Neg(g.inputs[1]), None, axes)
    d_value = None
    if g.has_input(2) and g.needs[2]:  # each padded position holds the constant
        value = g.inputs[2]
        total = b.Sub(b.ReduceSum(dy, keepdims=0), b.ReduceSum(dx, keepdims=0))
        d_value = b.Reshape(total, b.Shape(value))
    return (dx if g.needs[0] else None), None, d_value


def _grad_pad_mirrored(g: GradContext, mode: str) -> ir.Value:
    """Axis by axis: keep the centre, fold each border back onto the input positions it copied.

    A negative pad crops first (onnxruntime pads what is left, as PyTorch's negative padding does): the
    border is folded onto the cropped input, then the cropped positions get zeros.
    """
    b, x = g.b, g.inputs[0]
    rank = _rank(g, x)
    axes = [_axis(g, a, rank) for a in _const_ints(g, 3, "axes")] if g.has_input(3) else list(range(rank))
    pads = g.const_input(1)
    t = g.dy[0]
    for i, axis in enumerate(axes):
        if pads is not None and pads[i] == 0 and pads[len(axes) + i] == 0:
            continue
        before = b.Slice(g.inputs[1], b.ints([i]), b.ints([i + 1]))
        after = b.Slice(g.inputs[1], b.ints([len(axes) + i]), b.ints([len(axes) + i + 1]))
        n = _dim(g, x, axis)
        if pads is not None and pads[i] >= 0 and pads[len(axes) + i] >= 0:
            t = _fold_borders(g, t, axis, rank, n, before, after, mode)
            continue
        zero = b.ints([0])
        grow_before, grow_after = b.Max(before, zero), b.Max(after, zero)
        cut_before, cut_after = b.Sub(grow_before, before), b.Sub(grow_after, after)
        kept = b.Sub(b.Sub(n, cut_before), cut_after)
        t = _fold_borders(g, t, axis, rank, kept, grow_before, grow_after, mode)
        t = _pad_axis(g, t, axis, rank, cut_before, cut_after)
    return t


def _fold_borders(g: GradContext, t, axis: int, rank: int, n, p, q, mode: str) -> ir.Value:
    b = g.b
    on = b.ints([axis])
    centre = b.Slice(t, p, b.Add(p, n), on)
    left = b.Slice(t, b.ints([0]), p, on)  # the p values written before the input
    right = b.Slice(t, b.Add(p, n), b.ints([INT64_MAX]), on)  # the q values written after it
    one = b.ints([1])
    if mode == "reflect":  # left[p-k] copies x[k], right[k-1] copies x[n-1-k], k = 1.. (edge excluded)
        left = _pad_axis(g, _flip(g, left, axis), axis, rank, one, b.Sub(b.Sub(n, one), p))
        right = _pad_axis(g, _flip(g, right, axis), axis, rank, b.Sub(b.Sub(n, one), q), one)
    elif mode == "edge":  # every border value copies the first or last input value
        zero = b.ints([0])
        left = _pad_axis(g, b.ReduceSum(left, on, keepdims=1), axis, rank, zero, b.Sub(n, one))
        right = _pad_axis(g, b.ReduceSum(right, on, keepdims=1), axis, rank, b.Sub(n, one), zero)
    else:  # wrap: left copies x[n-p:], right copies x[:q]
        zero = b.ints([0])
        left = _pad_axis(g, left, axis, rank, b.Sub(n, p), zero)
        right = _pad_axis(g, right, axis, rank, zero, b.Sub(n, q))
    return b.Sum(centre, left, right)


def _flip(g: GradContext, t: ir.Value, axis: int) -> ir.Value:
    b = g.b
    return b.Slice(t, b.ints([-1]), b.ints([INT64_MIN]), b.ints([axis]), b.ints([-1]))


# -- other linear rearrangements ----------------------------------------------------------------
@r("Trilu")
def grad_trilu(g: GradContext):
    k = g.inputs[1] if g.has_input(1) else None
    return g.b.Trilu(g.dy[0], k, upper=g.attr("upper", 1)), None


@r("CumSum")
def grad_cumsum(g: GradContext):
    """The adjoint of a running sum is the running sum in the other direction."""
    dx = g.b.CumSum(g.dy[0], g.inputs[1], exclusive=g.attr("exclusive", 0),
                    reverse=1 - g.attr("reverse", 0))
    return dx, None


@r("SpaceToDepth")
def grad_space_to_depth(g: GradContext):
    return (g.b.DepthToSpace(g.dy[0], blocksize=g.attr("blocksize"), mode="DCR"),)


@r("DepthToSpace")
def grad_depth_to_space(g: GradContext):
    block, dy = g.attr("blocksize"), g.dy[0]
    if g.attr("mode", "DCR") == "DCR":
        return (g.b.SpaceToDepth(dy, blocksize=block),)
    # CRD: x[n, c, b1, b2, h, w] was laid out as y[n, c, h, b1, w, b2]; undo the permutation.
    b, x = g.b, g.inputs[0]
    blk = b.ints([block])
    view = b.Concat(_dims(g, x, 0, 1), b.ints([-1]), _dims(g, x, 2, 3), blk, _dims(g, x, 3, 4), blk, axis=0)
    moved = b.Transpose(b.Reshape(dy, view), perm=[0, 1, 3, 5, 2, 4])
    return (b.Reshape(moved, b.Shape(x)),)
