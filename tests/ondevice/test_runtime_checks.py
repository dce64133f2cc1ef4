"""The runtime's checks before training starts or a step runs: checkpoint and models agree (issue 16.3),
bad labels and token ids are refused by name, once (16.4), and the optimizer's copies stay in step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.ondevice import checkpoint as ckpt
from onnxtrain.ondevice import optimizer as optimizer_module
from tests.ondevice.helpers import export, generate


def _rewrite_checkpoint(path, edit) -> None:
    data = ckpt.load(path)
    edit(data)
    ckpt.save(data, path)


def test_checkpoint_with_an_extra_trainable_parameter_is_refused(mlp_artifacts):
    def add(data):
        data.parameters["head.weight"] = np.zeros((3, 3), np.float32)
        data.requires_grad["head.weight"] = True

    _rewrite_checkpoint(mlp_artifacts.checkpoint, add)
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.raises(ValueError, match=r"the checkpoint has parameters \['head.weight'\] that .* does not use"):
        Module(mlp_artifacts.training_model, state, mlp_artifacts.eval_model)


def test_checkpoint_missing_a_parameter_is_refused(mlp_artifacts):
    _rewrite_checkpoint(mlp_artifacts.checkpoint, lambda data: (data.parameters.pop("net.2.bias"),
                                                                data.requires_grad.pop("net.2.bias")))
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.raises(ValueError, match=r"the checkpoint lacks parameters \['net.2.bias'\]"):
        Module(mlp_artifacts.training_model, state)


def test_checkpoint_trainability_must_agree_both_ways(mlp_artifacts):
    def freeze(data):
        data.requires_grad["net.0.bias"] = False

    _rewrite_checkpoint(mlp_artifacts.checkpoint, freeze)
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.raises(ValueError, match=r"trains \['net.0.bias'\], which the checkpoint marks requires_grad=False"):
        Module(mlp_artifacts.training_model, state)


def _module(artifacts):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    return state, Module(artifacts.training_model, state, artifacts.eval_model)


def test_fewer_labels_than_rows_is_refused_once(mlp_artifacts, capfd):
    _, module = _module(mlp_artifacts)
    x = np.zeros((4, 16), np.float32)
    with pytest.raises(ValueError, match=r"input 'labels' has 3 on axis 0 but input 'x' has 4 on axis 0"):
        module(x, np.zeros(3, np.int64))
    module.eval()
    with pytest.raises(ValueError, match=r"input 'labels' has 3 on axis 0"):
        module(x, np.zeros(3, np.int64))
    assert capfd.readouterr().err == ""  # no onnxruntime log line


def test_wrong_rank_and_fixed_size_are_refused(mlp_artifacts):
    _, module = _module(mlp_artifacts)
    with pytest.raises(ValueError, match=r"input 'x' must have 2 dimensions \[batch, 16\], got shape \[4\]"):
        module(np.zeros(4, np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"input 'x' must have size 16 on axis 1"):
        module(np.zeros((4, 15), np.float32), np.zeros(4, np.int64))


@pytest.mark.parametrize("bad", [5, -1, 1 << 40])
def test_out_of_range_label_is_refused_once(mlp_artifacts, capfd, bad):
    _, module = _module(mlp_artifacts)
    labels = np.array([0, 1, bad, 2], np.int64)
    with pytest.raises(ValueError, match=rf"input 'labels' has value {bad} at \[2\], out of range: class labels "
                                         r"of CrossEntropyLoss \(5 classes\) must lie in \[0, 5\)"):
        module(np.zeros((4, 16), np.float32), labels)
    assert capfd.readouterr().err == ""


def test_ignore_index_is_accepted(mlp_onnx, tmp_path):
    from onnxtrain.artifacts import CrossEntropyLoss

    model, path = mlp_onnx
    paths = generate(path, tmp_path, requires_grad=[n for n, _ in model.named_parameters()],
                     loss=CrossEntropyLoss(ignore_index=-100))
    _, module = _module(paths)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    loss = module(x, np.array([0, -100, 4, 2], np.int64))
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor([0, -100, 4, 2]), ignore_index=-100)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match=r"has value -7 at \[1\].*\(or -100, ignored\)"):
        module(x, np.array([0, -7, 4, 2], np.int64))


class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def test_out_of_range_token_id_is_refused_once(tmp_path, capfd):
    torch.manual_seed(0)
    model = _Bag()
    path = export(model, (torch.zeros(2, 5, dtype=torch.int64),), tmp_path / "bag.onnx", ["ids"])
    paths = generate(path, tmp_path, requires_grad=[n for n, _ in model.named_parameters()], loss="crossentropy")
    _, module = _module(paths)
    ids = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int64)
    capfd.readouterr()
    with pytest.raises(ValueError, match=r"input 'ids' has value 10 at \[1, 4\], out of range: indices into "
                                         r"'emb.weight' \(10 rows, Gather\) must lie in \[-10, 10\)"):
        module(ids, np.zeros(2, np.int64))
    assert capfd.readouterr().err == ""
    ids[1, 4] = 9
    loss = module(ids, np.zeros(2, np.int64))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(torch.from_numpy(ids)), torch.zeros(2, dtype=torch.int64))
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("in_place", [True, False])
def test_optimizer_reads_one_copy_and_writes_the_other(mlp_artifacts, in_place, monkeypatch):
    """Row by row the update is written in place (the live copy stays); with ``IN_PLACE`` off, as for the models
    that read every row (clipping, loss scaling), it writes the other copy and the live copy flips."""
    monkeypatch.setattr(optimizer_module, "IN_PLACE", in_place)
    state, module = _module(mlp_artifacts)
    optimizer = Optimizer(mlp_artifacts.optimizer_model, module)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 16)).astype(np.float32), rng.integers(0, 5, 4)
    buffers = module.buffers
    for src, ranges in enumerate(optimizer._bindings):  # reads copy src, writes the other copy (or copy src)
        (binding,) = ranges  # the MLP's vectors are one chunk: one call over all of it
        written = {v.data_ptr() for v in binding.get_outputs()}
        copies = [{buffers.params(c)["float32"].ctypes.data} | {buffers.states(s, c)["float32"].ctypes.data
                                                                for s in ("exp_avg", "exp_avg_sq")} for c in (0, 1)]
        assert written == copies[src if in_place else 1 - src] and not written & copies[1 - src if in_place else src]
    before = state.parameters["net.0.weight"].data
    module(x, y)
    optimizer.step()  # the live copy flips (or not): parameters, saves and the next steps must follow it
    assert buffers.current == (0 if in_place else 1)
    after = state.parameters["net.0.weight"].data
    assert not np.array_equal(before, after)
    module.eval()
    zero = np.zeros(module.get_parameters_size(), np.float32)
    module.copy_buffer_to_parameters(zero)
    np.testing.assert_array_equal(module(x, y), np.log(5.0).astype(np.float32))  # all-zero logits
    module.train()
    module.copy_buffer_to_parameters(module.get_contiguous_parameters(trainable_only=True).numpy() + 0)
    module(x, y)
    optimizer.step()
    CheckpointState.save_checkpoint(state, mlp_artifacts.checkpoint, include_optimizer_state=True)
    reloaded = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    for name in state.parameters:
        np.testing.assert_array_equal(reloaded.parameters[name].data, state.parameters[name].data)
