"""Checks of a step's inputs before onnxruntime sees them, so that bad data gets an error naming the input
and the bad value, once (instead of a kernel's error, logged once more in red, or a silently wrong loss).

Two kinds of checks:

- shapes, from the model's declared input shapes: the rank, fixed sizes, and named (symbolic) sizes,
  which must agree across inputs (``x`` [batch, 16] and ``labels`` [batch]: 4 rows of ``x`` need 4 labels);
- index ranges, from the training model's metadata ``input_checks`` (docs/format.md): class labels of a
  cross-entropy loss in [0, classes) unless equal to its ignore_index, token ids in a table's range.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


def _dims(value) -> tuple[int, ...]:
    return tuple(value.shape()) if isinstance(value, ort.OrtValue) else value.shape


class InputChecker:
    def __init__(self, session: ort.InferenceSession, names: list[str], ranges: dict[str, dict]):
        declared = {i.name: i.shape for i in session.get_inputs()}
        self.shapes = {n: declared.get(n) for n in names}
        self.ranges = {n: r for n, r in ranges.items() if n in self.shapes}

    def check(self, arrays: dict) -> None:
        self._check_shapes(arrays)
        for name, spec in self.ranges.items():
            value = arrays[name]
            if not isinstance(value, ort.OrtValue):
                _check_range(name, value, spec)

    def _check_shapes(self, arrays: dict) -> None:
        seen: dict[str, tuple[str, int, int]] = {}  # symbolic dim -> (input, axis, size)
        for name, value in arrays.items():
            want, have = self.shapes.get(name), _dims(value)
            if want is None:
                continue
            if len(want) != len(have):
                raise ValueError(f"input {name!r} must have {len(want)} dimensions {_show(want)}, got shape "
                                 f"{list(have)}")
            for axis, (w, h) in enumerate(zip(want, have)):
                if isinstance(w, int) and w >= 0 and w != h:
                    raise ValueError(f"input {name!r} must have size {w} on axis {axis} (shape {_show(want)}), "
                                     f"got shape {list(have)}")
                if isinstance(w, str) and w:
                    first = seen.setdefault(w, (name, axis, h))
                    if first[2] != h:
                        raise ValueError(f"input {name!r} has {h} on axis {axis} but input {first[0]!r} has "
                                         f"{first[2]} on axis {first[1]}; the model needs them equal ({w!r})")


def _show(shape) -> str:
    return "[" + ", ".join(str(d) if d not in (None, "") else "?" for d in shape) + "]"


def _check_range(name: str, array: np.ndarray, spec: dict) -> None:
    """Values of ``array`` must lie in [low, high) or equal ``ignore``; raise naming the first bad one."""
    if array.size == 0:
        return
    low, high, ignore = spec["low"], spec["high"], spec.get("ignore")
    if array.min() >= low and array.max() < high:
        return
    bad = (array < low) | (array >= high)
    if ignore is not None:
        bad &= array != ignore
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        also = f" (or {ignore}, ignored)" if ignore is not None else ""
        raise ValueError(f"input {name!r} has value {int(array[index])} at {list(index)}, out of range: "
                         f"{spec['what']} must lie in [{low}, {high}){also}")
