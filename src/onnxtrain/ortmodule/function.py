"""The ``torch.autograd.Function`` that runs the forward graph and, on backward, the backward graph.

Its inputs are ``[*user input tensors, *parameters and buffers]`` (the graphs take the dropout masks drawn here
after them: :func:`reseed`); the parameters are the user's own
``torch.nn.Parameter`` objects, so autograd accumulates the gradients the backward graph returns into
their ``.grad`` (and DDP's hooks, gradient clipping and optimizers see them as usual). Where the training
graphs have a fused step (:mod:`onnxtrain.ortmodule.fused`), forward computes the loss's gradients too and
backward scales them, or, when another output takes a gradient, runs the forward graph again and the exact
backward graph.
"""

from __future__ import annotations

import contextlib

import onnxruntime as ort
import torch
from torch.autograd.function import once_differentiable

from onnxtrain.ortmodule.graphs import SchemaGraphs, Training
from onnxtrain.passes.defer_row_scatters import RowScatters
from onnxtrain.runtime import torch_threads
from onnxtrain.utils.ort_options import release_arena


def reseed(graphs: SchemaGraphs, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dropout keep-masks for a run on ``tensors`` (the user inputs come first), drawn from torch's generator
    as eager draws them, in eager's order (:mod:`onnxtrain.passes.dropout_masks`), after onnxruntime's seed,
    drawn from it too where the graph keeps random ops: both follow ``torch.manual_seed``."""
    if graphs.random:
        ort.set_seed(int(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).item()))
    return [_keep_mask(m.shape(tensors), m.keep, graphs.device) for m in graphs.masks]


def _keep_mask(shape: tuple[int, ...], keep: float, device: torch.device) -> torch.Tensor:
    mask = torch.empty(shape, dtype=torch.bool, device=device)
    return mask.bernoulli_(keep) if mask.numel() else mask  # eager's dropout of an empty tensor draws nothing


class ORTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: SchemaGraphs, training: Training, *given: torch.Tensor):
        tensors = [*given, *reseed(graphs, given)]  # the graphs' inputs: the masks come last
        if training.release:  # what was freed since the last step (its gradients, at zero_grad) goes back first
            release_arena()
        n_visible = graphs.num_outputs + len(graphs.mutated_buffers)
        ctx.training = training
        ctx.num_tensors = len(given)
        ctx.scatter_like = [_like(tensors[training.wrt[s.gradient]]) for s in training.row_scatters.scatters]
        fused = training.fused
        if fused is not None:  # outputs and the loss's gradients in one call (onnxtrain.ortmodule.fused)
            outputs = fused.session.run([*tensors, fused.seed])
            fused.session.check_output_shapes(outputs, [*tensors, fused.seed])
            ctx.fused_grads = outputs[fused.num_forward_outputs:]
            ctx.fused_like = [_like(tensors[training.wrt[s.gradient]]) for s in fused.plan.scatters]
            ctx.stashed = None
            ctx.save_for_backward(*tensors)  # for the exact path, should another output take a gradient
        else:
            outputs = training.forward.run(tensors)
            training.forward.check_output_shapes(outputs, tensors)  # before anything uses them: ORTModule falls back
            ctx.fused_grads = None
            ctx.stashed = [outputs[i] for i in training.split.stashed_outputs]
            ctx.save_for_backward(*(tensors[j] for j in training.split.reused_inputs))
        visible = outputs[:n_visible]
        if fused is None:  # eager autocast's dtypes for the outputs stashed too (the others are cast in the graph)
            for k, dtype in training.torch_casts.items():
                visible[k] = visible[k].to(dtype)
        differentiable = set(training.differentiable_outputs)
        ctx.mark_non_differentiable(*(t for i, t in enumerate(visible) if i not in differentiable))
        # Outputs that do not reach the loss get None, not zeros, so that backward can skip them.
        ctx.set_materialize_grads(False)
        ctx.output_meta = [(visible[i].shape, visible[i].dtype, visible[i].device)
                           for i in training.differentiable_outputs]
        return tuple(visible)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        if torch.is_grad_enabled():  # autograd runs backward in grad mode only for create_graph=True
            raise RuntimeError("ORTModule's graphs give first-order gradients only: a backward with "
                               "create_graph=True (torch.autograd.grad of a gradient: gradient penalties, "
                               "Hessian-vector products, MAML) needs the module run in PyTorch, without ORTModule")
        # on OpenVINO, the torch work here opens no OpenMP team whose idle worker would spin into the next call
        with torch_threads.one_thread() if ctx.training.forward.backend == "openvino" else contextlib.nullcontext():
            return ORTFunction._backward(ctx, *grad_outputs)

    @staticmethod
    @once_differentiable
    def _backward(ctx, *grad_outputs: torch.Tensor):
        training: Training = ctx.training
        given = [grad_outputs[i] for i in training.differentiable_outputs]
        if ctx.stashed is None and ctx.fused_grads is None:
            raise RuntimeError("ORTModule frees the forward's saved tensors during the first backward through a "
                               "graph; a second backward through it (retain_graph=True) is not supported: run "
                               "the forward again")
        fused = training.fused
        if ctx.fused_grads is not None:
            grads, ctx.fused_grads = ctx.fused_grads, None
            loss = given[fused.loss]
            if loss is not None and all(g is None for k, g in enumerate(given) if k != fused.loss):
                fused.scale(grads, loss)
                grads = _add_rows(grads, fused.plan, ctx.fused_like, fused.padding_ids, fused.freq_scaled)
                return _result(ctx, training, fused.zero_rows, grads)
            del grads  # another output has a gradient: forward again, then the exact backward
            tensors = ctx.saved_tensors
            outputs = training.forward.run(tensors)
            stashed = [outputs[i] for i in training.split.stashed_outputs]
            saved = [tensors[j] for j in training.split.reused_inputs]
            del outputs, tensors
        else:
            stashed, ctx.stashed = ctx.stashed, None  # ours alone now: backward frees each after its last use
            saved = ctx.saved_tensors
        grads = _split_backward(ctx, training, given, stashed, saved)
        return _result(ctx, training, training.zero_rows, grads)


def _split_backward(ctx, training: Training, given: list, stashed: list[torch.Tensor],
                    saved: list[torch.Tensor]) -> list[torch.Tensor]:
    """The backward graph for the present output gradients, fed the forward's stash (emptied here)."""
    present = tuple(g is not None for g in given)
    releasable = [t.numel() * t.element_size() for t in stashed]
    session = training.backward_for(present, [0] * sum(present) + releasable + [0] * len(saved))
    if session is None:  # the full graph, with zeros for the missing output gradients
        present = (True,) * len(given)
        session = training.backward_for(present, [0] * len(given) + releasable + [0] * len(saved))
        given = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(given, ctx.output_meta)]
    feeds = [*(_seed(g, dtype) for g, dtype in zip(given, training.seed_dtypes) if g is not None), *stashed, *saved]
    stashed.clear()
    outputs = session.run(feeds)
    if training.copy_out:
        _out_of_arena(outputs)
    return _add_rows(outputs, training.row_scatters, ctx.scatter_like, training.padding_ids, training.freq_scaled)


