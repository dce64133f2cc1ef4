"""The optimizer model's rows are symbolic where each row's update reads only that row, and the runtime then runs
a step as calls on ranges of the rows from two threads: the same values as one call over all of them, and as
PyTorch's AdamW."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.blocks.optim import AdamW, build_optimizer_model
from onnxtrain.blocks.loss_scale import LossScaler
from tests.ondevice.helpers import export, generate

RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 640)).astype(np.float32)
Y = RNG.integers(0, 700, 32).astype(np.int64)


def _rows(proto: onnx.ModelProto) -> list:
    """The first dims of the optimizer model's flat inputs (an int when fixed, a name when symbolic)."""
    dims = [i.type.tensor_type.shape.dim for i in proto.graph.input if len(i.type.tensor_type.shape.dim) == 2]
    return [d[0].dim_param or d[0].dim_value for d in dims]


def test_rows_are_symbolic_only_where_each_row_s_update_is_its_own():
    params = [("w", np.float32, (600, 1000))]  # 3 chunks of 2^18
    assert set(_rows(build_optimizer_model(AdamW(), params))) == {"chunks.float32"}
    for fixed in (build_optimizer_model(AdamW(max_grad_norm=1.0), params),  # the norm reads every row
                  build_optimizer_model(AdamW(), params, LossScaler()),  # so does the inf check
                  build_optimizer_model(AdamW(), params, scan=False)):  # web: whole vectors
        assert set(_rows(fixed)) == {3}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A 640 -> 700 linear layer (448,700 parameters: 2 chunks) and its artifacts."""
    tmp = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    model = torch.nn.Linear(640, 700)
    path = export(model, (torch.from_numpy(X[:4]),), tmp / "wide.onnx", ["x"])
    paths = generate(path, tmp / "artifacts", requires_grad=["weight", "bias"], loss="crossentropy",
                     optimizer="adamw")
    return model, paths


def _train(paths, threads: int, steps: int = 3):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, session_options=options)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(1e-3)
    for step in range(steps):
        module(X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8])
        optimizer.step()
        module.lazy_reset_grad()
    return len(optimizer._bindings[0]), {n: state.parameters[n].data.copy() for n in ("weight", "bias")}


def test_ranges_of_rows_update_as_one_call_and_as_pytorch(wide):
    model, paths = wide
    parts, halves = _train(paths, threads=2)
    whole_parts, whole = _train(paths, threads=1)  # one thread: one call
    assert (parts, whole_parts) == (2, 1)  # 2 chunks: 2 ranges
    for name in whole:
        assert np.array_equal(halves[name], whole[name]), name
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad()
        x, y = torch.from_numpy(X[8 * step:8 * step + 8]), torch.from_numpy(Y[8 * step:8 * step + 8])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for name, p in model.named_parameters():  # a tenth of a step: Adam's m / sqrt(v) of a near-zero gradient
        np.testing.assert_allclose(halves[name], p.detach().numpy(), rtol=1e-5, atol=1e-4)  # amplifies its rounding
