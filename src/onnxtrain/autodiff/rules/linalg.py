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


# -- Einsum ---------------------------------------------------------------------------------------
ELLIPSIS = "..."


def _einsum_terms(g: GradContext) -> tuple[list[list[str]], list[str]]:
    """The operand terms and the output term of the node's equation, as lists of labels ("..." one)."""
    equation = g.attr("equation").replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")

    def tokens(term: str) -> list[str]:
        out = []
        rest = term
        while rest:
            if rest.startswith(ELLIPSIS):
                out.append(ELLIPSIS)
                rest = rest[3:]
            else:
                out.append(rest[0])
                rest = rest[1:]
        return out

    terms = [tokens(t) for t in lhs.split(",")]
    for i, term in enumerate(terms):
        repeated = sorted({label for label in term if term.count(label) > 1})
        if repeated:
            raise NotImplementedError(
                f"Einsum node {g.node.name!r} ({equation!r}): operand {i} repeats label(s) {repeated} "
                "(a diagonal); its gradient is not supported. Take the diagonal explicitly before Einsum."
            )
    if arrow:
        return terms, tokens(rhs)
    labels = [label for term in terms for label in term if label != ELLIPSIS]
    once = sorted(label for label in set(labels) if labels.count(label) == 1)
    return terms, ([ELLIPSIS] if any(ELLIPSIS in t for t in terms) else []) + once


def _ellipsis_rank(g: GradContext, term: list[str], value) -> int:
    rank = g.rank(value)
    if rank is None:
        raise ValueError(f"Einsum node {g.node.name!r}: the gradient needs the rank of {value.name!r}")
    return rank - (len(term) - 1) if ELLIPSIS in term else 0


@r("Einsum")
def grad_einsum(g: GradContext):
    """d operand_k = einsum(other operands, dy -> term_k); labels (or "...") only operand k has are
    broadcast back with Unsqueeze + Expand, and broadcast "..." dims are summed back."""
    terms, out = _einsum_terms(g)
    return tuple(_grad_einsum_operand(g, terms, out, k) if g.needs[k] else None for k in range(len(terms)))


def _grad_einsum_operand(g: GradContext, terms, out, k: int):
    bld, x, dy = g.b, g.inputs[k], g.dy[0]
    operands = [(t, v) for i, (t, v) in enumerate(zip(terms, g.inputs)) if i != k]
    if out:
        operands.append((out, dy))
    seen = {label for t, _ in operands for label in t} | set(out)
    kept = [label for label in terms[k] if label in seen]
    # "..." spans the same number of dims in every operand (ONNX requires it); its size-1 dims
    # broadcast, so an operand's own "..." gradient may need summing (size 1 here) or expanding.
    width = _ellipsis_rank(g, terms[k], x) if ELLIPSIS in terms[k] else max(
        [_ellipsis_rank(g, t, v) for t, v in operands if ELLIPSIS in t], default=0)
    summed = ELLIPSIS in seen and ELLIPSIS not in kept  # only the others have it
    result = ([ELLIPSIS] if summed else []) + kept  # onnxruntime wants "..." in the output then
    if not operands:
        grad = dy
    elif len(operands) == 1 and operands[0][0] == result:
        grad = operands[0][1]
    else:
        equation = ",".join("".join(t) for t, _ in operands) + "->" + "".join(result)
        grad = bld.Einsum(*(v for _, v in operands), equation=equation)
    if summed and width:
        grad = bld.ReduceSum(grad, bld.ints(list(range(width))), keepdims=0)
    if not out:
        grad = bld.Mul(grad, dy) if operands else grad

    layout, dropped = [], []  # operand k's axes by label; the axes of labels only it has
    for label in terms[k]:
        span = width if label == ELLIPSIS else 1
        if label not in kept:
            dropped += range(len(layout), len(layout) + span)
        layout += [label] * span
    if dropped:
        grad = bld.Unsqueeze(grad, bld.ints(dropped))
    if ELLIPSIS in kept:
        dims = list(x.shape)
        grad = g.sum_to(grad, x, grad_shape=[None if lb == ELLIPSIS else d for lb, d in zip(layout, dims)])
    if dropped or ELLIPSIS in kept:
        grad = bld.Expand(grad, bld.Shape(x))
    return grad
