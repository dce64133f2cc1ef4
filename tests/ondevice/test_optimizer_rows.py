"""The optimizer model's rows are symbolic where each row's update reads only that row, and the runtime then runs
a step as calls on ranges of the rows from two threads, writing the update in place: the same values as one call
over all of them, as the double-buffered update, and as PyTorch's AdamW."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.blocks.loss_scale import LossScaler
from onnxtrain.blocks.optim import AdamW, build_optimizer_model
from onnxtrain.ondevice.buffers import FlatLayout
from onnxtrain.ondevice import optimizer as optimizer_module
from onnxtrain.ondevice.optimizer import _cuts, _ranges
from onnxtrain.runtime import backends
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


def _linear(tmp, width: int, optimizer="adamw"):
    """A 640 -> ``width`` linear layer and its artifacts."""
    torch.manual_seed(0)
    model = torch.nn.Linear(640, width)
    path = export(model, (torch.from_numpy(X[:4]),), tmp / "linear.onnx", ["x"])
    paths = generate(path, tmp / "artifacts", requires_grad=["weight", "bias"], loss="crossentropy",
                     optimizer=optimizer)
    return model, paths


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A 640 -> 700 linear layer (448,700 parameters: 2 chunks) and its artifacts."""
    return _linear(tmp_path_factory.mktemp("wide"), 700)


@pytest.fixture(scope="module")
def wide_sgd(tmp_path_factory):
    """The 640 -> 700 layer with SGD (Nesterov momentum, weight decay: the update reads the parameter twice, the
    second time in the node that writes it)."""
    sgd = artifacts.SGD(momentum=0.9, nesterov=True, weight_decay=1e-2)
    return _linear(tmp_path_factory.mktemp("wide_sgd"), 700, sgd)


@pytest.fixture(scope="module")
def wider(tmp_path_factory):
    """A 640 -> 4200 linear layer (2,692,200 parameters: 11 chunks) and its artifacts."""
    return _linear(tmp_path_factory.mktemp("wider"), 4200)


def _train(paths, threads: int, steps: int = 3, backend: str = "onnxruntime"):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, session_options=options, backend=backend)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(1e-3)
    for step in range(steps):
        module(X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8])
        optimizer.step()
        module.lazy_reset_grad()
    return optimizer, {n: state.parameters[n].data.copy() for n in ("weight", "bias")}


def test_ranges_of_rows_update_as_one_call_and_as_pytorch(wide):
    model, paths = wide
    ranged, halves = _train(paths, threads=2)
    one, whole = _train(paths, threads=1)  # one thread: one call
    assert (len(ranged._bindings[0]), len(one._bindings[0])) == (2, 1)  # 2 chunks: 2 ranges
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


def test_ranges_shrink_to_one_row():
    for rows in (1, 2, 3, 11, 43, 1000):
        cuts = _cuts(rows)
        sizes = np.diff(cuts)
        assert cuts[0] == 0 and cuts[-1] == rows and (sizes >= 1).all(), rows
        assert (np.diff(sizes) <= 0).all() and sizes[-1] == 1, (rows, sizes)  # the thread ending first waits a row
        assert sizes[0] == -(-rows // 3), (rows, sizes)  # a third of the rows left, each time
    assert list(np.diff(_cuts(43))) == [15, 10, 6, 4, 3, 2, 1, 1, 1]  # BERT-small's


def test_ranges_of_several_element_types_each_hold_a_row_of_every_vector():
    shapes = {"a": (5, 2 ** 18), "b": (2, 2 ** 18), "c": (7,)}
    dtypes = {"a": np.float32, "b": np.float16, "c": np.float32}
    layout = FlatLayout(list(shapes), shapes, dtypes)  # float32: 6 rows, float16: 2 rows
    ranges = _ranges(layout, ranged=True)
    assert len(ranges) == len(_cuts(2)) - 1 == 2  # cut on the float16 vector's 2 rows
    for key in ("float32", "float16"):
        rows = layout.rows(key)[0]
        covered = [r for part in ranges for r in range(rows)[part[key]]]
        assert covered == list(range(rows)), key  # every row once, in order
        assert all(part[key].stop > part[key].start for part in ranges), key
    assert _ranges(layout, ranged=False) == [{"float32": slice(0, 6), "float16": slice(0, 2)}]


def test_shrinking_ranges_update_as_one_call(wider):
    _, paths = wider
    optimizer, ranged = _train(paths, threads=2)
    one, whole = _train(paths, threads=1)
    assert (len(optimizer._bindings[0]), len(one._bindings[0])) == (len(_cuts(11)) - 1, 1) == (5, 1)  # rows 4, 3, 2, 1, 1
    for name in whole:
        assert np.array_equal(ranged[name], whole[name]), name


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model", ["wide", "wider", "wide_sgd"])
def test_update_in_place_as_into_the_other_copy(model, threads, request, monkeypatch):
    """Written over its inputs, the update is bitwise the double-buffered one, step after step (onnxruntime's Scan
    reads each chunk of an input before it writes that chunk of the output of its name)."""
    _, paths = request.getfixturevalue(model)
    optimizer, in_place = _train(paths, threads=threads, steps=4)
    assert optimizer._in_place and optimizer._buffers.current == 0  # written in place: no swap
    monkeypatch.setattr(optimizer_module, "IN_PLACE", False)
    optimizer, swapped = _train(paths, threads=threads, steps=4)
    assert not optimizer._in_place and optimizer._buffers.current == 0  # swapped 4 times
    for name in swapped:
        assert np.array_equal(in_place[name], swapped[name]), name


@pytest.mark.skipif(not backends.openvino_has_bf16(), reason="this CPU has no bfloat16 arithmetic")
def test_update_in_place_under_openvino_bf16(tmp_path, monkeypatch):
    """OpenVINO's training call reads the parameters the update overwrote (bf16 artifacts, as the benchmark runs
    them): the same losses and parameters as with the double buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(640, 1100), torch.nn.GELU(), torch.nn.Linear(1100, 700))
    path = export(model, (torch.from_numpy(X[:4]),), tmp_path / "mlp.onnx", ["x"])
    names = [n for n, _ in model.named_parameters()]
    paths = generate(path, tmp_path / "bf16", requires_grad=names, loss="crossentropy", optimizer="adamw",
                     precision="bf16")
    runs = []
    for in_place in (True, False):
        monkeypatch.setattr(optimizer_module, "IN_PLACE", in_place)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        state = CheckpointState.load_checkpoint(paths.checkpoint)
        module = Module(paths.training_model, state, session_options=options)
        assert (module.backend, module.precision) == ("openvino", "bf16")
        optimizer = Optimizer(paths.optimizer_model, module)
        assert optimizer._in_place is in_place and len(optimizer._bindings[0]) > 1  # 6 chunks: ranges
        losses = []
        for step in range(4):
            losses.append(float(module(X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8])))
            optimizer.step()
            module.lazy_reset_grad()
        runs.append((losses, {n: state.parameters[n].data.copy() for n in names}))
    assert runs[0][0] == runs[1][0]
    for name in names:
        assert np.array_equal(runs[0][1][name], runs[1][1][name]), name
