"""Finite-difference cases for rules/nn.py."""

import numpy as np

from tests.autodiff.gradcheck import Case, F

MS = "com.microsoft"


def _labels(shape, classes, ignore=None, seed=1):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=shape)
    if ignore is not None:
        labels.flat[::3] = ignore  # every third sample is ignored
    return labels.astype(np.int64)


# -- softmax ------------------------------------------------------------------------------------
CASES: list[Case] = [
    Case("Softmax", [("x", F(2, 3, 4))], name="Softmax-default-axis"),
    Case("Softmax", [("x", F(2, 3, 4))], {"axis": 1}, name="Softmax-axis1"),
    Case("Softmax", [("x", F(2, 3, 4))], {"axis": 0}, opset=13, name="Softmax-axis0-opset13"),
    Case("LogSoftmax", [("x", F(2, 3, 4))], name="LogSoftmax-default-axis"),
    Case("LogSoftmax", [("x", F(2, 3, 4))], {"axis": -2}, opset=13, name="LogSoftmax-axis-2-opset13"),
]

# -- losses -------------------------------------------------------------------------------------
_W = F(5, low=0.2, high=2.0)
for op in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"):
    short = "SCE" if op.startswith("Softmax") else "NLL"
    for reduction in ("none", "sum", "mean"):
        CASES.append(Case(op, [("x", F(4, 5)), ("t", _labels((4,), 5))], {"reduction": reduction},
                          name=f"{short}-{reduction}"))
        CASES.append(Case(op, [("x", F(3, 5, 2)), ("t", _labels((3, 2), 5, ignore=-100)), ("w", _W)],
                          {"reduction": reduction, "ignore_index": -100}, const=("w",),
                          name=f"{short}-{reduction}-3d-weight-ignore"))
    CASES.append(Case(op, [("x", F(6, 5)), ("t", _labels((6,), 5, ignore=2))], {"ignore_index": 2},
                      name=f"{short}-mean-ignore-in-range"))
    CASES.append(Case(op, [("x", F(2, 5, 2, 2)), ("t", _labels((2, 2, 2), 5).astype(np.int32)), ("w", _W)],
                      const=("w",), name=f"{short}-mean-4d-weight-int32"))
    # before opset 16 ScatterElements cannot add: the gradient takes the one-hot route
    CASES.append(Case(op, [("x", F(3, 5, 2)), ("t", _labels((3, 2), 5, ignore=-100)), ("w", _W)],
                      {"reduction": "none", "ignore_index": -100}, const=("w",), opset=13,
                      name=f"{short}-none-3d-weight-ignore-opset13"))
    CASES.append(Case(op, [("x", F(4, 5)), ("t", _labels((4,), 5))], opset=15, name=f"{short}-mean-opset15"))
    # the default mean over [N, C, d]: weights of one, the scale reshaped per row (autodiff/rules/nn.py)
    CASES.append(Case(op, [("x", F(3, 5, 2)), ("t", _labels((3, 2), 5))], name=f"{short}-mean-3d"))
    CASES.append(Case(op, [("x", F(2, 5, 0)), ("t", _labels((2, 0), 5))], {"reduction": "none"},
                      name=f"{short}-none-3d-empty-axis"))
CASES += [
    Case("SoftmaxCrossEntropyLoss", [("x", F(4, 5)), ("t", _labels((4,), 5, ignore=1))],
         {"reduction": "mean", "ignore_index": 1}, num_outputs=2, name="SCE-with-log-prob"),
    Case("SoftmaxCrossEntropyLoss", [("x", F(4, 5)), ("t", _labels((4,), 5))], num_outputs=2,
         diff_outputs=[1], name="SCE-log-prob-only"),
]

# -- dropout (a fixed seed makes the onnx reference mask repeatable; onnxruntime draws its own) ---
CASES += [
    Case("Dropout", [("x", F(3, 4))], name="Dropout-no-training-input"),
    Case("Dropout", [("x", F(3, 4)), ("ratio", np.float64(0.3)), ("training", np.array(False))],
         const=("ratio",), name="Dropout-eval"),
    Case("Dropout", [("x", F(4, 5)), ("ratio", np.float64(0.3)), ("training", np.array(True))],
         {"seed": 7}, const=("ratio",), f64_only=True, name="Dropout-train"),
    Case("Dropout", [("x", F(4, 5)), ("ratio", np.float64(0.5)), ("training", np.array(True))], {"seed": 3},
         const=("ratio",), num_outputs=2, diff_outputs=[0], f64_only=True, name="Dropout-train-with-mask"),
    Case("Dropout", [("x", F(4, 5)), ("ratio", np.float32(0.0)), ("training", np.array(True))],
         name="Dropout-train-ratio0-float32-ratio"),
]

