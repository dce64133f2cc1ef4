"""ONNXTRAIN_CPU_ARENA: the shared arena by default, handed back as training steps start and end or none at all
on request (benchmarks/memory_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.utils.ort_options import (ARENA_ENV, for_training, forward_without_arena, release_arena,
                                         release_step_memory)


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


def test_a_session_can_opt_out_of_the_shared_arena(monkeypatch):
    monkeypatch.delenv(ARENA_ENV, raising=False)
    own = for_training(arena=False)
    assert not own.enable_cpu_mem_arena and not own.enable_mem_pattern
    with pytest.raises(RuntimeError):  # never set: onnxruntime raises for it
        own.get_session_config_entry("session.use_env_allocators")


def test_a_bad_arena_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ARENA_ENV, "maybe")
    with pytest.raises(ValueError, match="ONNXTRAIN_CPU_ARENA"):
        for_training()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _wide_model(n: int) -> bytes:
    """x [1] -> Expand to [n] -> Exp -> ReduceSum: an n-float value made and freed inside one run."""
    f = TensorProto.FLOAT
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [n])
    graph = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["wide"]),
                               helper.make_node("Exp", ["wide"], ["e"]),
                               helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0)], "wide",
                              [helper.make_tensor_value_info("x", f, [1])], [helper.make_tensor_value_info("y", f, [])],
                              initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString()


def test_release_arena_hands_the_runs_memory_back():
    """In a fresh process: the shared arena is made once per process, with the settings of the first call."""
    n = 16 * 2**20  # 64 MiB a value
    code = f"""
import numpy as np, onnxruntime as ort
from onnxtrain.utils.ort_options import for_training, release_arena
from tests.utils.test_ort_options import _rss_mb, _wide_model
session = ort.InferenceSession(_wide_model({n}), sess_options=for_training(), providers=["CPUExecutionProvider"])
assert abs(session.run(None, {{"x": np.zeros(1, np.float32)}})[0] - {n}) < 1e-5 * {n}
held = _rss_mb()
release_arena()
print(held - _rss_mb())
"""
    env = {**os.environ, ARENA_ENV: "release", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    # the 64 MiB value's region (Exp writes over Expand's output), kept by the arena without the release
    assert float(out.stdout.strip().splitlines()[-1]) > 48


def test_release_step_memory_follows_the_variable(monkeypatch):
    monkeypatch.delenv(ARENA_ENV, raising=False)
    assert not release_step_memory()
    monkeypatch.setenv(ARENA_ENV, "release")
    assert release_step_memory()
    assert not forward_without_arena()
    monkeypatch.setenv(ARENA_ENV, "backward")
    assert release_step_memory() and forward_without_arena()
    monkeypatch.setenv(ARENA_ENV, "0")
    assert not release_step_memory() and not forward_without_arena()
