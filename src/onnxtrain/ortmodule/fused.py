"""One OpenVINO call for the forward and the gradients, when a scalar loss is the only output that takes one.

The gradients of a scalar output ``L`` are linear in the gradient ``g`` that ``backward()`` brings it:
``d(g L)/dp = g dL/dp``. So the joint graph (forward + gradients, before the forward/backward split), with
``L``'s seed fed as 1, gives the outputs and ``dL/dp`` in one call at forward time, and backward only
multiplies them by ``g`` (skipped when ``g`` is 1, as it is for ``loss.backward()``). On OpenVINO this
replaces five calls (forward, four backward stages) and the stash that crosses from one compiled model to
the next (copied out of one infer request, bound to the next) by one call: measured in docs/precision.md.

Exactness first. The fused results hold ``L``'s gradients only; when backward brings a gradient to any
other output (logits also used in a second loss), or none to ``L``, backward runs the forward graph again on
the saved inputs (autograd refuses them if they were changed in place since) and then the exact backward
graph, as without fusion. Decided when the graphs are built, never during training: the fused call is made
only where

- the graphs run on OpenVINO (onnxruntime keeps its staged backward, which frees the stash as it goes);
- exactly one differentiable output is 0-d and floating point (the loss);
- the graph has no random ops (a second forward must draw what the first drew; dropout's masks are inputs,
  :mod:`onnxtrain.passes.dropout_masks`, read again by a second forward) and mutates no buffer (a second
  forward would read the updated buffer);
- embedding gradients come out of the fused graph as ids and rows with the same ``padding_idx`` and
  ``scale_grad_by_freq`` handling as the split backward's (:mod:`onnxtrain.passes.defer_row_scatters`).

``ONNXTRAIN_FUSED_STEP=0`` turns it off (:mod:`onnxtrain.ortmodule.options`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import onnx
import onnx_ir as ir
import torch

from onnxtrain.autodiff.engine import ir_version_for_onnxruntime
from onnxtrain.passes import pipeline
from onnxtrain.passes.defer_row_scatters import RowScatters, defer_row_scatters
from onnxtrain.passes.zero_inputs import CannotPrune, prune_zero_inputs
from onnxtrain.runtime.session import TorchSession

logger = logging.getLogger("onnxtrain.ortmodule")


@dataclass
class FusedStep:
    """The joint graph's session, fed ``[*inputs, *state, seed]``; it returns the forward's outputs
    (``num_forward_outputs``) and then the gradients as ``plan`` makes them (positions counted after the
    forward's outputs)."""

    session: TorchSession
    num_forward_outputs: int
    loss: int  # the position, in the differentiable outputs, of the scalar output whose gradients these are
    seed: torch.Tensor  # the loss's seed: 1, of its dtype
    plan: RowScatters
    padding_ids: dict[int, int] = field(default_factory=dict)
    zero_rows: dict[int, int] = field(default_factory=dict)
    freq_scaled: set[int] = field(default_factory=set)

    def scale(self, grads: list[torch.Tensor], g: torch.Tensor) -> None:
        """Multiply the gradient outputs (all but the row scatters' ids) by ``g`` in place."""
        if bool(g == 1):
            return
        ids = {s.ids for s in self.plan.scatters}
        for k, tensor in enumerate(grads):
            if k not in ids:
                tensor.mul_(g.to(tensor.dtype))


def why_not(backend: str, random: bool, mutated_buffers: list[str], outputs: list[ir.Value],
            differentiable: list[int]) -> str | None:
    """Why the fused call cannot be made for these graphs, or None if it can (before anything is built)."""
    scalars = [i for i in differentiable if outputs[i].shape is not None and len(outputs[i].shape) == 0]
    if backend != "openvino":
        return f"the graphs run on {backend}"
    if random:
        return "the graph draws random numbers, which a second forward would draw differently"
    if mutated_buffers:
        return "the graph updates buffers, which a second forward would read updated"
    if len(scalars) != 1:
        return f"{len(scalars)} differentiable outputs are scalars (one loss is needed)"
    return None


def build(joint: onnx.ModelProto, num_forward_outputs: int, seeds: list[str], loss: int,
          float32_sums: bool = False) -> tuple[onnx.ModelProto, RowScatters]:
    """The fused graph from the joint one (inputs ``[*inputs, *state, *seeds]``, outputs ``[*forward
    outputs, *gradients]``): the other outputs' seeds pruned as zeros, the backward passes run
    (``float32_sums``: as :func:`pipeline.ortmodule_backward`'s) and the loss's log-softmax made a log-sum-exp
    (:mod:`onnxtrain.passes.log_sum_exp_loss`), embedding gradients left as ids and rows.
    Raises :class:`CannotPrune` where the other seeds cannot be pruned."""
    absent = [name for k, name in enumerate(seeds) if k != loss]
    proto = ir_version_for_onnxruntime(prune_zero_inputs(joint, absent)) if absent else joint
    model = pipeline.ortmodule_fused(float32_sums)(ir.from_proto(proto))
    plan = _after(defer_row_scatters(model), num_forward_outputs)
    return ir_version_for_onnxruntime(ir.to_proto(model)), plan


def _after(plan: RowScatters, n: int) -> RowScatters:
    """``plan`` for the outputs after the first ``n`` (the forward's, which it keeps in place)."""
    if plan.kept[:n] != list(range(n)):
        raise CannotPrune("the forward's outputs did not keep their places")
    return RowScatters(plan.num_outputs - n, [k - n for k in plan.kept[n:]],
                       [replace(s, gradient=s.gradient - n, base=None if s.base is None else s.base - n,
                                ids=s.ids - n, rows=s.rows - n) for s in plan.scatters],
                       {k - n for k in plan.partial})

