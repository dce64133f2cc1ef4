"""Export a ``torch.nn.Module`` call to an ONNX graph whose inputs and outputs are flat tensor lists.

``capture(module, args, kwargs)`` wraps the module in :class:`FlatModule` (flat tensors in, flat tensors
out, plus the new values of the module's buffers so that in-place updates such as BatchNorm's running
statistics survive), exports it with ``torch.onnx.export(..., dynamo=True)`` with the batch and sequence
axes dynamic, and falls back to the TorchScript exporter if that fails. Parameters and buffers stay
initializers named as in ``module.named_parameters()``; no constant folding touches them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from onnxtrain.capture.captured import Captured
from onnxtrain.capture.flatten import Constant, Spec, UnsupportedStructureError, flatten, unflatten
from onnxtrain.capture.moe import moe_translations
from onnxtrain.capture.promotion import needs_type_promotion
from onnxtrain.capture.quiet import quiet_exporter, summary
from onnxtrain.capture.custom_backward import refusing_custom_backward
from onnxtrain.capture.refuse import Refused, refused_reason
from onnxtrain.capture.registry import lazy_registry, registry_key
from onnxtrain.capture.split_to_slices import split_to_slices
from onnxtrain.capture.stop_gradient import mark_stop_gradients
from onnxtrain.capture.translations import TRANSLATIONS

logger = logging.getLogger("onnxtrain.capture")

OPSET = 20
_PREFIX = "module."


class ExportError(RuntimeError):
    """Both exporters failed; the message carries both reasons."""


class _Record(dict):
    """A dict that copies as itself: torch.export restores the attributes of the module it traced with
    copies of them afterwards, and what forward wrote during a later export must still reach us."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class FlatModule(torch.nn.Module):
    """``forward(*tensors)`` -> ``(*output tensors, *buffer values)`` around ``module``."""

    def __init__(self, module: torch.nn.Module, input_spec: Spec, buffer_names: list[str]):
        super().__init__()
        self.module = module
        self.input_spec = input_spec
        self.buffer_names = buffer_names
        self.record = _Record()  # the output structure, written by forward while an exporter traces it
        self.watch: _StopGradientWatch | None = None  # set while the TorchScript exporter traces

    def forward(self, *tensors):
        args, kwargs = unflatten(tensors, self.input_spec)
        with self.watch if self.watch is not None else contextlib.nullcontext():
            out = self.module(*args, **kwargs)
        try:
            flat, self.record["output_spec"] = flatten(out, "output")
        except UnsupportedStructureError as exc:  # the same under every exporter: capture() says it alone
            self.record["structure_error"] = exc
            raise
        if any(t.is_complex() for t in flat):  # the exporter writes them as real (..., 2) tensors
            raise ExportError("the forward returns a complex tensor, which ORTModule does not support")
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        return (*flat, *(buffers[name] for name in self.buffer_names))


