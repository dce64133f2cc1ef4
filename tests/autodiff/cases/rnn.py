"""Finite-difference cases for rules/rnn.py: LSTM, GRU, RNN.

Small sizes (sequence 3, batch 2, input 3, hidden 2) in every direction, with and without the optional
inputs, both layouts, and gradients arriving at Y, Y_h and Y_c alone or together.
"""

import numpy as np

from tests.autodiff.gradcheck import Case, F, I  # noqa: F401

SEQ, BATCH, INPUT, HIDDEN = 3, 2, 3, 2
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
OUTPUTS = {"LSTM": 3, "GRU": 2, "RNN": 2}


def recurrent_case(op: str, direction: str = "forward", *, bias: bool = True, initial_h: bool = True,
                   initial_c: bool = True, layout: int = 0, full_lens: bool = False,
                   evaluator: str = "reference", diff_outputs=None, num_outputs=None,
                   name: str = "", **attrs) -> Case:
    d = 2 if direction == "bidirectional" else 1
    gh = GATES[op] * HIDDEN
    x = F(BATCH, SEQ, INPUT) if layout else F(SEQ, BATCH, INPUT)
    state = (lambda: F(BATCH, d, HIDDEN)) if layout else (lambda: F(d, BATCH, HIDDEN))
    inputs = [
        ("X", x), ("W", F(d, gh, INPUT)), ("R", F(d, gh, HIDDEN)),
        ("B", F(d, 2 * gh) if bias else None),
        # A constant sequence_lens equal to the full length is accepted (exporters emit it).
        ("sequence_lens", np.full((BATCH,), SEQ, dtype=np.int32) if full_lens else None),
        ("initial_h", state() if initial_h else None),
    ]
    if op == "LSTM":
        inputs.append(("initial_c", state() if initial_c else None))
    while inputs[-1][1] is None:
        inputs.pop()
    attrs = {"hidden_size": HIDDEN, "direction": direction, **attrs}
    if layout:
        attrs["layout"] = layout
    label = name or "-".join(
        [op, direction] + [f"{k}{v}" for k, v in attrs.items() if k not in ("hidden_size", "direction")]
        + ([] if bias else ["noB"]) + (["full_lens"] if full_lens else []) + ([] if initial_h else ["noH0"])
        + ([] if initial_c or op != "LSTM" else ["noC0"])
        + ([f"dout{''.join(map(str, diff_outputs))}"] if diff_outputs is not None else [])
    )
    # onnxruntime's LSTM/GRU/RNN kernels reject layout 1: those cases check in float64 only.
    return Case(op, inputs, attrs, opset=14, num_outputs=num_outputs or OUTPUTS[op],
                diff_outputs=diff_outputs, f64_only=layout == 1, evaluator=evaluator, name=label)


CASES: list[Case] = [
    # LSTM
    recurrent_case("LSTM", "forward"),
    recurrent_case("LSTM", "reverse", bias=False, initial_h=False, initial_c=False),
    recurrent_case("LSTM", "bidirectional"),
    recurrent_case("LSTM", "bidirectional", initial_h=False, diff_outputs=[1, 2]),
    recurrent_case("LSTM", "forward", diff_outputs=[2]),
    recurrent_case("LSTM", "reverse", num_outputs=1, initial_c=False),
    recurrent_case("LSTM", "bidirectional", layout=1),
    recurrent_case("LSTM", "bidirectional", full_lens=True, diff_outputs=[0]),
    # GRU, both reset variants
    *(recurrent_case("GRU", direction, linear_before_reset=lbr, bias=bias, initial_h=bias)
      for lbr in (0, 1)
      for direction, bias in (("forward", True), ("reverse", False), ("bidirectional", True))),
    recurrent_case("GRU", "forward", linear_before_reset=1, diff_outputs=[1]),
    recurrent_case("GRU", "bidirectional", linear_before_reset=0, layout=1, bias=False),
    # RNN
    recurrent_case("RNN", "forward"),
    recurrent_case("RNN", "reverse", bias=False, initial_h=False),
    recurrent_case("RNN", "bidirectional", diff_outputs=[1]),
    recurrent_case("RNN", "bidirectional", layout=1),
    # onnx.reference's RNN knows only Tanh: other activations are checked in float32 on onnxruntime
    # (Relu, with its kink, against PyTorch in test_rnn_torch.py).
    recurrent_case("RNN", "bidirectional", activations=["Sigmoid", "Tanh"], evaluator="ort32"),
]