# -- GELU (onnxruntime has no float64 Erf: the erf form runs in float32) --------------------------
CASES += [
    Case("Gelu", [("x", F(3, 4, low=-3, high=3))], evaluator="ort32", name="Gelu-erf"),
    Case("Gelu", [("x", F(3, 4, low=-3, high=3))], {"approximate": "tanh"}, evaluator="ort",
         name="Gelu-tanh"),
]

# -- normalizations over trailing axes -----------------------------------------------------------
CASES += [
    Case("LayerNormalization", [("x", F(2, 3, 4)), ("s", F(4)), ("b", F(4))], opset=17, name="LayerNorm"),
    Case("LayerNormalization", [("x", F(2, 3, 4)), ("s", F(3, 4)), ("b", F(4))], {"axis": 1, "epsilon": 1e-3},
         name="LayerNorm-axis1"),
    Case("LayerNormalization", [("x", F(2, 3, 4)), ("s", F(4))], {"axis": -1}, num_outputs=3,
         diff_outputs=[0], name="LayerNorm-saved-stats-no-bias"),
    Case("LayerNormalization", [("x", F(3, 4)), ("s", F(4)), ("b", F(4))], evaluator="ort32",
         num_outputs=3, diff_outputs=[0], name="LayerNorm-float32-saved-stats"),
    Case("RMSNormalization", [("x", F(2, 3, 4)), ("s", F(4))], opset=23, name="RMSNorm"),
    Case("RMSNormalization", [("x", F(2, 3, 4)), ("s", F(3, 4))], {"axis": 1, "epsilon": 1e-3}, opset=23,
         name="RMSNorm-axis1"),
]

# -- ops whose outputs onnx shape inference leaves untyped (onnxruntime contrib ops, GroupNormalization):
# checked by tests/autodiff/test_nn_torch.py until gradcheck types them (rules in rules.nn.staged_rules).
STAGED_CASES: list[Case] = [
    Case("Gelu", [("x", F(3, 4, low=-3, high=3))], domain=MS, evaluator="ort32", name="ms-Gelu"),
    Case("BiasGelu", [("x", F(2, 3, 4, low=-3, high=3)), ("b", F(4))], domain=MS, evaluator="ort32"),
    Case("FastGelu", [("x", F(2, 3, 4, low=-3, high=3)), ("b", F(4))], domain=MS, evaluator="ort",
         name="FastGelu-bias"),
    Case("FastGelu", [("x", F(2, 3, 4, low=-3, high=3))], domain=MS, evaluator="ort32", name="FastGelu"),
    Case("QuickGelu", [("x", F(2, 3, low=-3, high=3))], domain=MS, evaluator="ort", name="QuickGelu"),
    Case("QuickGelu", [("x", F(2, 3, low=-3, high=3))], {"alpha": 1.3}, domain=MS, evaluator="ort32",
         name="QuickGelu-alpha"),
    Case("SimplifiedLayerNormalization", [("x", F(2, 3, 4)), ("s", F(4))], evaluator="ort"),
    Case("SimplifiedLayerNormalization", [("x", F(2, 3, 4)), ("s", F(3, 4))], {"axis": 1},
         evaluator="ort32", num_outputs=2, diff_outputs=[0], name="SimplifiedLayerNorm-axis1-saved"),
    Case("SkipLayerNormalization", [("x", F(2, 3, 4)), ("k", F(2, 3, 4)), ("s", F(4)), ("b", F(4)),
                                    ("bias", F(4))], domain=MS, evaluator="ort32", num_outputs=4,
         diff_outputs=[0, 3], name="SkipLayerNorm-output-and-sum"),
    Case("SkipLayerNormalization", [("x", F(2, 3, 4)), ("k", F(3, 4)), ("s", F(4))], {"epsilon": 1e-5},
         domain=MS, evaluator="ort32", name="SkipLayerNorm-broadcast-skip"),
    Case("SkipSimplifiedLayerNormalization", [("x", F(2, 3, 4)), ("k", F(2, 3, 4)), ("s", F(4)),
                                              ("bias", F(4))], domain=MS, evaluator="ort32"),
    Case("SkipSimplifiedLayerNormalization", [("x", F(2, 3, 4)), ("k", F(2, 3, 4)), ("s", F(4))],
         domain=MS, evaluator="ort32", num_outputs=4, diff_outputs=[3], name="SkipSimplifiedLayerNorm-sum-only"),
    # stash_type=11: onnxruntime then normalizes float64 in float64 (by default it does it in float32)
    Case("GroupNormalization", [("x", F(2, 4, 2, 3)), ("s", F(4)), ("b", F(4))], {"num_groups": 2, "stash_type": 11},
         opset=21, evaluator="ort", name="GroupNorm-21"),
    Case("GroupNormalization", [("x", F(2, 6, 3)), ("s", F(6)), ("b", F(6))], {"num_groups": 3, "epsilon": 1e-3},
         opset=21, evaluator="ort32", name="GroupNorm-21-1d-float32"),
]