def dynamic_axes(tensor: torch.Tensor) -> list[int]:
    """The axes exported as dynamic: batch and sequence (the first two), for every input tensor."""
    return list(range(min(tensor.dim(), 2)))


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, *, verbose: bool = False) -> Captured:
    _check_supported(module)
    flat, input_spec = flatten((tuple(args), dict(kwargs)))
    # onnxruntime is fed contiguous copies: export with those too. A non-contiguous input (a slice) would
    # otherwise put its symbolic strides in the program (aten.sym_stride), which nothing translates.
    flat = [t.contiguous() for t in flat]
    buffer_names = [name for name, _ in module.named_buffers(remove_duplicate=False)]
    wrapper = FlatModule(module, input_spec, buffer_names)
    record = wrapper.record
    errors = []
    for label in _EXPORTERS:
        try:
            with refusing_custom_backward():
                model = globals()[_EXPORTERS[label]](wrapper, flat, verbose)
            break
        except TraceDependsOnExample as exc:  # the reason, in one line, with the dynamo exporter's first line
            logger.info("export: %s", "\n".join(errors))
            raise TraceDependsOnExample(f"{exc}; torch.export failed too (log level INFO shows why)" if errors
                                        else str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any exporter failure: try the next, report all
            if "structure_error" in record:  # the forward returns what ORTModule cannot carry: one line
                raise ExportError(str(record["structure_error"])) from None
            refused = refused_reason(exc)
            if refused is not None:  # an op no exporter translates exactly: no other exporter is tried
                raise ExportError(refused) from None
            errors.append(f"{label} failed: {type(exc).__name__}: {exc}")
            logger.info("export: %s", errors[-1])
    else:
        raise ExportError(
            "could not export the module to ONNX:\n  " + "\n  ".join(e[:2000] for e in errors)
            + "\nSimplify the forward (data-dependent control flow, unsupported ops), or run it in PyTorch."
        )
    if len(errors) == 1:
        logger.debug("export: %s", errors[0])
        warnings.warn(f"the dynamo exporter failed, the TorchScript exporter was used instead (its trace "
                      f"neither depends on the example nor drops a detach() or no_grad block): "
                      f"{summary(errors[0])}", UserWarning, stacklevel=3)
    if "output_spec" not in record:
        raise ExportError("the exporter never ran the module's forward; cannot tell its output structure"
                          + "".join(f"\n  {e[:2000]}" for e in errors))
    return _finish(model, wrapper, record["output_spec"], flat, "dynamo" if not errors else "torchscript")


def _check_supported(module: torch.nn.Module) -> None:
    """Refuse what no exporter captures correctly, before one captures it wrongly."""
    for name, m in module.named_modules():
        if (isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.momentum is None
                and m.track_running_stats):
            # Its update factor, 1 / num_batches_tracked, is a Python float read from a buffer: torch.export
            # stops at it, and the TorchScript exporter would freeze the first step's value into the graph.
            raise ExportError(f"{name or type(m).__name__}: BatchNorm with momentum=None (a cumulative average "
                              "of the batch statistics) cannot be captured for training; give it a momentum "
                              "(e.g. 0.1) or run the module in PyTorch")


# Tried in this order (looked up by name at call time).
_EXPORTERS = {
    "torch.onnx.export(dynamo=True)": "_export_dynamo",
    "torch.onnx.export(dynamo=False)": "_export_torchscript",
}


def _export_dynamo(wrapper: FlatModule, flat: list[torch.Tensor], verbose: bool) -> ir.Model:
    try:
        return _export_dynamo_with(wrapper, flat, verbose, dynamic_ones=True)
    except Exception:
        # A size-1 axis made dynamic can stop torch.export where the module broadcasts it (a [B, 1, L, S]
        # attention mask against the heads). Such axes are broadcast axes more often than batch axes: keep
        # them static and try once more (another size there then exports a graph of its own).
        if not any(t.shape[axis] == 1 for t in flat for axis in dynamic_axes(t)):
            raise
        logger.info("export with size-1 axes dynamic failed; retrying with them static")
        return _export_dynamo_with(wrapper, flat, verbose, dynamic_ones=False)


def _export_dynamo_with(wrapper: FlatModule, flat: list[torch.Tensor], verbose: bool, dynamic_ones: bool) -> ir.Model:
    auto = torch.export.Dim.AUTO
    shapes = tuple({axis: auto for axis in dynamic_axes(t) if dynamic_ones or t.shape[axis] != 1} for t in flat)
    with quiet_exporter(verbose), _exporter_shortcuts(keep_stack_traces=verbose) as hooked:
        program = torch.onnx.export(
            wrapper, tuple(flat), dynamo=True, dynamic_shapes=(shapes,), optimize=False,
            custom_translation_table={**TRANSLATIONS, **moe_translations()}, opset_version=OPSET, verbose=verbose,
        )
    if not hooked["stop_gradients"]:
        raise ExportError(f"torch {torch.__version__}'s ONNX exporter never called the hook where onnxtrain marks "
                          "detach() and no_grad blocks: gradients would flow through them")
    try:
        signature = program.exported_program.graph_signature
        mutated = set(signature.user_inputs_to_mutate.values())
        names = list(signature.user_inputs)
    except AttributeError as exc:  # never guess: a mutation the graph drops would go unnoticed
        raise ExportError(f"torch {torch.__version__}'s exported program does not say which inputs the forward "
                          f"changes in place ({exc})") from None
    _refuse_input_mutations([k for k, name in enumerate(names) if name in mutated])
    model = program.model
    model.meta[_DIM_RANGES] = _dim_ranges(program, len(flat))
    return model


_DIM_RANGES = "onnxtrain.dim_ranges"


def _dim_ranges(program, count: int) -> list[dict[int, tuple[int, int | None]]]:
    """Per input tensor, the sizes each symbolic axis may take in this graph: torch.export's range
    constraints. A Python branch on a size (``if x.shape[0] > 4``) is traced once and becomes a bound
    (``[5, oo)``); a graph must never run on a size outside it, where the forward takes the other branch."""
    try:
        exported = program.exported_program
        constraints = exported.range_constraints
        placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
        names = list(exported.graph_signature.user_inputs)
    except AttributeError as exc:  # a torch whose ONNXProgram/ExportedProgram lacks these: refuse, never guess
        raise ExportError(f"torch {torch.__version__}'s exported program does not expose its range constraints "
                          f"({exc}): onnxtrain cannot tell which input sizes its graph is valid for") from None
    if len(names) != count:
        raise ExportError(f"the exported program has {len(names)} user inputs for {count} input tensors")
    ranges = []
    for name in names:
        value = placeholders[name].meta.get("val")
        axes = {}
        for axis, size in enumerate(getattr(value, "shape", ())):
            bound = constraints.get(size.node.expr) if isinstance(size, torch.SymInt) else None
            if bound is None:
                continue
            lower, upper = int(bound.lower), _finite(bound.upper)
            if lower > 0 or upper is not None:  # [0, oo) bounds nothing: kept off the per-forward check
                axes[axis] = (lower, upper)
        ranges.append(axes)
    return ranges


def _finite(value) -> int | None:
    """A range's upper bound as an int, or None where it is unbounded (sympy's oo / torch's int_oo)."""
    try:
        number = int(value)
    except Exception:  # noqa: BLE001 - int(int_oo) raises AttributeError ('Infinity' has no _mpf_)
        return None
    return number if number < 2**62 else None


def _refuse_input_mutations(positions: list[int]) -> None:
    """The forward changes these input tensors in place (``x.mul_(2)``, ``mask[0] = 1``). The exported ONNX
    graph drops such a change (torch.export records it beside the graph, the TorchScript trace makes it
    functional), so the caller's tensor would keep its old value where PyTorch changes it: refused."""
    if positions:
        raise Refused(f"the forward changes its input tensor(s) {positions} (in flattened argument order) in "
                      "place, which the ONNX graph would not do to the caller's tensor; it runs in PyTorch")


def _export_torchscript(wrapper: FlatModule, flat: list[torch.Tensor], verbose: bool) -> ir.Model:
    # The tracer runs the forward on real tensors: on copies, so that the caller's tensors never change here.
    flat = [t.detach().clone().requires_grad_(t.requires_grad) for t in flat]
    versions = [t._version for t in flat]
    names = [f"input_{i}" for i in range(len(flat))]
    axes = {name: {a: f"{name}_dim{a}" for a in dynamic_axes(t)} for name, t in zip(names, flat)}
    mode = torch.onnx.TrainingMode.TRAINING if wrapper.training else torch.onnx.TrainingMode.EVAL
    buffer = io.BytesIO()
    wrapper.watch = _StopGradientWatch()
    try:
        with quiet_exporter(verbose), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)  # also those torch's own filters hide
            torch.onnx.export(
                wrapper, tuple(flat), buffer, dynamo=False, input_names=names, dynamic_axes=axes,
                training=mode, do_constant_folding=False, opset_version=OPSET, verbose=verbose,
            )
    finally:
        watch, wrapper.watch = wrapper.watch, None
    _refuse_example_dependent_trace(caught)
    _refuse_input_mutations([k for k, (t, v) in enumerate(zip(flat, versions)) if t._version != v])
    if watch.seen:
        raise ExportError(f"the module's forward {watch.seen}, which the TorchScript exporter does not keep: "
                          "gradients would flow where PyTorch stops them")
    proto = onnx.load_from_string(buffer.getvalue())
    return ir.from_proto(proto)


