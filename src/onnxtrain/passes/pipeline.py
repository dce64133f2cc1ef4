"""The order in which passes build the training graphs, said once per front end.

Each function below returns a :class:`Pipeline`: the passes one stage of graph building runs, in
order, over one ``onnx_ir`` model (the model stays in the IR from the first pass to the last). Each step
says why it sits where it does; the callers (``ortmodule/graphs.py``, ``ondevice/artifacts.py``) build
graphs around these stages (capture, autodiff, the forward/backward split, the loss and optimizer blocks)
and convert to protos only at session and file boundaries.

ORTModule (``onnxtrain.ortmodule.graphs``)::

    captured model -> ortmodule_prepare -> base graph -> before_autodiff --autodiff-->
        ortmodule_training (recompute last)
        --split_forward_backward--> forward graph, backward graph --per pattern of present output
        gradients: prune_zero_inputs--> ortmodule_backward --stage_graph--> sessions

On-device artifacts (``onnxtrain.ondevice.artifacts``)::

    model, parameters lifted to inputs -> artifacts_forward --+ loss, outputs--> artifacts_eval -> eval graph
    eval graph -> before_autodiff --autodiff--> artifacts_training -> training_model.onnx
    eval graph -> artifacts_eval_export -> eval_model.onnx

To add a pass: write it as an ``ir.passes.InPlacePass`` (or ``FunctionalPass``) in its own file with its
test, then add one ``Step`` to the pipeline it belongs to, at the place its requirements hold, with a
line saying why it is there. A pass with knobs takes them in its constructor; the pipeline function
takes them as arguments and its caller passes them from the user's options.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx_ir as ir
import onnx_ir.passes.common

from onnxtrain.passes.chunk_cross_entropy import ChunkCrossEntropyPass, chunks_for
from onnxtrain.passes.conv_batch_gemm import ConvBatchGemmPass
from onnxtrain.passes.conv_patches import ConvColumnsPass, ConvPatchesPass
from onnxtrain.passes.erf_cdf import ErfCdfPass
from onnxtrain.passes.expand_cross_entropy import ExpandCrossEntropyPass
from onnxtrain.passes.initializers_to_inputs import InitializersToInputsPass
from onnxtrain.passes.log_sum_exp_loss import LogSumExpLossPass
from onnxtrain.passes.optimize import OptimizePass
from onnxtrain.passes.order_backward import OrderBackwardPass
from onnxtrain.passes.recompute import Recompute, RecomputePass, Saved
from onnxtrain.passes.shared_rows import SharedRowsPass
from onnxtrain.passes.split_sizes import SplitSizesPass
from onnxtrain.passes.squeeze_axes import SqueezeAxesPass
from onnxtrain.passes.strip_stop_gradients import StripStopGradientsPass
from onnxtrain.passes.sum_rows_by_matmul import SumRowsByMatMulPass
from onnxtrain.passes.symbolic_shapes import SymbolicShapesPass
from onnxtrain.passes.transposed_gemm import TransposedGemmPass

logger = logging.getLogger("onnxtrain.passes")


@dataclass(frozen=True)
class Step:
    """One pass of a pipeline and why it runs where it does."""

    name: str
    run: ir.passes.PassBase
    why: str


class Pipeline:
    """Named passes run in order over one model; :meth:`__call__` returns the resulting model (the same
    object unless a step is a functional pass)."""

    def __init__(self, name: str, steps: Sequence[Step]):
        names = [s.name for s in steps]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pipeline {name!r}: step names repeat: {dupes}")
        self.name, self.steps = name, list(steps)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    def step(self, name: str) -> ir.passes.PassBase:
        """The pass of the step named ``name`` (to read what it found after the run)."""
        for s in self.steps:
            if s.name == name:
                return s.run
        raise KeyError(f"pipeline {self.name!r} has no step {name!r}; its steps: {self.names}")

    def __call__(self, model: ir.Model) -> ir.Model:
        for step in self.steps:
            start = time.perf_counter()
            result = step.run(model)
            model = result.model
            logger.debug("%s/%s: %s in %.3f s", self.name, step.name,
                         "modified" if result.modified else "unchanged", time.perf_counter() - start)
        return model

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, {self.names})"


# -------------------------------------------------------------------------------------------------
# ORTModule
# -------------------------------------------------------------------------------------------------


def ortmodule_prepare(state_names: Sequence[str]) -> Pipeline:
    """The exported graph -> the base graph every training and inference graph is built from."""
    return Pipeline("ortmodule_prepare", [
        Step("initializers_to_inputs", InitializersToInputsPass(state_names),
             "first: parameters and buffers become inputs before anything may fold a weight into a constant"),
        Step("optimize", OptimizePass(),
             "folds the shape arithmetic that gradient rules need as constants; weights are inputs by now"),
        Step("remove_unused_nodes", onnx_ir.passes.common.RemoveUnusedNodesPass(),
             "drops what folding left unused"),
        Step("symbolic_shapes", SymbolicShapesPass(),
             "last: names the dims of the final graph, so that autodiff un-broadcasts at build time"),
    ])


def before_autodiff(recompute: Recompute | None = None, chunk_loss: bool = True) -> Pipeline:
    """The graph autodiff differentiates, in ORTModule's training graphs and the artifacts' training model
    (inference and eval graphs keep the plain loss). ``chunk_loss=False``: never the chunked loss."""
    steps = []
    if chunk_loss and chunks_for(recompute):
        steps.append(Step("chunk_cross_entropy", ChunkCrossEntropyPass(),
                          "before autodiff: its loss's gradient is the Mul rule's on values the chunks make; with a "
                          "recompute budget below 1 only"))
    return Pipeline("before_autodiff", steps)


def presaved(before: Pipeline) -> list[Saved]:
    """What a ``before_autodiff`` pipeline (already run) took off the stash: the chunked losses' log-softmax."""
    return list(before.step("chunk_cross_entropy").saved) if "chunk_cross_entropy" in before.names else []


