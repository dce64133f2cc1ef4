"""LoRA artifacts from a PEFT-wrapped tiny Llama (from a config, random weights): only the adapters train
and sit in the per-step state; losses match PEFT + PyTorch over 20 steps; an int8 base stays int8, lets
the gradient through to the adapters and keeps the loss curve within 2% of the float32 base's."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import peft  # in the [test] extra
import pytest
import torch

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.ondevice.lora import generate_lora_artifacts, quantize_base_int8, quantize_rows_int8, split_parameters
from tests.ondevice.helpers import assert_losses_close

VOCAB, STEPS, LR = 128, 20, 1e-2
Q_PROJ = "model.base_model.model.model.layers.0.self_attn.q_proj"  # PEFT's names under WithLoss


class WithLoss(torch.nn.Module):
    """The causal LM's next-token cross-entropy as the model's only output (``loss=None`` artifacts)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batches(n=STEPS, seed=0):
    """Sequences that count up by a per-row stride: the next token is learnable."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start, stride = rng.integers(0, VOCAB, (4, 1)), rng.integers(1, 4, (4, 1))
        seq = (start + stride * np.arange(17)) % VOCAB
        out.append((seq[:, :-1].astype(np.int64), seq[:, 1:].astype(np.int64)))
    return out


@pytest.fixture(scope="module")
def peft_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = WithLoss(peft.get_peft_model(LlamaForCausalLM(config), lora)).eval()
    with torch.no_grad():  # PEFT starts B at zero; a nonzero B makes the first steps reach A too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    ids, labels = (torch.from_numpy(a) for a in _batches(1)[0])
    path = tmp_path_factory.mktemp("peft_llama") / "model.onnx"
    program = torch.onnx.export(copy.deepcopy(model), (ids, labels), dynamo=True, input_names=["input_ids", "labels"],
                                output_names=["loss"], optimize=False, verbose=False,
                                dynamic_shapes=({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}))
    program.save(str(path))
    return model, path


def _train(directory):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(LR)
    losses = []
    for x, y in _batches():
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    return state, module, losses


def _train_torch(reference):
    """PyTorch's losses over the same batches: AdamW (lr LR, weight decay 0.01 as the artifacts') on the
    parameters that require grad."""
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    losses = []
    for x, y in _batches():
        optimizer.zero_grad()
        loss = reference(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def float_run(peft_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_f32")
    generate_lora_artifacts(peft_llama[1], loss=None, optimizer="adamw", artifact_directory=out)
    return out, *_train(out)


def test_adapters_alone_train_and_match_peft(peft_llama, float_run):
    model, _ = peft_llama
    out, state, module, losses = float_run
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    assert [n for n in state.parameters if state.parameters[n].requires_grad] == adapters
    assert module.get_parameters_size(trainable_only=True) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = [n for n in state.parameters if not state.parameters[n].requires_grad]
    assert f"{Q_PROJ}.base_layer.weight" in frozen
    # the models hold no weights: the base is in the checkpoint once
    assert all(not onnx.load(out / f, load_external_data=False).graph.initializer or
               max(t.ByteSize() for t in onnx.load(out / f).graph.initializer) < 4096
               for f in ("training_model.onnx", "eval_model.onnx"))

    reference = copy.deepcopy(model).train()
    ref_losses = _train_torch(reference)
    assert ref_losses[-1] < ref_losses[0]
    assert_losses_close(losses, ref_losses, rtol=1e-4)
    for name, p in reference.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(state.parameters[name].data, p.detach().numpy(), rtol=1e-3, atol=1e-5)


def test_int8_base_trains_the_adapters_close_to_float32(peft_llama, float_run, tmp_path):
    _, f32_state, _, f32_losses = float_run
    generate_lora_artifacts(peft_llama[1], base="int8", loss=None, optimizer="adamw", artifact_directory=tmp_path)
    before = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    q_name = f"{Q_PROJ}.base_layer.weight"
    q_int8 = before.parameters[f"{q_name}.int8"].data
    assert q_int8.dtype == np.int8 and not before.parameters[f"{q_name}.int8"].requires_grad
    state, _, losses = _train(tmp_path)
    rel = np.abs(np.array(losses) - f32_losses) / np.array(f32_losses)
    assert rel.max() < 0.02, rel
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(state.parameters[f"{q_name}.int8"].data, q_int8)  # the base never moves
    adapter = f"{Q_PROJ}.lora_A.default.weight"
    start = before.parameters[adapter].data
    assert not np.allclose(state.parameters[adapter].data, start)  # the gradient reached the adapter


def test_int8_quantization_pass_against_numpy(peft_llama):
    """onnxruntime runs the model before and after the pass: each quantized matrix is within half a step
    of its row's scale, and the loss moves by less than 1%."""
    import onnxruntime as ort

    proto = onnx.load(peft_llama[1])
    adapters, base = split_parameters(proto)
    quantized, names = quantize_base_int8(proto, base)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    for name in base:
        if weights[name].ndim == 2:
            q, scale = quantize_rows_int8(weights[name])
            assert np.abs(q * scale[:, None] - weights[name]).max() <= scale.max() / 2 + 1e-7
            assert f"{name}.int8" in names and name not in names
        else:
            assert name in names
    x, y = _batches(1)[0]
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": x, "labels": y})[0]
    assert abs(run(quantized) - run(proto)) < 0.01 * abs(run(proto))


