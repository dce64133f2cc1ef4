"""The ``onnxtrain`` command: plain error messages, help, the model path after a list option, -m."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.cli import main


def _model(path, op="Tanh"):
    w = onnx.numpy_helper.from_array(np.full((3, 2), 0.5, np.float32), "fc1.weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "fc1.weight"], ["h"]), helper.make_node(op, ["h"], ["y"], name="act")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_unknown_parameter_error_has_no_python_reprs(tmp_path, capsys):
    model = _model(tmp_path / "m.onnx")
    assert main(["artifacts", model, "--requires-grad", "fc1.wieght", "--loss", "mse", "-o", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err == ("onnxtrain artifacts: error: fc1.wieght: not initializers of the model; its float "
                   "initializers are: fc1.weight\n")


def test_misspelt_op_is_not_an_op_of_the_opset(tmp_path, capsys):
    model = _model(tmp_path / "m.onnx", op="Tahn")
    assert main(["grad", model, "--wrt", "fc1.weight", "-o", str(tmp_path / "g.onnx")]) == 1
    err = capsys.readouterr().err
    assert "Tahn (node 'act'): not an op of ONNX opset 17" in err and "did you mean Tanh?" in err
    assert "gradient rule" not in err and "onnxtrain/autodiff" not in err


def test_model_path_after_a_list_option(tmp_path, capsys):
    model = _model(tmp_path / "m.onnx")
    rc = main(["artifacts", "--requires-grad", "fc1.weight", model, "--loss", "mse", "-o", str(tmp_path / "o")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "o" / "checkpoint").is_file()
    rc = main(["grad", "--wrt", "fc1.weight", model, "-o", str(tmp_path / "g.onnx")])
    assert rc == 0 and (tmp_path / "g.onnx").is_file()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_artifacts_precision(tmp_path, precision):
    import json

    model = _model(tmp_path / "m.onnx")
    out = tmp_path / "o"
    assert main(["artifacts", model, "--requires-grad", "fc1.weight", "--loss", "mse", "--optimizer", "adamw",
                 "--precision", precision, "-o", str(out)]) == 0
    training = onnx.load(out / "training_model.onnx")
    meta = json.loads({p.key: p.value for p in training.metadata_props}["onnxtrain.training"])
    assert meta["precision"] == precision
    assert ("loss_scale" in [i.name for i in training.graph.input]) == (precision == "fp16")


def test_missing_model_path_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["artifacts", "--requires-grad", "w", "--loss", "mse", "-o", "out"])
    assert info.value.code == 2
    assert "the model path is missing" in capsys.readouterr().err


def test_bare_command_prints_plain_help_and_fails(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: onnxtrain" in err and "artifacts" in err and "grad" in err
    assert "``" not in err and ":mod:" not in err


def test_python_dash_m_onnxtrain():
    result = subprocess.run([sys.executable, "-m", "onnxtrain", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("onnxtrain ")
    result = subprocess.run([sys.executable, "-m", "onnxtrain"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "usage: onnxtrain" in result.stderr
