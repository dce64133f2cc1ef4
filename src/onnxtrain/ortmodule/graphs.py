"""The graphs ORTModule runs for one input schema: an inference graph, and forward + backward graphs.

Every graph takes ``[*user input tensors, *module state, *dropout masks]`` where the state is the module's
parameters and buffers as graph inputs (fed from the live torch tensors on each run) and the masks are drawn
by torch before each run (:mod:`onnxtrain.passes.dropout_masks`). Outputs: the user outputs, then the
new values of mutated buffers; the forward graph adds the values backward needs.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

from onnxtrain.autodiff.builder import is_float
from onnxtrain.autodiff.engine import (
    add_gradient_outputs,
    ir_version_for_onnxruntime,
    values_by_name,
)
from onnxtrain.autodiff.stop_gradient import is_stop_gradient, strip_stop_gradients
from onnxtrain.capture.captured import Captured
from onnxtrain.ortmodule import fused as fusion
from onnxtrain.ortmodule.guards import Guards
from onnxtrain.ortmodule.options import FUSED_STEP_ENV, TORCH_DROPOUT_ENV, MIN_STAGE_BYTES, backward_stages, fused_step
from onnxtrain.passes import Split, pipeline, split_forward_backward
from onnxtrain.passes.cast_outputs import cast_outputs
from onnxtrain.passes.defer_row_scatters import RowScatters, defer_row_scatters
from onnxtrain.passes.dropout_masks import RANDOM_OPS, Mask, draw_order, draws_nothing, dropout_masks
from onnxtrain.passes.precision import apply_precision, float32_accumulations
from onnxtrain.passes.recompute import Plan as RecomputePlan
from onnxtrain.passes.recompute import Recompute, dims_from_inputs
from onnxtrain.passes.stage_graph import CannotStage, one_stage, stage_graph
from onnxtrain.passes.zero_inputs import CannotPrune, prune_zero_inputs
from onnxtrain.runtime import openvino
from onnxtrain.runtime.openvino_float32 import float32_sums
from onnxtrain.runtime.session import TorchSession, session_options
from onnxtrain.runtime.staged import StagedSession
from onnxtrain.utils.io import save_model_atomic
from onnxtrain.utils.ort_options import forward_without_arena, release_step_memory

logger = logging.getLogger("onnxtrain.ortmodule")
# Autocast bf16 with the products lowered in the graph itself (passes.precision) and OpenVINO at its float32
# hint: where eager computes attention in float32 (PyTorch's math kernel, taken with dropout_p > 0), its nodes
# stay float32 (capture.attention.from_attention), the rest of the graph as the precision pass leaves it.
PRODUCTS_BF16 = "bf16-products"
# Under PRODUCTS_BF16, the fused call is compiled by OpenVINO for each of the first STATIC_SHAPES sets of input sizes
# it meets, every size fixed: its weight gradients bf16 products (one rounding with static sizes), its elementwise
# ops and their conversions fused (BERT at hidden 768: the call's CPU time 595 -> 481 ms). Other sizes run one
# compile over dynamic sizes of the graph whose weight gradients accumulate in float32 (passes.precision).
STATIC_SHAPES = 8


@dataclass
class Training:
    """Forward and backward graphs and how their inputs and outputs line up with the torch side.

    Backward sessions are made on first use, one per pattern of present output gradients: when only
    the loss reaches ``backward()``, the graph without the other outputs' gradient inputs runs
    (:mod:`onnxtrain.passes.zero_inputs`), and the full graph's session is never made. Each backward
    graph runs in up to ``backward_stages`` stages (:mod:`onnxtrain.passes.stage_graph`), cut by the
    sizes of the stash on that first use, so that stashed activations are freed as backward goes.
    """

    forward: TorchSession
    backward_proto: onnx.ModelProto
    split: Split
    wrt: list[int]  # positions in [*inputs, *state] whose gradients backward returns, in order
    differentiable_outputs: list[int]  # user outputs that take an output gradient, in order
    make_session: Callable[[onnx.ModelProto], TorchSession]
    # How the backward graph's outputs make the gradients in ``wrt`` order (embedding gradients come
    # out as ids and rows, which torch adds up: :mod:`onnxtrain.passes.defer_row_scatters`).
    row_scatters: RowScatters
    # What nn.Embedding does that the exported Gather forgets. ``padding_idx``: for embedding gradients
    # whose lookups all leave the graph as ids and rows, the rows at the padding id are left out when they
    # are added (exact, also for a table tied to other uses); for others, of a table nothing else uses,
    # the padding row is zeroed. Both map a position in ``wrt`` to the padding id. ``scale_grad_by_freq``
    # (positions in ``wrt``; lookups as ids and rows only): each row is divided by its id's count in its
    # lookup.
    padding_ids: dict[int, int] = field(default_factory=dict)
    zero_rows: dict[int, int] = field(default_factory=dict)
    freq_scaled: set[int] = field(default_factory=set)
    backward_stages: int = 1
    float32_sums: bool = False  # the backward pipeline's (OpenVINO bf16: LayerNorm's row sums stay ReduceSum)
    recompute: RecomputePlan | None = None  # what backward recomputes instead of stashing, and the bytes
    dims: dict[str, int] | None = None  # sizes of the symbolic dims at build time: stage cuts by liveness
    # Whether a step starts and ends by handing onnxruntime's arena back (utils.ort_options.release_arena).
    release: bool = False
    # Whether backward's outputs are copied out of the CPU arena (ONNXTRAIN_CPU_ARENA=backward).
    copy_out: bool = False
    # The forward and the loss's gradients in one call (OpenVINO; :mod:`onnxtrain.ortmodule.fused`), or None.
    fused: fusion.FusedStep | None = None
    # The dtype each differentiable output's gradient enters the backward graph in (the graph's float32 where
    # the output was cast: SchemaGraphs.output_casts).
    seed_dtypes: list[torch.dtype] = field(default_factory=list)
    # Casts to make in torch after the forward graph (outputs that are stashed for backward too, which the
    # forward graph returns in float32 once); the others are cast inside the forward graph.
    torch_casts: dict[int, torch.dtype] = field(default_factory=dict)
    # Keyed by which differentiable outputs have a gradient. None: those cannot be pruned, so the full
    # graph runs with zeros fed for them.
    _backward: dict[tuple[bool, ...], StagedSession | None] = field(default_factory=dict)

    def backward_for(self, present: tuple[bool, ...], input_bytes: list[int]) -> StagedSession | None:
        """The session taking only the present output gradients, or None if the full one must be fed zeros.
        ``input_bytes``: the size of each input that backward may free (0 for the others), which places
        the stage cuts when the session is made."""
        if present not in self._backward:
            self._backward[present] = self._build(present, input_bytes)
        return self._backward[present]

    def _build(self, present: tuple[bool, ...], input_bytes: list[int]) -> StagedSession | None:
        proto = self.backward_proto
        if not all(present):
            absent = [v.name for v, here in zip(proto.graph.input, present) if not here]
            try:
                proto = ir_version_for_onnxruntime(prune_zero_inputs(proto, absent))
            except CannotPrune as exc:
                logger.info("output gradients %s are fed as zeros: %s", absent, exc)
                return None
            logger.info("built a backward graph without the output gradients %s", absent)
        proto = ir.to_proto(pipeline.ortmodule_backward(self.float32_sums)(ir.from_proto(proto)))
        try:
            staged = stage_graph(proto, input_bytes, self.backward_stages, MIN_STAGE_BYTES, self.dims)
        except CannotStage as exc:
            logger.info("backward runs as one graph: %s", exc)
            staged = one_stage(proto)
        logger.info("backward runs in %d stage(s)", len(staged.stages))
        return StagedSession(staged, self.make_session)


@dataclass
class SchemaGraphs:
    """Everything built for one input schema; sessions are created on first use."""

    captured: Captured
    state_names: list[str]  # parameter and buffer names, in graph input order after the user inputs
    num_inputs: int
    base: onnx.ModelProto  # the exported graph with the state as inputs
    random: bool  # has random ops: onnxruntime's seed is drawn from torch's generator on each run
    device: torch.device
    padding_rows: dict[str, int] = field(default_factory=dict)  # embedding weight name -> padding_idx
    freq_scaled: set[str] = field(default_factory=set)  # embedding weights with scale_grad_by_freq
    shared_weights: set[str] = field(default_factory=set)  # those of both that other modules use too
    log_severity: int = 3
    saver: Saver | None = None
    # Which engine runs the sessions, in which precision (onnxtrain.runtime.backends.resolve).
    backend: str = "onnxruntime"
    precision: str = "fp32"
    # User output position -> the dtype eager autocast returns it in, where the graph's is float32 (bfloat16
    # logits): a Cast at the graph's output (passes.cast_outputs); the output gradient comes back in that dtype
    # and enters the backward graph as float32 (Training.seed_dtypes).
    output_casts: dict[int, ir.DataType] = field(default_factory=dict)
    # Under autocast: (the input shapes of the call the graphs were made on, eager's output shapes there, None for a
    # symbolic one): that call's outputs are checked against them (ortmodule.module._check_eager_shapes)
    eager_shapes: tuple[list, list] | None = None
    inference: TorchSession | None = None
    inference_refused: str | None = None  # why calls without gradients run in PyTorch (ORTModule._fall_back)
    training: dict[tuple[bool, ...], Training] = field(default_factory=dict)
    guards: Guards = field(default_factory=Guards)  # the Python values the graph holds as constants
    traced: tuple | None = None  # capture/structure.py's key, kept when the forward changed what it read
    # Dropout keep-masks drawn by torch before each run, the graphs' last inputs (passes/dropout_masks.py).
    masks: list[Mask] = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        return self.captured.num_outputs

    @property
    def mutated_buffers(self) -> list[str]:
        return self.captured.mutated_buffers

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the graph's fixed axes (the ones the exporter specialized) and the size ranges it was traced
        for (torch.export's range constraints) fit these inputs."""
        for tensor, fixed in zip(tensors, self.captured.static_dims):
            if any(axis >= tensor.dim() or tensor.shape[axis] != size for axis, size in fixed.items()):
                return False
        for tensor, bounds in zip(tensors, self.captured.dim_ranges):  # sizes the graph was traced for
            for axis, (lower, upper) in bounds.items():
                if axis >= tensor.dim() or tensor.shape[axis] < lower or (upper is not None and tensor.shape[axis] > upper):
                    return False
        return True

    def inference_session(self) -> TorchSession:
        if self.inference is None:
            model = pipeline.ortmodule_inference()(ir.from_proto(self.base))
            if self.backend == "openvino":  # mBART's Squeeze without axes, as in the training graphs
                model = pipeline.openvino_graphs()(model)
                _refuse(model, "inference")
            self.inference = self._session(ir.to_proto(cast_outputs(model, self.output_casts)))
        return self.inference

    def _session(self, proto: onnx.ModelProto, in_node_order: bool = False, arena: bool = True,
                 dynamic: onnx.ModelProto | None = None) -> TorchSession:
        """``in_node_order``: onnxruntime runs the nodes in the graph's order (its priority-based order)
        rather than its default topological order, which in the forward graph ran work early and kept its
        outputs alive (BERT-small at 4x batch: the forward's peak at recompute budget 0, 132 -> 88 MB above
        the RSS between steps; the step's activation memory without recompute, 319 -> 307 MB).
        ``arena``: False for a session that takes no memory from the shared arena
        (:func:`onnxtrain.utils.ort_options.forward_without_arena`). ``dynamic``: the graph OpenVINO compiles over
        dynamic sizes, ``proto`` compiled per input sizes (:data:`STATIC_SHAPES` of them)."""
        proto = strip_stop_gradients(proto)
        static = {"static_shapes": STATIC_SHAPES, "dynamic_model": strip_stop_gradients(dynamic)} if dynamic else {}
        precision = self.precision
        if precision == "fp16":  # float16 products in the graph itself (passes.precision), run as it is
            proto, precision = apply_precision(proto, "fp16"), "fp32"
        elif precision == PRODUCTS_BF16:  # lowered in the base graph (lower_products): OpenVINO's float32 hint
            precision = "fp32"
        options = session_options(log_severity=self.log_severity, arena=arena)
        if in_node_order:
            options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        return TorchSession(proto, self.device, options, self.backend, precision, **static)


