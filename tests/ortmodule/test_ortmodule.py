"""ORTModule behaviour a user relies on, each checked against PyTorch eager."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from onnxtrain import ORTModule
from tests.ortmodule import models
from tests.ortmodule.conftest import trainings


def _pair(make=models.MLP, seed=0):
    torch.manual_seed(seed)
    reference = make()
    return reference, ORTModule(copy.deepcopy(reference))


def test_dynamic_batch_and_sequence_need_no_new_export():
    reference, model = _pair(models.bert)
    reference.eval()
    model.eval()
    for batch in (2, 3, 8):
        for seq in (16, 40):
            inputs = models.text_batch(batch, seq, classify=True)
            got = model(**inputs)
            want = reference(**inputs)
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    assert model.export_count == 1


def test_training_with_changing_shapes_matches_eager_without_new_export():
    reference, model = _pair(models.gpt2)
    for batch, seq in ((2, 16), (3, 40), (8, 16), (1, 24)):
        inputs = models.text_batch(batch, seq)
        for m in (reference, model.module):
            m.zero_grad()
        got = model(**inputs).loss
        got.backward()
        want = reference(**inputs).loss
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=f"{name} at {batch}x{seq}")
    assert model.export_count == 1


def test_new_export_only_for_a_new_schema():
    reference, model = _pair()
    x = torch.randn(4, 16)
    model(x)
    model(torch.randn(9, 16))
    assert model.export_count == 1
    model(x, labels=torch.randint(0, 4, (4,)))  # new input names
    assert model.export_count == 2
    model.eval()
    model(x)  # eval mode is part of the schema
    assert model.export_count == 3
    model.train()
    model(x.double().float())  # same schema again
    assert model.export_count == 3
    model.double()  # new parameter dtype: a new graph, and the right result
    torch.testing.assert_close(model(x.double()), reference.double()(x.double()))
    assert model.export_count == 4


def test_structured_inputs_and_outputs_keep_their_structure():
    class Structured(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, pair, scale: float, extra=None, double: bool = False):
            a, b = pair
            h = self.fc(a) * scale + b
            if double:
                h = h * 2
            out = {"h": h, "parts": [h.sum(), (h * h).mean()]}
            if extra is not None:
                out["extra"] = extra + 1
            return out

    reference, model = _pair(Structured)
    pair = (torch.randn(3, 4), torch.randn(3, 4))
    for kwargs in ({}, {"double": True}, {"extra": torch.ones(2)}):
        got = model(pair, 0.5, **kwargs)
        want = reference(pair, 0.5, **kwargs)
        assert got.keys() == want.keys()
        assert isinstance(got["parts"], list) and len(got["parts"]) == 2
        torch.testing.assert_close(got, want)
    assert model.export_count == 3  # bool and None arguments are part of the schema


def test_a_causal_lm_with_its_default_cache_trains_and_returns_the_cache():
    """Hugging Face causal LMs return a DynamicCache unless use_cache=False: it comes back as one, with the
    same keys and values, and loss.backward() runs a backward graph without the cache's gradients."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=models.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
    assert config.use_cache
    reference, model = _pair(lambda: LlamaForCausalLM(config))
    for seq in (8, 13):
        batch = models.text_batch(2, seq)
        got, want = model(**batch), reference(**batch)
        assert isinstance(got.past_key_values, DynamicCache)
        for a, b in zip(got.past_key_values.layers, want.past_key_values.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        got.loss.backward()
        want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=name)
    assert model.export_count == 1
    (training,) = trainings(model)
    (present,) = training._backward  # only the loss's gradient reached backward
    assert present[0] and not any(present[1:])


def test_pytree_nodes_pass_through_as_inputs_and_outputs():
    import dataclasses

    import torch.utils._pytree as pytree

    @dataclasses.dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor
        scale: float

    pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], p.scale), lambda v, c: Pair(v[0], v[1], c))

    class UsesPair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, pair):
            h = self.fc(pair.a) * pair.scale + pair.b
            return Pair(h, h.sum(dim=1), pair.scale)

    reference, model = _pair(UsesPair)
    for scale in (0.5, 0.5, 2.0):
        pair = Pair(torch.randn(3, 4), torch.randn(3, 4), scale)
        got, want = model(pair), reference(pair)
        assert isinstance(got, Pair) and got.scale == scale
        torch.testing.assert_close((got.a, got.b), (want.a, want.b))
    assert model.export_count == 2  # the scale is part of the input schema


def test_model_output_comes_back_as_model_output():
    from transformers.modeling_outputs import SequenceClassifierOutput

    reference, model = _pair(models.bert)
    inputs = models.text_batch(2, 16, classify=True)
    got = model(**inputs)
    assert isinstance(got, SequenceClassifierOutput)
    assert got.keys() == reference(**inputs).keys()
    assert got.loss.requires_grad and got.loss.grad_fn is not None