def ortmodule_training(num_forward_outputs: int, recompute: Recompute | None = None,
                       dims: Mapping[str, int] | None = None, saved: Sequence[Saved] = ()) -> Pipeline:
    """The joint graph (forward + gradients, just differentiated) before the forward/backward split.
    ``num_forward_outputs``: its first outputs are the forward's; ``dims``: sizes of its symbolic dims;
    ``saved``: :func:`presaved` of the ``before_autodiff`` run, shown in the recompute plan's table."""
    return Pipeline("ortmodule_training", [
        Step("expand_cross_entropy", ExpandCrossEntropyPass(),
             "after autodiff: the SoftmaxCrossEntropyLoss rule builds the cheaper backward"),
        Step("recompute", RecomputePass(num_forward_outputs, recompute, dims, saved),
             "last before the split: decides what backward recomputes of the final forward; the split puts "
             "the clones in backward"),
    ])


def openvino_graphs() -> Pipeline:
    """A graph ORTModule runs on OpenVINO, what its CPU plugin cannot compile written in a form it can: the joint
    graph after :func:`ortmodule_training` (before the split, so that the forward, backward and fused graphs all
    have it), and the inference graph after :func:`ortmodule_inference`."""
    return Pipeline("openvino_graphs", [
        Step("conv_columns", ConvColumnsPass(),
             "convolution weight gradients (kernels of dynamic size) as one product over the stacked input windows "
             "where ungrouped and of at most 16 positions: the per-position products' Concat ran on the plugin's "
             "reference kernel (ResNet-18's backward, docs/precision.md)"),
        Step("conv_patches", ConvPatchesPass(),
             "the other convolution weight gradients as products over input windows, one per position"),
        Step("squeeze_axes", SqueezeAxesPass(), "a Squeeze without axes has a dynamic rank in OpenVINO"),
        Step("split_sizes", SplitSizesPass(), "OpenVINO splits by num_outputs only into equal chunks"),
    ])


