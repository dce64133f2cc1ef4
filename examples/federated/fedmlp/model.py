"""The model and its artifacts, built on the workstation (onnx and onnxtrain.artifacts; no torch).

An MLP 20 -> 64 -> 64 -> 10 written directly as ONNX, initialised as torch.nn.Linear is (uniform in
+-1/sqrt(fan_in)), returning logits; the artifacts add cross-entropy and AdamW and return the logits
after the loss so the eval model gives accuracy.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts
from fedmlp.data import CLASSES, FEATURES

SIZES = (FEATURES, 64, 64, CLASSES)


def mlp(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        bound = 1 / np.sqrt(a)
        inits += [numpy_helper.from_array(rng.uniform(-bound, bound, (a, b)).astype(np.float32), f"fc{i}.weight"),
                  numpy_helper.from_array(rng.uniform(-bound, bound, b).astype(np.float32), f"fc{i}.bias")]
        last = i == len(SIZES) - 2
        nodes += [helper.make_node("MatMul", [x, f"fc{i}.weight"], [f"mm{i}"]),
                  helper.make_node("Add", [f"mm{i}", f"fc{i}.bias"], ["logits" if last else f"pre{i}"])]
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{i}"], [f"h{i}"]))
            x = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def build_artifacts(directory, lr: float = 3e-3) -> artifacts.Artifacts:
    model = mlp()
    return artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                        loss="crossentropy", optimizer=artifacts.AdamW(lr=lr, weight_decay=0.0),
                                        additional_output_names=["logits"], artifact_directory=directory,
                                        overwrite=True)
