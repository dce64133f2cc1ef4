"""Attention that eager computes in float32 under ``torch.autocast("cpu", dtype=torch.bfloat16)`` runs on the graphs.

With ``dropout_p > 0`` (the configs' default attention dropout, 0.1, in training) PyTorch's sdpa takes its CPU math
kernel, which computes both products, the mask's add, the softmax, the dropout and their backward in float32 from
the bfloat16 q, k, v, where OpenVINO's bf16 hint would run them in bfloat16. With ``ONNXTRAIN_BF16_ATTENTION_FLOAT32=1`` the graphs run
in ``PRODUCTS_BF16`` there (by default ORTModule falls back to PyTorch, as before): the precision pass
lowers the other products before autodiff (their gradients' products follow), attention's nodes stay float32, the
weight gradients are computed in float32 from the values the forward cast down (OpenVINO's bf16 product over a
dynamic row count at its float32 hint is 2x one rounding's error: ``passes.precision.float32_accumulations``), and
OpenVINO runs at its float32 hint (docs/precision.md). Checked here against eager autocast with the same dropout
masks and against float64 PyTorch, with the families tier's bounds, and on the compiled models' runtime precision.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from onnxtrain import ORTModule  # noqa: E402
from onnxtrain.capture.attention import from_attention  # noqa: E402
from onnxtrain.ortmodule.graphs import PRODUCTS_BF16  # noqa: E402
from onnxtrain.ortmodule.options import ATTENTION_FLOAT32_ENV  # noqa: E402
from onnxtrain.runtime import backends  # noqa: E402

from .test_autocast_policy import _sessions  # noqa: E402
from .test_families_bf16 import SCALE_FLOOR, assert_as_close_as_eager, errors_against_float64  # noqa: E402

pytestmark = pytest.mark.skipif(not (backends.openvino_installed() and backends.openvino_has_bf16()),
                                reason="autocast bfloat16 needs onnxtrain[openvino] and a CPU with bfloat16")

BATCHES = 4
# The worst gradient's error from float64 as a multiple of eager autocast's, where the fused call is compiled for the
# batches' sizes (its weight gradients bf16 products rounding once): BERT tiny 1.35x, GPT-2 tiny 0.99x (with float32
# accumulations over dynamic sizes, before: 1.75x, 1.70x); the families tier's bound is 2x
STATIC_GRAD_RATIO = 1.5


def _tiny(kind: str):
    """BERT-small's and GPT-2-small's architectures at test size, every dropout at its config's default (0.1)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "bert":
        config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            vocab_size=100, max_position_embeddings=64)
        model = BertForSequenceClassification(config)
        assert config.attention_probs_dropout_prob == 0.1 and config.hidden_dropout_prob == 0.1
    else:
        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, use_cache=False,
                            bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
        assert config.attn_pdrop == 0.1 and config.resid_pdrop == 0.1
    return model.train()