def test_inputs_that_require_grad_receive_gradients():
    reference, model = _pair()
    x = torch.randn(5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model(x).pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_frozen_parameters_get_no_gradient():
    reference, model = _pair()
    for m in (reference, model.module):
        m.fc1.requires_grad_(False)
    x = torch.randn(5, 16)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert model.module.fc1.weight.grad is None
    torch.testing.assert_close(model.module.fc2.weight.grad, reference.fc2.weight.grad, rtol=1e-4, atol=1e-6)


def test_no_grad_and_eval_run_the_forward_graph_only():
    reference, model = _pair()
    x = torch.randn(5, 16)
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference(x).detach(), rtol=1e-4, atol=1e-6)
    model.eval()
    assert not model(x).requires_grad
    graphs = [g for entries in model._cache.values() for g in entries]
    assert all(not g.training for g in graphs)  # no backward graph was ever built


def test_batchnorm_statistics_update_in_train_mode_only():
    reference, model = _pair(models.CNN)
    batch = models.image_batch(6)
    model(**batch).backward()
    reference(**batch).backward()
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
    model.eval()
    reference.eval()
    before = [b.clone() for b in model.buffers()]
    with torch.no_grad():
        torch.testing.assert_close(model(**batch), reference(**batch), rtol=1e-4, atol=1e-5)
    for b, c in zip(model.buffers(), before):
        assert torch.equal(b, c)


def test_dropout_bert_trains_and_follows_the_seed():
    def run(seed):
        torch.manual_seed(0)
        model = ORTModule(models.bert(dropout=0.1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batch = models.text_batch(8, 16, classify=True, generator=torch.Generator().manual_seed(5))
        torch.manual_seed(seed)
        losses = []
        for _ in range(15):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    first, again, other = run(1), run(1), run(2)
    assert first == again
    assert first != other  # the masks do depend on the seed
    assert sum(first[-3:]) / 3 < 0.7 * sum(first[:3]) / 3, first


def test_dropout_masks_differ_between_steps_and_match_eager_statistics():
    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return torch.nn.functional.dropout(x * self.scale, 0.5, self.training)

    model = ORTModule(Drop())
    x = torch.ones(64, 64)
    torch.manual_seed(0)
    a, b = model(x), model(x)
    assert not torch.equal(a, b)
    kept = (a != 0).float().mean().item()
    assert 0.45 < kept < 0.55
    assert torch.all((a == 0) | (a == 2.0))
    a.sum().backward()
    assert model.scale.grad.item() == pytest.approx(a.sum().item(), rel=1e-5)


def test_module_view_state_dict_and_attributes():
    reference, model = _pair()
    assert model.module is not reference and isinstance(model.module, models.MLP)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert model.fc1 is model.module.fc1  # attribute access reaches the wrapped module
    model.load_state_dict(reference.state_dict())
    x = torch.randn(3, 16)
    model(x)
    with torch.no_grad():
        model.module.fc1.weight.mul_(2)  # in place, as an optimizer does: seen without a new export
        reference.fc1.weight.mul_(2)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-6)
    model.to(torch.float32)
    assert model.export_count == 1

    parent = torch.nn.Sequential(model)  # as a submodule: keys and loading stay consistent
    state = parent.state_dict()
    assert "0.fc1.weight" in state
    parent.load_state_dict(state)


def test_deepcopy_and_pickle():
    _, model = _pair()
    x = torch.randn(3, 16)
    want = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(clone, ORTModule)
        torch.testing.assert_close(clone(x), want)
        assert clone.module.fc1.weight is not model.module.fc1.weight


def test_gradient_accumulation_and_clipping_work_unchanged():
    reference, model = _pair()
    batches = [models.mlp_batch(4) for _ in range(3)]
    for m in (reference, model):
        for batch in batches:
            models.loss_of(m(**batch)).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_padded_table_looked_up_twice_and_tied_to_the_projection_matches_eager():
    """BART's layout: one table with padding_idx, looked up by an encoder and a decoder embedding and used
    as the output projection. PyTorch leaves the lookups' rows at the padding id out of the gradient and
    keeps the projection's; ORTModule once added them all (a warning said so)."""

    class Seq2Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = torch.nn.Embedding(13, 8, padding_idx=1)
            self.enc = torch.nn.Embedding(13, 8, padding_idx=1)
            self.dec = torch.nn.Embedding(13, 8, padding_idx=1)
            self.head = torch.nn.Linear(8, 13, bias=False)
            self.enc.weight = self.dec.weight = self.head.weight = self.shared.weight

        def forward(self, ids, dec_ids):
            h = torch.tanh(self.enc(ids)).mean(1, keepdim=True) + self.dec(dec_ids)
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())

    reference, model = _pair(Seq2Seq)
    ids = torch.tensor([[3, 1, 1, 5, 3, 12], [0, 1, 7, 3, 3, 1]])
    dec_ids = torch.tensor([[2, 3, 1, 1, 5, 3], [2, 0, 1, 7, 3, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for m in (model, reference):
            m(ids, dec_ids).backward()
    (got,), (want,) = [p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want[1].abs().max() > 0  # the projection's share of the padding row stays
    (training,) = trainings(model)
    assert list(training.padding_ids.values()) == [1] and not training.zero_rows


@pytest.mark.parametrize("tied", [False, True])
def test_scale_grad_by_freq_and_padding_idx_match_eager(tied):
    """scale_grad_by_freq divides each looked-up row's gradient by its id's count in the batch; the
    exported Gather forgot it (a gradient off by 1.16 on a small table)."""

    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, padding_idx=0, scale_grad_by_freq=True)
            self.head = torch.nn.Linear(4, 10, bias=False)
            if tied:
                self.head.weight = self.emb.weight

        def forward(self, ids):
            return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.emb(ids))).flatten(0, 1),
                                                     ids.flatten())

    reference, model = _pair(Counted)
    ids = torch.tensor([[1, 1, 1, 2, 0], [3, 1, 2, 0, 9]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for m in (model, reference):
            m(ids).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    (training,) = trainings(model)
    assert len(training.freq_scaled) == 1 and list(training.padding_ids.values()) == [0]


@pytest.mark.parametrize("use_logits", [False, True])
def test_outputs_outside_the_loss_are_left_out_of_backward(use_logits):
    """loss.backward() alone runs a backward graph without the logits' gradient input (not a zero tensor
    added to the loss's); using the logits too runs the full graph. Both match eager."""
    reference, model = _pair(models.gpt2)
    inputs = models.text_batch(3, 16)
    for m in (model, reference):
        out = m(**inputs)
        (out.loss + out.logits.square().mean() if use_logits else out.loss).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=name)
    (training,) = trainings(model)
    (present, session), = training._backward.items()  # one backward session was made
    assert present == ((True, True) if use_logits else (True, False))
    assert session is not None
    full_inputs = [i.name for i in training.backward_proto.graph.input]
    assert session.input_names == (full_inputs if use_logits else full_inputs[:1] + full_inputs[2:])


def test_bias_sums_become_matmuls_after_the_absent_gradients_are_pruned():
    """A bias shared by two heads: its gradient sums both heads' output gradients over batch and
    sequence. With only the first head in the loss, the second's sum reads a zero input, which pruning
    removes; the sums left become MatMuls by ones (passes/sum_rows_by_matmul.py) only after that, since
    pruning cannot see through the Shape those read. Gradients match eager."""

    class SharedBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 6, bias=False)
            self.bias = torch.nn.Parameter(torch.randn(6))

        def forward(self, x):
            h = self.fc(x)
            return (torch.tanh(h + self.bias) ** 2).sum(), h * 2 + self.bias

    reference, model = _pair(SharedBias)
    x = torch.randn(3, 5, 4)
    for m in (model, reference):
        m(x)[0].backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    (training,) = trainings(model)
    (present, session), = training._backward.items()
    assert present == (True, False) and session is not None  # pruned, not fed zeros
    ops = [n.op_type for stage in session.staged.stages for n in stage.model.graph.node]
    assert "ReduceSum" not in ops and "MatMul" in ops