def _out_of_arena(outputs: list[torch.Tensor]) -> None:
    """Replace backward's outputs by copies in torch's memory, handing the arena's free regions back before the
    first copy and after each original is dropped, so that no copy comes on top of the arena's high-water
    mark. Held as ``.grad`` until the next ``zero_grad``, the arena's chunks would keep the regions they sit
    in, with their free space, from the system between steps (``ONNXTRAIN_CPU_ARENA=backward``; GPT-2-small at
    4x batch, budget 1.0: 412 MB)."""
    release_arena()
    for k in range(len(outputs)):
        outputs[k] = outputs[k].clone()
        release_arena()


def _result(ctx, training: Training, zero_rows: dict[int, int], grads: list[torch.Tensor]) -> tuple:
    """backward's return: None for the graphs and for the inputs without a gradient."""
    result: list[torch.Tensor | None] = [None] * ctx.num_tensors
    for k, row in zero_rows.items():
        grads[k][row] = 0
    if training.release:  # the step's last onnxruntime work is done and its values dropped
        release_arena()
    for position, grad in zip(training.wrt, grads):
        result[position] = grad
    return (None, None, *result)


def _like(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.dtype, tensor.device


def _add_rows(outputs: list[torch.Tensor], plan: RowScatters, like: list[tuple],
              padding_ids: dict[int, int], freq_scaled: set[int]) -> list[torch.Tensor]:
    """The gradients from the backward graph's outputs: the embedding gradients' rows added up here,
    leaving out the rows looked up at a ``padding_idx`` (``padding_ids``: gradient position -> id) and,
    for ``scale_grad_by_freq`` (``freq_scaled``), dividing each row by its id's count in its lookup."""
    if not plan.scatters:
        return outputs
    grads: list[torch.Tensor | None] = [None] * plan.num_outputs
    for k, position in enumerate(plan.kept):
        grads[position] = outputs[k]
    for scatter, (shape, dtype, device) in zip(plan.scatters, like):
        target = grads[scatter.gradient]
        if target is None:
            target = torch.zeros(shape, dtype=dtype, device=device)
        ids, rows = outputs[scatter.ids], outputs[scatter.rows]
        column = [-1] + [1] * (rows.dim() - 1)
        if scatter.gradient in freq_scaled:
            counts = torch.bincount(ids, minlength=shape[0])
            rows = rows / counts[ids].view(column).to(rows.dtype)
        padding = padding_ids.get(scatter.gradient)
        if padding is not None:
            rows = rows.masked_fill((ids == padding).view(column), 0)
        grads[scatter.gradient] = target.index_add_(0, ids, rows)
    return grads  # type: ignore[return-value]


def _seed(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output gradient as the backward graph takes it: contiguous, in the graph's dtype (float32 where eager
    autocast's bfloat16 output brought a bfloat16 gradient)."""
    return grad.to(dtype, memory_format=torch.contiguous_format)
