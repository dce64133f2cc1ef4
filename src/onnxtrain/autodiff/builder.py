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
        for i, out in enumerate(node.outputs):
            out.name = self.fresh_name(f"{node.name}:{i}" if num_outputs > 1 else node.name)
        self.nodes.append(node)
        return list(node.outputs)
