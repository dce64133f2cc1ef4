"""PyTorch's OpInfo samples through ORTModule under ``torch.autocast("cpu", dtype=torch.bfloat16)``, against a
float64 reference beside eager autocast (see ``tests/opinfo/autocast.py``).

The subset (``autocast.SUBSET``: one op or two per class of the precision policy) runs in the default suite:
each of its samples must run on OpenVINO at the bfloat16 hint and pass (eager autocast's dtypes, within the
bound), or be skipped as incomparable. The whole sweep (``-m opinfo_bf16``, its own tier in scripts/test.sh)
requires no sample to be wrong or to raise.
"""

from __future__ import annotations

import pytest

from onnxtrain.runtime import backends
from tests.opinfo import autocast, harness
from tests.opinfo.test_opinfo import _op, _quiet  # noqa: F401 - _quiet: the autouse fixture silencing warnings

pytestmark = pytest.mark.skipif(not (backends.openvino_installed() and backends.openvino_has_bf16()),
                                reason="autocast bfloat16 needs onnxtrain[openvino] and a CPU with bfloat16")


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", autocast.SUBSET)
def test_subset_under_autocast_bf16_as_close_to_float64_as_eager(name, mode):
    op = _op(name)
    results = [autocast.run_sample(op, s, mode, i) for i, s in enumerate(harness.samples(op))]
    assert results, f"{name} has no samples"
    bad = [f"sample {r.index}: {r.status}: {r.reason}" for r in results if r.status not in ("pass", "skip")]
    bad += [f"sample {r.index} ran on {r.ran}" for r in results if r.status == "pass" and r.ran != "openvino/bf16"]
    assert not bad, f"{name} ({mode}):\n" + "\n".join(bad)


# (op, sample, way) -> what the error says: OpenVINO's kernels returning empty gradients in backward, after the
# forward's outputs were used (too late to fall back). Gaps to close: remove an entry when its sample stops raising.
KNOWN_ERRORS = {
    # the source's gradient, a GatherElements of the (10, 5) output gradient by (5, 5) indices on axis 1:
    # OpenVINO's needs the two equal off the axis and returns (0, 0) (cropping the data first did not help)
    ("scatter_add", 1, "inputs"): "got [0, 0]",
    ("scatter_add", 1, "params"): "got [0, 0]",
}


@pytest.mark.opinfo_bf16
def test_full_sweep_under_autocast_bf16_has_no_error_and_nothing_wrong():
    try:
        results = list(autocast.sweep())
    except ModuleNotFoundError as exc:
        pytest.skip(f"op_db cannot be imported: {exc}")
    from tests.opinfo.table import table

    print("\n" + table(results))  # the log of the tier shows docs/opinfo.md's bf16 table as it is now (pytest -s)
    bad = [f"{r.status} {r.op} #{r.index} ({r.mode}): {r.reason}" for r in results if r.status in ("error", "wrong")
           and not (r.status == "error" and KNOWN_ERRORS.get((r.op, r.index, r.mode), "\0") in r.reason)]
    known = {(r.op, r.index, r.mode) for r in results if r.status == "error"}
    bad += [f"{op} #{index} ({mode}) no longer raises: remove it from KNOWN_ERRORS"
            for op, index, mode in KNOWN_ERRORS if (op, index, mode) not in known]
    assert not bad, f"{len(bad)} samples wrong or raising:\n" + "\n".join(bad)


# What the first whole sweep found wrong (twenty-second session), each now a fallback with the reason that names
# it, or a pass: (op, sample, status, what the reason says). Every one was "wrong" before its fix.
FOUND = [
    # products eager runs float32 (autocast leaves them alone or keeps them so) that the graph computes with a
    # MatMul, Conv or Interpolate, which OpenVINO's hint lowers: their outputs a bf16 rounding from float64
    ("addr", 0, "fallback", "addr in torch.float32"),
    ("nn.functional.bilinear", 0, "fallback", "_trilinear in torch.float32"),
    ("einsum", 1, "fallback", "einsum in torch.float32"),  # "i,j->ij": a mul in eager
    ("nn.functional.avg_pool2d", 0, "fallback", "avg_pool2d(divisor_override) in torch.float32"),
    ("nn.functional.avg_pool3d", 1, "fallback", "avg_pool3d(divisor_override) in torch.float32"),
    ("nn.functional.interpolate.bilinear", 0, "fallback", "upsample_bilinear2d in torch.float32"),
    ("nn.functional.interpolate.trilinear", 0, "fallback", "upsample_trilinear3d in torch.float32"),
    ("_upsample_bilinear2d_aa", 0, "fallback", "_upsample_bilinear2d_aa in torch.float32"),
    # OpenVINO's kernels, in float32 too (the tests below)
    ("torch.ops.aten._safe_softmax.default", 0, "pass", ""),  # rows of -inf: uniform, not zeros
    ("chunk", 0, "pass", ""),  # 5 rows in 2 chunks: empty outputs
    ("squeeze", 0, "fallback", "OutputShapeError"),  # (5, 1, 5) where eager gives (5, 5)
    ("index_select", 0, "fallback", "OutputShapeError"),  # (1,) where eager gives ()
    # (2, 2, 1) and (2, 1, 2), exported with one symbol for an axis of 2 and one of 1: OpenVINO followed the
    # declared shapes (its forward value another, -0.14 for 0.38), then raised in backward
    ("tensordot", 1, "fallback", "OutputShapeError: the graph's inputs give its size"),
]  # and _unsafe_masked_index_put_accumulate #0: the last test


