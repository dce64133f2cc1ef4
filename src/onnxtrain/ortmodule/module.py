"""``ORTModule``: run a ``torch.nn.Module``'s forward and backward in onnxruntime.

    model = ORTModule(model)        # same parameters, same state_dict keys
    loss = model(x, labels=y).loss  # first call exports; later calls reuse the graphs
    loss.backward()                 # gradients land in .grad as usual
    optimizer.step()

One set of graphs is built per input *schema*: the structure of the arguments, non-tensor argument values,
tensor dtypes, ranks, devices and ``requires_grad``, train/eval mode, and the parameters' dtypes, devices
and ``requires_grad``, and the ``torch.autocast`` state. Batch and sequence lengths are
dynamic and never cause a new export.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the float32 graphs run on OpenVINO with its bfloat16
precision hint (onnxtrain.runtime.backends; without the ``openvino`` package or a CPU with bfloat16, a
warning once and float32). Each output has the dtype eager autocast gives it (bfloat16 logits, a float32 loss),
asked of PyTorch on fake tensors at export (onnxtrain.capture.autocast_dtypes) and cast inside the graph. Where
eager computes the attention in float32 (sdpa's math kernel, taken with dropout), ORTModule runs the graphs in
``graphs.PRODUCTS_BF16``: products in bf16 in the graph, attention float32, OpenVINO at its f32 hint
(``ONNXTRAIN_BF16_ATTENTION_FLOAT32=0`` falls back there instead). Under
``torch.autocast("cpu", dtype=torch.float16)`` the graphs' matmul-class products run in float16
(onnxtrain.passes.precision) on onnxruntime; with ``torch.amp.GradScaler`` the scaled loss's gradient flows
in and inf/NaN gradients reach the scaler. CUDA autocast is not supported yet: a warning once, and the graphs
run float32.
``backend=`` (or the ``ONNXTRAIN_BACKEND`` env var) picks the engine: "onnxruntime" (default) or "openvino".
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict

import onnx_ir as ir
import torch

from onnxtrain.capture.flatten import flatten, leaf_paths, unflatten
from onnxtrain.capture.autocast_dtypes import AutocastDtypeError, autocast_run
from onnxtrain.capture.quiet import summary
from onnxtrain.capture.structure import structure
from onnxtrain.ortmodule import distributed, export_process, guards
from onnxtrain.ortmodule.function import ORTFunction, reseed
from onnxtrain.ortmodule.graphs import PRODUCTS_BF16, Saver, SchemaGraphs, build_training, lower_products, prepare
from onnxtrain.ortmodule.options import FALLBACK_ENV, DebugOptions, attention_float32, torch_dropout
from onnxtrain.ortmodule.verify import VerificationError, first_difference
from onnxtrain.runtime import backends
from onnxtrain.runtime.session import OutputShapeError
from onnxtrain.utils.gc import young_objects_only

logger = logging.getLogger("onnxtrain.ortmodule")

# Attributes that live on the ORTModule itself; everything else is looked up on the wrapped module.
_OWN = ("_cache", "_debug", "_fallback_reason", "_export_count", "_schema_ids", "_backend", "_verified",
        "_deferred_hooks")
_warned_autocast: set[tuple] = set()


class ORTModule(torch.nn.Module):
    """A ``torch.nn.Module`` that runs ``module`` in onnxruntime (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None,
                 backend: str | None = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, not a {type(module).__name__}")
        if isinstance(module, ORTModule):
            raise TypeError("the module is already an ORTModule")
        super().__init__()
        self.module = module
        self._debug = debug_options if debug_options is not None else DebugOptions()
        self._cache: dict[tuple, list[SchemaGraphs]] = {}
        self._schema_ids: dict[tuple, int] = {}
        self._fallback_reason: str | None = None
        self._export_count = 0
        self._verified: set[int] = set()  # ids of the graphs (inference or training) verify has checked
        backends.resolve(backend, None)  # an unknown or missing backend is an error now, not at the first call
        self._backend = backend
        self._z3_leaf = True  # DeepSpeed ZeRO-3 gathers every parameter for the one graph (ortmodule/distributed.py)
        self._deferred_hooks: OrderedDict = OrderedDict()  # full backward hooks run when backward ends (ZeRO-3)
        logger.setLevel(self._debug.log_level.python_level)

    # -- what users see -------------------------------------------------------------------
    @property
    def export_count(self) -> int:
        """How many times the module has been exported (one per input schema)."""
        return self._export_count

    @property
    def fallback_reason(self) -> str | None:
        """Why the module runs in PyTorch instead of onnxruntime, or ``None`` if it does not."""
        return self._fallback_reason

    @property
    def debug_options(self) -> DebugOptions:
        """The :class:`DebugOptions` this module was made with."""
        return self._debug

    def forward(self, *args, **kwargs):
        if self._fallback_reason is not None:
            return self._run_in_pytorch(args, kwargs)
        partial = distributed.partitioned(self._state_lookup())
        if partial:
            raise RuntimeError(f"ORTModule: {len(partial)} DeepSpeed ZeRO-3 parameters (e.g. {partial[0]!r}) hold "
                               "only this rank's partition; the graph reads them whole. Pass the ORTModule itself "
                               "to deepspeed.initialize (it gathers them), or call it inside "
                               "deepspeed.zero.GatheredParameters.")
        tensors, spec = flatten((args, kwargs))
        try:
            graphs = self._graphs_for(args, kwargs, tensors, spec)
            state = self._state(graphs)
            training = self._training_for(graphs, tensors, state)
        except Exception as exc:  # noqa: BLE001 - any export/build failure falls back (or re-raises)
            self._fall_back(exc)
            return self._run_in_pytorch(args, kwargs)
        if training is None and graphs.inference_refused is None and graphs.inference is None:
            try:  # made at the first call without gradients, which may come between training steps
                graphs.inference_session()
            except Exception as exc:  # noqa: BLE001 - these calls run in PyTorch; training keeps its graphs
                self._fall_back(exc, inference_of=graphs)
        if training is None and graphs.inference_refused is not None:
            return self._run_in_pytorch(args, kwargs)
        if self._debug.verify and id(training or graphs) not in self._verified:
            self._verified.add(id(training or graphs))
            problem = self._verify(graphs, training, args, kwargs, tensors, state, spec)
            if problem is not None:
                self._fall_back(VerificationError(f"verify: {problem}, on the first batch of a new graph"))
                return self._run_in_pytorch(args, kwargs)
        if training is None:
            try:
                outputs = self._run_inference(graphs, tensors, state)
                if not graphs.inference.runs:
                    _check_eager_shapes(graphs, tensors, outputs)
            except Exception as exc:  # noqa: BLE001 - on its first run, nothing has changed yet
                if graphs.inference.runs:  # it has run before: a failure now is raised, not hidden
                    raise
                self._fall_back(exc, inference_of=graphs)
                return self._run_in_pytorch(args, kwargs)
            graphs.inference.runs += 1
        else:
            try:
                outputs = ORTFunction.apply(graphs, training, *tensors, *state)
                if not training.forward.runs:
                    _check_eager_shapes(graphs, tensors, outputs)
            except Exception as exc:  # noqa: BLE001 - on its first run, no output has been used yet
                if training.forward.runs:  # it has run before: a failure now is raised, not hidden
                    raise
                self._fall_back(exc)
                return self._run_in_pytorch(args, kwargs)
            training.forward.runs += 1
            outputs = distributed.after_backward(self, self._deferred_hooks, list(outputs))
        user = outputs[: graphs.num_outputs]
        self._update_buffers(graphs, outputs[graphs.num_outputs:])
        return unflatten(list(user), graphs.captured.output_spec)

    # -- graphs ---------------------------------------------------------------------------
    def _schema(self, spec, tensors: list[torch.Tensor]) -> tuple:
        return (
            spec,
            tuple((t.dtype, t.dim(), t.device, t.requires_grad) for t in tensors),
            self.module.training,
            tuple((p.dtype, p.device, p.requires_grad) for p in self.module.parameters()),
            _autocast_state(),
        )

    def _graphs_for(self, args, kwargs, tensors, spec) -> SchemaGraphs:
        key = self._schema(spec, tensors)
        entries = self._cache.setdefault(key, [])
        for entry in entries:
            if entry.matches(tensors) and entry.guards.hold():
                return entry
        variants = [entry for entry in entries if entry.matches(tensors)]  # these sizes, other Python values
        retraced = None
        if variants:
            changed = "; ".join(variants[-1].guards.changed()[:3])
            if len(variants) >= guards.MAX_VARIANTS:
                raise guards.GuardError(
                    f"the forward reads Python values that keep changing ({changed}): each set of values is "
                    f"frozen into a graph of its own and {len(variants)} were exported; make such a value a "
                    "tensor (an argument or a buffer) to train in onnxruntime")
            if variants[-1].guards.only_changed_by_export():  # e.g. HF's first call sets config.problem_type
                logger.info("tracing %s again: its forward changed what it reads while it was exported (%s)",
                            type(self.module).__name__, changed)
                with young_objects_only():
                    retraced = self._retrace(variants[-1], args, kwargs, tensors)
                if retraced is None:
                    return variants[-1]
            else:
                warnings.warn(f"ORTModule exports {type(self.module).__name__} again: what its forward "
                              f"reads changed ({changed}), and the graph holds it as a constant", UserWarning,
                              stacklevel=5)
        graphs, why = (self._in_child(key, args, kwargs, tensors) if not entries
                       else (None, "a later variant of its schema (what the forward reads changed)"))
        if graphs is None:
            with young_objects_only():  # the export's object churn would otherwise make the collector walk it all
                graphs = self._export(key, len(entries), args, kwargs, tensors, retraced, why)
        entries.append(graphs)
        return graphs

    def _in_child(self, key, args, kwargs, tensors) -> tuple[SchemaGraphs | None, str]:
        """The schema's graphs made in a child process (:func:`onnxtrain.ortmodule.export_process.decide`: where
        a memory budget is set, or ``DebugOptions.export_process`` / ``$ONNXTRAIN_EXPORT_PROCESS`` asks), or None
        where the export runs here; and why. One INFO line says where each export ran and why."""
        spawn, why = export_process.decide(self._debug.export_process, self._debug.recompute_plan())
        if not spawn:
            return None, why
        reason = export_process.why_not(self, tensors)
        if reason is None:
            logger.info("exporting %s for a new input schema (s%d_0) in a child process: %s (export_process="
                        "'in-process' exports here)", type(self.module).__name__,
                        self._schema_ids.setdefault(key, len(self._schema_ids)), why)
            try:
                return export_process.export(self, args, kwargs, tensors), why
            except export_process.ChildUnavailable as exc:
                reason = str(exc)
        return None, f"{why}, but {reason}"

    def _export(self, key, index: int, args, kwargs, tensors, retraced=None, why: str = "") -> SchemaGraphs:
        tag = f"s{self._schema_ids.setdefault(key, len(self._schema_ids))}_{index}"
        logger.info("exporting %s for a new input schema (%s) in this process: %s", type(self.module).__name__, tag,
                    why)
        unsupported = distributed.unsupported(self.module)
        if unsupported is not None:
            raise NotImplementedError(unsupported)
        hooked = guards.backward_hooks(self.module)
        if hooked is not None:
            raise guards.BackwardHookError(hooked)
        device = _device_of(self.module, tensors)
        backend, precision = _backend_for(self._backend, device)
        captured, read = retraced if retraced is not None else self._capture(args, kwargs, device)
        self._export_count += 1
        casts, precision, eager_shapes = (_output_casts(self.module, args, kwargs, captured, device.type, precision)
                                          if torch.is_autocast_enabled(device.type) else ({}, precision, None))
        backend = _float64_backend(self.module, captured, backend, precision)
        state_names = [n for n in self._state_names() if n in captured.model.graph.initializers]
        traced = structure(captured.model, set(state_names)) if read.changed_by_export else None
        saver = self._saver(tag)
        if saver is not None:
            saver(captured.model, "exported")
        graphs = prepare(captured, state_names, device, int(self._debug.log_level),
                         torch_masks=backend == "openvino" or torch_dropout())
        graphs.padding_rows, graphs.freq_scaled, graphs.shared_weights = _embedding_rules(self.module)
        graphs.saver = saver
        graphs.guards, graphs.traced = read, traced
        graphs.backend, graphs.precision = backend, precision
        if precision == PRODUCTS_BF16:
            lower_products(graphs)
        graphs.output_casts = casts
        if eager_shapes is not None:
            graphs.eager_shapes = ([tuple(t.shape) for t in tensors], eager_shapes)
        if saver is not None:
            saver(graphs.base, "inference")
        return graphs

    def _capture(self, args, kwargs, device: torch.device):
        """The float32 graph (the precision is the backend's business), and the guards of what it read."""
        with (_no_side_effects(self.module), torch.autocast(device.type, enabled=False),
              guards.recording(self.module) as read):
            captured = capture(self.module, args, kwargs, verbose=self._debug.log_level <= 0)
        return captured, read

    def _retrace(self, graphs: SchemaGraphs, args, kwargs, tensors):
        """Trace the forward again. If that gives ``graphs``' graph, keep ``graphs`` (its built sessions)
        with the new trace's guards and return None; else return the trace (captured, guards) to build.
        The first trace read values its own forward then changed, so it holds for the old values only; a
        graph equal to it holds for the new ones as well."""
        traced = self._capture(args, kwargs, _device_of(self.module, tensors))
        captured, read = traced
        if graphs.traced is None:
            return traced
        same = (structure(captured.model, set(graphs.state_names)) == graphs.traced
                and captured.num_outputs == graphs.captured.num_outputs
                and captured.mutated_buffers == graphs.captured.mutated_buffers
                and captured.static_dims == graphs.captured.static_dims
                and captured.dim_ranges == graphs.captured.dim_ranges
                and repr(captured.output_spec) == repr(graphs.captured.output_spec))
        logger.info("the new trace gives %s graph", "the same" if same else "another")
        if not same:
            return traced
        graphs.guards = read
        return None

    def _training_for(self, graphs: SchemaGraphs, tensors: list[torch.Tensor], state: list[torch.Tensor]):
        """The training graphs if gradients are wanted (grad mode, train mode, something requires grad)."""
        if not (torch.is_grad_enabled() and self.module.training):
            return None
        flags = tuple(t.requires_grad for t in (*tensors, *state))
        if not any(flags):
            return None
        training = graphs.training.get(flags)
        if training is None:
            with young_objects_only():
                training = build_training(graphs, list(flags), graphs.saver, self._debug.recompute_plan(),
                                          [tuple(t.shape) for t in (*tensors, *state)])
            graphs.training[flags] = training
        return training

    def _state_lookup(self) -> dict[str, torch.Tensor]:
        """Every name of every parameter and buffer, shared ones (tied weights) under each of their names."""
        lookup = dict(self.module.named_parameters(remove_duplicate=False))
        lookup.update(self.module.named_buffers(remove_duplicate=False))
        return lookup

    def _state_names(self) -> list[str]:
        return list(self._state_lookup())

    def _state(self, graphs: SchemaGraphs) -> list[torch.Tensor]:
        lookup = self._state_lookup()
        return [lookup[name] for name in graphs.state_names]

    def _saver(self, tag: str) -> Saver | None:
        if not self._debug.save_onnx:
            return None
        return Saver(self._debug.save_dir, self._debug.onnx_prefix, tag)

    # -- running --------------------------------------------------------------------------
    def _verify(self, graphs: SchemaGraphs, training, args, kwargs, tensors, state, spec) -> str | None:
        """Run this batch through onnxruntime and through eager from the same RNG state and buffers;
        the first output or gradient that differs, or None (:mod:`onnxtrain.ortmodule.verify`)."""
        unchecked = ("it draws random numbers that onnxruntime draws differently from PyTorch "
                     "(ONNXTRAIN_TORCH_DROPOUT=0); verify it with that off"
                     if graphs.random else
                     "it runs under torch.autocast, whose precision differs from eager's by design"
                     if any(_autocast_state()[k][0] for k in range(2)) else None)
        if unchecked:
            warnings.warn(f"ORTModule(verify) cannot check {type(self.module).__name__}'s graph: {unchecked}",
                          UserWarning, stacklevel=3)
            return None
        flags = [t.requires_grad for t in (*tensors, *state)] if training is not None else []
        names = [*leaf_paths(spec, "input"), *graphs.state_names]
        wrt = [t for t, flag in zip((*tensors, *state), flags) if flag]
        wrt_names = [n for n, flag in zip(names, flags) if flag]
        rng = torch.get_rng_state()

        def run_ort():
            if training is None:
                return self._run_inference(graphs, tensors, state)[: graphs.num_outputs]
            return list(ORTFunction.apply(graphs, training, *tensors, *state)[: graphs.num_outputs])

        def run_eager():
            torch.set_rng_state(rng)
            return flatten(self.module(*args, **kwargs), "output")[0]

        with _no_side_effects(self.module):
            return first_difference(run_ort, run_eager, leaf_paths(graphs.captured.output_spec, "output"),
                                    wrt, wrt_names)

    def _run_in_pytorch(self, args, kwargs):
        """The wrapped module's forward (the fallback), with the ZeRO-3 backward hooks deferred as on the graph."""
        result = self.module(*args, **kwargs)
        if not self._deferred_hooks:
            return result
        outputs, spec = flatten(result, "output")
        return unflatten(distributed.after_backward(self, self._deferred_hooks, outputs), spec)

    def _run_inference(self, graphs: SchemaGraphs, tensors, state) -> list[torch.Tensor]:
        session = graphs.inference_session()
        with torch.no_grad():
            return session.run([*tensors, *state, *reseed(graphs, tensors)])

    def _update_buffers(self, graphs: SchemaGraphs, values) -> None:
        if not graphs.mutated_buffers:
            return
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, value in zip(graphs.mutated_buffers, values):
                buffers[name].copy_(value)

    def _fall_back(self, exc: Exception, inference_of: SchemaGraphs | None = None) -> None:
        """Run the module in PyTorch from now, with the reason (or raise ``exc`` where fallback is off).
        ``inference_of``: only that schema's calls without gradients; its training calls keep their graphs. Its
        inference graph is made at the first such call, which may be an eval loop between training steps, where
        switching the training to PyTorch would change it midway."""
        if not self._debug.fallback:
            raise exc
        reason, name = f"{type(exc).__name__}: {exc}", type(self.module).__name__
        if inference_of is None:
            self._fallback_reason = reason
            what, now, full = f"falls back to PyTorch for {name}", "It now runs in PyTorch eager mode.", \
                "model.fallback_reason (or ONNXTRAIN_LOG_LEVEL=VERBOSE)"
        else:
            inference_of.inference_refused = reason
            what = (f"runs {name} in PyTorch eager mode for calls without gradients (torch.no_grad(), eval mode) "
                    "of this input schema")
            now, full = "Calls that train keep running on the graphs.", "ONNXTRAIN_LOG_LEVEL=VERBOSE"
        logger.debug("ORTModule %s, the full reason: %s", what, reason)
        warnings.warn(f"ORTModule {what}: {summary(reason)}\n{now} The full reason: {full}; to raise instead: "
                      f"{FALLBACK_ENV}=0 or DebugOptions(fallback=False).", UserWarning, stacklevel=3)

    def register_full_backward_hook(self, hook, prepend: bool = False):
        if any(distributed.is_zero3(p) for p in self.module.parameters()):
            return distributed.register_deferred(self._deferred_hooks, hook)  # why: ortmodule/distributed.py
        return super().register_full_backward_hook(hook, prepend=prepend)

    # -- the wrapped module's view --------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        # A public attribute the wrapped module has (``model.scale = 2.0``, ``model.fc = nn.Linear(...)``) is
        # set on it, where its forward reads it: set here, it would shadow the wrapped one for reads through
        # the wrapper while the forward kept using the old value. Names of the wrapper's own (its class's,
        # ``training``, private ones) stay here.
        inner = self.__dict__.get("_modules", {}).get("module")
        if (inner is not None and not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name) and hasattr(inner, name)):
            setattr(inner, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _OWN or name == "module":
                raise
            return getattr(self._modules["module"], name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A parent's load_state_dict reaches us with our own prefix: map "p.x" to "p.module.x".
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
            state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = {}
        state["_schema_ids"] = {}
        state["_verified"] = set()
        return state

    def __setstate__(self, state):
        super().__setstate__(state)


def capture(module: torch.nn.Module, args, kwargs, *, verbose: bool = False):
    """:func:`onnxtrain.capture.export.capture`, imported by the first export: torch's exporter and onnxscript's
    op library (about 45 MB of modules) are not imported with ORTModule (ortmodule/export_process.py)."""
    from onnxtrain.capture.export import capture as export

    return export(module, args, kwargs, verbose=verbose)


def _embedding_rules(module: torch.nn.Module) -> tuple[dict[str, int], set[str], set[str]]:
    """What ``nn.Embedding`` does to its table's gradient that an exported Gather forgets: ({table name:
    padding_idx}, {tables with scale_grad_by_freq}, {those tables that other modules use too}), for the
    tables whose every ``nn.Embedding`` agrees. A tied table is listed under each of its names."""
    aliases: dict[int, list[str]] = {}  # a tied table is in the exported graph under one of its names
    for n, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    uses: dict[int, int] = {}
    holders: dict[int, list[torch.nn.Embedding]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        if isinstance(m, torch.nn.Embedding) and id(m.weight) in aliases:
            holders.setdefault(id(m.weight), []).append(m)
    rows, by_freq, shared = {}, set(), set()
    for key, embeddings in holders.items():
        paddings = {None if m.padding_idx is None else m.padding_idx % m.num_embeddings for m in embeddings}
        freq = {bool(m.scale_grad_by_freq) for m in embeddings}
        if len(paddings) > 1 or len(freq) > 1:
            warnings.warn(f"embedding weight {aliases[key][0]!r} is shared by embeddings with different padding_idx "
                          "or scale_grad_by_freq: under ORTModule its gradient follows neither",
                          UserWarning, stacklevel=4)
            continue
        (row,), (scaled,) = paddings, freq
        if row is not None:
            rows.update(dict.fromkeys(aliases[key], row))
        if scaled:
            by_freq.update(aliases[key])
        if (row is not None or scaled) and uses[key] > 1:
            shared.update(aliases[key])
    return rows, by_freq, shared


def _autocast_state() -> tuple:
    """(enabled, dtype) of torch.autocast on CPU and on CUDA: part of the schema."""
    return tuple((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda"))


def _output_casts(module: torch.nn.Module, args, kwargs, captured, kind: str,
                  precision: str) -> tuple[dict[int, ir.DataType], str, list | None]:
    """({user output position: dtype} for the float32 graph outputs that eager autocast returns in bfloat16 or
    float16 (:mod:`onnxtrain.capture.autocast_dtypes`, asked under the caller's autocast state), the precision
    the graphs run in (:func:`_check_policy`), eager's output shapes for these inputs or None). Where eager's dtypes cannot be known, no casts: the outputs stay
    float32, with a warning once per module class. Raises :class:`AutocastPolicyError` where the graphs would not
    compute what eager does: a product eager runs in another type than the one ``precision`` lowers it to, or a
    branch on the autocast state."""
    try:
        with _no_side_effects(module):
            run = autocast_run(module, args, kwargs)
    except AutocastDtypeError as exc:
        reason = f"its forward does not run on fake tensors ({exc})"
        if precision == "bf16":  # OpenVINO lowers every product: one eager keeps float32 would go unseen
            raise AutocastPolicyError(
                f"under torch.autocast({kind!r}, dtype=torch.bfloat16) {type(module).__name__}'s products cannot "
                f"be checked against autocast's types ({reason}), and the bf16 graphs lower them all") from exc
    else:
        precision = _check_policy(module, run, kind, precision)
        if len(run.dtypes) == captured.num_outputs:
            outputs = captured.model.graph.outputs
            return {k: _LOW[dtype] for k, dtype in enumerate(run.dtypes)
                    if dtype in _LOW and outputs[k].dtype == ir.DataType.FLOAT}, precision, run.shapes
        reason = f"it returned {len(run.dtypes)} tensors there and {captured.num_outputs} when exported"
    key = ("dtypes", type(module).__name__)
    if key not in _warned_autocast:
        _warned_autocast.add(key)
        warnings.warn(f"ORTModule returns {type(module).__name__}'s outputs in float32 under torch.autocast, where "
                      f"eager may return bfloat16 or float16, and does not check that eager runs every product in "
                      f"autocast's type (the graphs lower them all): the forward is unknown there, {reason}",
                      RuntimeWarning, stacklevel=5)
    return {}, precision, None


def _check_eager_shapes(graphs, tensors: list[torch.Tensor], outputs) -> None:
    """On the call whose inputs the graphs were made for under autocast, raise :class:`OutputShapeError` where a
    user output's shape is not the one eager's forward gave on fake tensors (:func:`_output_casts`): OpenVINO
    follows a declared shape that shape inference got wrong where onnxruntime's kernels do not (``squeeze()`` of
    an axis of size 1 exported as dynamic: ``(5, 1, 5)`` where eager gives ``(5, 5)``; the OpInfo sweep under
    autocast bf16), so the graph's outputs are checked against eager's before any is used."""
    if graphs.eager_shapes is None:
        return
    inputs, shapes = graphs.eager_shapes
    if [tuple(t.shape) for t in tensors] != inputs:
        return
    for k, (shape, output) in enumerate(zip(shapes, outputs[: graphs.num_outputs])):
        if shape is not None and isinstance(output, torch.Tensor) and tuple(output.shape) != shape:
            raise OutputShapeError(f"output {k} has shape {list(output.shape)} where eager's forward gives "
                                   f"{list(shape)} (the graph's declared shape, which the backend followed, is wrong)")


class AutocastPolicyError(RuntimeError):
    """Under torch.autocast the forward does what the graphs' precision cannot follow (ORTModule falls back)."""


# The operand types each precision's backend lowers: OpenVINO's bfloat16 hint every float type of the graph,
# the float16 pass (onnxtrain.passes.precision) the float32 products (a bfloat16 product fails on onnxruntime)
_LOWERED = {"bf16": frozenset({torch.float32, torch.float64, torch.float16}),
            "fp16": frozenset({torch.float32, torch.bfloat16})}


def _check_policy(module: torch.nn.Module, run, kind: str, precision: str) -> str:
    """The precision the graphs run in under autocast: ``precision``, or :data:`graphs.PRODUCTS_BF16` where eager
    computes every attention in float32 (PyTorch's math kernel), OpenVINO's bf16 hint would lower it, and
    ``$ONNXTRAIN_BF16_ATTENTION_FLOAT32`` asks for it (:func:`options.attention_float32`). Raises
    :class:`AutocastPolicyError` where no precision of the graphs follows eager's."""
    name = type(module).__name__
    if run.reads:
        raise AutocastPolicyError(
            f"{name}'s forward reads the autocast state, {run.reads[0]}, which the float32 graph, traced with "
            "autocast off, sees as False: it would hold the branch eager does not take")
    if precision not in _LOWERED:  # float32 graphs (autocast not run, with a warning): products stay float32
        return precision
    low = torch.get_autocast_dtype(kind)
    attention = sorted((d for d in run.attention if d != low and d in _LOWERED[precision]), key=str)
    mode = precision
    eligible = precision == "bf16" and attention == [torch.float32] and low not in run.attention
    if eligible and attention_float32():
        # Every attention call computes in float32: the products in the graph (bf16) but attention's, whose nodes
        # are known (capture.attention), at OpenVINO's float32 hint; the other products are checked below
        mode, attention = PRODUCTS_BF16, []
    if attention:  # PyTorch's choice of kernel, not the model's code: say what runs attention in autocast's type
        # The math kernel is PyTorch's choice: with dropout_p > 0 always; without, where its fused kernels do
        # not take the call (on torch 2.13, Falcon's and Swin's attention with dropout 0)
        cause, remedy = ((", taken with dropout_p > 0", "attention dropout 0 or ") if run.attention_dropout
                         else ("", ""))
        raise AutocastPolicyError(
            f"scaled_dot_product_attention computes in {', '.join(map(str, attention))} under autocast (PyTorch's "
            f"{kind} math kernel{cause}) where the {precision} graphs would compute in {precision}; "
            f"{remedy}attn_implementation=\"eager\" (Hugging Face) runs it in {low}"
            + (f" (at {run.attention_site})" if run.attention_site else "")
            + ("; ONNXTRAIN_BF16_ATTENTION_FLOAT32=0 turned off running it on the graphs, attention float32"
               if eligible else ""))
    off = run.off_policy(low, _LOWERED[precision], openvino=precision == "bf16")
    if off:
        raise AutocastPolicyError(
            f"under torch.autocast({kind!r}, dtype={torch.get_autocast_dtype(kind)}) {name}'s forward runs "
            f"products that autocast does not lower ({', '.join(off[:3])}: an autocast(enabled=False) region, "
            "custom_fwd(cast_inputs=...), a float64 tensor or an op autocast keeps float32), which the "
            f"{precision} graphs would run in {precision}")
    return mode


_LOW = {torch.bfloat16: ir.DataType.BFLOAT16, torch.float16: ir.DataType.FLOAT16}


def _backend_for(backend: str | None, device: torch.device) -> tuple[str, str]:
    """The (backend, precision) that runs the graphs under the current autocast state."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return backends.resolve(backend, "fp32", kind)
    dtype = torch.get_autocast_dtype(kind)
    if kind == "cpu" and dtype == torch.bfloat16:
        return backends.resolve(backend, "bf16", kind)
    if kind == "cpu" and dtype == torch.float16:  # the precision pass, in the graphs (ortmodule.graphs)
        return backends.resolve(backend, "fp32", kind)[0], "fp16"
    if (kind, dtype) not in _warned_autocast:
        _warned_autocast.add((kind, dtype))
        warnings.warn(f"ORTModule does not run torch.autocast({kind!r}, dtype={dtype}) yet: its graphs run in "
                      "float32 (autocast bfloat16 and float16 on CPU are supported)", RuntimeWarning, stacklevel=4)
    return backends.resolve(backend, "fp32", kind)


def _float64_backend(module: torch.nn.Module, captured, backend: str, precision: str) -> str:
    """onnxruntime for a graph that takes or returns float64 tensors, which OpenVINO computes in float32
    (a float64 MLP's gradients were 1e-7 from eager's, not 1e-16): a warning once per module class. Under its
    bfloat16 hint, where onnxruntime cannot stand in, :class:`AutocastPolicyError` (the fallback)."""
    graph = captured.model.graph
    if backend != "openvino" or not any(v.dtype == ir.DataType.DOUBLE for v in (*graph.inputs, *graph.outputs)):
        return backend
    name = type(module).__name__
    if precision in ("bf16", PRODUCTS_BF16):
        raise AutocastPolicyError(f"{name}'s graph has float64 tensors, which eager keeps float64 under autocast "
                                  "and OpenVINO computes in float32 or bfloat16")
    if ("float64", name) not in _warned_autocast:
        _warned_autocast.add(("float64", name))
        warnings.warn(f"ORTModule runs {name} on onnxruntime, not OpenVINO: its graph has float64 tensors, which "
                      "OpenVINO computes in float32", RuntimeWarning, stacklevel=5)
    return "onnxruntime"


def _device_of(module: torch.nn.Module, tensors: list[torch.Tensor]) -> torch.device:
    for p in module.parameters():
        return p.device
    return tensors[0].device if tensors else torch.device("cpu")


class _no_side_effects:
    """Export traces the forward once; keep buffers (BatchNorm statistics) and the RNG as they were."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self):
        self.buffers = OrderedDict((n, b.detach().clone()) for n, b in self.module.named_buffers())
        self.rng = torch.get_rng_state()
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for name, buf in self.module.named_buffers():
                saved = self.buffers.get(name)
                if saved is not None and saved.shape == buf.shape:
                    buf.copy_(saved)
        torch.set_rng_state(self.rng)
        return False
