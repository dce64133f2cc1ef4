"""``torch.nn.functional.scaled_dot_product_attention`` for training, in standard ONNX ops.

The exporter's own translation (onnxscript's torchlib) is written for inference, and differs from
PyTorch in three ways that matter when the graph is trained:

- **Dropout is dropped.** It emits ``Dropout(weights, p)`` without ``training_mode``, which ONNX defines
  as inference: attention dropout (BERT's ``attention_probs_dropout_prob``, GPT-2's ``attn_pdrop``) never
  happened under ORTModule. Here ``training_mode`` is true whenever ``dropout_p > 0``, as in PyTorch,
  which applies ``dropout_p`` whatever the module's mode (Hugging Face models pass 0 in eval mode).
- **Rows with every key masked.** PyTorch returns zeros for them (its "safe softmax"). The torchlib
  translation returns a uniform average for a Boolean mask and NaN for a float mask holding ``-inf``.
  Here the scores are masked with half the dtype's lowest finite value (so Softmax never sees a row of
  ``-inf``) and the output is multiplied by a per-row 0/1 factor taken from the mask alone: a
  ``[..., L, 1]`` tensor, computed once per mask however many layers share it. (Scaling a row of the
  weights scales that row of the output, whose ``[..., L, Ev]`` is the smaller of the two, and backward
  no longer redoes the scaled weights: BERT-small's Mul kernels, 11.3 -> 10.1 ms a step in
  onnxruntime's profiler; in wall-clock steps the change is within the noise.)
- **Cost.** Its ``Where(IsNaN(weights), 0, weights)`` guard costs two passes over the attention weights
  in forward and two more in backward (onnxruntime's ``Where`` is several times slower than ``Mul``);
  the key's transpose goes through a Reshape, so it is copied instead of fused into the MatMul; and both
  the query and the key are scaled. Here only the query is scaled, and the key's transpose feeds the
  MatMul directly, so onnxruntime folds both into one ``FusedMatMul``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False):
    """``scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, *, scale, enable_gqa)``"""
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: is_causal and attn_mask cannot both be set")
    rank = len(query.shape)
    if enable_gqa:
        key, value = _repeat_heads(query, key), _repeat_heads(query, value)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    scores = op.MatMul(op.Mul(query, _scale(query, scale)), op.Transpose(key, perm=perm))
    row_valid = None
    if is_causal:  # every row keeps at least its first key: no row is fully masked
        scores = op.Add(scores, _causal_mask(query, key))
    elif attn_mask is not None:
        bias, row_valid = _mask(attn_mask, query.dtype)
        scores = op.Add(scores, bias)
    weights = op.Softmax(scores, axis=-1)
    if dropout_p > 0:
        ratio = op.Constant(value=ir.tensor(np.array(dropout_p, dtype=np.float32)))
        weights, _ = op.Dropout(weights, ratio, op.Constant(value=ir.tensor(np.array(True))))
    out = op.MatMul(weights, value)
    # Zeroing a fully masked row of the weights zeroes that row of the output: done on [..., L, Ev],
    # smaller than the weights' [..., L, S], and backward scales the output's gradient instead of
    # redoing the product and scaling the weights' gradient.
    return op.Mul(out, row_valid) if row_valid is not None else out


def from_attention(node: ir.Node) -> bool:
    """Whether ``node`` is one of this translation's nodes: the exporter records each node's torch op as the last
    part of its ``namespace`` (``.../scaled_dot_product_attention: aten.scaled_dot_product_attention.default``)."""
    origin = node.metadata_props.get("namespace", "").rsplit(": ", 1)[-1]
    return origin.startswith("aten.scaled_dot_product_attention.")


def _masked(dtype: ir.DataType):
    """The bias of a masked score: half the lowest finite value, so that adding a negative score cannot
    overflow to -inf (float16: -32752 + scores down to -32752), and Softmax never sees a row of -inf."""
    return op.Constant(value=ir.tensor(np.array(np.finfo(dtype.numpy()).min / 2, dtype=dtype.numpy())))


def _scalar(value: float, dtype: ir.DataType):
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


def _scale(query, scale: float | None):
    """``scale``, or PyTorch's default ``1 / sqrt(E)`` (E the query's last dim, maybe dynamic)."""
    dtype = query.dtype
    if scale is not None:
        return _scalar(scale, dtype)
    head_dim = query.shape[-1]
    if isinstance(head_dim, int):
        return _scalar(1.0 / math.sqrt(head_dim), dtype)
    return op.Reciprocal(op.Sqrt(op.Cast(op.Shape(query, start=-1), to=dtype)))


def _mask(attn_mask, dtype: ir.DataType):
    """(additive bias with finite values only, per-row factor: 0 where every key is masked, else 1)."""
    last = op.Constant(value_ints=[-1])
    if attn_mask.dtype == ir.DataType.BOOL:
        bias = op.Where(attn_mask, _scalar(0.0, dtype), _masked(dtype))
        row_valid = op.ReduceMax(op.Cast(attn_mask, to=dtype), last, keepdims=1)
        return bias, row_valid
    # A float mask: -inf (PyTorch's masked_fill idiom), and anything else below the masked bias, is raised
    # to it; a row that is -inf throughout is a fully masked row.
    mask = attn_mask if attn_mask.dtype == dtype else op.Cast(attn_mask, to=dtype)
    bias = op.Max(mask, _masked(dtype))
    return bias, finite_rows(mask, last, dtype)


def finite_rows(x, axes, dtype: ir.DataType):
    """1 where a row of ``x`` along ``axes`` has a value other than ``-inf``, else 0 (in ``dtype``): the rows of
    ``-inf`` counted with ``IsInf``, not compared with ``ReduceMax``, which OpenVINO's CPU plugin starts from the
    lowest finite value (2026.4: the maximum of ``-inf`` alone came out -3.4e38, and such a row was taken as valid,
    so a softmax over it was uniform, not zeros; the OpInfo sweep under autocast bf16, ``_safe_softmax`` #0)."""
    return op.ReduceMax(op.Cast(op.Not(op.IsInf(x, detect_positive=0)), to=dtype), axes, keepdims=1)


def _causal_mask(query, key):
    """``[L, S]``: 0 on and below the diagonal (top-left aligned, as PyTorch's ``is_causal``), masked above."""
    size = op.Concat(op.Shape(query, start=-2, end=-1), op.Shape(key, start=-2, end=-1), axis=0)
    full = op.Expand(_masked(query.dtype), size)
    return op.Trilu(full, op.Constant(value=ir.tensor(np.array(1, dtype=np.int64))), upper=1)


def _repeat_heads(query, kv):
    """``kv.repeat_interleave(Hq // Hkv, dim=-3)`` (``enable_gqa``); head counts that the export left
    symbolic (torch 2.15 keeps a 4-D input's axis 1 dynamic) are read from the shapes at run time."""
    heads, kv_heads = query.shape[-3], kv.shape[-3]
    static = isinstance(heads, int) and isinstance(kv_heads, int)
    if static and heads == kv_heads:
        return kv
    if static and heads % kv_heads:
        raise ValueError(f"scaled_dot_product_attention(enable_gqa=True): {heads} query heads are not a "
                         f"multiple of {kv_heads} key/value heads")
    if static:
        repeats, all_heads = op.Constant(value_ints=[heads // kv_heads]), op.Constant(value_ints=[heads])
    else:
        all_heads = op.Shape(query, start=-3, end=-2)
        repeats = op.Div(all_heads, op.Shape(kv, start=-3, end=-2))
    lead, tail = op.Shape(kv, end=-2), op.Shape(kv, start=-2)
    expanded = op.Expand(op.Unsqueeze(kv, op.Constant(value_ints=[-3])), op.Concat(lead, repeats, tail, axis=0))
    batch = op.Shape(kv, end=-3)
    return op.Reshape(expanded, op.Concat(batch, all_heads, tail, axis=0))
