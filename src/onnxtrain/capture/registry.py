"""torch.onnx's registry of ATen-to-ONNX translations, with each op's entries built on first lookup.

The exporter builds its registry afresh for every export: for each of the ~560 torchlib functions it
compiles the function's source to ONNX IR (only to read its domain) and infers its ONNX signature. That
is 0.5-0.7 s of the first step, for a model that uses a few dozen ops. :func:`lazy_registry` makes a
registry with the same keys whose entries are built when the exporter first looks an op up, with the
same contents and order as ``ONNXRegistry.from_torchlib`` gives (``tests/ortmodule/test_capture.py``
compares every op of the two).

This reaches into the exporter's internals; :func:`lazy_registry` raises if they are not as expected, and
the caller then lets the exporter build its registry as usual.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("onnxtrain.capture")


def registry_key(target) -> str | Callable:
    """The registry's key for an FX call target: an OpOverload's qualified name ("aten::add.Tensor"), else
    the callable itself (as ``ONNXRegistry.get_decomps`` looks them up)."""
    return target.name() if isinstance(target, torch._ops.OpOverload) else target


class _LazyFunctions(dict):
    """``ONNXRegistry.functions``: key -> list of ``OnnxDecompMeta``, each list built on first access."""

    def __init__(self, pending: dict, build: Callable[[list], list]):
        super().__init__(dict.fromkeys(pending))
        self._pending = pending
        self._build = build

    def _ready(self, key) -> None:
        if key in self._pending:
            built = self._build(self._pending.pop(key))
            if built:
                dict.__setitem__(self, key, built)
            else:  # every entry failed to build: as if never registered
                dict.__delitem__(self, key)

    def _all_ready(self) -> None:
        for key in list(self._pending):
            self._ready(key)

    def __getitem__(self, key):
        self._ready(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._ready(key)
        return dict.get(self, key, default)

    def setdefault(self, key, default=None):
        self._ready(key)
        return dict.setdefault(self, key, default)

    def pop(self, key, *default):
        self._ready(key)
        return dict.pop(self, key, *default)

    def values(self):
        self._all_ready()
        return dict.values(self)

    def items(self):
        self._all_ready()
        return dict.items(self)

    def __repr__(self) -> str:
        return f"_LazyFunctions({len(self)} ops, {len(self._pending)} not built yet)"


def lazy_registry(cls, opset_version: int):
    """An ``ONNXRegistry`` (``cls``) for ``opset_version`` equal to ``cls.from_torchlib(opset_version)``."""
    from onnxscript.function_libs.torch_lib import ops as _ops  # noqa: F401 - registers torchlib's functions
    from onnxscript.function_libs.torch_lib.registration import default_registry
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    meta_type = _registration.OnnxDecompMeta
    default_opset = {f.name: f.default for f in dataclasses.fields(meta_type)}["opset_introduced"]

    # from_torchlib's order: torch's own translations, then torchlib's (overloads, then complex ones).
    pending: dict = {}
    for meta in _torchlib_registry.get_torchlib_ops():
        pending.setdefault(registry_key(meta.fx_target), []).append(meta)
    for qualified_name, functions in default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        target = _registration._get_overload(qualified_name)
        if target is None:
            continue
        entries = pending.setdefault(registry_key(target), [])
        entries.extend((target, f, False) for f in functions.overloads)
        entries.extend((target, f, True) for f in functions.complex)

    def opset_of(entry) -> int:
        return entry.opset_introduced if isinstance(entry, meta_type) else default_opset

    def keep(entries: list) -> list:
        """``_cleanup_registry_based_on_opset_version``: the newest entries valid at this opset."""
        valid = [e for e in entries if opset_of(e) <= opset_version]
        newest = max((opset_of(e) for e in valid), default=None)
        return [e for e in valid if opset_of(e) == newest]

    def build(entries: list) -> list:
        metas = []
        for entry in entries:
            if isinstance(entry, meta_type):
                metas.append(entry)
                continue
            target, function, is_complex = entry
            try:  # as from_torchlib: a function whose signature cannot be inferred is skipped
                metas.append(meta_type(onnx_function=function, fx_target=target, signature=None, is_custom=False,
                                       is_complex=is_complex))
            except Exception:
                logger.exception("Failed to register '%s'. Skipped", target)
        return metas

    kept = {key: entries for key, entries in ((k, keep(v)) for k, v in pending.items()) if entries}
    registry = cls()
    registry._opset_version = opset_version
    registry.functions = _LazyFunctions(kept, build)
    return registry
