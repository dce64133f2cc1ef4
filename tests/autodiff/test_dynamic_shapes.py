"""One gradient graph serves every batch and sequence size.

Small models with symbolic input dims (``["batch", "seq", 8]``) run the shape and reduction rules on
shapes known only at run time; their gradient model is built once and run in onnxruntime at two
sizes, and compared with PyTorch autograd on the same computation.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import gradient_model

BIG = np.iinfo(np.int64).max
SIZES = [(2, 3), (3, 5)]


def _const(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def _check(model, wrt, torch_fn, make_feeds):
    """Build the gradient model once; at each size compare outputs and gradients with torch."""
    grad = gradient_model(model, wrt=wrt)
    onnx.checker.check_model(grad, full_check=True)
    rng = np.random.default_rng(0)
    for batch, seq in SIZES:
        feeds = make_feeds(rng, batch, seq)
        t_inputs = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
        t_outputs = torch_fn(**t_inputs)
        seeds = {f"{name}_grad": rng.standard_normal(tuple(t.shape)).astype(np.float32)
                 for name, t in t_outputs.items()}
        expected = torch.autograd.grad(
            list(t_outputs.values()), [t_inputs[w] for w in wrt],
            [torch.from_numpy(seeds[f"{name}_grad"]) for name in t_outputs],
        )
        got = _run(grad, {**feeds, **seeds})
        for name, t in t_outputs.items():
            np.testing.assert_allclose(got[name], t.detach().numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=f"output {name} at batch={batch}, seq={seq}")
        for name, e in zip(wrt, expected):
            np.testing.assert_allclose(got[f"{name}_grad"], e.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"gradient of {name} at batch={batch}, seq={seq}")


# -- an attention-like block: Gather, Reshape, Transpose, Slice, Concat, Split, reductions ---------
def _block_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),  # [B, S, 8]
        helper.make_node("Add", ["x", "e"], ["h0"]),
        helper.make_node("Mul", ["h0", "w"], ["h"]),  # broadcast [8]
        helper.make_node("Shape", ["h"], ["hs"]),
        helper.make_node("Slice", ["hs", "zero", "two"], ["bs"]),
        helper.make_node("Concat", ["bs", "heads"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["h", "new_shape"], ["r"]),  # [B, S, 2, 4]
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),  # [B, 2, S, 4]
        helper.make_node("Slice", ["t", "one", "big", "two"], ["tail"]),  # [B, 2, S-1, 4]
        helper.make_node("Slice", ["t", "zero", "one", "two"], ["head"]),  # [B, 2, 1, 4]
        helper.make_node("Concat", ["tail", "head"], ["rolled"], axis=2),  # roll along the sequence
        helper.make_node("Split", ["rolled"], ["a", "b"], axis=3, num_outputs=2),  # [B, 2, S, 2] x2
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("ReduceMean", ["ab", "one"], ["y"], keepdims=0),  # [B, S, 2]
        helper.make_node("Slice", ["x", "minus_one", "minus_big", "one", "minus_two"], ["odd"]),
        helper.make_node("ReduceSum", ["odd", "minus_one"], ["y2"], keepdims=1),  # [B, ceil(S/2), 1]
    ]
    inits = [_const("zero", [0]), _const("one", [1]), _const("two", [2]), _const("big", [BIG]),
             _const("heads", [2, 4]), _const("minus_one", [-1]), _const("minus_big", [-BIG]),
             _const("minus_two", [-2])]
    graph = helper.make_graph(
        nodes, "block",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, [10, 8]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _block_torch(ids, x, emb, w):
    h = (x + emb[ids]) * w
    t = h.reshape(*h.shape[:2], 2, 4).transpose(1, 2)
    rolled = torch.cat([t[:, :, 1:], t[:, :, :1]], dim=2)
    a, b = rolled.chunk(2, dim=3)
    y = (a * b).mean(dim=1)
    odd = x.flip(1)[:, ::2]
    return {"y": y, "y2": odd.sum(dim=-1, keepdim=True)}


def test_attention_like_block_at_two_sizes():
    rng = np.random.default_rng(1)
    params = {"emb": rng.standard_normal((10, 8)).astype(np.float32),
              "w": rng.standard_normal(8).astype(np.float32)}

    def feeds(rng, batch, seq):  # repeated token ids: the embedding gradient must add them up
        return {"ids": rng.integers(0, 4, (batch, seq)).astype(np.int64),
                "x": rng.standard_normal((batch, seq, 8)).astype(np.float32), **params}

    _check(_block_model(), ["x", "emb", "w"], _block_torch, feeds)


# -- borders and repeats: Pad (reflect), Tile, CumSum, ReduceMax, Squeeze, Expand -------------------
def _borders_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),  # [B, S+3, 4]
        helper.make_node("Tile", ["p", "reps"], ["t"]),  # [B, S+3, 8]
        helper.make_node("CumSum", ["t", "axis1"], ["c"], reverse=1),
        helper.make_node("ReduceMax", ["c", "minus_one"], ["m"], keepdims=1),  # [B, S+3, 1]
        helper.make_node("Squeeze", ["m", "minus_one"], ["y"]),  # [B, S+3]
        helper.make_node("Unsqueeze", ["y", "minus_one"], ["u"]),
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Slice", ["xs", "zero", "one"], ["b"]),
        helper.make_node("Concat", ["b", "one", "four"], ["ex_shape"], axis=0),
        helper.make_node("Expand", ["v", "ex_shape"], ["ve"]),  # [B, 1, 4]
        helper.make_node("Mul", ["x", "ve"], ["xv"]),
        helper.make_node("ReduceSum", ["xv", "one"], ["y2"], keepdims=0),  # [B, 4]
    ]
    inits = [_const("pads", [0, 1, 0, 0, 2, 0]), _const("reps", [1, 1, 2]), _const("axis1", 1),
             _const("minus_one", [-1]), _const("zero", [0]), _const("one", [1]), _const("four", [4])]
    graph = helper.make_graph(
        nodes, "borders",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _borders_torch(x, v):
    p = torch.nn.functional.pad(x.transpose(1, 2), (1, 2), mode="reflect").transpose(1, 2)
    t = p.repeat(1, 1, 2)
    c = t.flip(1).cumsum(1).flip(1)
    y = c.amax(dim=-1)
    y2 = (x * v.expand(x.shape[0], 1, 4)).sum(dim=1)
    return {"y": y, "y2": y2}


def test_borders_and_repeats_at_two_sizes():
    rng = np.random.default_rng(2)
    v = rng.standard_normal((1, 1, 4)).astype(np.float32)

    def feeds(rng, batch, seq):
        return {"x": rng.standard_normal((batch, seq, 4)).astype(np.float32), "v": v}

    _check(_borders_model(), ["x", "v"], _borders_torch, feeds)


@pytest.mark.parametrize("opset", [13, 18])
def test_gather_embedding_opsets(opset):
    """Embedding gradients add repeated ids, also before opset 16 (no ScatterND reduction there)."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["y"])], "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, [6, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    emb = np.random.default_rng(3).standard_normal((6, 3)).astype(np.float32)

    def feeds(rng, batch, seq):
        return {"ids": rng.integers(-6, 6, (batch, seq)).astype(np.int64), "emb": emb}

    def embed(ids, emb):
        return {"y": emb[torch.where(ids < 0, ids + 6, ids)]}

    _check(model, ["emb"], embed, feeds)