def onnxruntime_graphs() -> Pipeline:
    """The joint graph ORTModule runs on onnxruntime, after :func:`ortmodule_training` (before the split), the
    counterpart of :func:`openvino_graphs`."""
    return Pipeline("onnxruntime_graphs", [
        Step("conv_columns", ConvColumnsPass(),
             "convolution weight gradients as one product over the stacked input windows: onnxruntime's Conv runs "
             "one small product per image there (ResNet-18's backward, docs/design.md)"),
        Step("conv_batch_gemm", ConvBatchGemmPass(),
             "convolutions and input gradients over small images (static sizes) as one product over the batch; "
             "after conv_columns, whose Conv it leaves alone (a kernel of dynamic size)"),
    ])


def ortmodule_backward(float32_sums: bool = False) -> Pipeline:
    """Each backward graph, after the absent output gradients are pruned and before it is cut in stages.
    ``float32_sums``: only the row sums whose rows a product also reads (linear layers' bias gradients) become
    products; the others (LayerNorm's) stay ``ReduceSum``, which OpenVINO runs in float32 under its bf16 hint
    (:func:`onnxtrain.runtime.openvino_float32.float32_sums`)."""
    return Pipeline("ortmodule_backward", [
        Step("strip_stop_gradients", StripStopGradientsPass(), "bound for a session: onnxruntime knows no StopGradient"),
        Step("sum_rows_by_matmul", SumRowsByMatMulPass(only_product_gradients=float32_sums),
             "after pruning, which cannot see through the Shape this pass reads"),
        Step("transposed_gemm", TransposedGemmPass(),
             "after pruning: a pruned gradient leaves no Transpose of a product to fold"),
    ])


def ortmodule_fused(float32_sums: bool = False) -> Pipeline:
    """The fused forward + backward graph (OpenVINO; :mod:`onnxtrain.ortmodule.fused`) after its absent output
    gradients are pruned: :func:`ortmodule_backward`'s passes, then the loss's log-softmax as a log-sum-exp, the loss
    gradient's two row views as one, GELU's ``HardSigmoid`` as ``Mul`` and ``Add``."""
    return Pipeline("ortmodule_fused", [
        *ortmodule_backward(float32_sums).steps,
        Step("log_sum_exp_loss", LogSumExpLossPass(),
             "the loss and its gradient's Exp in one graph: the log-softmax itself need not be made"),
        Step("shared_rows", SharedRowsPass(),
             "joint graph only: a gradient read by the input gradient's and the weight gradient's products "
             "is converted to bf16 once"),
        Step("erf_cdf", ErfCdfPass(),
             "OpenVINO only: its HardSigmoid is a reference float32 kernel; Mul and Add join the Erf's jit chain"),
    ])


def ortmodule_inference() -> Pipeline:
    """The base graph run without gradients."""
    return Pipeline("ortmodule_inference", [
        Step("expand_cross_entropy", ExpandCrossEntropyPass(), "no gradient rule to prefer the fused op for"),
    ])


# -------------------------------------------------------------------------------------------------
# On-device artifacts
# -------------------------------------------------------------------------------------------------


def artifacts_forward() -> Pipeline:
    """The user's model with its checkpoint parameters lifted to inputs, before the loss is added."""
    return Pipeline("artifacts_forward", [
        Step("topological_sort", onnx_ir.passes.common.TopologicalSortPass(),
             "first: a model from any source may list its nodes out of order; every later pass walks them in order"),
        Step("optimize", OptimizePass(), "parameters are inputs now: only true constants (shape arithmetic) fold"),
    ])


def artifacts_eval() -> Pipeline:
    """The model with its loss and outputs set: the eval graph that the training graph is built from."""
    return Pipeline("artifacts_eval", [
        Step("remove_unused_nodes", onnx_ir.passes.common.RemoveUnusedNodesPass(),
             "after the outputs are set: drops what neither the loss nor an output reads"),
    ])