def lower_products(graphs: SchemaGraphs) -> None:
    """Under :data:`PRODUCTS_BF16`: the base graph's products in bfloat16 but attention's, before autodiff, so each
    gradient product takes its forward product's type (the ``Cast`` rule): a linear layer's in bfloat16, as
    autocast's, attention's in float32, as PyTorch's math kernel computes its backward."""
    from onnxtrain.capture.attention import from_attention  # imports onnxscript: only where the export ran here

    graphs.base = apply_precision(graphs.base, "bf16", keep=from_attention)


class RandomDrawsError(RuntimeError):
    """The graph would draw random numbers where eager PyTorch draws others: its outputs would not be eager's."""


def prepare(captured: Captured, state_names: list[str], device: torch.device, log_severity: int,
            torch_masks: bool = True) -> SchemaGraphs:
    """The base graph; ``torch_masks``: dropout's masks become inputs drawn by torch (passes/dropout_masks.py),
    and a graph that would still draw random numbers itself is refused (:class:`RandomDrawsError`: ORTModule
    falls back); without, the graph's random ops draw from onnxruntime's generator (seeded from torch's)."""
    order = draw_order(captured.model)  # the trace's order: eager's
    model = pipeline.ortmodule_prepare(state_names)(captured.model)
    num_inputs = len(model.graph.inputs) - len(state_names)
    # after the shapes are known; the masks go after the state
    masks = dropout_masks(model, num_inputs, order) if torch_masks else []
    draws = [n for n in model.graph if n.op_type in RANDOM_OPS and not (n.op_type == "Dropout" and draws_nothing(n))]
    proto = ir_version_for_onnxruntime(ir.to_proto(model))
    if draws and torch_masks:
        raise RandomDrawsError(
            f"the graph draws random numbers that eager PyTorch draws otherwise ({_draws(draws)}): from the same "
            f"seed its outputs would not be eager's; {TORCH_DROPOUT_ENV}=0 runs them on onnxruntime's draws "
            "(seeded from torch's generator)")
    return SchemaGraphs(captured, state_names, num_inputs, proto, bool(draws), device, log_severity, masks=masks)


