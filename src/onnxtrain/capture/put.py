"""``aten.put``: ``self.put(index, source, accumulate)`` writes (or adds) ``source`` at the positions ``index``
names in ``self`` flattened. The exporter has no translation; this is a ``ScatterElements`` over the flattened
tensor (``reduction="add"`` when accumulating), negative indices counted from the end as PyTorch does. Which of
several writes to one position wins without ``accumulate`` is unspecified in PyTorch, as in ONNX.
"""

from __future__ import annotations

from onnxscript import opset18 as op


def put(self, index, source, accumulate: bool = False):
    """``put(Tensor self, Tensor index, Tensor source, bool accumulate=False) -> Tensor``"""
    flat = op.Constant(value_ints=[-1])
    values = op.Reshape(self, flat)
    index = op.Reshape(index, flat)
    size = op.Size(self)
    index = op.Where(op.Less(index, op.Constant(value_int=0)), op.Add(index, size), index)
    out = op.ScatterElements(values, index, op.Reshape(source, flat), axis=0,
                             reduction="add" if accumulate else "none")
    return op.Reshape(out, op.Shape(self))