# -- per-channel normalizations ------------------------------------------------------------------
_C3 = F(3, low=0.5, high=1.5)
CASES += [
    Case("BatchNormalization", [("x", F(4, 3, 2, 2)), ("s", F(3)), ("b", F(3)), ("m", F(3)),
                                ("v", F(3, low=0.5, high=1.5))], {"training_mode": 1, "momentum": 0.8},
         num_outputs=3, diff_outputs=[0], name="BatchNorm-train"),
    Case("BatchNormalization", [("x", F(5, 3)), ("s", F(3)), ("b", F(3)), ("m", F(3)), ("v", _C3)],
         {"training_mode": 1}, opset=15, num_outputs=3, diff_outputs=[0], name="BatchNorm-train-2d"),
    Case("BatchNormalization", [("x", F(2, 3, 2, 2)), ("s", F(3)), ("b", F(3)), ("m", F(3)), ("v", _C3)],
         {"epsilon": 1e-3}, opset=14, name="BatchNorm-eval"),
    Case("BatchNormalization", [("x", F(2, 3, 4)), ("s", F(3)), ("b", F(3)), ("m", F(3)), ("v", _C3)],
         opset=13, evaluator="ort", name="BatchNorm-eval-opset13"),  # onnx.reference: opset-9 BN trains
    Case("InstanceNormalization", [("x", F(2, 3, 2, 3)), ("s", F(3)), ("b", F(3))]),
    Case("InstanceNormalization", [("x", F(2, 3, 4)), ("s", F(3)), ("b", F(3))], {"epsilon": 1e-3},
         name="InstanceNorm-1d"),
]

