"""scaled_dot_product_attention under ORTModule against PyTorch: masks (with fully masked rows), causal,
grouped-query heads, custom scale, and attention dropout (which the exporter's own translation dropped)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from onnxtrain import DebugOptions, ORTModule

HEADS, HEAD_DIM = 2, 4


class Attention(torch.nn.Module):
    """Projects ``x`` [B, S, 8] to heads and attends; ``mask`` [B, L, S] is unsqueezed to [B, 1, L, S]."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        kv_heads = 1 if kind == "gqa" else HEADS
        self.q = torch.nn.Linear(8, HEADS * HEAD_DIM)
        self.kv = torch.nn.Linear(8, 2 * kv_heads * HEAD_DIM)
        self.kv_heads = kv_heads

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if self.kind == "causal":  # fewer queries than keys: PyTorch aligns the causal mask top-left
            return F.scaled_dot_product_attention(q[:, :, :3], k, v, is_causal=True)
        if self.kind == "scale":
            return F.scaled_dot_product_attention(q, k, v, scale=0.3)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=self.kind == "gqa")


def _mask(kind: str, batch: int, seq: int) -> torch.Tensor | None:
    keep = torch.rand(batch, seq, seq) > 0.4
    keep[..., 0] = True
    keep[0, 1] = False  # a query row with every key masked: PyTorch returns zeros for it
    if kind == "float":
        return torch.zeros(batch, seq, seq).masked_fill(~keep, float("-inf"))
    return keep if kind in ("bool", "gqa") else None


@pytest.mark.parametrize("kind", ["bool", "float", "causal", "gqa", "scale"])
def test_attention_matches_pytorch(kind):
    torch.manual_seed(0)
    reference = Attention(kind)
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    for batch, seq in ((3, 5), (2, 5)):  # a mask's third axis is not dynamic
        x = torch.randn(batch, seq, 8)
        mask = _mask(kind, batch, seq)
        args = (x,) if mask is None else (x, mask)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        got, want = model(xs[0], *args[1:]), reference(xs[1], *args[1:])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if kind in ("bool", "float"):
            assert torch.all(got[0, :, 1] == 0)  # the fully masked row
        weights = torch.randn_like(want)
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert model.export_count == 1


class DropoutAttention(torch.nn.Module):
    """Values are the identity, so the output is the dropped-out attention weights themselves."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.q = torch.nn.Linear(8, HEADS * 8)

    def forward(self, x, eye):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, 8).transpose(1, 2)
        k = x.unsqueeze(1).expand(b, HEADS, s, 8)
        return F.scaled_dot_product_attention(q, k, eye, dropout_p=self.p)


def test_attention_dropout_is_applied_and_its_gradient_uses_the_same_mask():
    torch.manual_seed(0)
    p, batch, seq = 0.5, 4, 16
    reference = DropoutAttention(p)
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    x = torch.randn(batch, seq, 8)
    eye = torch.eye(seq).expand(batch, HEADS, seq, seq).contiguous()
    got = model(x, eye)
    again = model(x, eye).detach()
    kept = got.detach() != 0
    dropped = 1 - kept.float().mean().item()
    assert 0.4 < dropped < 0.6, dropped  # 2048 weights, each dropped with probability 0.5
    assert not torch.equal(kept, again != 0)  # a fresh mask on every run

    # PyTorch, with the mask ORTModule drew: weights * mask / (1 - p).
    q = reference.q(x).view(batch, seq, HEADS, 8).transpose(1, 2)
    k = x.unsqueeze(1).expand(batch, HEADS, seq, 8)
    want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) * kept / (1 - p)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), model.module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


class BroadcastMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 3 * HEADS * HEAD_DIM)

    def forward(self, x, mask):  # mask: [B, 1, S, S], broadcast over the heads
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_size_one_axis_that_broadcasts_exports_with_the_dynamo_exporter():
    """torch.export fails with the mask's size-1 head axis dynamic; the retry keeps it static."""
    torch.manual_seed(0)
    reference = BroadcastMask()
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    for batch in (3, 2):
        x, mask = torch.randn(batch, 5, 8), torch.rand(batch, 1, 5, 5) > 0.3
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no TorchScript fallback
            got = model(x, mask)
        want = reference(x, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.sum().backward()
        want.sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert model.export_count == 1  # the batch axis stayed dynamic


def test_left_padded_llama_matches_pytorch():
    """Left padding masks every key of the first queries of a padded row (causal + padding): PyTorch
    gives those rows zero attention, the exporter's translation gave them a uniform average (logits off
    by 0.46 on this model)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    model = ORTModule(copy.deepcopy(reference), DebugOptions(fallback=False))
    ids = torch.randint(0, 100, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.int64)
    mask[0, :4] = 0
    mask[1, :2] = 0
    got, want = (m(input_ids=ids, attention_mask=mask, labels=ids) for m in (model, reference))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), model.module.parameters()):
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * scale + 1e-9,
                                   msg=lambda m, n=name: f"{n}: {m}")
