"""Mixture-of-experts: transformers' grouped matmul (``torch.ops.transformers.grouped_mm_fallback``) in
standard ONNX ops.

transformers 5's MoE layers (Mixtral, Qwen-MoE and the others built on ``use_experts_implementation``)
sort the (token, expert) pairs by expert and multiply each expert's run of rows by that expert's weight
matrix with a custom op, which the exporter cannot translate. Here row ``s`` belongs to expert ``e``, the
number of offsets ``<= s``; every expert's product is computed for every row (``[E, S, N]``) and the
row's own expert's kept by a 0/1 mask. That is ``E`` times the multiply-adds of the grouped kernel (4x for
top-2 of 8 experts), in ops every gradient rule knows: ``MatMul``, ``Mul`` and ``ReduceSum``. Rows from
the last offset on belong to no expert and are zero, as in transformers.

The op exists only once transformers has registered it; :func:`moe_translations` looks it up without
importing transformers.
"""

from __future__ import annotations

import onnx_ir as ir
import torch
from onnxscript import opset18 as op


def grouped_mm(input, weight, offs):
    """``transformers::grouped_mm_fallback(input [S, K], weight [E, K, N], offs [E]) -> [S, N]``"""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Range(zero, op.Squeeze(op.Shape(input, start=0, end=1)), one)
    ends = op.Cast(offs, to=ir.DataType.INT64)
    expert_of_row = op.ReduceSum(  # [S]: how many experts' runs end at or before the row
        op.Cast(op.GreaterOrEqual(op.Unsqueeze(rows, [1]), op.Unsqueeze(ends, [0])), to=ir.DataType.INT64),
        op.Constant(value_ints=[1]), keepdims=0)
    experts = op.Range(zero, op.Squeeze(op.Shape(offs, start=0, end=1)), one)
    mask = op.Cast(op.Equal(op.Unsqueeze(experts, [1]), op.Unsqueeze(expert_of_row, [0])), to=input.dtype)
    products = op.MatMul(op.Unsqueeze(input, [0]), weight)  # [E, S, N]
    return op.ReduceSum(op.Mul(products, op.Unsqueeze(mask, [2])), op.Constant(value_ints=[0]), keepdims=0)


def moe_translations() -> dict:
    """``{transformers' grouped matmul op: its translation}`` once transformers has registered it, else {}."""
    try:
        grouped = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):
        return {}
    return {grouped: grouped_mm}
