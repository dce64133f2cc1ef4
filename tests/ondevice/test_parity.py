"""On-device training against PyTorch: same model, weights and batches; the loss at every step agrees.

Tolerance: relative 1e-4 on each of the 20 losses. Both sides compute in float32 with different kernels
and summation orders (about 1e-7 relative per op); AdamW normalizes each update, so after 20 steps the
parameters differ by a few ulps times the step count, far below 1e-4 of the loss.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxtrain import artifacts
from onnxtrain.ondevice.api import TRAINING_METADATA_KEY
from onnxtrain.utils import chunks
from tests.ondevice.helpers import (
    CNN,
    MLP,
    STEPS,
    assert_losses_close,
    classification_batches,
    clone,
    export,
    generate,
    load,
    ondevice_losses,
    torch_losses,
)

RTOL = 1e-4


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP()
    path = export(clone(model), (torch.randn(4, 16),), tmp_path_factory.mktemp("mlp") / "mlp.onnx", ["x"])
    return model, path


def _torch_adamw_losses(model, batches, lr=1e-2):
    """The reference: a copy of ``model`` trained on cross-entropy by torch.optim.AdamW."""
    ref = clone(model)
    return torch_losses(ref, torch.optim.AdamW(ref.parameters(), lr=lr), torch.nn.functional.cross_entropy, batches)


def _params(model):
    return [n for n, _ in model.named_parameters()]


def test_mlp_cross_entropy_adamw_matches_torch(mlp, tmp_path):
    model, path = mlp
    paths = generate(path, tmp_path, requires_grad=_params(model), loss=artifacts.LossType.CrossEntropyLoss,
                     optimizer=artifacts.OptimType.AdamW)
    batches = classification_batches(np.random.default_rng(1), STEPS, 8, (16,), 5)
    _, module, optimizer = load(paths, lr=1e-2)
    ours = ondevice_losses(module, optimizer, batches)
    theirs = _torch_adamw_losses(model, batches)
    assert_losses_close(ours, theirs, RTOL)
    assert theirs[-1] < theirs[0]  # it trains


def test_mlp_frozen_parameters_stay_bit_identical(mlp, tmp_path):
    model, path = mlp
    frozen = ["net.0.weight", "net.0.bias"]
    trainable = [n for n in _params(model) if n not in frozen]
    paths = generate(path, tmp_path, requires_grad=trainable, frozen_params=frozen, loss="crossentropy",
                     optimizer="adamw")
    batches = classification_batches(np.random.default_rng(2), STEPS, 8, (16,), 5)
    state, module, optimizer = load(paths, lr=1e-2)
    before = {n: state.parameters[n].data for n in _params(model)}
    ours = ondevice_losses(module, optimizer, batches)
    ref = clone(model)
    for name, p in ref.named_parameters():
        p.requires_grad_(name not in frozen)
    theirs = torch_losses(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2),
                          torch.nn.functional.cross_entropy, batches)
    assert_losses_close(ours, theirs, RTOL)
    for name in frozen:
        assert state.parameters[name].data.tobytes() == before[name].tobytes()
        assert not state.parameters[name].requires_grad and state.parameters[name].grad is None
    for name in trainable:
        assert not np.array_equal(state.parameters[name].data, before[name])


@pytest.fixture(params=["one chunk", "many chunks"])
def chunk_size(request, monkeypatch):
    """The optimizer graph in one chunk, or in 100-element chunks with a zero-padded tail."""
    if request.param == "many chunks":
        monkeypatch.setattr(chunks, "CHUNK", 100)
    return request.param


def test_regression_mlp_mse_sgd_momentum_matches_torch(tmp_path, chunk_size):
    torch.manual_seed(3)
    model = MLP((6, 16, 3))
    path = export(clone(model), (torch.randn(4, 6),), tmp_path / "reg.onnx", ["x"])
    sgd = artifacts.SGD(momentum=0.9, weight_decay=1e-3)
    paths = generate(path, tmp_path, requires_grad=_params(model), loss=artifacts.LossType.MSELoss, optimizer=sgd)
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32))
               for _ in range(STEPS)]
    _, module, optimizer = load(paths, lr=0.05)
    ours = ondevice_losses(module, optimizer, batches)
    ref = clone(model)
    theirs = torch_losses(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                          torch.nn.functional.mse_loss, batches)
    assert_losses_close(ours, theirs, RTOL)


def test_adamw_with_global_norm_clipping_matches_torch(mlp, tmp_path, chunk_size):
    model, path = mlp
    opt = artifacts.AdamW(weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6, max_grad_norm=0.5)
    paths = generate(path, tmp_path, requires_grad=_params(model), loss="crossentropy", optimizer=opt)
    batches = classification_batches(np.random.default_rng(4), STEPS, 8, (16,), 5)
    _, module, optimizer = load(paths, lr=1e-2)
    ours = ondevice_losses(module, optimizer, batches)
    ref = clone(model)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    theirs = []
    for x, y in batches:
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        topt.step()
        theirs.append(loss.item())
    assert_losses_close(ours, theirs, RTOL)
    if chunk_size == "many chunks":
        (group,) = optimizer._meta["groups"]
        assert group["chunks"] > 1 and group["chunks"] * group["chunk"] > group["size"]  # padded tail


def test_optimizer_chunked_differently_from_the_runtime_is_refused(mlp, tmp_path, monkeypatch):
    model, path = mlp
    monkeypatch.setattr(chunks, "CHUNK", 100)
    paths = generate(path, tmp_path, requires_grad=_params(model), loss="crossentropy", optimizer="adamw")
    monkeypatch.setattr(chunks, "CHUNK", 1 << 18)
    with pytest.raises(ValueError, match="generate the artifacts again"):
        load(paths, lr=1e-2)


def test_gradients_accumulate_until_lazy_reset(mlp, tmp_path):
    model, path = mlp
    paths = generate(path, tmp_path, requires_grad=_params(model), loss="crossentropy", optimizer="sgd")
    (x1, y1), (x2, y2) = classification_batches(np.random.default_rng(5), 2, 8, (16,), 5, distinct=2)
    state, module, _ = load(paths, lr=0.1)
    module(x1, y1)
    module(x2, y2)
    ref = clone(model)
    for x, y in ((x1, y1), (x2, y2)):
        torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-5, atol=1e-6)
    module.lazy_reset_grad()
    assert not state.parameters["net.0.weight"].grad.any()
    module(x1, y1)  # overwrites: the sum is gone
    ref.zero_grad()
    torch.nn.functional.cross_entropy(ref(torch.from_numpy(x1)), torch.from_numpy(y1)).backward()
    np.testing.assert_allclose(state.parameters["net.0.weight"].grad, ref.net[0].weight.grad.numpy(),
                               rtol=1e-5, atol=1e-6)


def test_exported_inference_model_matches_eval_model(mlp, tmp_path):
    model, path = mlp
    paths = generate(path, tmp_path, requires_grad=_params(model), loss="crossentropy", optimizer="adamw",
                     additional_output_names=["logits"])
    batches = classification_batches(np.random.default_rng(6), 5, 8, (16,), 5)
    _, module, optimizer = load(paths, lr=1e-2)
    ondevice_losses(module, optimizer, batches)
    module.eval()
    x, y = batches[0]
    loss, logits = module(x, y)
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    session = ort.InferenceSession(str(tmp_path / "inference.onnx"))
    assert [i.name for i in session.get_inputs()] == ["x"]
    (inferred,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(inferred, logits)
    assert np.isclose(float(loss), torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y)).item(),
                      rtol=1e-6)


def test_cnn_cross_entropy_adamw_matches_torch(tmp_path):
    torch.manual_seed(7)
    model = CNN()
    path = export(clone(model), (torch.randn(2, 1, 8, 8),), tmp_path / "cnn.onnx", ["x"])
    paths = generate(path, tmp_path, requires_grad=_params(model), loss="crossentropy", optimizer="adamw")
    batches = classification_batches(np.random.default_rng(7), STEPS, 8, (1, 8, 8), 4)
    _, module, optimizer = load(paths, lr=1e-2)
    ours = ondevice_losses(module, optimizer, batches)
    theirs = _torch_adamw_losses(model, batches)
    assert_losses_close(ours, theirs, RTOL)


def test_bert_cross_entropy_adamw_matches_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(8)
    bert = transformers.BertForSequenceClassification(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.bert = inner

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).logits

    model = Logits(bert)
    rng = np.random.default_rng(8)
    ids = torch.from_numpy(rng.integers(0, 100, (2, 16)))
    path = export(clone(model), (ids, torch.ones_like(ids)), tmp_path / "bert.onnx", ["input_ids", "attention_mask"])
    names = {n for n, _ in model.named_parameters()}
    import onnx

    inits = [i.name for i in onnx.load(str(path), load_external_data=False).graph.initializer]
    trainable = [n for n in inits if n in names]
    paths = generate(path, tmp_path, requires_grad=trainable, loss="crossentropy", optimizer="adamw")
    batches = []
    for _ in range(STEPS):
        mask = np.ones((4, 16), np.int64)
        mask[:, 12:] = rng.integers(0, 2, (4, 4))
        # Token ids from 1: id 0 is BERT's padding_idx, whose embedding row torch never updates
        # (nn.Embedding(padding_idx=0) masks its gradient), a rule the exported Gather cannot know.
        batches.append((rng.integers(1, 100, (4, 16)).astype(np.int64), mask, rng.integers(0, 3, 4).astype(np.int64)))
    _, module, optimizer = load(paths, lr=1e-3)
    ours = ondevice_losses(module, optimizer, batches)
    ref = clone(model)
    params = dict(ref.named_parameters())
    theirs = torch_losses(ref, torch.optim.AdamW([params[n] for n in trainable], lr=1e-3),
                          torch.nn.functional.cross_entropy, batches)
    assert_losses_close(ours, theirs, RTOL)


def test_training_models_of_an_earlier_format_warn(mlp, tmp_path):
    _, path = mlp
    paths = generate(path, tmp_path, requires_grad=_params(mlp[0]), loss="crossentropy", optimizer="adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current format: no warning
        load(paths, lr=1e-2)
    model = onnx.load(paths.training_model)
    (entry,) = [p for p in model.metadata_props if p.key == TRAINING_METADATA_KEY]
    meta = json.loads(entry.value)
    del meta["format"]  # as written before the format was recorded
    entry.value = json.dumps(meta)
    onnx.save(model, paths.training_model)
    with pytest.warns(UserWarning, match="generate the artifacts again"):
        load(paths, lr=1e-2)


class _SequenceClassifier(torch.nn.Module):
    """Linear layers on a [batch, seq, features] input: exported as MatMul(x, Transpose(W)), whose weight
    gradient the MatMul and Transpose rules make as a Gemm and a Transpose."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)).mean(dim=1))