@pytest.mark.parametrize("name,index,status,reason", FOUND)
def test_found_wrong_now_falls_back_or_matches(name, index, status, reason):
    op = _op(name)
    result = autocast.run_sample(op, harness.samples(op, index + 1)[index], "inputs", index)
    assert result.status == status and any(part in result.reason for part in reason.split("|")), \
        f"{result.status}: {result.reason}"


def _openvino_and_eager(module, *inputs):
    from onnxtrain import ORTModule

    model = ORTModule(module, backend="openvino")
    return model, model(*inputs), module(*inputs)


def test_safe_softmax_rows_of_minus_inf_are_zeros_on_openvino():
    """OpenVINO's ReduceMax of a row of -inf is the lowest finite float: the row was taken as valid (uniform)."""
    import torch

    class SafeSoftmax(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten._safe_softmax.default(x, 1)

    x = torch.randn(2, 3, 4)
    x[1] = float("-inf")
    x[1, 0, 2] = 3.0
    model, got, want = _openvino_and_eager(SafeSoftmax(), x)
    assert model.fallback_reason is None
    torch.testing.assert_close(got, want)


def test_chunk_into_unequal_parts_on_openvino():
    """torch.chunk(5 rows, 2): OpenVINO split it equally (empty outputs, or an error)."""
    import torch

    class Chunk(torch.nn.Module):
        def forward(self, x):
            return x.chunk(2, dim=0)

    x = torch.randn(5, 5, 5, requires_grad=True)
    model, got, want = _openvino_and_eager(Chunk(), x)
    assert model.fallback_reason is None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_antialiased_interpolate_falls_back_on_openvino():
    """OpenVINO's antialiased Interpolate differs from PyTorch's by 1.5-3.9 norm-relative, in float32."""
    import torch

    class Down(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, size=(3, 3), mode="bilinear", antialias=True)

    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model, got, want = _openvino_and_eager(Down(), x)
    assert model.fallback_reason is not None and "antialiased" in model.fallback_reason, model.fallback_reason
    torch.testing.assert_close(got, want)


def test_output_sizes_named_by_input_symbols_are_checked_on_openvino():
    """OpenVINO returned (0, 0) for an output the graph declares as the input's [s0, s1]: a fallback now."""
    import torch

    from onnxtrain import ORTModule

    op = _op("_unsafe_masked_index_put_accumulate")
    fresh = harness.module_factory(op, harness.samples(op, 1)[0], "inputs")
    module, inputs, _ = fresh()
    model = ORTModule(module, backend="openvino")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # OpenVINO's threads follow torch's: on several its plugin raises instead (a fallback)
    try:
        got, want = model(*inputs), fresh()[0](*inputs)
    finally:
        torch.set_num_threads(threads)
    assert model.fallback_reason is not None and "OutputShapeError" in model.fallback_reason
    assert got.shape == want.shape


def test_attention_float_mask_rows_of_minus_inf_are_zeros_on_openvino():
    """The float attention mask's fully masked rows (capture.attention.finite_rows): zeros, as PyTorch's."""
    import torch

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    mask = torch.zeros(3, 3)
    mask[1] = float("-inf")
    model, got, want = _openvino_and_eager(Attention(), q, k, v, mask)
    assert model.fallback_reason is None
    torch.testing.assert_close(got, want.nan_to_num(0.0))  # eager: NaN or zeros there, by torch version
    assert not got[:, :, 1].any()