class _StopGradientWatch(torch.overrides.TorchFunctionMode):
    """Notes, while the module's forward is traced, a ``detach()`` or an op run with gradients off (a
    ``no_grad`` block) where they were on: the TorchScript exporter drops both."""

    def __enter__(self):
        self.grad_on = torch.is_grad_enabled()
        self.seen = getattr(self, "seen", "")
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.seen:
            name = getattr(func, "__name__", "")
            if name in ("detach", "detach_"):
                self.seen = f"calls {name}()"
            elif self.grad_on and not torch.is_grad_enabled():
                self.seen = f"runs {name or func} with gradients off (a torch.no_grad() block)"
        with warnings.catch_warnings(record=True) as caught:  # the tracer's warnings, told from the caller's line
            warnings.simplefilter("always")
            result = func(*args, **(kwargs or {}))
        caller = sys._getframe(1)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, caller.f_code.co_filename, caller.f_lineno)
        return result


class TraceDependsOnExample(ExportError):
    """The TorchScript trace recorded what the example input did, not what the code does for every input."""


def _refuse_example_dependent_trace(caught: list[warnings.WarningMessage]) -> None:
    """Raise if tracing warned that the trace depends on the example: a data-dependent branch or a tensor
    turned into a Python number (frozen into the graph as the example's value), or an output that does
    not depend on the inputs. Any ``TracerWarning`` says so; the first one is the reason, in one line."""
    for w in caught:
        if issubclass(w.category, torch.jit.TracerWarning):
            where = f"{Path(w.filename).name}:{w.lineno}"
            raise TraceDependsOnExample(f"the TorchScript trace depends on the example input (TracerWarning at "
                                        f"{where}: {_first_sentence(str(w.message))}): it would train what the "
                                        "first batch did on every batch")