def _draws(nodes: list[ir.Node]) -> str:
    """The random ops, each with the torch op it came from where the exporter recorded it."""
    named = []
    for node in nodes:
        origin = node.metadata_props.get("namespace", "").rsplit(": ", 1)[-1]
        what = "a dropout whose shape the inputs' sizes do not tell, or whose ratio or mode is known at run time only" if node.op_type == "Dropout" \
            else f"{node.op_type} from {origin}" if origin else node.op_type
        if what not in named:
            named.append(what)
    return "; ".join(named)


def build_training(graphs: SchemaGraphs, requires_grad: list[bool], save: Saver | None = None,
                   recompute: Recompute | None = None, input_shapes: list[tuple[int, ...]] | None = None) -> Training:
    """Differentiate the base graph w.r.t. the inputs flagged in ``requires_grad`` and split it.
    ``recompute``: what backward recomputes instead of stashing (:mod:`onnxtrain.passes.recompute`), its
    bytes counted with the dims of ``input_shapes`` (the shapes of ``[*inputs, *state]`` on this call)."""
    # The chunked loss's loop body stays float32 and runs in onnxruntime: not under fp16 products or OpenVINO.
    plain = graphs.precision == "fp32" and graphs.backend == "onnxruntime"
    before = pipeline.before_autodiff(recompute, chunk_loss=plain)
    model = before(ir.from_proto(graphs.base))
    graph = model.graph
    inputs = list(graph.inputs)
    dims = dims_from_inputs(graph, input_shapes or [])
    user_outputs = list(graph.outputs[: graphs.num_outputs])
    wanted = {v for v, flag in zip(inputs, requires_grad) if flag and is_float(v)}
    # Outputs that no gradient can reach (ints, or values behind detach() / no_grad) do not require grad.
    dependent = _depends_on(graph, wanted)
    diff_outputs = [i for i, v in enumerate(user_outputs) if is_float(v) and v in dependent]
    targets = [user_outputs[i] for i in diff_outputs]
    reachable = _reaches(graph, targets)
    wrt = [i for i, v in enumerate(inputs) if v in wanted and v in reachable]

    # Internal names only need to be unique: seeds and gradients take free names.
    taken = set(values_by_name(graph))
    seeds = [ir.Value(name=_free_grad_base(v.name, taken) + "_grad", type=v.type, shape=v.shape) for v in targets]
    graph.inputs.extend(seeds)
    num_forward_outputs = len(graph.outputs)
    if wrt:
        bases = [_free_grad_base(inputs[i].name, taken) for i in wrt]
        add_gradient_outputs(model, [inputs[i] for i in wrt], targets, seeds, names=bases)
    training_passes = pipeline.ortmodule_training(num_forward_outputs, recompute, dims, pipeline.presaved(before))
    model = training_passes(model)
    no_fusion = (fusion.why_not(graphs.backend, graphs.random, graphs.mutated_buffers, user_outputs, diff_outputs)
                 if fused_step() else f"{FUSED_STEP_ENV}=0")
    static = None  # the fused graph OpenVINO compiles per input sizes (its weight gradients' products bf16)
    if graphs.precision == PRODUCTS_BF16:  # weight gradients: float32 from the values the forward cast down,
        # where OpenVINO compiles over dynamic sizes (its bf16 product rounds twice there: passes.precision)
        if graphs.backend == "openvino" and not no_fusion:
            static = pipeline.openvino_graphs()(ir.from_proto(ir.to_proto(model)))
            _refuse(static, "training")
        model = ir.from_proto(float32_accumulations(ir.to_proto(model)))
    if save is not None:
        save(model, "training")
    if graphs.backend == "openvino":  # what OpenVINO cannot compile: rewritten, else refused before any call
        model = pipeline.openvino_graphs()(model)
        _refuse(model, "training")
    elif graphs.device.type == "cpu":  # measured on onnxruntime's CPU kernels only
        model = pipeline.onnxruntime_graphs()(model)
    joint = None if no_fusion else ir_version_for_onnxruntime(ir.to_proto(model))  # before the split takes it apart
    static = None if static is None else ir_version_for_onnxruntime(ir.to_proto(static))
    split = split_forward_backward(model, num_forward_outputs, len(seeds))
    row_scatters = defer_row_scatters(split.backward)  # embedding gradients: torch adds the rows
    stashed = set(split.stashed_outputs)
    in_graph = {k: dtype for k, dtype in graphs.output_casts.items() if k not in stashed}
    forward = ir_version_for_onnxruntime(ir.to_proto(cast_outputs(split.forward, in_graph)))
    backward = ir_version_for_onnxruntime(ir.to_proto(split.backward))
    if save is not None:
        save(forward, "forward")
        save(backward, "backward")
    logger.info("built training graphs: %d forward nodes, %d backward nodes, %d stashed values",
                len(forward.graph.node), len(backward.graph.node), split.num_stashed)
    state = {graphs.num_inputs + i: name for i, name in enumerate(graphs.state_names)}
    names = [state.get(pos) for pos in wrt]  # the parameter (or buffer) each gradient is for, None for inputs
    padding_ids, zero_rows, freq_scaled = _lookup_rules(graphs, names, row_scatters)
    plan = training_passes.step("recompute").plan
    budget = recompute is not None and recompute.budget is not None and plan is not None and plan.saved_bytes > 0
    forward_session = graphs._session(forward, in_node_order=True, arena=not forward_without_arena())
    training = Training(forward_session, backward, split, wrt, diff_outputs,
                        graphs._session, row_scatters, padding_ids, zero_rows, freq_scaled, backward_stages(budget),
                        float32_sums(graphs.precision), plan, dims or None,
                        release=release_step_memory(),
                        copy_out=forward_without_arena() and graphs.device.type == "cpu",
                        seed_dtypes=[_TORCH_DTYPES[seed.dtype] for seed in seeds],
                        torch_casts={k: _TORCH_DTYPES[dtype] for k, dtype in graphs.output_casts.items()
                                     if k not in in_graph})
    if joint is not None:
        training.fused = _fused_step(graphs, training, joint, num_forward_outputs, seeds, names, static)
    else:
        logger.info("forward and backward run as two graphs: %s", no_fusion)
    return training


