"""A tiny node emitter: ``b.Mul(x, y)`` appends a Mul node and returns its output ``ir.Value``.

Gradient rules and the engine build every new node through a :class:`GraphBuilder`, which
- turns Python ints/lists and numpy arrays given as inputs into (deduplicated) constants,
- names every new value and node uniquely against the names already in the graph,
- records the nodes in creation order (which is a valid topological order) for the caller to insert.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
)


def is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in FLOAT_TYPES


_BOOL_OPS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or",
                       "Xor", "IsNaN", "IsInf"})
_INT64_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
# Ops whose output type is neither the first input's nor fixed: left unknown rather than guessed.
_UNTYPED_OPS = frozenset({"Scan", "Loop", "If", "EyeLike", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                          "Bernoulli", "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
# Multi-output ops whose outputs do not all share the first input's type.
_OUTPUT_TYPES = {"TopK": (None, ir.DataType.INT64), "MaxPool": (None, ir.DataType.INT64),
                 "Dropout": (None, ir.DataType.BOOL), "Unique": (None, ir.DataType.INT64,
                                                                  ir.DataType.INT64, ir.DataType.INT64)}


def _output_dtypes(op_type: str, inputs, attrs, num_outputs: int) -> list[ir.DataType | None]:
    """Element types of a new node's outputs, so rules can make constants ``like`` any value."""
    first = inputs[0].dtype if inputs and inputs[0] is not None else None
    if op_type in _BOOL_OPS:
        return [ir.DataType.BOOL]
    if op_type in _INT64_OPS:
        return [ir.DataType.INT64]
    if op_type == "Cast":
        return [ir.DataType(attrs["to"])]
    if op_type == "CastLike":
        return [inputs[1].dtype]
    if op_type in ("Constant", "ConstantOfShape"):
        value = attrs.get("value")
        return [value.dtype if value is not None else ir.DataType.FLOAT]
    if op_type == "Where":
        return [inputs[1].dtype]
    if op_type == "OneHot":
        return [inputs[2].dtype]
    if op_type in _UNTYPED_OPS:
        return [None] * num_outputs
    if op_type in _OUTPUT_TYPES:
        return [t if t is not None else first for t in _OUTPUT_TYPES[op_type]][:num_outputs]
    return [first] * num_outputs


class GraphBuilder:
    def __init__(self, taken_names: Iterable[str] = (), prefix: str = "grad", opset: int = 17):
        self.nodes: list[ir.Node] = []
        self.opset = opset
        self._taken = set(taken_names)
        self._prefix = prefix
        self._counter = 0
        self._consts: dict[tuple, ir.Value] = {}
        self.scope = ""  # prefix for node names, e.g. the forward node being differentiated

    # -- naming ---------------------------------------------------------------------------
    def fresh_name(self, hint: str) -> str:
        name = hint
        while name in self._taken:
            self._counter += 1
            name = f"{hint}_{self._counter}"
        self._taken.add(name)
        return name

    def reserve(self, name: str) -> None:
        self._taken.add(name)

    # -- constants ------------------------------------------------------------------------
    def const(self, value, dtype: ir.DataType | None = None) -> ir.Value:
        """A Constant node holding ``value`` (cast to ``dtype`` if given); equal constants are shared."""
        if dtype is not None:
            array = np.asarray(value, dtype=dtype.numpy())
        else:
            array = np.asarray(value)
            if array.dtype == np.float64 and not isinstance(value, np.ndarray):
                raise TypeError("float constants need an explicit dtype (use like=...)")
            if array.dtype.kind in "iu" and not isinstance(value, np.ndarray):
                array = array.astype(np.int64)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            tensor = ir.tensor(array, name=self.fresh_name(f"{self._prefix}/const"))
            out = self._emit("Constant", [], {"value": tensor}, domain="", num_outputs=1)[0]
            out.const_value = tensor
            self._consts[key] = out
        return self._consts[key]

    def scalar(self, value: float, like: ir.Value) -> ir.Value:
        """A rank-0 constant of ``like``'s element type."""
        if like.dtype is None:
            raise TypeError(f"the element type of {like.name!r} is unknown; make the constant like a typed value")
        return self.const(value, dtype=like.dtype)

    def ints(self, values: Sequence[int] | int) -> ir.Value:
        return self.const(np.asarray(values, dtype=np.int64))

    # -- ops ------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs, domain: str = "", num_outputs: int = 1, **attributes):
        """Append a node; returns its output value, or a tuple when ``num_outputs > 1``."""
        values = [self._as_value(i) for i in inputs]
        # Trailing omitted optional inputs are dropped; inner ones stay as empty inputs.
        while values and values[-1] is None:
            values.pop()
        attrs = {k: v for k, v in attributes.items() if v is not None}
        outs = self._emit(op_type, values, attrs, domain=domain, num_outputs=num_outputs)
        return outs[0] if num_outputs == 1 else tuple(outs)

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    def _as_value(self, x):
        if x is None or isinstance(x, ir.Value):
            return x
        if isinstance(x, np.ndarray):
            return self.const(x)
        if isinstance(x, (int, np.integer)) or (
            isinstance(x, (list, tuple)) and all(isinstance(i, (int, np.integer)) for i in x)
        ):
            return self.ints(x)
        raise TypeError(f"cannot use {type(x).__name__} as an op input; wrap floats with b.scalar(v, like=x)")

    def _emit(self, op_type, inputs, attrs, *, domain, num_outputs) -> list[ir.Value]:
        node = ir.Node(
            domain,
            op_type,
            inputs,
            attributes=ir.convenience.convert_attributes(attrs),
            num_outputs=num_outputs,
            name=self.fresh_name(f"{self.scope or self._prefix}/{op_type}"),
        )
        dtypes = _output_dtypes(op_type, inputs, attrs, num_outputs) if not domain else [None] * num_outputs
        for i, out in enumerate(node.outputs):
            out.name = self.fresh_name(f"{node.name}:{i}" if num_outputs > 1 else node.name)
            if i < len(dtypes) and dtypes[i] is not None:
                out.dtype = dtypes[i]
        self.nodes.append(node)
        return list(node.outputs)
