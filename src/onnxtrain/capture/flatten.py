"""Flatten nested Python structures of tensors into a flat tensor list plus a hashable spec, and back.

Inputs and outputs of a ``torch.nn.Module`` may be tensors, tuples, lists, dicts, Hugging Face
``ModelOutput``s (ordered mappings) and plain values (``None``, bools, ints, floats, strings). The spec
records everything but the tensors, so it can key a cache: two calls with the same spec can share one
exported graph. Plain values are part of the spec, which is why a new ``bool`` argument means a new graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class Leaf:
    """A tensor slot in a spec."""


@dataclass(frozen=True)
class Constant:
    value: Any
    kind: type = object  # part of equality: 1 and True must not share a cache entry


@dataclass(frozen=True)
class Sequence_:
    kind: type  # tuple or list (or a namedtuple class)
    items: tuple


@dataclass(frozen=True)
class Mapping_:
    kind: type  # dict, OrderedDict, a ModelOutput subclass, ...
    keys: tuple
    items: tuple


LEAF = Leaf()
Spec = Leaf | Constant | Sequence_ | Mapping_


class UnsupportedStructureError(TypeError):
    pass


def flatten(obj: Any, path: str = "input") -> tuple[list[torch.Tensor], Spec]:
    """Return the tensors of ``obj`` in depth-first order and the spec that rebuilds it."""
    tensors: list[torch.Tensor] = []
    spec = _flatten(obj, tensors, path)
    return tensors, spec


def _flatten(obj: Any, tensors: list[torch.Tensor], path: str) -> Spec:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return LEAF
    if isinstance(obj, _CONSTANT_TYPES):
        return Constant(obj, type(obj))
    if isinstance(obj, Mapping):
        keys = tuple(obj.keys())
        items = tuple(_flatten(obj[k], tensors, f"{path}[{k!r}]") for k in keys)
        return Mapping_(type(obj), keys, items)
    if isinstance(obj, (tuple, list)):
        items = tuple(_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj))
        return Sequence_(type(obj), items)
    raise UnsupportedStructureError(
        f"{path} is a {type(obj).__name__}; ORTModule takes and returns tensors, tuples, lists, dicts, "
        "ModelOutputs and plain values (None, bool, int, float, str). Convert it to one of those."
    )


def unflatten(tensors: list[torch.Tensor] | tuple, spec: Spec) -> Any:
    """Rebuild the structure described by ``spec`` with ``tensors`` in its tensor slots."""
    it = iter(tensors)
    result = _unflatten(it, spec)
    if next(it, None) is not None:
        raise ValueError("more tensors than the spec has slots")
    return result


def _unflatten(it, spec: Spec) -> Any:
    if spec is LEAF or isinstance(spec, Leaf):
        return next(it)
    if isinstance(spec, Constant):
        return spec.value
    if isinstance(spec, Sequence_):
        values = [_unflatten(it, s) for s in spec.items]
        if spec.kind in (tuple, list):
            return spec.kind(values)
        if hasattr(spec.kind, "_fields"):  # namedtuple
            return spec.kind(*values)
        return spec.kind(values)
    if isinstance(spec, Mapping_):
        values = {k: _unflatten(it, s) for k, s in zip(spec.keys, spec.items)}
        return spec.kind(**values) if _takes_kwargs(spec.kind) else spec.kind(values)
    raise TypeError(f"not a spec: {spec!r}")


def _takes_kwargs(kind: type) -> bool:
    # dataclass-like mappings (ModelOutput) are built from keyword arguments; plain dicts from a dict
    return kind not in (dict,) and hasattr(kind, "__dataclass_fields__")


def count_leaves(spec: Spec) -> int:
    if isinstance(spec, Leaf):
        return 1
    if isinstance(spec, Constant):
        return 0
    return sum(count_leaves(s) for s in spec.items)


def leaf_paths(spec: Spec, root: str = "") -> list[str]:
    """Readable names for the tensor slots, e.g. ``x``, ``labels``, ``out[0]``, ``out['logits']``."""
    paths: list[str] = []
    _leaf_paths(spec, root, paths)
    return paths


def _leaf_paths(spec: Spec, path: str, paths: list[str]) -> None:
    if isinstance(spec, Leaf):
        paths.append(path)
    elif isinstance(spec, Sequence_):
        for i, s in enumerate(spec.items):
            _leaf_paths(s, f"{path}[{i}]", paths)
    elif isinstance(spec, Mapping_):
        for k, s in zip(spec.keys, spec.items):
            _leaf_paths(s, f"{path}.{k}" if path else str(k), paths)