def artifacts_training(num_outputs: int, recompute: Recompute | None = None, sum_rows_by_matmul: bool = True,
                       seeds: Sequence[ir.Value] = (), saved: Sequence[Saved] = (),
                       transposed_gemm: bool = True, float32_sums: bool = False, erf_cdf: bool = False,
                       conv_patches: bool = False) -> Pipeline:
    """The eval graph with the gradients added: training_model.onnx. ``num_outputs``: the eval graph's
    outputs (loss and additional outputs), first in the training graph's; ``recompute``: a plan, if any
    (onnxruntime runs the graph as one session: with a plan, the backward work that reads only forward
    values is gated on the gradient values its readers need, ``seeds`` being where backward starts, so that
    it runs where the plan put it, not early);
    ``sum_rows_by_matmul=False`` keeps the gradients' ``ReduceSum`` (web artifacts: onnxruntime-web's
    WebGPU MatMul refuses the row-of-ones product); ``saved``: as :func:`ortmodule_training`'s;
    ``transposed_gemm=False`` keeps the weight gradients' ``Transpose`` (web artifacts: not measured there);
    ``float32_sums``: as :func:`ortmodule_backward`'s; ``erf_cdf``: GELU's gradient's ``HardSigmoid`` as ``Mul`` and
    ``Add`` (bf16 artifacts, which the runtime runs on OpenVINO: :func:`ortmodule_fused`'s rewrite);
    ``conv_patches``: convolution weight gradients as products over input windows (bf16 artifacts: OpenVINO's plugin
    compiles no kernel of dynamic size; :func:`openvino_graphs`' rewrite)."""
    steps = [
        Step("expand_cross_entropy", ExpandCrossEntropyPass(),
             "after autodiff: the SoftmaxCrossEntropyLoss rule builds the cheaper backward"),
    ]
    if sum_rows_by_matmul:
        steps.append(Step("sum_rows_by_matmul", SumRowsByMatMulPass(only_product_gradients=float32_sums),
                          "after autodiff: rewrites the gradients' leading-axis sums"))
    if transposed_gemm:
        steps.append(Step("transposed_gemm", TransposedGemmPass(),
                          "after autodiff: a weight used transposed gets its gradient as one Gemm, not a Gemm and "
                          "a Transpose (OpenVINO ran that Transpose on its reference kernel; onnxruntime fused the two "
                          "into a node its priority-based order runs last among the ready ones, keeping what it "
                          "reads alive)"))
    if erf_cdf:
        steps.append(Step("erf_cdf", ErfCdfPass(),
                          "after autodiff, which writes the GELU rule's HardSigmoid: OpenVINO has only a reference "
                          "float32 kernel for it, while Mul and Add join the Erf's jit chain (the same values)"))
    if conv_patches:
        steps.append(Step("conv_patches", ConvPatchesPass(),
                          "after autodiff, which writes the weight gradients: OpenVINO compiles no convolution whose "
                          "kernel (the output gradient) has a dynamic size; before recompute plans the final graph"))
    if recompute is not None:
        planner = RecomputePass(num_outputs, recompute, saved=saved, split=False)
        steps.append(Step("recompute", planner,
                          "after the rewrites of the gradient nodes, which it clones forward work for"))
        if seeds:
            def recomputes() -> bool:
                return planner.plan is not None and any(c.on for c in planner.plan.candidates)

            steps.append(Step("order_backward", OrderBackwardPass(num_outputs, seeds, when=recomputes),
                              "after recompute has placed its clones: keeps them, and the backward work that reads "
                              "only forward values, from running before their readers in the one session"))
    steps.append(Step("strip_stop_gradients", StripStopGradientsPass(), "last: the file runs on any ONNX runtime"))
    return Pipeline("artifacts_training", steps)


def artifacts_eval_export() -> Pipeline:
    """The eval graph as written to eval_model.onnx."""
    return Pipeline("artifacts_eval_export", [
        Step("expand_cross_entropy", ExpandCrossEntropyPass(), "no gradient rule to prefer the fused op for"),
        Step("strip_stop_gradients", StripStopGradientsPass(), "last: the file runs on any ONNX runtime"),
    ])


__all__ = [
    "Pipeline",
    "Step",
    "artifacts_eval",
    "artifacts_eval_export",
    "artifacts_forward",
    "artifacts_training",
    "ortmodule_backward",
    "before_autodiff",
    "ortmodule_inference",
    "ortmodule_prepare",
    "ortmodule_training",
    "presaved",
]