class BackendRefusal(RuntimeError):
    """The backend cannot compile a graph (ORTModule runs that mode in PyTorch before any graph runs)."""


def _refuse(model: ir.Model, kind: str) -> None:
    """Raise :class:`BackendRefusal` where OpenVINO's CPU plugin would not compile ``model`` (the joint graph for
    ``kind`` "training": the forward, the fused call and every backward graph made later are cut from it, and a
    backward graph is compiled only at its first backward, too late to fall back), naming the node. What a
    backward graph goes through after this (pruning, the backward pipeline, staging) adds no convolution and no
    op of unknown rank (docs/design.md)."""
    refusal = openvino.dynamic_kernel(model.graph)
    if refusal is None:
        refusal = openvino.refusal(strip_stop_gradients(ir.to_proto(model)).SerializeToString())
    if refusal is not None:
        raise BackendRefusal(f"OpenVINO cannot compile the {kind} graph: {refusal}")


def _fused_step(graphs: SchemaGraphs, training: Training, joint: onnx.ModelProto, num_forward_outputs: int,
                seeds: list[ir.Value], names: list[str | None],
                static: onnx.ModelProto | None = None) -> fusion.FusedStep | None:
    """The fused call for the one scalar differentiable output (:func:`fusion.why_not` said it may be
    made), or None where its graph cannot be made or would treat embedding gradients otherwise. ``static``:
    ``joint`` as OpenVINO runs it for fixed input sizes (:data:`STATIC_SHAPES`), with the same inputs and outputs."""
    loss = next(k for k, seed in enumerate(seeds) if seed.shape is not None and len(seed.shape) == 0)
    try:
        proto, plan = fusion.build(joint, num_forward_outputs, [s.name for s in seeds], loss,
                                   training.float32_sums)
    except CannotPrune as exc:
        logger.info("forward and backward run as two graphs: %s", exc)
        return None
    with warnings.catch_warnings():  # the split graphs' rules have warned already
        warnings.simplefilter("ignore")
        rules = _lookup_rules(graphs, names, plan)
    if rules != (training.padding_ids, training.zero_rows, training.freq_scaled):
        logger.info("forward and backward run as two graphs: the fused graph's embedding gradients differ")
        return None
    proto = _with_output_casts(graphs, proto)
    if static is not None:
        static = _with_output_casts(graphs, fusion.build(static, num_forward_outputs, [s.name for s in seeds], loss,
                                                         training.float32_sums)[0])
        if _interface(static) != _interface(proto):  # not expected: then dynamic sizes only
            logger.info("the fused graph runs over dynamic sizes only: its static form's inputs or outputs differ")
            static = None
    if graphs.saver is not None:
        graphs.saver(proto, "fused")
    seed = torch.ones((), dtype=_TORCH_DTYPES[seeds[loss].dtype])
    logger.info("forward and the loss's gradients run as one graph of %d nodes", len(proto.graph.node))
    session = graphs._session(proto) if static is None else graphs._session(static, dynamic=proto)
    return fusion.FusedStep(session, num_forward_outputs, loss, seed, plan, *rules)


