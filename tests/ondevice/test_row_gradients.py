"""bf16 artifacts (training model format 4): an embedding's gradient leaves the graph as its token ids and rows,
which the runtime adds (``FlatBuffers.add_rows``), against the float32 artifacts' in-graph scatter."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.ondevice.buffers import FlatBuffers, FlatLayout, sum_rows
from onnxtrain.ondevice.format import ROW_GRADIENTS_FORMAT, TRAINING_METADATA_KEY
from tests.conformance.test_schemas import _validator
from tests.ondevice.helpers import export, generate

RNG = np.random.default_rng(0)


class Bag(torch.nn.Module):
    """Token ids -> mean of their embeddings -> classes; ``tied``: the table is also the output layer's weight."""

    def __init__(self, tied: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 8)
        self.lin = torch.nn.Linear(8, 40 if tied else 5)
        if tied:
            self.lin.weight = self.emb.weight

    def forward(self, ids):
        return self.lin(self.emb(ids).mean(1))


def _batches(classes: int):
    out = []
    for _ in range(3):
        ids = RNG.integers(0, 40, (4, 6)).astype(np.int64)
        ids[0, :4] = 7  # a repeated id, within a row and across rows
        ids[2, 1] = 7
        out.append((ids, RNG.integers(0, classes, 4).astype(np.int64)))
    return out


def _artifacts(tmp_path, tied: bool):
    torch.manual_seed(0)
    model = Bag(tied)
    path = export(model, (torch.from_numpy(_batches(5)[0][0]),), tmp_path / "bag.onnx", ["ids"])
    params = [i.name for i in onnx.load(path).graph.initializer]  # a tied table is exported once, by one name
    kwargs = dict(requires_grad=params, loss="crossentropy", optimizer="adamw")
    return params, {p: generate(path, tmp_path / p, precision=p, **kwargs) for p in ("fp32", "bf16")}


def _meta(path) -> dict:
    entries = {p.key: p.value for p in onnx.load(path).metadata_props}
    return json.loads(entries[TRAINING_METADATA_KEY])


def _run(paths, params, batches, **kwargs) -> list[dict[str, np.ndarray]]:
    """Gradients after each step of two accumulated training calls, and the parameters after each update."""
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, **kwargs)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(0.05)
    seen = []
    for ids, labels in batches:
        module(ids, labels)
        seen.append({n: state.parameters[n].grad for n in params})  # one call: into zeros
        module(ids[::-1].copy(), labels[::-1].copy())  # accumulated
        seen.append({n: state.parameters[n].grad for n in params})
        optimizer.step()
        module.lazy_reset_grad()
        seen.append({n: state.parameters[n].data.copy() for n in params})
    return seen


@pytest.mark.parametrize("tied", [False, True], ids=["embedding", "tied-output-layer"])
def test_bf16_artifacts_leave_embedding_rows_to_the_runtime(tmp_path, tied):
    params, paths = _artifacts(tmp_path, tied)
    meta = _meta(paths["bf16"].training_model)
    assert meta["format"] == ROW_GRADIENTS_FORMAT
    ((table, entry),) = meta["row_gradients"].items()
    assert meta["trainable"][meta["gradients"].index(table + "_grad")] == table and table.endswith(".weight")
    assert entry["base"] is tied  # tied: the output layer's term is the gradient output the rows are added into
    errors = list(_validator("training-metadata.schema.json").iter_errors(meta))
    assert not errors, errors
    assert "format" in _meta(paths["fp32"].training_model) and "row_gradients" not in _meta(paths["fp32"].training_model)
    batches = _batches(40 if tied else 5)
    want = _run(paths["fp32"], params, batches)  # the in-graph scatter, on onnxruntime
    backends = [("onnxruntime", "fp32")]
    if pytest.importorskip("openvino") is not None:
        backends.append(("openvino", "fp32"))
    for backend, precision in backends:
        got = _run(paths["bf16"], params, batches, backend=backend, precision=precision)
        for k, (g, w) in enumerate(zip(got, want)):
            for name in params:
                np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{backend}: {name} at record {k}")


def test_sum_rows_adds_each_id_s_rows_in_order():
    """The sums are float32 additions in the rows' order (a scatter-add's, the same values) for ids of at most 16
    rows, and float32 sums within rounding of float64's for longer runs; negative ids count from the end (as
    ONNX's); no ids, none."""
    rows = (RNG.standard_normal((300, 3)) * 1e4 ** RNG.integers(-1, 2, (300, 1))).astype(np.float32)
    for ids, exact in ((RNG.integers(-30, 30, 300), True),  # runs of about 5, none above 16
                       (RNG.permutation(300) - 150, True),  # all distinct
                       (np.r_[np.zeros(100, np.int64), RNG.integers(0, 50, 200)], False)):  # a run of 100+
        assert (np.bincount(ids % 300).max() <= 16) == exact
        want = np.zeros((300, 3), np.float32)
        for i, r in zip(ids, rows):  # one float32 addition at a time
            want[i] += r
        got_ids, sums = sum_rows(ids, rows, 300)
        assert len(set(got_ids.tolist())) == len(got_ids) and got_ids.min() >= 0
        got = np.zeros_like(want)
        got[got_ids] = sums
        if exact:
            assert np.array_equal(got, want)
        else:
            exact64 = np.zeros((300, 3))
            np.add.at(exact64, ids, rows.astype(np.float64))
            np.testing.assert_allclose(got, exact64, rtol=1e-5, atol=1e-2)
    empty_ids, empty_rows = sum_rows(np.zeros(0, np.int64), rows[:0], 300)
    assert empty_ids.size == 0 and empty_rows.shape == (0, 3)
    with pytest.raises(IndexError, match="outside"):
        sum_rows(np.array([300]), rows[:1], 300)


def test_add_rows_into_zeros_is_zero_plus_the_sums():
    """Into zeros, the rows an earlier step wrote are cleared and each sum lands as 0 + sum (a -0.0 sum as 0.0, what
    the scatter-add into zeros gives); accumulated, the sums add into what is there."""
    layout = FlatLayout(["t"], {"t": (6, 2)}, {"t": np.float32})
    buffers = FlatBuffers(layout, {"t": np.ones((6, 2), np.float32)})
    grad = buffers.grad_views["t"]
    buffers.add_rows("t", np.array([1, 3, 1]), np.array([[1, 2], [-0.0, 5], [3, 4]], np.float32), into_zeros=True)
    assert np.array_equal(grad, [[0, 0], [4, 6], [0, 0], [0, 5], [0, 0], [0, 0]]) and not np.signbit(grad).any()
    buffers.add_rows("t", np.array([3, -2]), np.array([[1, 1], [2, 2]], np.float32), into_zeros=False)
    assert np.array_equal(grad, [[0, 0], [4, 6], [0, 0], [1, 6], [2, 2], [0, 0]])
    buffers.add_rows("t", np.array([0]), np.array([[7, 7]], np.float32), into_zeros=True)  # rows 1, 3, 4 cleared
    assert np.array_equal(grad, [[7, 7], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]])
