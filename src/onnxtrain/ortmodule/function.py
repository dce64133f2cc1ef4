"""The ``torch.autograd.Function`` that runs the forward graph and, on backward, the backward graph.

Its inputs are ``[*user input tensors, *parameters and buffers]``; the parameters are the user's own
``torch.nn.Parameter`` objects, so autograd accumulates the gradients the backward graph returns into
their ``.grad`` (and DDP's hooks, gradient clipping and optimizers see them as usual).
"""

from __future__ import annotations

import onnxruntime as ort
import torch
from torch.autograd.function import once_differentiable

from onnxtrain.ortmodule.graphs import SchemaGraphs, Training
from onnxtrain.passes.defer_row_scatters import RowScatters


def reseed(graphs: SchemaGraphs) -> None:
    """Draw onnxruntime's seed from torch's generator so that dropout follows ``torch.manual_seed``."""
    if graphs.random:
        ort.set_seed(int(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).item()))


class ORTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: SchemaGraphs, training: Training, *tensors: torch.Tensor):
        reseed(graphs)
        outputs = training.forward.run(tensors)
        training.forward.check_output_shapes(outputs)  # before anything uses them: ORTModule falls back
        n_user = graphs.num_outputs
        n_visible = n_user + len(graphs.mutated_buffers)
        ctx.training = training
        ctx.num_tensors = len(tensors)
        ctx.stashed = [outputs[i] for i in training.split.stashed_outputs]
        ctx.save_for_backward(*(tensors[j] for j in training.split.reused_inputs))
        ctx.scatter_like = [_like(tensors[training.wrt[s.gradient]]) for s in training.row_scatters.scatters]
        visible = outputs[:n_visible]
        differentiable = set(training.differentiable_outputs)
        ctx.mark_non_differentiable(*(t for i, t in enumerate(visible) if i not in differentiable))
        # Outputs that do not reach the loss get None, not zeros, so that backward can skip them.
        ctx.set_materialize_grads(False)
        ctx.output_meta = [(visible[i].shape, visible[i].dtype, visible[i].device)
                           for i in training.differentiable_outputs]
        return tuple(visible)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        training: Training = ctx.training
        given = [grad_outputs[i] for i in training.differentiable_outputs]
        present = tuple(g is not None for g in given)
        if ctx.stashed is None:
            raise RuntimeError("ORTModule frees the forward's saved tensors during the first backward through a "
                               "graph; a second backward through it (retain_graph=True) is not supported: run "
                               "the forward again")
        stashed, ctx.stashed = ctx.stashed, None  # ours alone now: backward frees each after its last use
        saved = ctx.saved_tensors
        releasable = [t.numel() * t.element_size() for t in stashed]
        session = training.backward_for(present, [0] * sum(present) + releasable + [0] * len(saved))
        if session is None:  # the full graph, with zeros for the missing output gradients
            present = (True,) * len(given)
            session = training.backward_for(present, [0] * len(given) + releasable + [0] * len(saved))
            given = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                     for g, (shape, dtype, device) in zip(given, ctx.output_meta)]
        feeds = [*(_seed(g) for g in given if g is not None), *stashed, *saved]
        del stashed
        grads = _add_rows(session.run(feeds), training.row_scatters, ctx.scatter_like, training.padding_ids,
                          training.freq_scaled)
        result: list[torch.Tensor | None] = [None] * ctx.num_tensors
        for k, row in training.zero_rows.items():
            grads[k][row] = 0
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


def _seed(grad: torch.Tensor) -> torch.Tensor:
    return grad if grad.is_contiguous() else grad.contiguous()