def test_lora_errors(peft_llama, mlp_onnx, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter initializers"):
        generate_lora_artifacts(mlp_onnx[1], loss="crossentropy", artifact_directory=tmp_path)
    with pytest.raises(TypeError, match="chooses requires_grad itself"):
        generate_lora_artifacts(peft_llama[1], requires_grad=["x"], artifact_directory=tmp_path)
    with pytest.raises(ValueError, match="base must be one of"):
        generate_lora_artifacts(peft_llama[1], base="int3", artifact_directory=tmp_path)


def _run_loss(path, x, y):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(session.run(None, {"input_ids": x, "labels": y})[0])


def test_export_merges_the_adapters_or_keeps_them_as_peft_names_them(peft_llama, float_run, tmp_path):
    """Against PEFT with the trained adapters: merge_and_unload()'s weights and loss for the merged export,
    the unmerged model's loss for the separate one, whose adapter initializers keep PEFT's names."""
    model, _ = peft_llama
    _, state, module, _ = float_run
    module.export_model_for_inferencing(tmp_path / "merged.onnx", ["loss"], merge_adapters=True)
    module.export_model_for_inferencing(tmp_path / "separate.onnx", ["loss"])
    reference = copy.deepcopy(model)
    adapters = [n for n, p in reference.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.requires_grad:
                p.copy_(torch.from_numpy(state.parameters[name].data))
    x, y = _batches(1, seed=1)[0]
    with torch.no_grad():
        separate_ref = reference(torch.from_numpy(x), torch.from_numpy(y)).item()
        merged_model = WithLoss(reference.model.merge_and_unload()).eval()
        merged_ref = merged_model(torch.from_numpy(x), torch.from_numpy(y)).item()

    separate = onnx.load(tmp_path / "separate.onnx")
    assert sorted(t.name for t in separate.graph.initializer if "lora_" in t.name) == sorted(adapters)
    assert _run_loss(tmp_path / "separate.onnx", x, y) == pytest.approx(separate_ref, rel=1e-5)

    merged = onnx.load(tmp_path / "merged.onnx")
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in merged.graph.initializer}
    assert not [n for n in inits if "lora_" in n]
    assert not [n for n in merged.graph.node if "lora_" in " ".join(n.input)]
    q_merged = dict(merged_model.named_parameters())["model.model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(inits[f"{Q_PROJ}.base_layer.weight"], q_merged.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert _run_loss(tmp_path / "merged.onnx", x, y) == pytest.approx(merged_ref, rel=1e-5)


def test_merge_with_an_int8_base_keeps_the_loss(peft_llama, tmp_path):
    """The merged int8 export (merged layers float32, the rest int8) computes what the separate one does."""
    generate_lora_artifacts(peft_llama[1], base="int8", loss=None, optimizer="adamw", artifact_directory=tmp_path)
    state, module, _ = _train(tmp_path)
    module.export_model_for_inferencing(tmp_path / "merged.onnx", ["loss"], merge_adapters=True)
    module.export_model_for_inferencing(tmp_path / "separate.onnx", ["loss"])
    x, y = _batches(1, seed=1)[0]
    assert _run_loss(tmp_path / "merged.onnx", x, y) == pytest.approx(_run_loss(tmp_path / "separate.onnx", x, y),
                                                                     rel=1e-5)
    merged = {t.name: t for t in onnx.load(tmp_path / "merged.onnx").graph.initializer}
    assert merged[f"{Q_PROJ}.base_layer.weight"].data_type == onnx.TensorProto.FLOAT
    k_proj = "model.base_model.model.model.layers.0.self_attn.k_proj.weight"
    assert merged[f"{k_proj}.int8"].data_type == onnx.TensorProto.INT8 and k_proj not in merged
    with pytest.raises(ValueError, match="no LoRA adapters"):
        from onnxtrain.ondevice.lora_merge import merge_adapters

        merge_adapters(onnx.load(tmp_path / "eval_model.onnx"), {})


def test_adapters_onnxtrain_adds_itself_train_as_peft(tmp_path):
    """A plain Llama export (no PEFT): target_modules adds the adapters; PEFT started from the same base and
    the same initial adapters trains to losses within 1e-4 over 20 steps, and merging matches PEFT's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    plain = WithLoss(LlamaForCausalLM(config)).eval()
    ids, labels = (torch.from_numpy(a) for a in _batches(1)[0])
    torch.onnx.export(copy.deepcopy(plain), (ids, labels), dynamo=True, input_names=["input_ids", "labels"],
                      output_names=["loss"], optimize=False, verbose=False,
                      dynamic_shapes=({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"})).save(str(tmp_path / "plain.onnx"))
    out = tmp_path / "artifacts"
    generate_lora_artifacts(tmp_path / "plain.onnx", target_modules=["q_proj", "v_proj"], r=4, alpha=8, seed=3,
                            loss=None, optimizer="adamw", artifact_directory=out)
    start = CheckpointState.load_checkpoint(out / "checkpoint")
    ours = [n for n in start.parameters if start.parameters[n].requires_grad]
    assert len(ours) == 8 and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in ours)

    reference = WithLoss(peft.get_peft_model(copy.deepcopy(plain.model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))).train()
    peft_name = lambda n: n.replace("model.", "model.base_model.model.", 1).replace(".weight", ".default.weight")  # noqa: E731
    with torch.no_grad():
        params = dict(reference.named_parameters())
        assert sorted(peft_name(n) for n in ours) == sorted(n for n, p in params.items() if p.requires_grad)
        for name in ours:
            params[peft_name(name)].copy_(torch.from_numpy(start.parameters[name].data))
    ref_losses = _train_torch(reference)
    state, module, losses = _train(out)
    assert ref_losses[-1] < ref_losses[0]
    assert_losses_close(losses, ref_losses, rtol=1e-4)
    for name in ours:
        np.testing.assert_allclose(state.parameters[name].data, params[peft_name(name)].detach().numpy(),
                                   rtol=1e-3, atol=1e-5)
    module.export_model_for_inferencing(tmp_path / "merged.onnx", ["loss"], merge_adapters=True)
    x, y = _batches(1, seed=1)[0]
    with torch.no_grad():
        merged_ref = WithLoss(reference.model.merge_and_unload())(torch.from_numpy(x), torch.from_numpy(y)).item()
    assert _run_loss(tmp_path / "merged.onnx", x, y) == pytest.approx(merged_ref, rel=1e-5)
    with pytest.raises(ValueError, match="no linear layer matches"):
        generate_lora_artifacts(tmp_path / "plain.onnx", target_modules=["qkv"], artifact_directory=tmp_path / "x")


def test_int4_base_trains_as_peft_on_the_dequantized_weights(peft_llama, float_run, tmp_path):
    """int4 blocks (two values a byte): PEFT + PyTorch with every quantized matrix replaced by numpy's
    dequantization of it trains to the same losses (1e-4) over 20 steps; the loss curve stays within 2%
    of the float32 base's."""
    from onnxtrain.ondevice.lora_quant import dequantize_blocks_int4

    model, _ = peft_llama
    _, _, _, f32_losses = float_run
    generate_lora_artifacts(peft_llama[1], base="int4", loss=None, optimizer="adamw", artifact_directory=tmp_path)
    start = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    reference = copy.deepcopy(model).train()
    quantized = 0
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if f"{name}.int4" in start.parameters:
                packed, scale = start.parameters[f"{name}.int4"].data, start.parameters[f"{name}.scale"].data
                assert packed.dtype == np.uint8 and packed.shape == (p.shape[0], p.shape[1] // 2)
                p.copy_(torch.from_numpy(dequantize_blocks_int4(packed, scale)))
                quantized += 1
            elif p.requires_grad:
                p.copy_(torch.from_numpy(start.parameters[name].data))
    assert quantized == 16  # embedding, 7 linear layers x 2, lm_head
    ref_losses = _train_torch(reference)
    state, _, losses = _train(tmp_path)
    assert_losses_close(losses, ref_losses, rtol=1e-4)
    rel = np.abs(np.array(losses) - f32_losses) / np.array(f32_losses)
    assert rel.max() < 0.02, rel
    for name, p in reference.named_parameters():
        if p.requires_grad:  # the gradient reached the adapters, as PyTorch's did
            np.testing.assert_allclose(state.parameters[name].data, p.detach().numpy(), rtol=1e-3, atol=1e-5)
    q_name = f"{Q_PROJ}.base_layer.weight.int4"
    np.testing.assert_array_equal(state.parameters[q_name].data, start.parameters[q_name].data)
    # the gradient nodes unpack the weights again instead of keeping the forward's float32 copies
    nodes = onnx.load(tmp_path / "training_model.onnx").graph.node
    assert any(n.op_type == "Div" and n.name.endswith("/again_in_backward") for n in nodes)


@pytest.mark.parametrize("cols, block", [(64, 32), (48, 16)])
def test_int4_quantization_pass_against_numpy(cols, block):
    """onnxruntime runs the int4 graph (a linear layer and an embedding lookup): what numpy's dequantization
    of the packed blocks gives, each weight within half a step of its block's scale."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from onnxtrain.ondevice.lora_quant import dequantize_blocks_int4, quantize_base, quantize_blocks_int4

    rng = np.random.default_rng(0)
    w, table = rng.normal(size=(8, cols)).astype(np.float32), rng.normal(size=(10, cols)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["y"]),
         helper.make_node("Gather", ["E", "ids"], ["rows"], axis=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, cols]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("rows", TensorProto.FLOAT, [2, 3, cols])],
        [onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(table, "E")])
    model, names = quantize_base(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), ["W", "E"], bits=4)
    assert names == ["W.int4", "W.scale", "E.int4", "E.scale"]
    x, ids = rng.normal(size=(2, cols)).astype(np.float32), np.array([[0, 9, 3], [3, 3, 1]])
    y, rows = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "ids": ids})
    for weight in (w, table):
        packed, scale = quantize_blocks_int4(weight, block)
        assert packed.dtype == np.uint8 and scale.shape == (weight.shape[0], cols // block)
        step = np.repeat(scale, block, axis=1)
        assert (np.abs(dequantize_blocks_int4(packed, scale) - weight) <= step / 2 + 1e-6).all()
    np.testing.assert_allclose(y, x @ dequantize_blocks_int4(*quantize_blocks_int4(w, block)).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(rows, dequantize_blocks_int4(*quantize_blocks_int4(table, block))[ids])


@pytest.mark.parametrize("quantized", [False, True])
def test_merge_into_a_layer_exported_as_gemm(quantized):
    """A base layer exported as ``Gemm(x, W, bias, transB=1)`` (a 2-D input) merges as MatMul ones do:
    onnxruntime on the merged graph gives numpy's ``x (W + s B A)^T + bias``, with an int8 base too."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from onnxtrain.ondevice.lora_merge import merge_adapters

    rng = np.random.default_rng(0)
    w, bias = rng.normal(size=(6, 5)).astype(np.float32), rng.normal(size=6).astype(np.float32)
    a, b = rng.normal(size=(2, 5)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    params = {"bias": bias, "l.lora_A.weight": a, "l.lora_B.weight": b}
    nodes = [helper.make_node("Gemm", ["x", "W", "bias"], ["base"], transB=1),
             helper.make_node("Transpose", ["l.lora_A.weight"], ["At"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "At"], ["xa"]),
             helper.make_node("Transpose", ["l.lora_B.weight"], ["Bt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xa", "Bt"], ["xab"]),
             helper.make_node("Mul", ["xab", "s"], ["scaled"]),
             helper.make_node("Add", ["base", "scaled"], ["y"])]
    if quantized:
        q, scale = quantize_rows_int8(w)
        params.update({"W.int8": q, "W.scale": scale})
        nodes.insert(0, helper.make_node("DequantizeLinear", ["W.int8", "W.scale"], ["W"], axis=0))
        w = q.astype(np.float32) * scale[:, None]
    else:
        params["W"] = w
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])] + [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)) for n, v in params.items()]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
                              [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "s")])
    model, merged = merge_adapters(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), params)
    expected = x @ (w + 0.5 * b @ a).T + bias
    if quantized:  # the merged weight is float32, an initializer in place of the DequantizeLinear
        assert not [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        feeds = {n: v for n, v in merged.items() if n in {i.name for i in model.graph.input}}
    else:
        np.testing.assert_allclose(merged["W"], w + 0.5 * b @ a, rtol=1e-6)
        feeds = merged
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, **feeds})[0]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_dequantize_where_read_computes_the_same_with_one_copy_per_reader():
    """The int8 scheduling pass (``lora_quant.dequantize_where_read``): onnxruntime gives the same forward and
    gradient outputs before and after it; afterwards the gradient node reads a dequantized copy of its
    own, every node made of weights alone comes first, and the dequantized shapes are left unknown."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from onnxtrain.ondevice.lora_quant import dequantize_where_read

    rng = np.random.default_rng(0)
    q, scale = quantize_rows_int8(rng.normal(size=(6, 5)).astype(np.float32))
    nodes = [helper.make_node("DequantizeLinear", ["W.int8", "W.scale"], ["W"], axis=0, name="dequantize/W"),
             helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Wt"], ["y"]),          # forward: y = relu(x) W^T
             helper.make_node("Transpose", ["Wt"], ["W_again"], perm=[1, 0]),
             helper.make_node("MatMul", ["dy", "W_again"], ["dh"])]   # a gradient node: dh = dy W
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5]),
                     helper.make_tensor_value_info("dy", TensorProto.FLOAT, [3, 6]),
                     helper.make_tensor_value_info("W.int8", TensorProto.INT8, [6, 5]),
                     helper.make_tensor_value_info("W.scale", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6]), helper.make_tensor_value_info("dh", TensorProto.FLOAT, [3, 5])],
        value_info=[helper.make_tensor_value_info("W", TensorProto.FLOAT, [6, 5]),
                    helper.make_tensor_value_info("Wt", TensorProto.FLOAT, [5, 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    feeds = {"x": rng.normal(size=(3, 5)).astype(np.float32), "dy": rng.normal(size=(3, 6)).astype(np.float32),
             "W.int8": q, "W.scale": scale}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    before = run(model)
    assert dequantize_where_read(model, 1, ["W.int8", "W.scale"]) == 1
    after = run(model)
    for a, b in zip(after, before):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    w = q.astype(np.float32) * scale[:, None]
    np.testing.assert_allclose(after[1], feeds["dy"] @ w, rtol=1e-5)  # and numpy's dh = dy W
    ops = [n.op_type for n in model.graph.node]
    assert ops[:4] == ["DequantizeLinear", "Transpose", "DequantizeLinear", "Transpose"]  # weights first
    readers = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert len({n.input[1] for n in readers}) == 2  # the gradient node reads its own copy
    assert not model.graph.value_info
    assert not any(d.HasField("dim_value") for d in model.graph.input[2].type.tensor_type.shape.dim)


def test_embedding_adapters_merge_as_peft_merges_them(tmp_path):
    """PEFT's adapters on the embedding table (``lora_embedding_A/B``) train with the others and merge into
    the table: the merged export has no adapters left and computes PEFT's ``merge_and_unload()`` loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], lora_dropout=0.0)
    model = WithLoss(peft.get_peft_model(LlamaForCausalLM(config), lora)).eval()
    ids, labels = (torch.from_numpy(a) for a in _batches(1)[0])
    torch.onnx.export(copy.deepcopy(model), (ids, labels), dynamo=True, input_names=["input_ids", "labels"],
                      output_names=["loss"], optimize=False, verbose=False,
                      dynamic_shapes=({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"})).save(str(tmp_path / "emb.onnx"))
    generate_lora_artifacts(tmp_path / "emb.onnx", loss=None, optimizer="adamw", artifact_directory=tmp_path / "a")
    state, module, _ = _train(tmp_path / "a")
    table_adapter = "model.base_model.model.model.embed_tokens.lora_embedding_A.default"
    assert state.parameters[table_adapter].requires_grad
    module.export_model_for_inferencing(tmp_path / "merged.onnx", ["loss"], merge_adapters=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.from_numpy(state.parameters[name].data))
        x, y = _batches(1, seed=1)[0]
        merged_ref = WithLoss(model.model.merge_and_unload())(torch.from_numpy(x), torch.from_numpy(y)).item()
    merged = onnx.load(tmp_path / "merged.onnx")
    assert not [t.name for t in merged.graph.initializer if "lora_" in t.name]
    assert _run_loss(tmp_path / "merged.onnx", x, y) == pytest.approx(merged_ref, rel=1e-5)