# -- convolutions (small: the float64 reference evaluator runs every finite difference) -------------
CASES += [
    Case("Conv", [("x", F(1, 2, 5, 4)), ("w", F(3, 2, 3, 3)), ("b", F(3))], {"pads": [1, 1, 1, 1]},
         name="Conv-2d-pads-bias"),
    Case("Conv", [("x", F(1, 2, 7, 6)), ("w", F(2, 2, 2, 3))],
         {"strides": [2, 2], "dilations": [2, 1], "pads": [1, 0, 2, 1]}, name="Conv-2d-strides-dilations"),
    Case("Conv", [("x", F(2, 4, 5, 5)), ("w", F(4, 2, 3, 3))], {"group": 2, "strides": [2, 2]},
         evaluator="ort32", name="Conv-2d-groups"),  # onnx.reference's ConvTranspose has no groups
    Case("Conv", [("x", F(1, 3, 4, 4)), ("w", F(3, 1, 3, 3)), ("b", F(3))], {"group": 3, "pads": [1, 1, 1, 1]},
         name="Conv-2d-depthwise"),
    Case("Conv", [("x", F(2, 2, 7)), ("w", F(3, 2, 3))], {"strides": [2], "pads": [1, 2]}, name="Conv-1d"),
    Case("Conv", [("x", F(1, 2, 4, 3, 3)), ("w", F(2, 2, 2, 2, 2))], {"strides": [2, 1, 1]}, name="Conv-3d"),
    Case("Conv", [("x", F(1, 2, 6, 5)), ("w", F(2, 2, 3, 3))], {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
         name="Conv-same-upper"),
    Case("Conv", [("x", F(1, 2, 5, 4)), ("w", F(2, 2, 2, 2))], {"auto_pad": "SAME_LOWER", "strides": [1, 2]},
         name="Conv-same-lower"),
    Case("Conv", [("x", F(1, 2, 5, 5)), ("w", F(2, 2, 3, 2))], {"auto_pad": "VALID", "strides": [2, 2]},
         name="Conv-valid"),
    Case("ConvTranspose", [("x", F(1, 2, 3, 3)), ("w", F(2, 3, 3, 3)), ("b", F(3))], name="ConvTranspose-bias"),
    Case("ConvTranspose", [("x", F(1, 2, 3, 3)), ("w", F(2, 2, 3, 3))],
         {"strides": [2, 2], "pads": [1, 0, 1, 1], "output_padding": [1, 0]},
         name="ConvTranspose-strides-pads-output-padding"),
    Case("ConvTranspose", [("x", F(1, 4, 3, 3)), ("w", F(4, 1, 2, 2))], {"group": 2, "dilations": [2, 2]},
         evaluator="ort32", name="ConvTranspose-groups-dilations"),
    Case("ConvTranspose", [("x", F(2, 2, 4)), ("w", F(2, 3, 3))], {"strides": [3], "pads": [1, 1]},
         name="ConvTranspose-1d"),
]

# -- pooling (onnx.reference's MaxPool Indices are wrong for overlapping windows: onnxruntime) -----
CASES += [
    Case("MaxPool", [("x", F(2, 2, 4, 4))], {"kernel_shape": [2, 2], "strides": [2, 2]}, evaluator="ort",
         name="MaxPool-2d"),
    Case("MaxPool", [("x", F(1, 2, 5, 5))], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2],
                                            "ceil_mode": 1}, evaluator="ort", name="MaxPool-pads-ceil"),
    Case("MaxPool", [("x", F(1, 2, 6, 5))], {"kernel_shape": [2, 2], "dilations": [2, 1]},
         evaluator="ort", name="MaxPool-dilations"),
    Case("MaxPool", [("x", F(2, 2, 7))], {"kernel_shape": [3], "strides": [2], "auto_pad": "SAME_UPPER"},
         evaluator="ort", name="MaxPool-1d-same"),
    Case("MaxPool", [("x", F(1, 2, 4, 4))], {"kernel_shape": [2, 2]}, num_outputs=2, diff_outputs=[0],
         evaluator="ort", name="MaxPool-overlap-with-indices"),
    Case("AveragePool", [("x", F(1, 2, 4, 4))], {"kernel_shape": [2, 2], "strides": [2, 2]},
         name="AveragePool-2d"),
    Case("AveragePool", [("x", F(1, 2, 5, 5))], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]},
         name="AveragePool-pads-exclude"),
    Case("AveragePool", [("x", F(1, 2, 5, 5))], {"kernel_shape": [3, 3], "pads": [1, 0, 1, 1], "strides": [2, 2],
                                                "count_include_pad": 1}, name="AveragePool-pads-include"),
    Case("AveragePool", [("x", F(1, 1, 5, 6))], {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1},
         name="AveragePool-ceil"),
    Case("AveragePool", [("x", F(1, 1, 5, 6))], {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1,
                                                "pads": [1, 1, 0, 0], "count_include_pad": 1},
         name="AveragePool-ceil-include-pad"),
    Case("AveragePool", [("x", F(1, 2, 6, 5))], {"kernel_shape": [2, 2], "dilations": [2, 1]}, opset=19,
         name="AveragePool-dilations"),
    Case("AveragePool", [("x", F(2, 1, 7))], {"kernel_shape": [3], "strides": [2], "auto_pad": "SAME_LOWER"},
         name="AveragePool-1d-same-lower"),
    Case("GlobalAveragePool", [("x", F(2, 3, 2, 3))]),
    Case("GlobalMaxPool", [("x", F(2, 3, 2, 3))]),
]