def _first_sentence(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line.split(". ")[0].rstrip(".")


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _exporter_shortcuts(keep_stack_traces: bool = False):
    """Hook into torch.onnx's exporter: mark what gradients must not flow through, and skip work that
    changes nothing for this export.

    - Before the exporter's decomposition step, ``detach()`` and ``no_grad`` blocks in the exported
      program are marked as stop-gradient (:mod:`onnxtrain.capture.stop_gradient`).
    - Its registry of translations is built lazily (:mod:`onnxtrain.capture.registry`): 0.5-0.7 s.
    - Its decomposition step re-traces the whole exported program to decompose the ATen ops it has no
      translation for (about 1-1.5 s of BERT-small's first step), even when there are none. When every op
      in the program has a translation and nothing in it mutates or is a higher-order op (which that
      re-trace would functionalize or lower), the program is handed on as it is.
    - Its type-promotion pass re-runs the program on fake tensors to find implicit promotions; it runs
      only where the values recorded in the program show one (:mod:`onnxtrain.capture.promotion`).
    - torch.fx records the Python stack of every traced op, only for reading the graph later: not
      recorded unless ``keep_stack_traces`` (verbose exports). BERT-small's export, warm, 0.66-0.70 ->
      0.60-0.61 s, and no source lines of every module on the way kept in ``linecache``.

    These reach into the exporter's internals. Where the hooks are missing, or the exporter never calls the
    one that marks stop-gradients, the export fails with that reason (gradients would flow through
    ``detach()`` and ``no_grad`` blocks); the other shortcuts fall back to the exporter's own step.
    """
    try:
        from torch.onnx._internal.exporter import _fx_passes, _registration
        original_decompose = _fx_passes.decompose_with_registry
        original_promote = _fx_passes.insert_type_promotion_nodes
        original_registry = _registration.ONNXRegistry.__dict__["from_torchlib"].__func__
    except (ImportError, AttributeError, KeyError) as exc:
        raise ExportError(f"torch {torch.__version__}'s ONNX exporter lacks the hook where onnxtrain marks detach() "
                          f"and no_grad blocks ({type(exc).__name__}: {exc}): gradients would flow through them"
                          ) from None
    hooked = {"stop_gradients": False}  # set once the exporter has called the hook that marks them

    def from_torchlib(cls, opset_version=None):
        opset = opset_version if opset_version is not None else _registration._constants.TORCHLIB_OPSET
        try:
            return lazy_registry(cls, opset)
        except Exception as exc:  # noqa: BLE001 - any surprise in the internals: the exporter's own registry
            logger.debug("lazy translation registry unavailable (%s)", exc)
            return original_registry(cls, opset)

    def decompose(program, registry):
        hooked["stop_gradients"] = True
        if mark_stop_gradients(program):  # before anything else: gradients depend on it
            logger.debug("detach() / no_grad regions marked as stop-gradient")
        try:
            needed = _needs_decomposition(program, registry)
        except Exception as exc:  # noqa: BLE001 - any surprise in the internals: decompose as usual
            logger.debug("decomposition check failed (%s); decomposing", exc)
            needed = True
        logger.debug("torch.onnx decomposition %s", "runs" if needed else "skipped: nothing to decompose")
        return original_decompose(program, registry) if needed else program

    def promote(graph_module):
        try:
            needed = needs_type_promotion(graph_module)
        except Exception as exc:  # noqa: BLE001 - any surprise in the internals: run the pass
            logger.debug("type promotion check failed (%s); running the pass", exc)
            needed = True
        logger.debug("torch.onnx type promotion %s", "runs" if needed else "skipped: nothing to promote")
        if needed:
            original_promote(graph_module)

    fx_config = getattr(torch.fx, "config", None)
    with _PATCH_LOCK:  # one export at a time: two threads must not save or restore each other's patches
        stack_traces = getattr(fx_config, "do_not_emit_stack_traces", None)
        _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)
        _fx_passes.decompose_with_registry = decompose
        _fx_passes.insert_type_promotion_nodes = promote
        if stack_traces is not None and not keep_stack_traces:
            fx_config.do_not_emit_stack_traces = True
        try:
            yield hooked
        finally:
            if stack_traces is not None:
                fx_config.do_not_emit_stack_traces = stack_traces
            _fx_passes.insert_type_promotion_nodes = original_promote
            _fx_passes.decompose_with_registry = original_decompose
            _registration.ONNXRegistry.from_torchlib = classmethod(original_registry)


