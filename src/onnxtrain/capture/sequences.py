"""``aten.atleast_{1,2,3}d.Sequence`` (``hstack``, ``vstack``, ``dstack``, ``column_stack``) as one reshape per tensor.

The exporter's translation puts the tensors in an ONNX sequence and maps a subgraph over it
(``SequenceConstruct`` -> ``SequenceMap`` -> ``SequenceAt``), which no gradient rule differentiates, so the
module fell back. Each tensor's rank is known at capture time, so the same reshape is applied to each
tensor directly and the op returns a tuple of tensors; the exporter indexes a tuple without ``SequenceAt``.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxscript.function_libs.torch_lib.ops import core
from onnxscript.function_libs.torch_lib.tensor_typing import TTensor


def atleast_1d_sequence(tensors: Sequence[TTensor]):
    """``atleast_1d.Sequence(Tensor[] tensors) -> Tensor[]``"""
    return tuple(core.aten_atleast_1d(t) for t in tensors)


def atleast_2d_sequence(tensors: Sequence[TTensor]):
    """``atleast_2d.Sequence(Tensor[] tensors) -> Tensor[]``"""
    return tuple(core.aten_atleast_2d(t) for t in tensors)


def atleast_3d_sequence(tensors: Sequence[TTensor]):
    """``atleast_3d.Sequence(Tensor[] tensors) -> Tensor[]``"""
    return tuple(core.aten_atleast_3d(t) for t in tensors)
