"""Dynamic loss scaling for fp16 artifacts, as ``torch.amp.GradScaler`` (same defaults and names).

The training model differentiates ``loss * loss_scale`` (the gradient seed is the scale), so the fp16
products of the backward see gradients large enough not to underflow; it returns the scaled gradients in
float32. The optimizer model then, in one call:

- unscales the gradients (``g / loss_scale``) and checks them all for inf/NaN;
- if any is not finite, leaves the parameters and optimizer states as they are (the step is skipped) and
  multiplies the scale by ``backoff_factor``, resetting the good-step count;
- else updates them with the unscaled gradients and counts a good step; after ``growth_interval`` good steps
  in a row the scale is multiplied by ``growth_factor`` (unless that would be inf) and the count restarts.

The scale and the good-step count are an input/output pair of the optimizer model (``loss_scale``,
``good_steps`` in, ``loss_scale.out``, ``good_steps.out`` out) and live in the checkpoint (docs/format.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder


@dataclass
class LossScaler:
    """The loss-scaling policy; defaults are ``torch.amp.GradScaler``'s."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (self.init_scale > 0 and np.isfinite(self.init_scale)):
            raise ValueError(f"LossScaler init_scale must be a finite number > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"LossScaler growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"LossScaler backoff_factor must lie in (0, 1), got {self.backoff_factor}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"LossScaler growth_interval must be an int >= 1, got {self.growth_interval!r}")

    def to_json(self) -> dict:
        """The policy as the artifacts' metadata records it (``loss_scaling``, docs/format.md)."""
        return asdict(self)


def found_inf(op: GraphBuilder, grads: list[ir.Value]) -> ir.Value:
    """A bool scalar: some element of ``grads`` is inf or NaN (``g * 0`` is NaN exactly there, and a sum
    with a NaN is NaN)."""
    sums = []
    for g in grads:
        zero = op.const(np.zeros((), dtype=g.dtype.numpy()))
        sums.append(op.Cast(op.ReduceSum(op.Mul(g, zero), keepdims=0), to=ir.DataType.FLOAT))
    return op.IsNaN(sums[0] if len(sums) == 1 else op.Sum(*sums))


def update_scale(op: GraphBuilder, scaler: LossScaler, scale: ir.Value, good: ir.Value,
                 inf: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The new (scale, good-step count) after a step that found ``inf`` or not (GradScaler.update)."""
    f = lambda x: op.const(np.array(x, np.float32))  # noqa: E731
    i = lambda x: op.const(np.array(x, np.int64))  # noqa: E731
    counted = op.Add(good, i(1))
    grow = op.GreaterOrEqual(counted, i(scaler.growth_interval))
    grown = op.Mul(scale, f(scaler.growth_factor))
    grown = op.Where(op.IsInf(grown), scale, grown)
    new_scale = op.Where(inf, op.Mul(scale, f(scaler.backoff_factor)), op.Where(grow, grown, scale))
    new_good = op.Where(op.Or(inf, grow), i(0), counted)
    return new_scale, new_good


__all__ = ["LossScaler", "found_inf", "update_scale"]
