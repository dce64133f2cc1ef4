"""Parameters in and out of an on-device checkpoint, by name: what a federated client exchanges.

numpy only (no torch, no onnx, no flwr), so a device can run it.

    spec = ParameterSpec.of(state)                  # names, shapes, dtypes of the trainable parameters
    arrays = get_parameters(state)                  # {name: ndarray}, checkpoint order, copies
    set_parameters(state, arrays)                   # checked against spec: names, order, shape, dtype

The flat forms of the runtime (``Module.get_contiguous_parameters`` / ``copy_buffer_to_parameters``)
carry no names: a buffer from another model of the same size would load silently. Exchanging
``{name: array}`` (Flower's ``ArrayRecord`` keeps the names) lets the receiver check what it gets, and
a mismatch is an error that names the first parameter at fault.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


class ParameterMismatchError(ValueError):
    """Received parameters do not match this model's: other names, order, shapes or element types."""


@dataclass(frozen=True)
class ParameterSpec:
    """The names, shapes and element types of a checkpoint's (trainable) parameters, in checkpoint order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @staticmethod
    def of(state, trainable_only: bool = True) -> ParameterSpec:
        """The spec of a :class:`onnxtrain.api.CheckpointState`."""
        params = state.parameters
        names = [n for n in params if not trainable_only or params[n].requires_grad]
        if not names:
            raise ValueError("the checkpoint has no trainable parameters to exchange"
                             if trainable_only else "the checkpoint has no parameters")
        arrays = [params[n].data for n in names]
        return ParameterSpec(tuple(names), tuple(a.shape for a in arrays), tuple(a.dtype.name for a in arrays))

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))

    def check(self, arrays: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> list[np.ndarray]:
        """``arrays`` in this spec's order, or a :class:`ParameterMismatchError` naming what differs.

        A mapping is checked by name (its order must be this spec's: Flower keeps it); a sequence has
        no names and is checked by position, shape and type.
        """
        if isinstance(arrays, Mapping):
            got = list(arrays)
            if got != list(self.names):
                missing = [n for n in self.names if n not in arrays]
                extra = [n for n in got if n not in self.names]
                if missing or extra:
                    what = [f"parameters {_few(extra)} that this model does not have"] if extra else []
                    what += [f"no {_few(missing)}, which this model has"] if missing else []
                    raise ParameterMismatchError(
                        f"received {' and '.join(what)} ({len(got)} received, {len(self.names)} expected): the "
                        "sender trains another model or another set of parameters")
                first = next(i for i, (a, b) in enumerate(zip(got, self.names)) if a != b)
                raise ParameterMismatchError(
                    f"received the parameters in another order: position {first} holds {got[first]!r}, this "
                    f"model has {self.names[first]!r} there")
            values = [np.asarray(arrays[n]) for n in self.names]
        else:
            values = [np.asarray(a) for a in arrays]
            if len(values) != len(self.names):
                raise ParameterMismatchError(
                    f"received {len(values)} arrays ({sum(v.size for v in values)} elements); this model has "
                    f"{len(self.names)} parameters ({self.size} elements): {_few(list(self.names))}")
        for name, shape, dtype, value in zip(self.names, self.shapes, self.dtypes, values):
            if value.shape != shape:
                raise ParameterMismatchError(f"parameter {name!r} has shape {list(shape)} in this model; received "
                                             f"shape {list(value.shape)}")
            if value.dtype.name != dtype:
                raise ParameterMismatchError(f"parameter {name!r} is {dtype} in this model; received {value.dtype}")
        return values


def _few(names: list[str], n: int = 5) -> str:
    return repr(names[:n])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > n else "]")


def get_parameters(state, trainable_only: bool = True) -> dict[str, np.ndarray]:
    """Copies of the parameters by name, in checkpoint order (the trainable ones unless told otherwise)."""
    params = state.parameters
    return {n: params[n].data for n in params if not trainable_only or params[n].requires_grad}


def set_parameters(state, arrays: Mapping[str, np.ndarray] | Sequence[np.ndarray],
                   trainable_only: bool = True) -> None:
    """Copy received parameters into ``state`` after checking names, order, shapes and types (all or none)."""
    spec = ParameterSpec.of(state, trainable_only)
    values = spec.check(arrays)
    params = state.parameters
    for name, value in zip(spec.names, values):
        params[name].data = value


__all__ = ["ParameterMismatchError", "ParameterSpec", "get_parameters", "set_parameters"]
