"""The GELU gradient rules (rules/nn.py) against PyTorch autograd in float64, over the whole range where
their parts saturate (erf and tanh at +-1, the Gaussian at 0), and their size: each op of the gradient is a
pass over a full-size tensor ([32, 128, 1024] at BERT-small's 4x batch), so the op count is its cost."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.passes.liveness import simulate, steps_of

X = np.concatenate([np.linspace(-12.0, 12.0, 4001), [0.0, -0.0, 1e-30, -1e-30, -40.0, 40.0, 5.5, -5.5]])


def _gradient(approximate: str, dtype):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)
    graph = helper.make_graph([node], "gelu", [helper.make_tensor_value_info("x", elem, [X.size])],
                              [helper.make_tensor_value_info("y", elem, [X.size])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    return gradient_model(model, wrt=["x"], outputs=["y"])


@pytest.mark.parametrize("approximate, dtype, most_ops", [("none", np.float32, 10), ("tanh", np.float32, 15),
                                                          ("tanh", np.float64, 15)])
def test_gelu_gradient_matches_torch_in_fewer_ops(approximate, dtype, most_ops):
    grad = _gradient(approximate, dtype)
    x = X.astype(dtype)
    seed = np.random.default_rng(0).standard_normal(x.size).astype(dtype)
    session = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    dx = session.run(None, {"x": x, "y_grad": seed})[-1]
    exact = torch.ops.aten.gelu_backward(torch.tensor(seed, dtype=torch.float64), torch.tensor(x, dtype=torch.float64),
                                         approximate=approximate).numpy()
    if dtype == np.float32:  # as close as torch's own float32 kernel is, within a factor
        own = torch.ops.aten.gelu_backward(torch.tensor(seed), torch.tensor(x), approximate=approximate).numpy()
        bound = 3.0 * max(np.abs(own.astype(np.float64) - exact).max(), 1e-7)
    else:
        bound = 1e-12
    assert np.abs(dx - exact).max() <= bound
    assert np.array_equal(dx[np.abs(x) >= 40], (seed * (x > 0))[np.abs(x) >= 40])
    # the gradient's ops beside the forward Gelu and the constants: 11 (erf) and 18 (tanh) before
    ops = [n.op_type for n in grad.graph.node if n.op_type not in ("Constant", "Gelu")]
    assert len(ops) <= most_ops, ops


def test_the_erf_gradient_in_its_own_order_holds_four_full_size_values():
    """Run in the order the rule makes its nodes (as onnxruntime's priority-based order does, and its
    default order mostly), the erf form's gradient holds at most four full-size values at once: the input,
    the incoming gradient and two temporaries (``passes/liveness.py``). Phi(x) made first held five (Phi
    beside ``x`` and two of the Gaussian's temporaries): the on-device training graph's peak at budget 0
    (BERT-small at 4x batch, docs/memory.md)."""
    grad = _gradient("none", np.float32)
    constants = {o for n in grad.graph.node if n.op_type == "Constant" for o in n.output}
    nodes = [n for n in grad.graph.node if n.op_type not in ("Constant", "Gelu")]
    steps = steps_of(nodes)
    full = 4 * X.size
    sizes = {v: 0 if v in constants else full for s in steps for v in (*s.inputs, *s.outputs)}
    peak = simulate(steps, sizes, inputs=["x", "y_grad"], outputs=[nodes[-1].output[0]])
    assert peak.bytes <= 4 * full, (peak.bytes / full, peak.live)
