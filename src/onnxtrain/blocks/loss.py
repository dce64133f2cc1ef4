"""Loss blocks: small Python classes that append a scalar loss to a model graph, in standard ONNX ops.

A loss block declares the extra graph inputs it needs (the labels) and builds the loss from the model
outputs and those inputs with a :class:`~onnxtrain.autodiff.builder.GraphBuilder` (``op.Sub(x, y)``
emits a ``Sub`` node and returns its value). The gradient comes from the autodiff engine, so a custom
loss only states the forward math. A custom loss::

    from onnxtrain import artifacts

    class HuberLoss(artifacts.Loss):
        def __init__(self, delta=1.0):
            self.delta = delta

        def inputs(self, output):                      # one per model output the loss reads
            return [artifacts.LossInput.like(output, "target")]

        def build(self, op, output, target):          # model outputs first, then the inputs above
            err = op.Abs(op.Sub(output, target))
            delta = op.scalar(self.delta, like=output)
            quad = op.Min(err, delta)
            lin = op.Sub(err, quad)
            half = op.scalar(0.5, like=output)
            return op.ReduceMean(op.Add(op.Mul(half, op.Mul(quad, quad)), op.Mul(delta, lin)), keepdims=0)

    artifacts.generate_artifacts(model, requires_grad=[...], loss=HuberLoss(0.5), ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder, is_float

_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class LossInput:
    """An extra input of the training and eval models that the loss reads (labels, targets, weights).

    ``shape`` entries are ints, dimension names (``"batch"``) or ``None`` for unknown. Integer inputs
    may give ``bounds`` (low, high): the runtime refuses a value outside [low, high) other than ``ignore``,
    naming ``what`` the values are (docs/format.md, ``input_checks``).
    """

    name: str
    dtype: ir.DataType | str = "float32"
    shape: Sequence[int | str | None] | None = None
    bounds: tuple[int, int] | None = None
    ignore: int | None = None
    what: str = ""

    @classmethod
    def like(cls, value: ir.Value, name: str) -> LossInput:
        """An input with ``value``'s element type and shape (e.g. a regression target)."""
        return cls(name, value.dtype, _dims(value.shape))

    def to_value(self) -> ir.Value:
        """This input as an ``onnx_ir`` graph input value."""
        dtype = self.dtype if isinstance(self.dtype, ir.DataType) else _dtype_from_name(self.dtype)
        shape = None if self.shape is None else ir.Shape(list(self.shape))
        return ir.Value(name=self.name, type=ir.TensorType(dtype), shape=shape)


def _dtype_from_name(name: str) -> ir.DataType:
    try:
        return ir.DataType.from_numpy(np.dtype(name))
    except TypeError as exc:
        raise ValueError(f"unknown element type {name!r} for a loss input; use e.g. 'float32' or 'int64'") from exc


def _dims(shape: ir.Shape | None) -> list | None:
    if shape is None:
        return None
    return [d if isinstance(d, int) else getattr(d, "value", None) for d in shape]


class Loss:
    """Base class of loss blocks. Subclasses implement :meth:`build` and, if they read labels, :meth:`inputs`.

    ``build(op, *model_outputs, *extra_inputs)`` returns a scalar (rank-0) float value.
    """

    def inputs(self, *outputs: ir.Value) -> list[LossInput]:
        """The extra inputs the loss reads, given the model outputs it is applied to."""
        return []

    def build(self, op: GraphBuilder, *values: ir.Value) -> ir.Value:
        """Emit the loss nodes with ``op``; ``values`` are the model outputs read, then the inputs from
        :meth:`inputs`. Return the scalar loss value."""
        raise NotImplementedError(f"{type(self).__name__} must implement build(op, *outputs, *inputs)")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _SingleOutputLoss(Loss):
    """A built-in loss on one model output, reduced by ``mean`` or ``sum`` as in torch.nn."""

    def __init__(self, reduction: str = "mean"):
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS} (the training loss must be a scalar), "
                             f"got {reduction!r}")
        self.reduction = reduction

    def _reduce(self, op: GraphBuilder, x: ir.Value) -> ir.Value:
        return op.op("ReduceMean" if self.reduction == "mean" else "ReduceSum", x, keepdims=0)

    @staticmethod
    def _require_float(output: ir.Value, loss: str) -> None:
        if not is_float(output):
            raise TypeError(f"{loss} needs a floating-point model output; {output.name!r} has type {output.dtype}")