def _with_output_casts(graphs: SchemaGraphs, proto: onnx.ModelProto) -> onnx.ModelProto:
    if not graphs.output_casts:  # the forward's outputs keep their places in the fused graph (fusion.build)
        return proto
    return ir_version_for_onnxruntime(ir.to_proto(cast_outputs(ir.from_proto(proto), graphs.output_casts)))


def _interface(proto: onnx.ModelProto) -> tuple:
    """Names and element types of the graph's inputs and outputs, in order."""
    return tuple((v.name, v.type.tensor_type.elem_type) for v in (*proto.graph.input, *proto.graph.output))


_TORCH_DTYPES = {ir.DataType.FLOAT: torch.float32, ir.DataType.DOUBLE: torch.float64,
                 ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}


def _lookup_rules(graphs: SchemaGraphs, names: list[str | None],
                  plan: RowScatters) -> tuple[dict[int, int], dict[int, int], set[int]]:
    """(padding_ids, zero_rows, freq_scaled) of :class:`Training` for the gradients named ``names``
    (None: an input), warning where PyTorch's rule cannot be followed."""
    scattered = {s.gradient for s in plan.scatters} - plan.partial
    padding_ids, zero_rows, freq_scaled = {}, {}, set()
    for k, name in enumerate(names):
        row = graphs.padding_rows.get(name)
        if row is not None:
            if k in scattered:
                padding_ids[k] = row
            elif name not in graphs.shared_weights:
                zero_rows[k] = row
            else:
                _unfollowed(name, f"padding_idx={row}", "its padding row receives the lookups' gradient too")
        if name in graphs.freq_scaled:
            if k in scattered:
                freq_scaled.add(k)
            else:
                _unfollowed(name, "scale_grad_by_freq", "its gradient rows are not divided by the ids' counts")
    return padding_ids, zero_rows, freq_scaled


