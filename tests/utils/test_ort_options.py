"""ONNXTRAIN_CPU_ARENA: the shared arena by default, none at all on request (benchmarks/memory_bench.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.utils.ort_options import ARENA_ENV, for_training


def _add_model() -> bytes:
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add",
                              [helper.make_tensor_value_info("x", f, [3])], [helper.make_tensor_value_info("y", f, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString()


def test_the_arena_is_shared_by_default_and_off_on_request(monkeypatch):
    monkeypatch.delenv(ARENA_ENV, raising=False)
    shared = for_training()
    assert shared.enable_cpu_mem_arena and shared.get_session_config_entry("session.use_env_allocators") == "1"
    monkeypatch.setenv(ARENA_ENV, "0")
    off = for_training()
    assert not off.enable_cpu_mem_arena and not off.enable_mem_pattern
    session = ort.InferenceSession(_add_model(), sess_options=off, providers=["CPUExecutionProvider"])
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], 2 * x)


def test_a_bad_arena_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ARENA_ENV, "maybe")
    with pytest.raises(ValueError, match="ONNXTRAIN_CPU_ARENA"):
        for_training()