def test_weight_gradients_are_one_gemm_and_match_torch(tmp_path):
    """The training model's weight gradients come from one Gemm each (passes/transposed_gemm.py, measured in
    docs/precision.md: the on-device BERT-small bf16 step on OpenVINO 0.77x), and training matches torch."""
    torch.manual_seed(0)
    model = _SequenceClassifier()
    path = export(clone(model), (torch.randn(4, 6, 16),), tmp_path / "seq.onnx", ["x"])
    paths = generate(path, tmp_path / "artifacts", requires_grad=_params(model),
                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW)
    graph = onnx.load(paths.training_model).graph
    producers = {out: node for node in graph.node for out in node.output}
    transposed_products = [n.name for n in graph.node if n.op_type == "Transpose"
                           and getattr(producers.get(n.input[0]), "op_type", None) == "Gemm"]
    assert transposed_products == []
    assert producers["proj.weight_grad"].op_type == "Gemm"  # a Transpose of a Gemm without the pass
    batches = classification_batches(np.random.default_rng(3), STEPS, 8, (6, 16), 5)
    _, module, optimizer = load(paths, lr=1e-2)
    ours = ondevice_losses(module, optimizer, batches)
    theirs = _torch_adamw_losses(model, batches)
    assert_losses_close(ours, theirs, RTOL)
    assert theirs[-1] < theirs[0]