class _TargetLoss(_SingleOutputLoss):
    """A loss of the output against one extra input, ``target``, of the output's type and shape."""

    def __init__(self, reduction: str = "mean", target_name: str = "target"):
        super().__init__(reduction)
        self.target_name = target_name

    def inputs(self, output):
        return [LossInput.like(output, self.target_name)]


class MSELoss(_TargetLoss):
    """``mean((output - target)**2)``; the extra input ``target`` has the output's type and shape."""

    def build(self, op, output, target):
        """The mean (or summed) squared difference of ``output`` and ``target``."""
        self._require_float(output, "MSELoss")
        diff = op.Sub(output, target)
        return self._reduce(op, op.Mul(diff, diff))


class L1Loss(_TargetLoss):
    """``mean(|output - target|)``; the extra input ``target`` has the output's type and shape."""

    def build(self, op, output, target):
        """The mean (or summed) absolute difference of ``output`` and ``target``."""
        self._require_float(output, "L1Loss")
        return self._reduce(op, op.Abs(op.Sub(output, target)))


class CrossEntropyLoss(_SingleOutputLoss):
    """Softmax cross-entropy of logits ``[N, C, d1, ...]`` against int64 class labels ``[N, d1, ...]``.

    Same semantics as ``torch.nn.CrossEntropyLoss`` (class axis 1, optional per-class ``weight``,
    ``ignore_index``); emitted as one ``SoftmaxCrossEntropyLoss`` node. ``ignore_index`` defaults to
    None (no label ignored), as in ONNX Runtime Training.
    """

    def __init__(self, weight=None, reduction: str = "mean", ignore_index: int | None = None,
                 labels_name: str = "labels"):
        super().__init__(reduction)
        self.weight = None if weight is None else np.asarray(weight)
        self.ignore_index = ignore_index
        self.labels_name = labels_name

    def inputs(self, output):
        dims = _dims(output.shape)
        shape = None if dims is None else [dims[0], *dims[2:]]
        classes = dims[1] if dims is not None and len(dims) > 1 and isinstance(dims[1], int) else None
        bounds = None if classes is None else (0, classes)
        return [LossInput(self.labels_name, ir.DataType.INT64, shape, bounds, self.ignore_index,
                          f"class labels of CrossEntropyLoss ({classes} classes)")]

    def build(self, op, output, labels):
        """The cross-entropy of ``output`` (logits ``[N, C, ...]``) against class ``labels`` (PyTorch's
        ``cross_entropy``)."""
        self._require_float(output, "CrossEntropyLoss")
        if output.shape is not None and len(output.shape) < 2:
            raise ValueError(f"CrossEntropyLoss needs logits of rank >= 2 ([N, C, ...]); {output.name!r} has "
                             f"shape {list(output.shape)}")
        weight = None if self.weight is None else op.const(self.weight, dtype=output.dtype)
        return op.SoftmaxCrossEntropyLoss(output, labels, weight, reduction=self.reduction,
                                          ignore_index=self.ignore_index)


class BCEWithLogitsLoss(_TargetLoss):
    """``torch.nn.BCEWithLogitsLoss``: sigmoid and binary cross-entropy in one, numerically stable form.

    ``l = (1 - t) * x + (1 + (pos_weight - 1) * t) * (log(1 + exp(-|x|)) + max(-x, 0))``, times ``weight``.
    """

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None, target_name: str = "target"):
        super().__init__(reduction, target_name)
        self.weight = None if weight is None else np.asarray(weight)
        self.pos_weight = None if pos_weight is None else np.asarray(pos_weight)

    def build(self, op, x, t):
        """The binary cross-entropy of logits ``x`` against targets ``t`` (see the class docstring), reduced."""
        self._require_float(x, "BCEWithLogitsLoss")
        one = op.scalar(1.0, like=x)
        softplus_neg_abs = op.Log(op.Add(one, op.Exp(op.Neg(op.Abs(x)))))
        tail = op.Add(softplus_neg_abs, op.Relu(op.Neg(x)))  # = log(1 + exp(-x)), stable
        head = op.Mul(op.Sub(one, t), x)
        if self.pos_weight is not None:
            pw = op.const(self.pos_weight, dtype=x.dtype)
            tail = op.Mul(op.Add(one, op.Mul(op.Sub(pw, one), t)), tail)
        loss = op.Add(head, tail)
        if self.weight is not None:
            loss = op.Mul(loss, op.const(self.weight, dtype=x.dtype))
        return self._reduce(op, loss)


__all__ = ["BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "Loss", "LossInput", "MSELoss"]
