"""LSTM, GRU and RNN gradients against PyTorch autograd, run in onnxruntime; and the clear errors for
what the rules do not support.

The ONNX nodes are built by hand from a ``torch.nn`` module's weights (rearranged to ONNX's gate
order), with a dynamic sequence length; one test goes through ``torch.onnx.export`` as a user would.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import gradient_model
from onnxtrain.autodiff.rules._rnn_common import UnsupportedRecurrentError

BATCH, INPUT, HIDDEN = 3, 5, 4
# ONNX gate blocks, as indices of PyTorch's: LSTM torch (i, f, g, o) -> onnx (i, o, f, c);
# GRU torch (r, z, n) -> onnx (z, r, h).
GATE_ORDER = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}
MODULES = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}


def to_onnx_gates(op: str, tensor: torch.Tensor) -> np.ndarray:
    blocks = tensor.detach().numpy().reshape(len(GATE_ORDER[op]), HIDDEN, *tensor.shape[1:])
    return np.concatenate([blocks[i] for i in GATE_ORDER[op]], axis=0)


def onnx_weights(op: str, module: torch.nn.Module, grads: bool = False) -> dict[str, np.ndarray]:
    """W, R, B of ONNX's layout from the module's parameters (or from their gradients)."""
    suffixes = ["", "_reverse"] if module.bidirectional else [""]

    def get(name):
        p = getattr(module, name)
        return p.grad if grads else p

    w = np.stack([to_onnx_gates(op, get(f"weight_ih_l0{s}")) for s in suffixes])
    r = np.stack([to_onnx_gates(op, get(f"weight_hh_l0{s}")) for s in suffixes])
    b = np.stack([np.concatenate([to_onnx_gates(op, get(f"bias_ih_l0{s}")),
                                  to_onnx_gates(op, get(f"bias_hh_l0{s}"))]) for s in suffixes])
    return {"W": w, "R": r, "B": b}


def recurrent_model(op: str, directions: int, **attrs) -> onnx.ModelProto:
    """One LSTM/GRU/RNN node; every input a float32 graph input; sequence and batch dynamic."""
    gates = len(GATE_ORDER[op])
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("X", f, ["T", "N", INPUT]),
        helper.make_tensor_value_info("W", f, [directions, gates * HIDDEN, INPUT]),
        helper.make_tensor_value_info("R", f, [directions, gates * HIDDEN, HIDDEN]),
        helper.make_tensor_value_info("B", f, [directions, 2 * gates * HIDDEN]),
        helper.make_tensor_value_info("initial_h", f, [directions, "N", HIDDEN]),
    ]
    outputs = ["Y", "Y_h"]
    if op == "LSTM":
        inputs.append(helper.make_tensor_value_info("initial_c", f, [directions, "N", HIDDEN]))
        outputs.append("Y_c")
    node_inputs = ["X", "W", "R", "B", "", "initial_h"] + (["initial_c"] if op == "LSTM" else [])
    node = helper.make_node(op, node_inputs, outputs, name=f"{op.lower()}_node", hidden_size=HIDDEN,
                            direction="bidirectional" if directions == 2 else "forward", **attrs)
    graph = helper.make_graph([node], "rnn", inputs,
                              [helper.make_tensor_value_info(o, f, None) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def torch_reference(op, module, x, h0, c0, seeds):
    """PyTorch's outputs (in ONNX's layout) and gradients, in float64."""
    module = module.double()
    module.zero_grad()
    x = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    h0 = torch.tensor(h0, dtype=torch.float64, requires_grad=True)
    state = h0
    if op == "LSTM":
        c0 = torch.tensor(c0, dtype=torch.float64, requires_grad=True)
        state = (h0, c0)
    y, last = module(x, state)
    t, n = x.shape[:2]
    y = y.reshape(t, n, -1, HIDDEN).permute(0, 2, 1, 3)  # [T, N, D*H] -> ONNX's [T, D, N, H]
    outs = [y, last[0], last[1]] if op == "LSTM" else [y, last]
    loss = sum((o * torch.from_numpy(s).double()).sum() for o, s in zip(outs, seeds))
    loss.backward()
    grads = {"X": x.grad.numpy(), **onnx_weights(op, module, grads=True), "initial_h": h0.grad.numpy()}
    if op == "LSTM":
        grads["initial_c"] = c0.grad.numpy()
    return [o.detach().numpy() for o in outs], grads


@pytest.mark.parametrize("bidirectional", [False, True], ids=["forward", "bidirectional"])
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN", "RNN-relu"])
def test_matches_torch_autograd(op, bidirectional):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    d = 2 if bidirectional else 1
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}  # PyTorch's GRU resets after the product
    if op == "RNN-relu":
        op, attrs = "RNN", {"activations": ["Relu"] * d}
        module = torch.nn.RNN(INPUT, HIDDEN, bidirectional=bidirectional, nonlinearity="relu")
    else:
        module = MODULES[op](INPUT, HIDDEN, bidirectional=bidirectional)
    model = recurrent_model(op, d, **attrs)
    wrt = ["X", "W", "R", "B", "initial_h"] + (["initial_c"] if op == "LSTM" else [])
    sess = session(gradient_model(model, wrt=wrt))
    weights = {k: v.astype(np.float32) for k, v in onnx_weights(op, module).items()}

    for seq in (1, 4):  # one gradient model serves every sequence length
        x = rng.standard_normal((seq, BATCH, INPUT))
        h0, c0 = rng.standard_normal((2, d, BATCH, HIDDEN))
        shapes = [(seq, d, BATCH, HIDDEN), (d, BATCH, HIDDEN)] + ([(d, BATCH, HIDDEN)] if op == "LSTM" else [])
        seeds = [rng.standard_normal(s) for s in shapes]
        expected_outs, expected = torch_reference(op, module, x, h0, c0, seeds)
        module.float()

        feeds = {"X": x, "initial_h": h0, **weights}
        if op == "LSTM":
            feeds["initial_c"] = c0
        names = ["Y", "Y_h", "Y_c"][: len(seeds)]
        feeds.update({f"{n}_grad": s for n, s in zip(names, seeds)})
        results = sess.run(None, {k: np.asarray(v, dtype=np.float32) for k, v in feeds.items()})
        for name, got, want in zip(names, results, expected_outs):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{op} output {name}")
        for name, got in zip(wrt, results[len(names):]):
            np.testing.assert_allclose(got, expected[name], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{op} seq={seq}: gradient of {name}")


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_exported_module_matches_torch(op):
    """The way a user gets there: torch.onnx.export of a bidirectional module, gradients of its
    parameters (the exporter's W, R, B initializers) and input; the outputs arrive reshaped."""
    torch.manual_seed(1)
    module = MODULES[op](INPUT, HIDDEN, bidirectional=True)
    x = torch.randn(4, BATCH, INPUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.onnx.export(module, (x,), dynamo=True, input_names=["x"],
                                     output_names=["y", "h_n"] + (["c_n"] if op == "LSTM" else []),
                                     verbose=False).model_proto
    node = next(n for n in exported.graph.node if n.op_type == op)
    params = dict(zip(["W", "R", "B"], node.input[1:4]))
    grad = gradient_model(exported, wrt=["x", *params.values()])
    outputs = [o.name for o in exported.graph.output]

    rng = np.random.default_rng(1)
    y = module(x)
    torch_outs = [y[0], *(y[1] if op == "LSTM" else (y[1],))]
    seeds = [rng.standard_normal(tuple(o.shape)).astype(np.float32) for o in torch_outs]
    xt = x.clone().requires_grad_(True)
    y = module(xt)
    torch_outs = [y[0], *(y[1] if op == "LSTM" else (y[1],))]
    sum((o * torch.from_numpy(s)).sum() for o, s in zip(torch_outs, seeds)).backward()
    expected = {"x": xt.grad.numpy(), **{params[k]: v for k, v in onnx_weights(op, module, grads=True).items()}}

    feeds = {"x": x.numpy(), **{f"{n}_grad": s for n, s in zip(outputs, seeds)}}
    results = session(grad).run(None, feeds)
    for name, got in zip(["x", *params.values()], results[len(outputs):]):
        np.testing.assert_allclose(got, expected[name], rtol=1e-4, atol=1e-4, err_msg=f"{op}: gradient of {name}")


@pytest.mark.parametrize("attrs, fragment", [
    ({"clip": 1.0}, "'clip'"),
    ({"activations": ["Sigmoid", "Tanh", "Relu"]}, "activations"),
    ({"activations": ["Sigmoid", "Tanh"]}, "activations"),
    ({"input_forget": 1}, "input_forget"),
])
def test_unsupported_attribute_names_node_and_attribute(attrs, fragment):
    with pytest.raises(UnsupportedRecurrentError, match=fragment) as info:
        gradient_model(recurrent_model("LSTM", 1, **attrs), wrt=["W"])
    assert "lstm_node" in str(info.value)


def test_variable_sequence_lens_is_refused():
    model = recurrent_model("GRU", 1)
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"]))
    graph.node[0].input[4] = "lens"
    with pytest.raises(UnsupportedRecurrentError, match="sequence_lens") as info:
        gradient_model(model, wrt=["X"])
    assert "gru_node" in str(info.value)


def test_peepholes_are_refused():
    model = recurrent_model("LSTM", 1)
    model.graph.input.append(helper.make_tensor_value_info("P", TensorProto.FLOAT, [1, 3 * HIDDEN]))
    model.graph.node[0].input.append("P")
    with pytest.raises(UnsupportedRecurrentError, match="peepholes"):
        gradient_model(model, wrt=["R"])


def test_node_without_y_output_gets_it_for_the_gradient():
    """Only Y_h is used: the rule asks the node for Y (its hidden states) and gets the same gradients
    as when the node returns Y itself."""
    rng = np.random.default_rng(2)
    full = recurrent_model("GRU", 2, linear_before_reset=1)
    last_only = onnx.ModelProto()
    last_only.CopyFrom(full)
    last_only.graph.node[0].output[0] = ""
    del last_only.graph.output[0]
    wrt = ["X", "W", "R", "B", "initial_h"]
    feeds = {
        "X": rng.standard_normal((4, BATCH, INPUT)), "W": rng.standard_normal((2, 3 * HIDDEN, INPUT)),
        "R": rng.standard_normal((2, 3 * HIDDEN, HIDDEN)), "B": rng.standard_normal((2, 6 * HIDDEN)),
        "initial_h": rng.standard_normal((2, BATCH, HIDDEN)), "Y_h_grad": rng.standard_normal((2, BATCH, HIDDEN)),
    }
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    got = session(gradient_model(last_only, wrt=wrt, outputs=["Y_h"])).run(None, feeds)[1:]
    want = session(gradient_model(full, wrt=wrt, outputs=["Y_h"])).run(None, feeds)[2:]
    for name, g, w in zip(wrt, got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"gradient of {name}")
