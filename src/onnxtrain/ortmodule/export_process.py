"""The export and the training graphs built in a child process: by default where a memory budget is set
(:func:`decide`), always with ``DebugOptions(export_process="spawn")`` or ``ONNXTRAIN_EXPORT_PROCESS=spawn``.

torch's ONNX exporter, onnxscript's op library and optimizer, and what they import and build once (sympy's,
``torch.export``'s and ``torch._functorch``'s modules) stay in a process once imported: BERT-small's RSS between
steps holds about 67 MB of them (docs/memory.md, "What ORTModule holds between steps"). With this setting
ORTModule's first export of an input schema runs in a fresh Python process (``python -c``, running
:func:`_child`): the model, the call's arguments and the options go there by
``torch.save``; the child wraps the model in an ORTModule, runs the export and builds the training graphs as the
in-process path does (the same code), and sends back the graphs as ONNX protos with what feeds and reads them;
the training process makes its onnxruntime sessions from them and never imports the exporter.

What crosses the boundary besides the graphs:

- the guards (:mod:`onnxtrain.ortmodule.guards`): each value the forward read, by the path of its owner in the
  module tree (a submodule, or an object a submodule holds, as ``config``), made again on the training
  process's own objects; a global by its module's name;
- the plain values the forward itself changed while it was exported (Hugging Face's classifiers set
  ``config.problem_type``): set on the training process's objects, as an in-process export leaves them, and the
  export the next call would then make (the graph traced again with the new values) is made in the child;
- an export error: raised again with its class and message, so that the fallback and its one-line reason are
  those of an in-process export.
- the child's log records (every level of the ``onnxtrain`` loggers): logged again here by the same loggers, so
  that this process's levels and handlers take them as an in-process export's (the recompute plan at INFO on
  ``onnxtrain.passes``); its other output (warnings, the exporter's own) is written to this process's stderr.

Where the child cannot be used the export runs in-process as before, decided before any graph runs, with the
reason logged at INFO (:func:`why_not` before the child; after it, a model or argument that cannot be pickled
or unpickled, a class defined in ``__main__``, a guard whose owner has no path): autocast, a backend or device
other than onnxruntime on CPU, DeepSpeed or FSDP2 parameters, ``save_onnx``, a schema's later variants.
Later backward graphs (another pattern of output gradients) are made in the training process: their passes
need neither the exporter nor onnxscript.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

from onnxtrain.capture.flatten import flatten
from onnxtrain.ortmodule import guards as guarding

logger = logging.getLogger("onnxtrain.ortmodule")

EXPORT_PROCESS_ENV = "ONNXTRAIN_EXPORT_PROCESS"
# The child ends with os._exit once its answer is written: tearing down the exporter's modules and objects took
# 2.5 s of BERT-small's first call (loaded machine), and nothing of the child's is needed after its answer.
_CHILD = ("import os, sys; from pathlib import Path; from onnxtrain.ortmodule.export_process import _child; "
          "_child(Path(sys.argv[1]), Path(sys.argv[2])); sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")
_MISSING = guarding._MISSING


class ChildUnavailable(RuntimeError):
    """The child could not export (not the export's own failure): the export runs in-process instead."""


class ChildExportError(RuntimeError):
    """An export error whose class could not be made again in the training process (its name leads the text)."""


IN_PROCESS = ("0", "in-process")
AUTO = ("", "auto")


def decide(option: str | None, plan) -> tuple[bool, str]:
    """Whether a schema's first export runs in the child, and why (the INFO line's reason).

    ``option`` (``DebugOptions.export_process``) where given, else ``$ONNXTRAIN_EXPORT_PROCESS``: ``"spawn"``
    always, ``"in-process"`` (``0``) never; ``"auto"`` (or neither set, the default) where ``plan`` (the
    :class:`~onnxtrain.passes.recompute.Recompute` the graphs are built with) asks for memory savings: a budget
    (a fraction under 1.0, or a number of bytes) or patterns to recompute. Such a user trades
    a few seconds of a schema's first call for the exporter's modules (about 67 MB on BERT-small) kept out of
    the process that trains; the graphs are the same either way."""
    if option is not None:
        where, value = "DebugOptions(export_process=...)", check(option, "DebugOptions(export_process=...)")
    else:
        where, value = EXPORT_PROCESS_ENV, check(os.environ.get(EXPORT_PROCESS_ENV, ""), EXPORT_PROCESS_ENV)
    if value != "auto":
        return value == "spawn", f"{where} is {value!r}"
    if plan.saves_memory:
        return True, f"a memory budget is set ({_describe(plan)})"
    return False, "no memory budget is set (export_process='spawn' exports in a child process)"


def _describe(plan) -> str:
    if plan.budget is None:
        return f"recompute patterns {sorted(plan.patterns)}"
    return f"recompute budget {plan.budget!r}"


def check(value: str, where: str) -> str:
    """``value`` normalized (``"spawn"``, ``"in-process"`` for ``0`` and itself, ``"auto"`` for empty and
    itself); a clear error else."""
    value = str(value).strip().lower()
    if value not in IN_PROCESS + AUTO + ("spawn",):
        raise ValueError(f"{where}={value!r}: use 'spawn' (export in a child process), 'in-process' ('0') or "
                         "'auto' (in a child where a memory budget is set: the default)")
    return "in-process" if value in IN_PROCESS else "auto" if value in AUTO else value


def why_not(ortmodule, tensors: list[torch.Tensor]) -> str | None:
    """A one-line reason this export runs in-process, or None where the child may make it."""
    from onnxtrain.ortmodule.module import _autocast_state, _backend_for, _device_of

    module = ortmodule.module
    if any(enabled for enabled, _ in _autocast_state()):
        return "under torch.autocast (the output dtypes are asked of PyTorch in the training process)"
    device = _device_of(module, tensors)
    if device.type != "cpu" or any(t.device.type != "cpu" for t in tensors):
        return "not on CPU"
    if _backend_for(ortmodule._backend, device) != ("onnxruntime", "fp32"):
        return "the graphs run on another backend than onnxruntime"
    if ortmodule._debug.save_onnx:
        return "save_onnx names its files by the training process's schemas"
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return "DeepSpeed parameters"
    main = next((type(m).__name__ for m in module.modules() if type(m).__module__ == "__main__"), None)
    if main is not None:
        return f"{main} is defined in __main__, which a child process cannot import"
    return None


def export(ortmodule, args, kwargs, tensors: list[torch.Tensor]):
    """The :class:`~onnxtrain.ortmodule.graphs.SchemaGraphs` of this call's schema, its training graphs for
    this call's ``requires_grad`` flags among them (where gradients are wanted), made in a child process.
    Raises the export's own error as an in-process export would, :class:`ChildUnavailable` where the child
    could not be used."""
    with tempfile.TemporaryDirectory(prefix="onnxtrain_export_") as folder:
        request, response = Path(folder) / "request.pt", Path(folder) / "response.pt"
        try:
            torch.save({"module": ortmodule.module, "args": args, "kwargs": kwargs, "debug": ortmodule._debug,
                        "backend": ortmodule._backend, "grad": torch.is_grad_enabled(),
                        "threads": torch.get_num_threads()}, request)
        except Exception as exc:  # noqa: BLE001 - a lambda, a local class: not picklable
            raise ChildUnavailable(f"the model or its arguments cannot be pickled ({type(exc).__name__}: "
                                   f"{exc})") from None
        # the child finds the modules this process finds (a model class next to the training script)
        env = {**os.environ, EXPORT_PROCESS_ENV: "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(request), str(response)],
                              env=env, capture_output=True, text=True, check=False)
        sys.stderr.write(done.stdout + done.stderr)  # the child's log and warnings, where this process's go
        if not response.exists():
            raise ChildUnavailable(f"the export process ended with code {done.returncode} and no answer")
        answer = torch.load(response, weights_only=False)
    for name, level, message in answer.get("logs", ()):  # as this process's loggers and handlers take them
        logging.getLogger(name).log(level, "%s", message)
    if "unavailable" in answer:
        raise ChildUnavailable(answer["unavailable"])
    if "error" in answer:
        raise _error(*answer["error"])
    return _land(ortmodule, answer, tensors)


def _error(module_name: str, qualname: str, message: str) -> Exception:
    """The export's error, of its own class where that class can be made from its message."""
    try:
        cls = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, Exception):
            exc = cls(message)
            if str(exc) == message:
                return exc
    except Exception:  # noqa: BLE001 - any class that cannot be made again from its text
        pass
    return ChildExportError(f"{qualname}: {message}")


