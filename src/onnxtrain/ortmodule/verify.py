"""Verification mode (``DebugOptions(verify=True)`` or ``ONNXTRAIN_VERIFY=1``): the first batch through each
new graph runs through PyTorch eager too, and outputs and gradients are compared.

:func:`first_difference` runs both on the same batch from the same RNG state and buffer values, each
differentiated with ``torch.autograd.grad`` along the same random output gradients (so no ``.grad`` is
touched), and returns the first output or gradient that differs, or ``None``. Its cost, paid once per
graph: one more forward and backward in onnxruntime and one in eager (docs/ortmodule.md has measurements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch



class VerificationError(RuntimeError):
    """onnxruntime's result on the first batch of a graph differs from PyTorch eager's."""


OUTPUT_RTOL = 1e-4  # of the largest magnitude in the eager tensor; float32 sums in another order
GRAD_RTOL = 1e-3  # gradients sum over more terms
ATOL = 1e-5


def first_difference(run_ort: Callable[[], list[torch.Tensor]], run_eager: Callable[[], list[torch.Tensor]],
                     names: list[str], wrt: list[torch.Tensor], wrt_names: list[str]) -> str | None:
    """Where onnxruntime and eager disagree: ``"output <name>: ..."``, ``"gradient of <name>: ..."`` or None.

    ``run_ort`` and ``run_eager`` return the flat user outputs (``names``: one per output); ``wrt`` are the
    tensors (inputs, parameters) whose gradients are compared, named by ``wrt_names``. The caller restores
    what the two runs change (buffers, the RNG state) before each."""
    ort_out, eager_out = run_ort(), run_eager()
    if len(ort_out) != len(eager_out):
        return f"outputs: onnxruntime returns {len(ort_out)} tensors, PyTorch {len(eager_out)}"
    for name, got, want in zip(names, ort_out, eager_out):
        problem = _differs(got, want, OUTPUT_RTOL)
        if problem:
            return f"output {name}: {problem}"
    pairs = [(g, w) for g, w in zip(ort_out, eager_out) if g.requires_grad and w.requires_grad]
    if not wrt or not pairs:
        return None
    generator = torch.Generator(device=pairs[0][1].device).manual_seed(0)
    seeds = [torch.randn(w.shape, dtype=w.dtype, device=w.device, generator=generator) for _, w in pairs]
    got_grads = torch.autograd.grad([g for g, _ in pairs], wrt, seeds, allow_unused=True)
    want_grads = torch.autograd.grad([w for _, w in pairs], wrt, seeds, allow_unused=True)
    for name, tensor, got, want in zip(wrt_names, wrt, got_grads, want_grads):
        got = torch.zeros_like(tensor) if got is None else got
        want = torch.zeros_like(tensor) if want is None else want
        problem = _differs(got, want, GRAD_RTOL)
        if problem:
            return f"gradient of {name}: {problem}"
    return None


def _differs(got: torch.Tensor, want: torch.Tensor, rtol: float) -> str | None:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} in onnxruntime, {tuple(want.shape)} in PyTorch"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} in onnxruntime, {want.dtype} in PyTorch"
    if not (got.is_floating_point() or got.is_complex()):
        return None if torch.equal(got, want) else "values differ"
    got, want = got.detach(), want.detach()
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        return "NaN where PyTorch has none, or the other way round"
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)]) or \
            not torch.equal(torch.isfinite(got), finite):
        return "infinities differ"
    if not finite.any():
        return None
    err = (got[finite] - want[finite]).abs().max().item()
    scale = want[finite].abs().max().item()
    if err > rtol * scale + ATOL:
        return f"off by {err:.3g} (largest magnitude {scale:.3g})"
    return None
