"""The plain Python values a forward reads from its modules, which export freezes into the graph.

``self.scale = 0.5`` read as ``x * self.scale`` is a constant in the exported graph. PyTorch reads it again
at every call, so after ``model.scale = 2.0`` (a temperature schedule, a flag switched between phases) the
graph would go on computing with 0.5: a different function, silently. torch.compile guards such reads;
this module does the same for ORTModule's export:

- :func:`recording` runs the export with every module of the tree temporarily given a subclass whose
  ``__getattribute__`` notes each plain value (numbers, strings, bools, None, dtypes, enums and tuples of
  them) read from a module's own ``__dict__`` by module code (a method of the module's class: the forwards,
  the helpers they call, ``nn.Module`` itself). Reads by other code (hooks: DeepSpeed's keep step counters
  on modules) are not guarded: they are not the forward's.
- :class:`Guards` holds what was read, with its value, and says which one no longer holds.

ORTModule keeps one graph per set of values (``ortmodule/module.py``) and, past ``MAX_VARIANTS`` of them,
runs the module in PyTorch with the attribute named in the reason. Values reached through other objects
(``self.config.flag``) are not guarded (docs/ortmodule.md).
"""

from __future__ import annotations

import contextlib
import enum
import sys
from dataclasses import dataclass, field

import torch

MAX_VARIANTS = 8  # graphs per input schema that differ only in guarded values; then PyTorch runs it

_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, enum.Enum)
_MISSING = object()


class GuardError(RuntimeError):
    """The forward's Python values changed more often than it is worth exporting a graph for each."""


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _same(old, new) -> bool:
    return old is new or (type(old) is type(new) and old == new)


@dataclass
class Guards:
    """(module, attribute, value read at export) for every plain value the forward read."""

    reads: list[tuple[torch.nn.Module, str, object]] = field(default_factory=list)
    paths: dict[int, str] = field(default_factory=dict)  # id(module) -> its name in the tree, for messages

    def hold(self) -> bool:
        for module, name, value in self.reads:
            if not _same(value, module.__dict__.get(name, _MISSING)):
                return False
        return True

    def changed(self) -> list[str]:
        """``"path.name: old -> new"`` for each value that no longer holds."""
        out = []
        for module, name, value in self.reads:
            now = module.__dict__.get(name, _MISSING)
            if not _same(value, now):
                path = self.paths.get(id(module), "")
                now = "(deleted)" if now is _MISSING else repr(now)
                out.append(f"{path + '.' if path else ''}{name}: {value!r} -> {now}")
        return out


@contextlib.contextmanager
def recording(module: torch.nn.Module):
    """While the block runs, note the plain values module code reads from ``module``'s tree; yields the
    :class:`Guards`, filled when the block ends. A module whose class cannot be swapped is left unguarded."""
    guards = Guards()
    seen: dict[tuple[int, str], tuple[torch.nn.Module, str, object]] = {}
    swapped = []
    subclasses: dict[type, type] = {}
    for path, m in module.named_modules(remove_duplicate=True):
        cls = type(m)
        sub = subclasses.get(cls)
        if sub is None:
            sub = subclasses[cls] = _recording_class(cls, seen)
        try:
            m.__class__ = sub
        except TypeError:
            continue
        swapped.append((m, cls))
        guards.paths[id(m)] = path
    try:
        yield guards
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        guards.reads = list(seen.values())


def _recording_class(cls: type, seen: dict) -> type:
    parent_getattribute = cls.__getattribute__

    def __getattribute__(self, name):
        value = parent_getattribute(self, name)
        if name.startswith("__") or not _plain(value):
            return value
        own = object.__getattribute__(self, "__dict__")
        if name in own and own[name] is value and (id(self), name) not in seen:
            if _module_code(sys._getframe(1)):
                seen[(id(self), name)] = (self, name, value)
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _module_code(frame) -> bool:
    """Whether ``frame`` runs a method of a module's class (a forward, a helper it calls, ``nn.Module``'s
    own): its first argument is a module and its qualified name is under a class of that module's MRO.
    A hook (a function, or a method of another class, such as DeepSpeed's) is not."""
    code = frame.f_code
    if not code.co_argcount:
        return False
    caller = frame.f_locals.get(code.co_varnames[0])
    if not isinstance(caller, torch.nn.Module):
        return False
    qualname = getattr(code, "co_qualname", None)  # Python 3.11+
    return qualname is None or any(qualname.startswith(c.__qualname__ + ".") for c in type(caller).__mro__)
