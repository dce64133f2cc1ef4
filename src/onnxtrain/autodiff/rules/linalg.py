"""Matrix products: MatMul and Gemm (Einsum lives here too)."""

from __future__ import annotations

from onnxtrain.autodiff.registry import GradContext, RuleTable

rules = RuleTable("linalg")
r = rules.register


def _swap_last_two(g: GradContext, x, rank: int):
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return g.b.Transpose(x, perm=perm)


@r("MatMul")
def grad_matmul(g: GradContext):
    """numpy matmul semantics: 1-D operands are promoted, batch dims broadcast."""
    (a, b), y, dy = g.inputs, g.outputs[0], g.dy[0]
    ra, rb = g.rank(a), g.rank(b)
    if ra is None or rb is None:
        raise ValueError(f"MatMul node {g.node.name!r}: the gradient needs the ranks of its inputs")
    bld = g.b
    # Promote 1-D operands to matrices (and dy with them) so the general formula applies.
    a2 = bld.Unsqueeze(a, bld.ints([0])) if ra == 1 else a
    b2 = bld.Unsqueeze(b, bld.ints([1])) if rb == 1 else b
    dy2 = dy
    if ra == 1 and rb == 1:
        dy2 = bld.Reshape(dy, bld.ints([1, 1]))
    elif ra == 1:
        dy2 = bld.Unsqueeze(dy, bld.ints([-2]))
    elif rb == 1:
        dy2 = bld.Unsqueeze(dy, bld.ints([-1]))
    ra2, rb2 = max(ra, 2), max(rb, 2)
    out_rank = max(ra2, rb2)

    da = db = None
    if g.needs[0]:
        da = bld.MatMul(dy2, _swap_last_two(g, b2, rb2))  # [..., M, K]
        if ra2 < out_rank or (ra2 > 2 and not _batch_matches(a2, y, ra2, out_rank, ra, rb)):
            if ra == 1:
                da = bld.ReduceSum(da, bld.ints(list(range(out_rank - 2))), keepdims=0) if out_rank > 2 else da
            else:
                shape = list(y.shape[: out_rank - 2]) + list(a.shape[-2:])
                da = g.sum_to(da, a, grad_shape=shape)
        if ra == 1:
            da = bld.Reshape(da, bld.ints([-1]))
    if g.needs[1]:
        if rb2 == 2 and ra2 > 2:
            # A weight shared across the batch: fold the batch into rows and do one 2-D product.
            a_rows = bld.Flatten(a2, axis=ra2 - 1)
            dy_rows = bld.Flatten(dy2, axis=ra2 - 1)
            db = bld.Gemm(a_rows, dy_rows, transA=1)
        else:
            db = bld.MatMul(_swap_last_two(g, a2, ra2), dy2)  # [..., K, N]
            if rb2 < out_rank or (rb2 > 2 and not _batch_matches(b2, y, rb2, out_rank, ra, rb)):
                shape = list(y.shape[: out_rank - 2]) + list(b2.shape[-2:]) if b2.shape is not None else None
                if rb == 1:
                    db = bld.ReduceSum(db, bld.ints(list(range(out_rank - 2))), keepdims=0) if out_rank > 2 else db
                else:
                    db = g.sum_to(db, b, grad_shape=shape)
        if rb == 1:
            db = bld.Reshape(db, bld.ints([-1]))
    return da, db


def _batch_matches(x, y, rx: int, out_rank: int, ra: int, rb: int) -> bool:
    """The batch dims of ``x`` are known to equal the output's (so its gradient needs no reduction)."""
    from onnxtrain.autodiff.broadcast import same_dim

    if ra == 1 or rb == 1 or x.shape is None or y.shape is None or rx != out_rank:
        return False
    return all(same_dim(dx, dy) for dx, dy in zip(x.shape[: rx - 2], y.shape[: out_rank - 2]))


@r("Gemm")
def grad_gemm(g: GradContext):
    """Y = alpha * A' B' + beta * C with A' = A^T if transA and B' = B^T if transB."""
    a, b = g.inputs[0], g.inputs[1]
    dy = g.dy[0]
    alpha, beta = g.attr("alpha", 1.0), g.attr("beta", 1.0)
    ta, tb = g.attr("transA", 0), g.attr("transB", 0)
    gemm = g.b.Gemm
    da = db = dc = None
    if g.needs[0]:
        # dA' = alpha * dY B'^T; dA = dA' (or its transpose when transA)
        if not ta:
            da = gemm(dy, b, alpha=alpha, transB=0 if tb else 1)
        else:
            da = gemm(b, dy, alpha=alpha, transA=1 if tb else 0, transB=1)
    if g.needs[1]:
        # dB' = alpha * A'^T dY; dB = dB' (or its transpose when transB)
        if not tb:
            db = gemm(a, dy, alpha=alpha, transA=0 if ta else 1)
        else:
            db = gemm(dy, a, alpha=alpha, transA=1, transB=1 if ta else 0)
    if g.has_input(2) and g.needs[2]:
        c = g.inputs[2]
        scaled = dy if beta == 1.0 else g.b.Mul(dy, g.b.scalar(beta, dy))
        dc = g.sum_to(scaled, c)
    return da, db, dc
