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
- :class:`Guards` holds what was read, with its value, and says which one no longer holds. It also holds
  the tree's *layout* at export: each module's submodules and the keys of its forward hooks (and the global
  module hooks'). Export traces the forward hooks into the graph and calls the submodules there, so a
  submodule replaced by another (``model.act = nn.Tanh()``) or a hook added or removed later is a change
  like a value's: a new graph.
- Module-level values (``SCALE``) that those methods name are guarded the same way (only those named by
  the module's own methods: a helper function elsewhere that reads a global is not seen).
- :func:`backward_hooks` names a module backward hook in the tree. Its gradients are computed inside the
  graph, where no such hook fires: the module runs in PyTorch instead (decided before export).

- Objects a module holds (``self.config``: a Hugging Face config, a dataclass, any plain Python object
  kept as an attribute) are lent a recording class too, so ``self.config.problem_type`` is guarded like
  ``self.scale`` (one level: the held object's own attributes, read by module code or the object's own
  methods, e.g. a property).

A value the forward itself changed while it was exported (Hugging Face's classifiers set
``config.problem_type`` on their first call) no longer holds at the next call, so that call exports again,
as torch.compile recompiles there: the first graph was traced from the old value. :meth:`Guards.changed_by_export`
says so, and ORTModule logs such a re-export instead of warning (the user changed nothing).

ORTModule keeps one graph per set of values (``ortmodule/module.py``) and, past ``MAX_VARIANTS`` of them,
runs the module in PyTorch with the attribute named in the reason (docs/ortmodule.md).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import operator
import sys
import types
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

MAX_VARIANTS = 8  # graphs per input schema that differ only in guarded values; then PyTorch runs it

# Functions kept as attributes (``self.act = F.gelu``) are compared by identity, like a swapped submodule.
_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, enum.Enum, types.FunctionType,
          types.BuiltinFunctionType)
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_BACKWARD_HOOKS = {"_backward_pre_hooks": "register_full_backward_pre_hook",
                   "_backward_hooks": "register_full_backward_hook or register_backward_hook"}
_MISSING = object()


class GuardError(RuntimeError):
    """The forward's Python values changed more often than it is worth exporting a graph for each."""


class BackwardHookError(RuntimeError):
    """A module backward hook in the tree: it would never fire inside the graph's backward."""


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _same(old, new) -> bool:
    return old is new or (type(old) is type(new) and old == new)


@dataclass
class Guards:
    """(module or held object, attribute, value read at export) for every plain value the forward read."""

    reads: list[tuple[object, str, object]] = field(default_factory=list)
    # (the module's globals, name, value read at export, the module's name) for plain globals module code read
    global_reads: list[tuple[dict, str, object, str]] = field(default_factory=list)
    paths: dict[int, str] = field(default_factory=dict)  # id(module) -> its name in the tree, for messages
    layout: list[tuple[torch.nn.Module, tuple]] = field(default_factory=list)  # (module, _layout(module))
    global_layout: tuple = ()
    fast: "_Check | None" = None  # reads and layout, checked in a few microseconds per call
    # (owner, name, value the export left) for the values read that the forward itself changed
    changed_by_export: list[tuple[object, str, object]] = field(default_factory=list)

    def arm(self, module: torch.nn.Module) -> None:
        """Make the fast check of ``reads`` and ``global_reads`` over ``module``'s tree, with its layout."""
        self.fast = _Check(self.reads, self.global_reads, list(module.modules()))
        self.layout, self.global_layout = self.fast.layout, self.fast.global_layout

    def hold(self) -> bool:
        if self.fast is not None:
            return self.fast.hold()
        return (all(_same(value, module.__dict__.get(name, _MISSING)) for module, name, value in self.reads)
                and all(_same(value, g.get(name, _MISSING)) for g, name, value, _ in self.global_reads))

    def changed(self) -> list[str]:
        """``"path.name: old -> new"`` for each value that no longer holds."""
        out = []
        for owner, name, value in self.reads:
            now = owner.__dict__.get(name, _MISSING)
            if not _same(value, now):
                now = "(deleted)" if now is _MISSING else repr(now)
                out.append(f"{self._path(owner, name)}: {value!r} -> {now}")
        for g, name, value, where in self.global_reads:
            now = g.get(name, _MISSING)
            if not _same(value, now):
                out.append(f"global {where}.{name}: {value!r} -> {'(deleted)' if now is _MISSING else repr(now)}")
        for module, layout in self.layout:
            now = _layout(module)
            if now != layout:
                path = self.paths.get(id(module), "") or "the module"
                if now[0] != layout[0]:
                    old, new = dict(layout[0]), dict(now[0])
                    swaps = [f"{k}: {_kind(old.get(k))} -> {_kind(new.get(k))}" for k in {*old, *new}
                             if old.get(k) is not new.get(k)]
                    out.append(f"{path}'s submodules ({', '.join(sorted(swaps))})")
                else:
                    out.append(f"{path}'s hooks")
        if _global_layout() != self.global_layout:
            out.append("the global module hooks")
        return out

    def only_changed_by_export(self) -> bool:
        """Whether what no longer holds is only values the forward itself changed during the export, each
        still as the export left it: the re-export the next call needs is the module's own doing."""
        if not self.changed_by_export:
            return False
        left = {(id(owner), name): value for owner, name, value in self.changed_by_export}
        for owner, name, value in self.reads:
            now = owner.__dict__.get(name, _MISSING)
            if not _same(value, now) and not ((id(owner), name) in left and _same(left[(id(owner), name)], now)):
                return False
        rest = Guards(global_reads=self.global_reads, layout=self.layout, global_layout=self.global_layout,
                      paths=self.paths)  # everything but the attribute reads checked above
        return not rest.changed()

    def _path(self, owner, name: str) -> str:
        path = self.paths.get(id(owner), "")
        return f"{path + '.' if path else ''}{name}"


def _kind(module) -> str:
    return "(none)" if module is None else type(module).__name__


def _layout(module: torch.nn.Module) -> tuple:
    """What export froze of ``module`` besides its values: its submodules and its hooks' keys."""
    own = module.__dict__
    return (tuple(own["_modules"].items()), *(tuple(own.get(name, ())) for name in _FORWARD_HOOKS),
            *(tuple(own.get(name, ())) for name in _BACKWARD_HOOKS))


class _Check:
    """:meth:`Guards.hold` without a Python loop per value: each value read is first compared by identity
    (it is the same object unless reassigned); the layout is as at export if no hook was registered since
    (any registration bumps ``RemovableHandle.next_id``), no hook dict that had hooks got shorter, no
    submodule dict changed length, and each submodule is the same object."""

    def __init__(self, reads: list, global_reads: list, modules: list[torch.nn.Module]):
        self.layout = [(m, _layout(m)) for m in modules]
        self.global_layout = _global_layout()
        entries = [(owner.__dict__, name, value) for owner, name, value in reads]
        entries += [(g, name, value) for g, name, value, _ in global_reads]
        self.owners = [owner for owner, _, _ in entries]
        self.names = [name for _, name, _ in entries]
        # The object there now where it equals the value read (export may have put an equal copy back).
        now = [owner.get(name, _MISSING) for owner, name, _ in entries]
        self.values = [n if _same(value, n) else value for (_, _, value), n in zip(entries, now)]
        hooks = torch.nn.modules.module
        dicts = [m.__dict__[name] for m in modules for name in (*_FORWARD_HOOKS, *_BACKWARD_HOOKS)
                 if name in m.__dict__]
        dicts += [getattr(hooks, f"_global{name}") for name in (*_FORWARD_HOOKS, *_BACKWARD_HOOKS)
                  if hasattr(hooks, f"_global{name}")]
        self.dicts = [d for d in dicts if d] + [m.__dict__["_modules"] for m in modules]
        self.lengths = list(map(len, self.dicts))
        children = [(m.__dict__["_modules"], name) for m in modules for name in m.__dict__["_modules"]]
        self.parents = [d for d, _ in children]
        self.slots = [name for _, name in children]
        self.expected = list(map(dict.get, self.parents, self.slots))
        self.next_id = RemovableHandle.next_id

    def hold(self) -> bool:
        now = list(map(dict.get, self.owners, self.names, itertools.repeat(_MISSING)))
        if not all(map(operator.is_, now, self.values)) and not all(map(_same, self.values, now)):
            return False
        if not (list(map(len, self.dicts)) == self.lengths
                and all(map(operator.is_, map(dict.get, self.parents, self.slots), self.expected))):
            return False
        if RemovableHandle.next_id != self.next_id:  # a hook registered somewhere (an export does that too)
            if not all(_layout(m) == layout for m, layout in self.layout) or _global_layout() != self.global_layout:
                return False
            self.next_id = RemovableHandle.next_id  # none of ours: quick again until the next registration
        return True


def _global_layout() -> tuple:
    hooks = torch.nn.modules.module
    return tuple(tuple(getattr(hooks, f"_global{name}", ())) for name in (*_FORWARD_HOOKS, *_BACKWARD_HOOKS))


def backward_hooks(module: torch.nn.Module) -> str | None:
    """A one-line reason naming a module backward hook in ``module``'s tree (or a global one), else None.
    PyTorch fires such a hook with the gradients of that module's inputs and outputs; in the graph those are
    never tensors of their own, so the hook would be skipped, silently: the module runs in PyTorch."""
    for path, m in module.named_modules():
        for name, how in _BACKWARD_HOOKS.items():
            if m.__dict__.get(name):
                where = f"submodule {path!r}" if path else "the wrapped module"
                return (f"{where} ({type(m).__name__}) has a backward hook ({how}), which cannot fire inside "
                        "ORTModule's graph; it runs in PyTorch (a hook on the ORTModule itself fires as usual)")
    hooks = torch.nn.modules.module
    for name, how in _BACKWARD_HOOKS.items():
        if getattr(hooks, f"_global{name}", None):
            return (f"a global module backward hook is registered ({how.replace('register_', 'register_module_')}"
                    "), which cannot fire inside ORTModule's graph; it runs in PyTorch")
    return None


@contextlib.contextmanager
def recording(module: torch.nn.Module):
    """While the block runs, note the plain values module code reads from ``module``'s tree; yields the
    :class:`Guards`, filled when the block ends. A module whose class cannot be swapped is left unguarded."""
    guards = Guards()
    seen: dict[tuple[int, str], tuple[object, str, object]] = {}
    codes: dict = {}  # code object -> its frame's globals if module code runs it, else None
    swapped = []
    subclasses: dict[type, type] = {}
    held: dict[int, object] = {}
    for path, m in module.named_modules(remove_duplicate=True):
        guards.paths[id(m)] = path
        if _lend(m, subclasses, swapped, lambda cls: _recording_class(cls, seen, codes, held)):
            for name, value in list(m.__dict__.items()):
                if id(value) not in held and _holdable(name, value):
                    held[id(value)] = value
                    guards.paths[id(value)] = f"{path + '.' if path else ''}{name}"
    for value in held.values():
        _lend(value, subclasses, swapped, lambda cls: _held_recording_class(cls, seen))
    try:
        yield guards
    finally:
        for m, cls in reversed(swapped):
            object.__setattr__(m, "__class__", cls)
        guards.reads = list(seen.values())
        guards.changed_by_export = [(owner, name, owner.__dict__.get(name, _MISSING))
                                    for owner, name, value in guards.reads
                                    if not _same(value, owner.__dict__.get(name, _MISSING))]
        guards.global_reads = _globals_read(codes)
        guards.arm(module)


def _lend(obj, subclasses: dict, swapped: list, make) -> bool:
    """Give ``obj`` its class's recording subclass (made once per class by ``make``) for the export."""
    cls = type(obj)
    sub = subclasses.get(cls)
    if sub is None:
        sub = subclasses[cls] = make(cls)
    try:
        object.__setattr__(obj, "__class__", sub)  # past a frozen dataclass's __setattr__
    except TypeError:  # a class with __slots__ or a C layout: left unguarded
        return False
    swapped.append((obj, cls))
    return True


def _holdable(name: str, value) -> bool:
    """Whether ``value``, a module attribute, is a plain Python object whose attributes a forward reads
    (``self.config``): not a module, tensor, plain value, container, class, function or C object."""
    if name.startswith("_") or _plain(value) or isinstance(value, (torch.nn.Module, torch.Tensor, type)):
        return False
    if callable(value) and not hasattr(type(value), "__dataclass_fields__"):
        return False  # functions, bound methods, partials: compared by identity where they are plain
    cls = type(value)
    return (isinstance(getattr(value, "__dict__", None), dict) and cls.__module__ not in ("builtins", "functools")
            and not cls.__module__.startswith("torch"))


def _held_recording_class(cls: type, seen: dict) -> type:
    """``cls`` with reads of its instances' plain attributes noted, when module code or the object's own
    methods (a property) read them."""
    parent_getattribute = cls.__getattribute__

    def __getattribute__(self, name):
        value = parent_getattribute(self, name)
        if name.startswith("__") or not _plain(value):
            return value
        own = object.__getattribute__(self, "__dict__")
        if name in own and own[name] is value and (id(self), name) not in seen:
            caller = sys._getframe(1)
            if _module_code(caller) or caller.f_locals.get("self") is self:
                seen[(id(self), name)] = (self, name, value)
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _recording_class(cls: type, seen: dict, codes: dict, held: dict) -> type:
    parent_getattribute = cls.__getattribute__

    def __getattribute__(self, name):
        caller = sys._getframe(1)
        if caller.f_code not in codes:  # the module code that runs, for the globals it reads
            codes[caller.f_code] = caller.f_globals if _module_code(caller) else None
        value = parent_getattribute(self, name)  # raises for a submodule: __getattr__ finds it
        # a held object is guarded by identity too (``self.options = dataclasses.replace(...)``)
        if name.startswith("__") or not (_plain(value) or id(value) in held):
            return value
        own = object.__getattribute__(self, "__dict__")
        if name in own and own[name] is value and (id(self), name) not in seen:
            if _module_code(sys._getframe(1)):
                seen[(id(self), name)] = (self, name, value)
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _globals_read(codes: dict) -> list[tuple[dict, str, object, str]]:
    """The plain module-level values (``SCALE = 0.5`` read as ``x * SCALE``) that the module code which ran
    during export names: export froze them as it froze attributes. A name the code also uses otherwise
    (an attribute called the same) is guarded too: harmless, it only re-exports if that global changes."""
    found = {}
    for code, g in codes.items():
        if g is None:
            continue
        for name in code.co_names:
            value = g.get(name, _MISSING)
            if value is not _MISSING and not name.startswith("__") and _plain(value):
                found[(id(g), name)] = (g, name, value, g.get("__name__", "?"))
    return list(found.values())


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