def _unfollowed(name: str, rule: str, consequence: str) -> None:
    warnings.warn(f"embedding weight {name!r} has {rule}, and its gradient is not all made of lookups onnxtrain "
                  f"can see: under ORTModule {consequence}", UserWarning, stacklevel=3)


def _free_grad_base(name: str, taken: set[str]) -> str:
    """``name`` or ``name_<k>``, whichever first has a ``_grad`` name not in ``taken`` (then taken)."""
    base, k = name, 0
    while f"{base}_grad" in taken:
        k += 1
        base = f"{name}_{k}"
    taken.add(f"{base}_grad")
    return base


def _depends_on(graph: ir.Graph, sources: set[ir.Value]) -> set[ir.Value]:
    """Values some source reaches (over any node but StopGradient): the forward twin of :func:`_reaches`."""
    depends = set(sources)
    for node in graph:
        if not is_stop_gradient(node) and any(v in depends for v in node.inputs if v is not None):
            depends.update(node.outputs)
    return depends


def _reaches(graph: ir.Graph, targets: list[ir.Value]) -> set[ir.Value]:
    """Values from which a gradient can reach some target (over any node but StopGradient)."""
    reach: set[ir.Value] = set(targets)
    for node in reversed(list(graph)):
        if any(o in reach for o in node.outputs) and not is_stop_gradient(node):
            reach.update(v for v in node.inputs if v is not None)
    return reach


class Saver:
    """Writes graphs to ``<dir>/<prefix>_<tag>_<kind>.onnx`` for DebugOptions(save_onnx=True)."""

    def __init__(self, directory: Path, prefix: str, tag: str):
        self.directory, self.prefix, self.tag = directory, prefix, tag

    def __call__(self, model: ir.Model | onnx.ModelProto, kind: str) -> Path:
        proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
        path = self.directory / f"{self.prefix}_{self.tag}_{kind}.onnx"
        save_model_atomic(proto, path)
        logger.info("saved %s", path)
        return path
