"""Mixture-of-experts (transformers' grouped matmul, capture/moe.py): a tiny Mixtral-style model trains in
onnxruntime with PyTorch's forward values and gradients."""

from __future__ import annotations

import copy

import torch
import transformers

from onnxtrain import ORTModule


def _mixtral(experts_implementation: str = "grouped_mm"):
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        use_cache=False, experts_implementation=experts_implementation)
    return transformers.MixtralForCausalLM(config)


def test_tiny_mixtral_matches_pytorch_forward_and_gradients():
    torch.manual_seed(0)
    reference = _mixtral()
    model = ORTModule(copy.deepcopy(reference))
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 7 + step), generator=generator)  # another sequence length: same graph
        got, want = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
        got.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=name)
    assert model.fallback_reason is None
    assert model.export_count == 1
    experts = [n for n, _ in model.named_parameters() if "experts" in n]
    assert experts  # the expert weights were trained through the grouped matmul's translation