# -- the child ------------------------------------------------------------------------------------------------

class _Kept(logging.Handler):
    """The child's onnxtrain log records, all levels, for the training process to log as its own (so that its
    handlers, levels and filters apply, as to an in-process export's); the child's own line saying where it
    exports is left out (the training process said it)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record):
        if not (record.name == "onnxtrain.ortmodule" and record.funcName == "_export"):
            self.records.append((record.name, record.levelno, record.getMessage()))


def _keep_logs(kept: _Kept) -> None:
    """Send every onnxtrain record to ``kept`` only (made again after ORTModule sets its loggers' levels)."""
    root = logging.getLogger("onnxtrain")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(kept)
    root.setLevel(logging.DEBUG)
    root.propagate = False
    for name, each in logging.root.manager.loggerDict.items():
        if name.startswith("onnxtrain.") and isinstance(each, logging.Logger):
            each.setLevel(logging.NOTSET)


def _child(request: Path, response: Path) -> None:
    kept = _Kept()
    _keep_logs(kept)
    try:
        asked = torch.load(request, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - e.g. a class the child cannot import
        _write({"unavailable": f"the child could not load the model ({type(exc).__name__}: {exc})"}, response,
               kept)
        return
    from onnxtrain.ortmodule.module import ORTModule

    torch.set_num_threads(asked["threads"])
    module, args, kwargs = asked["module"], asked["args"], asked["kwargs"]
    ortmodule = ORTModule(module, dataclasses.replace(asked["debug"], fallback=False, export_process="in-process"),
                          asked["backend"])
    _keep_logs(kept)  # the options set the loggers' levels and onnxtrain's stderr handler again
    recorded: list = []
    try:
        with torch.set_grad_enabled(asked["grad"]):
            tensors, spec = flatten((args, kwargs))
            graphs = ortmodule._graphs_for(args, kwargs, tensors, spec)
            first = graphs.guards
            recorded.append(_built_sessions(graphs))
            if not graphs.guards.hold():  # the forward changed what it read: the next call's export, made here
                graphs = ortmodule._graphs_for(args, kwargs, tensors, spec)
                recorded.append(_built_sessions(graphs))
            ortmodule._training_for(graphs, tensors, ortmodule._state(graphs))
    except Exception as exc:  # noqa: BLE001 - the export's own failure: raised again in the training process
        _write({"error": (type(exc).__module__, type(exc).__qualname__, str(exc))}, response, kept)
        return
    try:
        _write(_ship(ortmodule, graphs, first, recorded[-1]), response, kept)
    except Exception as exc:  # noqa: BLE001 - a guard without a path, a value that cannot be pickled
        _write({"unavailable": f"the child could not send the graphs back ({type(exc).__name__}: {exc})"}, response,
               kept)


def _write(answer: dict, response: Path, kept: _Kept) -> None:
    """``answer`` and the log records so far saved whole or not at all (a value that cannot be pickled fails
    half-way)."""
    answer = {**answer, "logs": kept.records}
    part = response.with_suffix(".part")
    torch.save(answer, part)
    os.replace(part, response)


def _built_sessions(graphs) -> dict:
    """Make ``graphs``' sessions record their graphs and options instead of being built (the training process
    builds them): {id of the placeholder: (proto, keyword arguments)}."""
    made: dict[int, tuple] = {}

    def record(proto, **options):
        placeholder = _Placeholder()
        made[id(placeholder)] = (placeholder, proto, options)
        return placeholder

    graphs._session = record
    return made


class _Placeholder:
    """Stands for a session the training process makes."""

    runs = 0


def _owner_paths(module: torch.nn.Module) -> dict[int, tuple[str, str | None]]:
    """id of each submodule -> (its path, None), of each object a submodule holds -> (that path, attribute),
    in :func:`onnxtrain.ortmodule.guards.recording`'s order."""
    where: dict[int, tuple[str, str | None]] = {}
    for path, m in module.named_modules(remove_duplicate=True):
        where.setdefault(id(m), (path, None))
    for path, m in module.named_modules(remove_duplicate=True):
        for name, value in m.__dict__.items():
            where.setdefault(id(value), (path, name))
    return where


def _ship(ortmodule, graphs, first, made: dict) -> dict:
    where = _owner_paths(ortmodule.module)

    def path(owner):
        found = where.get(id(owner))
        if found is None:
            raise ChildUnavailable(f"a value the forward read belongs to a {type(owner).__name__} outside the "
                                   "module tree")
        return found

    guards = graphs.guards
    reads = [(path(owner), name, value) for owner, name, value in guards.reads]
    globals_read = [(name, value, module_name) for _, name, value, module_name in guards.global_reads]
    # what the export left changed, against what the training process's objects still hold
    changes = [(path(owner), name, owner.__dict__.get(name, _MISSING)) for owner, name, value in first.reads
               if not guarding._same(value, owner.__dict__.get(name, _MISSING))]
    changes = [(p, name, None if now is _MISSING else now, now is _MISSING) for p, name, now in changes]
    trainings = {}
    for flags, training in graphs.training.items():
        forward = made[id(training.forward)]
        trainings[flags] = dataclasses.replace(
            training, forward=None, make_session=None, fused=None, _backward={}, recompute=_plan(training.recompute),
            split=dataclasses.replace(training.split, forward=None, backward=None)), forward[1:]
    graphs.captured.model = None  # the exported IR: the training process never reads it
    shipped = dataclasses.replace(graphs, training={}, guards=None, inference=None, saver=None)
    shipped.__dict__.pop("_session", None)
    return {"graphs": shipped, "trainings": trainings, "reads": reads, "globals": globals_read,
            "changes": changes, "exports": ortmodule._export_count}


def _plan(plan):
    """The recompute plan without its graph (each candidate's nodes by their op types: its pattern)."""
    if plan is None:
        return None
    candidates = [dataclasses.replace(c, node=None, outputs=[], nodes=[types.SimpleNamespace(op_type=n.op_type)
                                                                      for n in c.nodes]) for c in plan.candidates]
    return dataclasses.replace(plan, candidates=candidates)


# -- back in the training process -----------------------------------------------------------------------------

def _land(ortmodule, answer: dict, tensors: list[torch.Tensor]):
    module = ortmodule.module
    modules = dict(module.named_modules(remove_duplicate=True))

    def owner(found):
        module_path, attribute = found
        if module_path not in modules or (attribute is not None and attribute not in modules[module_path].__dict__):
            raise ChildUnavailable(f"the training process's module has no {module_path}.{attribute or ''}")
        return modules[module_path] if attribute is None else modules[module_path].__dict__[attribute]

    reads = [(owner(found), name, value) for found, name, value in answer["reads"]]
    globals_read = []
    for name, value, module_name in answer["globals"]:
        if module_name not in sys.modules and module_name.startswith("onnxtrain."):
            continue  # the exporter's own wrapper (capture/export.py), which the training process never runs
        if module_name not in sys.modules:
            raise ChildUnavailable(f"the forward read a global of {module_name}, which the training process "
                                   "has not imported")
        globals_read.append((sys.modules[module_name].__dict__, name, value, module_name))
    for found, name, value, deleted in answer["changes"]:  # as an in-process export leaves them
        target = owner(found)
        if deleted:
            target.__dict__.pop(name, None)
        else:
            setattr(target, name, value)
    guards = guarding.Guards(reads=reads, global_reads=globals_read)
    guards.paths = {id(m): p for p, m in modules.items()}
    guards.arm(module)
    graphs = answer["graphs"]
    graphs.guards = guards
    for flags, (training, (proto, options)) in answer["trainings"].items():
        training.forward = graphs._session(proto, **options)
        training.make_session = graphs._session
        graphs.training[flags] = training
    ortmodule._export_count += answer["exports"]
    return graphs

