"""``aten.cross_entropy_loss`` with ``label_smoothing`` or probability targets, as PyTorch computes them.

The exporter's translation (onnxscript's ``aten_cross_entropy_loss``) is one ``SoftmaxCrossEntropyLoss``: it
drops ``label_smoothing`` (a silently different loss: 0.886 where PyTorch gives 1.217 for 4 x 5 logits at
0.3) and assumes class indices, so probability targets made an invalid graph (``NegativeLogLikelihoodLoss``
of a float target). Here, with ``logp = log_softmax(input, class axis)`` and ``C`` classes:

- class indices, ``label_smoothing = 0``, reduced: the exporter's ``SoftmaxCrossEntropyLoss`` as before;
- class indices otherwise (``reduction="none"``, whose output the exporter declared 0-d, or
  ``label_smoothing = s > 0``): per element ``(1 - s) * nll + s / C * smooth`` with ``nll = -weight_t logp_t``
  and ``smooth = -sum_c weight_c logp_c``, both 0 where the target is ``ignore_index``; ``"mean"`` divides
  the sum by the summed weights of the targets not ignored (or their count), as PyTorch does;
- probabilities (a float target): ``target * (1 - s) + s / C``, then ``-sum_c weight_c target_c logp_c`` per
  element; ``"mean"`` divides by the number of elements (weights do not enter the divisor).

An unbatched input (``[C]``) gets a batch of one for the computation.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op

from onnxtrain.capture.constants import int64 as _int
from onnxtrain.capture.constants import scalar_like as _like

_NONE, _MEAN, _SUM = 0, 1, 2


def cross_entropy_loss(self, target, weight=None, reduction: int = _MEAN, ignore_index: int = -100,
                       label_smoothing: float = 0.0):
    """``cross_entropy_loss(Tensor self, Tensor target, Tensor? weight=None, int reduction=Mean,
    SymInt ignore_index=-100, float label_smoothing=0.0)``"""
    probabilities = target.dtype is not None and target.dtype.is_floating_point()
    if not probabilities and label_smoothing == 0.0 and reduction != _NONE:
        from onnxscript.function_libs.torch_lib.ops.nn import aten_cross_entropy_loss

        return aten_cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)
    unbatched = len(self.shape) == 1
    rank = max(len(self.shape), 2)
    if unbatched:
        self = op.Unsqueeze(self, _int([0]))
        target = op.Unsqueeze(target, _int([0]))
    logp = op.LogSoftmax(self, axis=1)
    classes = op.CastLike(op.Shape(self, start=1, end=2), self)
    weighted = logp if weight is None else op.Mul(logp, op.Reshape(weight, _int([1, -1] + [1] * (rank - 2))))
    if probabilities:
        if label_smoothing:
            target = op.Add(op.Mul(target, _like(1.0 - label_smoothing, target)),
                            op.Div(_like(label_smoothing, target), classes))
        loss = op.Neg(op.ReduceSum(op.Mul(weighted, target), _int([1]), keepdims=0))
        if reduction == _MEAN:
            loss = op.Div(op.ReduceSum(loss, keepdims=0), op.CastLike(op.Size(loss), loss))
        elif reduction == _SUM:
            loss = op.ReduceSum(loss, keepdims=0)
    else:
        ignored = op.Equal(target, op.CastLike(_int(ignore_index), target))
        safe = op.Where(ignored, op.CastLike(_int(0), target), target)
        picked = op.Squeeze(op.GatherElements(weighted, op.Unsqueeze(safe, _int([1])), axis=1), _int([1]))
        zero = _like(0.0, self)
        nll = op.Where(ignored, zero, op.Neg(picked))
        smooth = op.Where(ignored, zero, op.Neg(op.ReduceSum(weighted, _int([1]), keepdims=0)))
        loss = op.Add(op.Mul(_like(1.0 - label_smoothing, nll), nll),
                      op.Mul(op.Div(_like(label_smoothing, smooth), classes), smooth))
        if reduction == _MEAN:
            if weight is None:
                divisor = op.CastLike(op.ReduceSum(op.Cast(op.Not(ignored), to=ir.DataType.INT64), keepdims=0), self)
            else:
                chosen = op.Gather(weight, safe, axis=0)
                divisor = op.ReduceSum(op.Where(ignored, _like(0.0, chosen), chosen), keepdims=0)
            loss = op.Div(op.ReduceSum(loss, keepdims=0), divisor)
        elif reduction == _SUM:
            loss = op.ReduceSum(loss, keepdims=0)
    if unbatched and reduction == _NONE:
        loss = op.Squeeze(loss, _int([0]))
    return loss
