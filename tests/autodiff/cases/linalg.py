"""Finite-difference cases for rules/linalg.py."""

from tests.autodiff.gradcheck import Case, F

CASES = [
    Case("MatMul", [("a", F(3, 4)), ("b", F(4, 5))], name="MatMul-2d"),
    Case("MatMul", [("a", F(2, 3, 4)), ("b", F(4, 5))], name="MatMul-3d-weight"),
    Case("MatMul", [("a", F(2, 3, 4)), ("b", F(2, 4, 5))], name="MatMul-batched"),
    Case("MatMul", [("a", F(2, 1, 3, 4)), ("b", F(3, 4, 2))], name="MatMul-batch-broadcast"),
    Case("MatMul", [("a", F(4)), ("b", F(2, 4, 3))], name="MatMul-1d-left"),
    Case("MatMul", [("a", F(2, 3, 4)), ("b", F(4))], name="MatMul-1d-right"),
    Case("MatMul", [("a", F(4)), ("b", F(4))], name="MatMul-1d-both"),
    Case("MatMul", [("a", F(3, 4)), ("b", F(2, 4, 5))], name="MatMul-2d-left-batched-right"),
]
for ta in (0, 1):
    for tb in (0, 1):
        a = F(4, 3) if ta else F(3, 4)
        b = F(5, 4) if tb else F(4, 5)
        CASES.append(Case("Gemm", [("a", a), ("b", b), ("c", F(5))],
                          {"transA": ta, "transB": tb, "alpha": 0.7, "beta": 1.3}, name=f"Gemm-t{ta}{tb}"))
CASES.append(Case("Gemm", [("a", F(3, 4)), ("b", F(4, 5))], name="Gemm-no-C"))
CASES.append(Case("Gemm", [("a", F(3, 4)), ("b", F(4, 5)), ("c", F(3, 1))], name="Gemm-C-column"))

# -- Einsum
CASES += [
    Case("Einsum", [("a", F(3, 4)), ("b", F(4, 5))], {"equation": "ij,jk->ik"}, name="Einsum-matmul"),
    Case("Einsum", [("a", F(2, 3, 4)), ("b", F(2, 4, 5))], {"equation": "bij, bjk -> bik"},
         name="Einsum-batched-spaces"),
    Case("Einsum", [("a", F(3, 4)), ("b", F(4, 5))], {"equation": "ij,jk"}, name="Einsum-implicit-output"),
    Case("Einsum", [("a", F(2, 3)), ("b", F(3, 4))], {"equation": "ij,jk->k"}, name="Einsum-sum-only-in-one"),
    Case("Einsum", [("a", F(2, 3, 4))], {"equation": "ijk->ki"}, name="Einsum-unary-transpose-sum"),
    Case("Einsum", [("a", F(2, 3))], {"equation": "ij->"}, name="Einsum-unary-total"),
    Case("Einsum", [("a", F(3)), ("b", F(3))], {"equation": "i,i->"}, name="Einsum-dot"),
    Case("Einsum", [("a", F(2)), ("b", F(3)), ("c", F(3, 2))], {"equation": "i,j,ji->ij"},
         name="Einsum-three-operands"),
    Case("Einsum", [("a", F(2, 3, 4)), ("b", F(4, 5))], {"equation": "...ij,jk->...ik"},
         name="Einsum-ellipsis"),
    # ONNX wants "..." to stand for the same number of dims everywhere; size-1 dims broadcast.
    Case("Einsum", [("a", F(2, 1, 3, 4)), ("b", F(1, 3, 4, 5))], {"equation": "...ij,...jk->...ik"},
         name="Einsum-ellipsis-broadcast"),
    Case("Einsum", [("a", F(2, 3, 4)), ("b", F(4))], {"equation": "...ij,j->..."},
         name="Einsum-ellipsis-label-only-in-one"),
]
