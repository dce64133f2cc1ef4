"""Tiny models and synthetic batches for the ORTModule tests (random weights, no downloads)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 100


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x, labels=None):
        logits = self.head(torch.relu(self.fc2(torch.tanh(self.fc1(x)))))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits, labels), logits


class Unexportable(nn.Module):
    """A forward that leaves torch (through numpy): no exporter follows it, so ORTModule falls back."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(torch.from_numpy(x.detach().numpy() * 2))


class CNN(nn.Module):
    """Conv-BatchNorm blocks; convs have no bias: BatchNorm cancels it, so its gradient is pure rounding
    noise, which Adam would amplify into parameter noise in both runs."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x, labels):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        logits = self.head(h.mean(dim=(2, 3)))
        return nn.functional.cross_entropy(logits, labels)


def bert(dropout: float = 0.0):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, num_labels=2)
    return BertForSequenceClassification(config)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(config)


def text_batch(batch=4, seq=16, classify=False, generator=None):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = torch.randint(0, 2, (batch,), generator=generator) if classify else ids.clone()
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.int64), "labels": labels}


def image_batch(batch=4, generator=None):
    return {"x": torch.randn(batch, 3, 8, 8, generator=generator),
            "labels": torch.randint(0, 4, (batch,), generator=generator)}


def mlp_batch(batch=8, generator=None):
    return {"x": torch.randn(batch, 16, generator=generator), "labels": torch.randint(0, 4, (batch,), generator=generator)}


def loss_of(output):
    """The loss of any of the test models' outputs."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.loss
