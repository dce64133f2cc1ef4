"""Tiny random-weight models and synthetic datasets for the ORTTrainer tests (nothing is downloaded)."""

import warnings

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 16


def bert_classifier(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=2, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, classifier_dropout=dropout,
    )
    return transformers.BertForSequenceClassification(config)


def gpt2_lm(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def llama_lm(seed=0, dropout=0.0):
    """A Llama with its default config otherwise: use_cache on, so the model returns a DynamicCache."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=dropout,
    )
    return transformers.LlamaForCausalLM(config)


def t5_seq2seq(seed=0, dropout=0.0):
    """A T5 with its default config otherwise: use_cache on, so the model returns an EncoderDecoderCache.
    Attention ``eager``: at this width torch's ONNX exporter cannot re-trace T5's sdpa call (docs/hf.md)."""
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=dropout,
        decoder_start_token_id=0, attn_implementation="eager",
    )
    return transformers.T5ForConditionalGeneration(config)


def classification_dataset(n=48, seed=0):
    """Label 1 when the first token is in the upper half of the vocabulary: learnable in a few steps.

    Sentences have 8 to 16 tokens, padded with id 0 to 16 and masked by attention_mask.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(n, SEQ))
    mask = (np.arange(SEQ) < rng.integers(8, SEQ + 1, size=(n, 1))).astype(np.int64)
    ids = ids * mask
    return datasets.Dataset.from_dict({
        "input_ids": ids.tolist(),
        "attention_mask": mask.tolist(),
        "labels": (ids[:, 0] >= VOCAB // 2).astype(np.int64).tolist(),
    })


def lm_dataset(n=48, seed=0):
    """Arithmetic progressions modulo the vocabulary: the next token follows from the previous two."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(n, 1))
    step = rng.integers(1, 4, size=(n, 1))
    ids = (start + step * np.arange(SEQ)) % VOCAB
    return datasets.Dataset.from_dict({
        "input_ids": ids.tolist(),
        "attention_mask": np.ones((n, SEQ), dtype=np.int64).tolist(),
        "labels": ids.tolist(),
    })


def accuracy(eval_prediction):
    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def train_args(cls, output_dir, **overrides):
    kwargs = dict(
        output_dir=str(output_dir), use_cpu=True, report_to=[], max_steps=10, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, learning_rate=3e-3, logging_steps=1, save_strategy="no", seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def run_in_ort(what, action, *args, **kwargs):
    """Run ``action``; fail (quoting ORTModule's warning) if ORTModule fell back to PyTorch on ``what``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = action(*args, **kwargs)
    for warning in caught:
        if issubclass(warning.category, UserWarning) and _is_fallback_warning(str(warning.message)):
            pytest.fail(f"ORTModule falls back on {what}: {warning.message}")
    return result


def _is_fallback_warning(message):
    text = message.lower()
    return "ortmodule" in text and ("fall" in text or "pytorch" in text)
