"""Whole-model parity: gradients built by the engine, run by onnxruntime, against PyTorch autograd.

Each model is exported in train mode with torch.onnx.export(dynamo=True), returning its scalar loss
(dropout probabilities set to 0 so both sides compute the same function). ``gradient_model`` then
differentiates the loss with respect to every parameter, onnxruntime runs it, and every parameter
gradient must match ``loss.backward()`` to a relative error (L2 norm) below 1e-4.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from onnxtrain.autodiff import gradient_model  # noqa: E402

REL_TOL = 1e-4


class LossOf(torch.nn.Module):
    """Return ``model(**kwargs).loss`` (or a cross-entropy on the logits for plain torch models)."""

    def __init__(self, model, hf: bool, input_name: str = "input_ids"):
        super().__init__()
        self.model, self.hf, self.input_name = model, hf, input_name

    def forward(self, x, labels):
        if self.hf:
            return self.model(**{self.input_name: x}, labels=labels).loss
        return torch.nn.functional.cross_entropy(self.model(x), labels)


def _export(module, args):
    """Export in train mode.

    - BatchNorm is decomposed into primitive ops first: the ONNX exporter's batch-norm translation
      always emits inference-mode BatchNormalization, which normalizes with the running statistics.
    - optimize=False: the exporter's optimizer folds weights (e.g. pre-transposed) into anonymous
      constants, and parameters must stay initializers named like the torch parameters.
    """
    from torch._decomp import get_decompositions

    batch_norms = get_decompositions([torch.ops.aten._native_batch_norm_legit_functional])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, args).run_decompositions(batch_norms)
        onnx_program = torch.onnx.export(program, args, dynamo=True, optimize=False, verbose=False)
    return onnx_program.model_proto


def check_parity(model, hf: bool, x, labels, input_name: str = "input_ids"):
    torch.manual_seed(0)
    module = LossOf(model, hf, input_name).train()
    reference = copy.deepcopy(module)
    loss = reference(x, labels)
    loss.backward()
    # Tied weights (GPT-2's wte and lm_head) have several names; the exporter keeps one of them.
    # Frozen parameters (Whisper's sinusoidal positions) are not differentiated.
    expected = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False) if p.requires_grad}
    aliases = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            aliases.setdefault(id(p), []).append(n)

    onnx_model = _export(module, (x, labels))
    inits = {i.name for i in onnx_model.graph.initializer}
    params = [n for n in expected if n in inits]
    unexported = [names for names in aliases.values() if not any(n in inits for n in names)]
    assert not unexported, f"parameters not exported as initializers: {unexported}"
    loss_name = onnx_model.graph.output[0].name
    grad = gradient_model(onnx_model, wrt=params, outputs=[loss_name])

    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {sess.get_inputs()[0].name: x.numpy(), sess.get_inputs()[1].name: labels.numpy(),
             f"{loss_name}_grad": np.ones((), np.float32)}
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    np.testing.assert_allclose(outputs[loss_name], loss.item(), rtol=1e-5)
    wants = {n: (np.zeros_like(outputs[f"{n}_grad"]) if expected[n] is None else expected[n].numpy()) for n in params}
    # Relative error per tensor, with a floor at 1e-4 of the largest gradient norm: a gradient that is
    # zero in exact arithmetic (a conv bias followed by BatchNorm) is float noise on both sides.
    floor = 1e-4 * max(np.linalg.norm(w) for w in wants.values())
    for name, want in wants.items():
        got = outputs[f"{name}_grad"]
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), floor)
        assert err < REL_TOL, f"{name}: relative gradient error {err:.2e}"
    return len(params)


def test_mlp():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                              torch.nn.Tanh(), torch.nn.Linear(16, 5))
    x = torch.randn(8, 12)
    labels = torch.randint(0, 5, (8,))
    assert check_parity(mlp, False, x, labels) == 6


def test_cnn_with_batchnorm_maxpool_gap():
    torch.manual_seed(0)
    nn = torch.nn
    # Convs followed by BatchNorm have no bias (as in ResNet): its exact gradient is zero, and comparing
    # float noise with float noise says nothing. Conv biases are covered by the finite-difference cases.
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )
    x = torch.randn(4, 3, 12, 12)
    labels = torch.randint(0, 4, (4,))
    check_parity(cnn, False, x, labels)


def _ids(vocab=100, batch=2, seq=16):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def test_bert_sequence_classification():
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    check_parity(model, True, _ids(), torch.tensor([0, 2]))


def test_gpt2_lm_head():
    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = _ids()
    check_parity(model, True, ids, ids)


def test_llama_causal_lm_with_grouped_query_attention():
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = _ids()
    check_parity(model, True, ids, ids)


# Beyond the list: architectures with other op mixes (relative position buckets, encoder-decoder
# cross-attention, convolutional stems).


def test_t5_encoder_decoder_with_relative_position_buckets():
    # attn_implementation="eager": with dropout 0, torch.export of the SDPA path fails (a view of a
    # transposed tensor inside transformers), before onnxtrain is involved.
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, dropout_rate=0.0, use_cache=False,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    ids = _ids(seq=12)
    check_parity(transformers.T5ForConditionalGeneration(config), True, ids, ids)


def test_vit_image_classification():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=3,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    check_parity(transformers.ViTForImageClassification(config), True, pixels, torch.tensor([0, 2]),
                 input_name="pixel_values")


def test_whisper_speech_to_text_with_conv1d_stem():
    config = transformers.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                        max_target_positions=16, use_cache=False, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, decoder_start_token_id=1, dropout=0.0)
    torch.manual_seed(0)
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(4))
    check_parity(transformers.WhisperForConditionalGeneration(config), True, features, labels,
                 input_name="input_features")


def test_encoder_decoder_cnn_with_upsampling():
    """A UNet-like net: pooling down, nearest and bilinear Resize up (F.interpolate's exports)."""
    torch.manual_seed(0)
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
            self.up_nearest = nn.Upsample(scale_factor=2, mode="nearest")
            self.up_bilinear = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.mix = nn.Conv2d(8, 4, 3, padding=1)
            self.head = nn.Linear(4, 5)

        def forward(self, x):
            h = self.down(x)
            h = self.up_nearest(h) + self.up_bilinear(h)
            return self.head(self.mix(h).mean(dim=(2, 3)))

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    check_parity(Net(), False, x, torch.tensor([1, 4]))