def _batch(kind: str, seed: int, length: int = 16) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, length), generator=generator)
    if kind == "bert":
        mask = torch.ones(2, length, dtype=torch.int64)
        mask[1, length - 4:] = 0  # a padded row: the mask's add is part of the float32 attention
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_default_dropout_attention_trains_on_the_graphs_as_close_to_float64_as_eager(kind, monkeypatch):
    """Before, the step fell back to PyTorch ("scaled_dot_product_attention computes in torch.float32 under
    autocast ..."). Each side draws its dropout masks from the same seed (ORTModule draws eager's:
    passes/dropout_masks.py), so the losses and gradients differ by rounding only."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")  # a fallback would pass the comparisons: refuse it below
    monkeypatch.setenv(ATTENTION_FLOAT32_ENV, "1")
    model = _tiny(kind)
    ort = ORTModule(copy.deepcopy(model))
    sq, losses = errors_against_float64(ort, model, [_batch(kind, seed) for seed in range(BATCHES)],
                                        seeds=[100 + seed for seed in range(BATCHES)])
    assert ort.fallback_reason is None, ort.fallback_reason
    assert [(g.backend, g.precision) for entries in ort._cache.values() for g in entries] == \
        [("openvino", PRODUCTS_BF16)]
    assert _sessions(ort) == {"OpenVINOSession"}
    for ort_loss, eager_loss, _ in losses:  # the same masks: a mask drawn otherwise moves the loss by ~1e-2
        assert abs(ort_loss - eager_loss) <= 2e-3 * abs(eager_loss), (ort_loss, eager_loss)
    assert_as_close_as_eager(kind, sq, losses)
    largest = max(norm for _, _, norm in sq.values())
    ratios = {name: (o / e) ** 0.5 for name, (o, e, norm) in sq.items() if norm >= SCALE_FLOOR ** 2 * largest and e > 0}
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= STATIC_GRAD_RATIO, (worst, ratios[worst])


def test_sizes_past_the_static_bound_run_the_float32_accumulations_as_close_to_float64(monkeypatch):
    """The fused call compiles each new set of sizes with every size fixed, up to graphs.STATIC_SHAPES (1 here);
    other sizes (Hugging Face pads each batch to its longest row) run the graph whose weight gradients accumulate in
    float32, compiled once over dynamic sizes: both within the bounds against eager autocast and float64."""
    from onnxtrain.ortmodule import graphs

    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")
    monkeypatch.setenv(ATTENTION_FLOAT32_ENV, "1")
    monkeypatch.setattr(graphs, "STATIC_SHAPES", 1)
    model = _tiny("bert")
    ort = ORTModule(copy.deepcopy(model))
    lengths = [16, 12, 16, 12]
    sq, losses = errors_against_float64(ort, model, [_batch("bert", seed, n) for seed, n in enumerate(lengths)],
                                        seeds=[100 + seed for seed in range(len(lengths))])
    assert ort.fallback_reason is None, ort.fallback_reason
    (fused,) = [t.fused for entries in ort._cache.values() for g in entries for t in g.training.values()]
    session = fused.session._session
    assert [shapes[0] for shapes in session._static] == [(2, 16)] and session._compiled is not None
    assert_as_close_as_eager("bert", sq, losses)


def test_attention_runs_float32_and_the_other_products_bf16_in_openvino(monkeypatch):
    """The compiled models' runtime precision (OpenVINO 2026.4, hint f32): every product of the attention and of its
    gradient in f32, as eager's math kernel computes them; every linear layer's product and its gradients' in bf16
    (the pass's explicit casts, which the plugin keeps at the float32 hint). The fused call is compiled for the
    call's sizes (graphs.STATIC_SHAPES), its weight gradients bf16 products there (one rounding, as autocast's);
    compiled over dynamic sizes (past the bound, and the graphs split in two), they are float32 products."""
    monkeypatch.setenv(ATTENTION_FLOAT32_ENV, "1")
    made = []
    create = backends.create_session
    monkeypatch.setattr(backends, "create_session", lambda *a, **k: made.append(create(*a, **k)) or made[-1])
    model = ORTModule(_tiny("bert"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**_batch("bert", 0)).loss
    loss.backward()
    assert model.fallback_reason is None, model.fallback_reason
    (graphs,) = [g for entries in model._cache.values() for g in entries]
    import onnx_ir as ir

    attention = {node.name for node in ir.from_proto(graphs.base).graph if from_attention(node)}
    assert made and all(s.precision == "fp32" for s in made)
    static = [c for s in made for c in s._static.values()]
    assert len(static) == 1  # the fused call, for the batch's sizes
    _assert_precisions([s._compile() for s in made], attention, "f32")
    _assert_precisions(static, attention, "bf16")


def _assert_precisions(models: list, attention: set, weight_gradients: str) -> None:
    precisions = {"attention": set(), "linear": set(), "weight gradient": set()}
    counts = dict.fromkeys(precisions, 0)
    ops = []
    for compiled in models:
        assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) in ("f32", "<Type: 'float32'>")
        ops += compiled.get_runtime_model().get_ordered_ops()
    for op in ops:
        info = op.get_rt_info()
        if info["layerType"].astype(str) != "MatMul":
            continue
        names = info["originalLayersNames"].astype(str).split(",")
        if any("ReduceSum" in name or name.endswith("_grad/MM") for name in names):
            continue  # row sums (bias and LayerNorm gradients: MatMuls by a row of ones), float32 as the pass leaves them
        where = ("attention" if all(name.split("_Grad/")[0] in attention for name in names)
                 else "weight gradient" if any("/float32" in name or name.endswith("weight_grad") for name in names)
                 else "linear")
        precisions[where].add(info["runtimePrecision"].astype(str))
        counts[where] += 1
    # BERT tiny: 2 layers x 2 forward products; the fused call adds 4 gradient products per layer
    assert counts["attention"] >= 12 and precisions["attention"] == {"f32"}, (counts, precisions)
    # 14 linear layers: forward and input gradient products bf16; weight gradients as the caller says
    if weight_gradients == "bf16":  # every product but attention's (the static graph names no weight gradient)
        assert counts["linear"] + counts["weight gradient"] >= 27 + 14, (counts, precisions)
        assert precisions["linear"] | precisions["weight gradient"] == {"bf16"}, (counts, precisions)
        return
    assert counts["linear"] >= 27 and precisions["linear"] == {"bf16"}, (counts, precisions)
    assert counts["weight gradient"] >= 14 and precisions["weight gradient"] == {weight_gradients}, (counts, precisions)