_ASSERTIONS = frozenset({"aten::sym_constrain_range_for_size", "aten::_assert_async", "aten::_assert_scalar",
                         "aten::_assert_tensor_metadata"})


def _needs_decomposition(program: torch.export.ExportedProgram, registry) -> bool:
    """Whether some call in ``program`` is an ATen op without translation in ``registry``, mutates, or is
    not an op."""
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            return True
        for node in module.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op != "call_function":
                return True
            target = node.target
            translated = bool(registry.functions.get(registry_key(target)))
            if isinstance(target, torch._ops.OpOverload):
                if target.name().split(".")[0] in _ASSERTIONS:  # the exporter drops these after decomposing
                    continue
                if not translated or target._schema.is_mutable:
                    return True
            elif not translated and getattr(target, "__module__", None) not in ("_operator", "operator"):
                return True
    return False


def _finish(model: ir.Model, wrapper: FlatModule, output_spec: Spec, flat: list[torch.Tensor],
            exporter: str) -> Captured:
    graph = model.graph
    for name in list(graph.initializers):
        if name.startswith(_PREFIX):
            value = graph.initializers.pop(name)
            value.name = name[len(_PREFIX):]
            graph.initializers[value.name] = value
    num_outputs = len(graph.outputs) - len(wrapper.buffer_names)
    mutated = _drop_unchanged_buffers(graph, wrapper.buffer_names, num_outputs)
    if not graph.outputs:  # onnxruntime refuses a graph without outputs (in C++, at session creation)
        raise ExportError(f"the forward returns no tensor ({_describe(output_spec)}) and updates no buffer: "
                          "there is nothing for onnxruntime to compute")
    if len(graph.inputs) != len(flat):
        raise ExportError(
            f"the exported graph has {len(graph.inputs)} inputs for {len(flat)} input tensors; an input "
            "the module does not use may have been dropped. Remove unused tensor arguments."
        )
    split_to_slices(graph, [t.shape for t in flat])  # before `static`: it makes split axes static
    static = [
        {axis: dim for axis, dim in enumerate(value.shape or []) if isinstance(dim, int)}
        for value in graph.inputs
    ]
    ranges = model.meta.get(_DIM_RANGES) or [{} for _ in flat]
    for fixed, bounds in zip(static, ranges):
        for axis, (lower, upper) in list(bounds.items()):
            if lower == upper:  # torch.export pinned the axis although the ONNX input left it symbolic
                fixed.setdefault(axis, lower)
                del bounds[axis]
    return Captured(model, output_spec, num_outputs, mutated, exporter, static, ranges)


def _describe(spec: Spec) -> str:
    """What a forward without tensor outputs returned, for the error: ``None``, ``a str``, ``a tuple``."""
    if isinstance(spec, Constant):
        return "None" if spec.value is None else f"a {spec.kind.__name__}"
    return f"a {getattr(spec, 'kind', type(spec)).__name__} of no tensors"


def _drop_unchanged_buffers(graph: ir.Graph, buffer_names: list[str], num_outputs: int) -> list[str]:
    """Remove buffer outputs that merely return the buffer; return the names of the mutated ones."""
    keep, mutated = list(graph.outputs[:num_outputs]), []
    for name, value in zip(buffer_names, graph.outputs[num_outputs:]):
        source = value
        while source.producer() is not None and source.producer().op_type == "Identity":
            source = source.producer().inputs[0]
        if source.is_initializer() or source.is_graph_input() or source.producer() is None:
            continue
        keep.append(value)
        mutated.append(name)
    graph.outputs.clear()
    graph.outputs.extend(keep)
    return mutated
