"""``aten.pad`` with ``mode="replicate"``, ``"reflect"`` or ``"circular"`` as a ``Gather`` of input positions.

The exporter translates them into onnxruntime's ``Pad`` (modes ``edge``, ``reflect``, ``wrap``), which
fails at run time where PyTorch does not: ``wrap`` is not implemented by the CPU kernel ("Unexpected mode of
3"), and with a negative pad ``Pad`` crops first and then pads what is left, so ``F.pad(x, (-4, 5),
"replicate")`` on 4 columns ("zero effective input extent") or ``F.pad(x, (2, -3), "reflect")`` on 5 (a
reflection wider than the 2 columns kept) fail, where PyTorch reads the positions from the whole axis.

Here output position ``i`` of a padded axis of size ``n`` with ``before`` pad ``p`` reads input position
``j = i - p``: clamped to ``[0, n - 1]`` (replicate) or reflected at both ends, ``(n - 1) - |(n - 1) - |j||``
(reflect); circular padding crops the negative pads first and reads the ``m`` positions kept at ``(i - p)
mod m``. All three as PyTorch defines them, negative pads included. The gradient is ``Gather``'s (a
scatter-add back to the positions read). Constant padding, and pads only known at run time, stay the
exporter's ``Pad``.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxscript import opset18 as op

from onnxtrain.capture.constants import int64 as _int


def pad(self, pad: Sequence[int], mode: str = "constant", value: float | None = None):
    """``pad(Tensor self, SymInt[] pad, str mode="constant", float? value=None)``"""
    if mode not in ("replicate", "reflect", "circular") or not all(isinstance(p, int) for p in pad):
        return _onnx_pad(self, pad, mode, value)
    rank = len(self.shape)
    x = self
    for k in range(len(pad) // 2):
        axis = rank - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        if before == 0 and after == 0:
            continue
        x = op.Gather(x, _positions(x, axis, before, after, mode), axis=axis)
    return x


def _positions(x, axis: int, before: int, after: int, mode: str):
    """The input positions (int64, 1-D) that the padded axis reads, in order."""
    size = op.Squeeze(op.Shape(x, start=axis, end=axis + 1), _int([0]))
    if mode != "circular":  # position i reads i - before, clamped or reflected at both ends
        raw = op.Range(_int(-before), op.Add(size, _int(after)), _int(1))
        last = op.Sub(size, _int(1))
        if mode == "replicate":
            return op.Clip(raw, _int(0), last)
        return op.Sub(last, op.Abs(op.Sub(last, op.Abs(raw))))
    # circular: negative pads crop first, then the kept m positions wrap: kept[(i - before) mod m]
    cut_before, cut_after = max(-before, 0), max(-after, 0)
    kept = op.Sub(size, _int(cut_before + cut_after))
    raw = op.Range(_int(-max(before, 0)), op.Add(kept, _int(max(after, 0))), _int(1))
    return op.Add(op.Mod(raw, kept), _int(cut_before))  # integer Mod takes the divisor's sign: in [0, m)


def _onnx_pad(self, pad, mode: str, value):
    """The exporter's own translation (onnxscript's ``aten_pad``)."""
    from onnxscript.function_libs.torch_lib.ops.nn import aten_pad

    return aten_pad(self, pad, mode, value)