def test_an_absent_output_gradient_that_cannot_be_pruned_is_fed_as_zeros():
    """The second output's gradient passes a Where, which the pruning pass does not simplify: backward
    runs the full graph with a zero tensor for it, and still matches eager."""

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return torch.tanh(h).sum(), torch.where(h > 0, h, torch.zeros_like(h))

    reference, model = _pair(TwoHeads)
    x = torch.randn(3, 4)
    for m in (model, reference):
        m(x)[0].backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    (training,) = trainings(model)
    assert set(training._backward) == {(True, False), (True, True)}  # the full graph ran, fed a zero tensor
    assert training._backward[(True, False)] is None


def test_embedding_gradients_are_added_up_by_torch_and_match_eager():
    """Embedding weight gradients leave the backward graph as ids and rows (passes/defer_row_scatters.py):
    torch adds them into zeros, or, for an embedding tied to the output projection, into the projection's
    gradient. Repeated ids, a padding row and gradient accumulation over two batches all match eager."""

    class TiedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(13, 8)
            self.pos = torch.nn.Embedding(6, 8)
            self.kind = torch.nn.Embedding(4, 8, padding_idx=0)
            self.head = torch.nn.Linear(8, 13, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, ids):
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1])) + self.kind(ids % 4)
            return torch.nn.functional.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), ids.flatten())

    reference, model = _pair(TiedLM)
    batches = [torch.tensor([[3, 3, 0, 5, 3, 12], [0, 0, 7, 3, 3, 1]]), torch.randint(0, 13, (3, 6))]
    for m in (model, reference):
        for ids in batches:
            m(ids).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    (training,) = trainings(model)
    assert sorted(s.base is None for s in training.row_scatters.scatters) == [False, True, True]
    assert training.padding_ids and not training.zero_rows  # kind's padding id: its rows are left out
