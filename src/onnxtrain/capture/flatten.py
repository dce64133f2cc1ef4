"""Flatten nested Python structures of tensors into a flat tensor list plus a hashable spec, and back.

Inputs and outputs of a ``torch.nn.Module`` may be tensors, tuples, lists, dicts, Hugging Face
``ModelOutput``s (ordered mappings), plain values (``None``, bools, ints, floats, strings) and any class
registered as a ``torch.utils._pytree`` node. Hugging Face's ``DynamicCache`` (what a causal LM returns
as ``past_key_values`` unless ``use_cache=False``; encoder-decoders name it ``cache`` from transformers 5.24)
is registered on first sight, the way transformers does it for ``torch.export``. The spec records
everything but the tensors, so it can key a cache: two calls with the same spec can share one exported
graph. Plain values are part of the spec, which is why a new ``bool`` argument means a new graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

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


@dataclass(frozen=True)
class Node_:
    """A registered pytree node: its children, and its context (compared in a hashable form)."""

    kind: type
    key: Any  # the context made hashable
    items: tuple
    context: Any = field(compare=False, hash=False)


LEAF = Leaf()
Spec = Leaf | Constant | Sequence_ | Mapping_ | Node_


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
    node = _pytree_node(obj)
    if node is not None:
        children, context = node.flatten_fn(obj)
        items = tuple(_flatten(v, tensors, f"{path}.<{i}>") for i, v in enumerate(children))
        return Node_(type(obj), _hashable(context), items, context)
    hint = " (a model cache: pass use_cache=False to train)" if "Cache" in type(obj).__name__ else ""
    raise UnsupportedStructureError(
        f"{path} has type {type(obj).__name__}{hint}; ORTModule takes and returns tensors, tuples, lists, dicts, "
        "ModelOutputs, plain values (None, bool, int, float, str) and torch.utils._pytree nodes. Convert it "
        "to one of those."
    )


def _pytree_node(obj: Any):
    """``obj``'s torch pytree registration, if any; transformers' ``DynamicCache`` is registered on first
    sight with transformers' own functions (written for ``torch.export``)."""
    node = pytree.SUPPORTED_NODES.get(type(obj))
    if node is None and type(obj).__name__ == "DynamicCache" and type(obj).__module__.startswith("transformers."):
        try:
            from transformers.integrations.executorch import (
                register_dynamic_cache_export_support,
            )
            register_dynamic_cache_export_support()
        except Exception:  # noqa: BLE001 - an older or newer transformers: unsupported, said below
            return None
        node = pytree.SUPPORTED_NODES.get(type(obj))
    return node


def _hashable(context: Any) -> Any:
    if isinstance(context, (list, tuple)):
        return tuple(_hashable(c) for c in context)
    if isinstance(context, dict):
        return tuple((k, _hashable(v)) for k, v in context.items())
    try:
        hash(context)
    except TypeError:
        return repr(context)
    return context


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
    if isinstance(spec, Node_):
        return pytree.SUPPORTED_NODES[spec.kind].unflatten_fn([_unflatten(it, s) for s in spec.items], spec.context)
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
    elif isinstance(spec, Node_):
        for i, s in enumerate(spec.items):
            _leaf_paths(s, f"{path}.<{i}>", paths)
