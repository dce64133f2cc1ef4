"""Finite-difference cases for rules/elementwise.py."""

from tests.autodiff.gradcheck import Case, F, I

_unary_pos = ["Log", "Sqrt", "Reciprocal", "Acosh"]
CASES = [Case(op, [("x", F(2, 3))]) for op in [
    "Exp", "Sin", "Cos", "Tan", "Sinh", "Cosh", "Tanh", "Sigmoid", "Softplus", "Softsign",
    "Asinh", "Atan", "Mish", "Neg", "Identity",
]]
CASES += [
    Case("Erf", [("x", F(2, 3))]),
    Case("Log", [("x", F(2, 3, low=0.5, high=2))]),
    Case("Sqrt", [("x", F(2, 3, low=0.5, high=2))]),
    Case("Reciprocal", [("x", F(2, 3, low=0.5, high=2))]),
    Case("Acosh", [("x", F(2, 3, low=1.5, high=3))]),
    Case("Asin", [("x", F(2, 3, low=-0.8, high=0.8))]),
    Case("Acos", [("x", F(2, 3, low=-0.8, high=0.8))]),
    Case("Atanh", [("x", F(2, 3, low=-0.8, high=0.8))]),
    Case("Abs", [("x", F(2, 3, away_from=0.0))]),
    Case("Relu", [("x", F(2, 3, away_from=0.0))]),
    Case("LeakyRelu", [("x", F(2, 3, away_from=0.0))], {"alpha": 0.2}),
    Case("ThresholdedRelu", [("x", F(2, 3, low=-2, high=2, away_from=0.5))], {"alpha": 0.5}),
    Case("Elu", [("x", F(2, 3, away_from=0.0))], {"alpha": 0.7}),
    Case("Celu", [("x", F(2, 3, away_from=0.0))], {"alpha": 0.7}, evaluator="ort32"),  # float32-only op
    Case("Selu", [("x", F(2, 3, away_from=0.0))]),
    Case("HardSigmoid", [("x", F(2, 3, low=-4, high=4, away_from=2.5))], {"alpha": 0.2, "beta": 0.5}),
    Case("HardSwish", [("x", F(2, 4, low=-4, high=4, away_from=3.0))]),
    Case("Clip", [("x", F(2, 3, away_from=0.4)), ("lo", F(low=-0.5, high=-0.4)), ("hi", F(low=0.3, high=0.35))],
         name="Clip-tensor-bounds"),
    Case("Clip", [("x", F(3, 3, away_from=0.0)), ("lo", None), ("hi", I(0).astype("float64"))],
         const=("hi",), name="Clip-max-only"),
    Case("Add", [("a", F(2, 3)), ("b", F(3))], name="Add-broadcast"),
    Case("Add", [("a", F(2, 1, 4)), ("b", F(3, 1))], name="Add-broadcast-both"),
    Case("Sum", [("a", F(2, 3)), ("b", F(1, 3)), ("c", F(2, 1))], name="Sum-variadic"),
    Case("Mean", [("a", F(2, 3)), ("b", F(3))], name="Mean-variadic"),
    Case("Sub", [("a", F(2, 3)), ("b", F(2, 1))], name="Sub-broadcast"),
    Case("Mul", [("a", F(4, 1, 3)), ("b", F(2, 3))], name="Mul-broadcast"),
    Case("Div", [("a", F(2, 3)), ("b", F(3, low=0.5, high=2))], name="Div-broadcast"),
    Case("Pow", [("a", F(2, 3, low=0.5, high=2)), ("e", F(3, low=0.5, high=2))], name="Pow-both"),
    Case("Pow", [("a", F(2, 3)), ("e", I(2).astype("float64"))], const=("e",), name="Pow-square"),
    Case("Pow", [("a", F(2, 3, low=0.5, high=2)), ("e", I(3))], name="Pow-int-exponent"),
    Case("PRelu", [("x", F(2, 3, away_from=0.0)), ("slope", F(3))], name="PRelu"),
    Case("Min", [("a", F(2, 3)), ("b", F(3)), ("c", F(2, 1))], name="Min-variadic"),
    Case("Max", [("a", F(2, 3)), ("b", F(2, 3))], name="Max"),
    Case("Mod", [("a", F(2, 3, low=1, high=3)), ("b", F(2, 3, low=0.7, high=0.9))], {"fmod": 1}, name="Mod-fmod"),
    Case("Where", [("c", F(2, 3) > 0), ("a", F(2, 3)), ("b", F(3))], name="Where-broadcast"),
    Case("Expand", [("x", F(3, 1)), ("shape", I([2, 3, 4]))], name="Expand"),
    Case("Cast", [("x", F(2, 3))], {"to": 1}, f64_only=True, eps=1e-2, name="Cast-to-float"),
    Case("CastLike", [("x", F(2, 3)), ("like", F(1))], const=("like",), name="CastLike"),
    # Zero-gradient ops: the engine gives zeros (checked against finite differences away from jumps).
    Case("Floor", [("x", F(2, 3, low=0.1, high=0.9))]),
    Case("Ceil", [("x", F(2, 3, low=0.1, high=0.9))]),
    Case("Round", [("x", F(2, 3, low=0.1, high=0.4))]),
    Case("Sign", [("x", F(2, 3, away_from=0.0))]),
]
