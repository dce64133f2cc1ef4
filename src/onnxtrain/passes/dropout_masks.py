"""Training-mode ``Dropout`` as a product with a keep-mask that is a graph input, drawn by torch's generator.

Eager PyTorch's dropout on CPU (``aten::dropout``, also the one inside attention's math kernel) draws
``empty_like(x).bernoulli_(1 - p)``, divides it by ``1 - p`` in ``x``'s type and multiplies: ``x * noise``; its
gradient is ``dy * noise``. Inside a graph the mask would come from the engine's generator: onnxruntime's
(seeded from torch's on each run: dropout follows ``torch.manual_seed``, with other masks than eager's) or
OpenVINO's, which converts no training-mode ``Dropout`` at all (and a ``RandomUniformLike`` there draws from a
fixed seed: the same mask on every step). Here each such node becomes

    noise = Cast(mask, x.dtype) * scale        scale = float32(1) / float32(1 - p), torch's rounding
    y     = x * noise

with ``mask`` a boolean graph input, one per dropout, in the graph's order: the exported graph keeps the
trace's order, which is the order eager runs its dropouts in. The caller draws each mask as
``torch.empty(shape, dtype=torch.bool).bernoulli_(1 - p)`` before the run (:class:`Mask`): the draws eager
makes, in its order, so the masks, the outputs and the gradients are eager's bit for bit (the mask does not
depend on the tensor's type: torch's CPU ``bernoulli_`` draws the same booleans for bool, float32 and
bfloat16 tensors of one size, and consumes the generator by the size only). Autodiff then gives the ``Mul``
rule's ``dy * noise``, the stash keeps the boolean mask (one byte an element, as onnxruntime's ``Dropout``
kept), and a second forward (the fused step's exact path, a recomputation) reads the same mask.

A dropout is rewritten only where its ratio and training mode are constants (``0 < p < 1``) and its shape is
told by the user inputs' sizes (a fixed size, or a symbolic one some input axis has); where any dropout is
not, none is (a partial rewrite would draw in another order than eager), and the graph keeps ``Dropout``.
The ratio comes as float32 from the exporter; ``p`` is the shortest decimal that rounds to it (the ``0.1``
the model's configuration holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.passes.rewrite import free_name

_DOMAINS = ("", "ai.onnx")
_NUMPY = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64, ir.DataType.FLOAT16: np.float16}


@dataclass(frozen=True)
class Mask:
    """One dropout's keep-mask input: its name, its shape (a fixed size, or ``(input, axis)``: the size of that
    axis of that user input) and the probability of keeping an element."""

    name: str
    dims: tuple[int | tuple[int, int], ...]
    keep: float

    def shape(self, inputs) -> tuple[int, ...]:
        """The mask's shape for these user inputs (anything with ``.shape``)."""
        return tuple(d if isinstance(d, int) else int(inputs[d[0]].shape[d[1]]) for d in self.dims)


def dropout_masks(model: ir.Model, num_inputs: int, order: list[str]) -> list[Mask]:
    """Rewrite every training-mode ``Dropout`` of ``model`` (inputs ``[*user inputs (num_inputs), ...]``) as
    described above, appending the masks to the graph's inputs in the order of ``order`` (the dropout nodes'
    names in the exported graph, before any pass could reorder them); the masks, or ``[]`` (nothing changed)
    where some dropout cannot be rewritten or is not named in ``order`` once."""
    graph = model.graph
    axes = {}  # symbolic dim name -> (user input, axis)
    for k, value in enumerate(list(graph.inputs)[:num_inputs]):
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                axes.setdefault(dim.value, (k, axis))
    plans = []
    for node in graph:
        if node.op_type != "Dropout" or node.domain not in _DOMAINS:
            continue
        plan = _plan(node, axes, graph)
        if plan is None:
            return []
        if plan is not _IDENTITY:
            plans.append((node, *plan))
    if len(set(order)) != len(order) or any(node.name not in order for node, *_ in plans):
        return []
    plans.sort(key=lambda plan: order.index(plan[0].name))
    taken = {v.name for v in graph.inputs} | {v.name for n in graph for v in n.outputs}
    masks = []
    for k, (node, dims, p) in enumerate(plans):
        x, y = node.inputs[0], node.outputs[0]
        mask = ir.Value(name=free_name(f"dropout_mask_{k}", taken), type=ir.TensorType(ir.DataType.BOOL),
                        shape=ir.Shape(x.shape))
        graph.inputs.append(mask)
        scale = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(
            np.float32(1) / np.float32(1 - p), dtype=np.float32).astype(_NUMPY[x.dtype]))})
        cast = ir.node("Cast", [mask], attributes={"to": x.dtype})
        noise = ir.node("Mul", [cast.outputs[0], scale.outputs[0]])
        product = ir.node("Mul", [x, noise.outputs[0]], name=node.name)
        for new in (cast, noise, product):
            new.outputs[0].dtype, new.outputs[0].shape = x.dtype, ir.Shape(x.shape)
        for new in (scale, cast, noise, product):  # where the node came from (attention: kept float32 as a whole)
            new.metadata_props.update(node.metadata_props)
        graph.insert_before(node, [scale, cast, noise, product])
        product.outputs[0].name, y.name = y.name, f"{y.name}_dropout"  # a graph output keeps its name
        ir.convenience.replace_all_uses_with(y, product.outputs[0], replace_graph_outputs=True)
        if len(node.outputs) > 1 and node.outputs[1] is not None:
            ir.convenience.replace_all_uses_with(node.outputs[1], mask)
        graph.remove(node, safe=True)
        masks.append(Mask(mask.name, dims, 1 - p))
    return masks


_IDENTITY = ()  # a dropout in inference mode or of ratio 0: eager draws nothing, onnxruntime copies


def _plan(node: ir.Node, axes: dict[str, tuple[int, int]], graph: ir.Graph):
    """(the mask's dims, p) for a training-mode dropout this pass rewrites, ``_IDENTITY`` for one that draws
    nothing, or None for one it cannot rewrite."""
    x = node.inputs[0]
    if len(node.inputs) < 3 or node.inputs[2] is None:  # no training_mode: inference
        return _IDENTITY
    training = ir.convenience.get_const_tensor(node.inputs[2])
    ratio = ir.tensor(np.array(0.5, np.float32)) if node.inputs[1] is None else \
        ir.convenience.get_const_tensor(node.inputs[1])
    if training is None or ratio is None:  # decided when it runs
        return None
    p = float(str(np.float32(ratio.numpy())))  # the shortest decimal of the float32 ratio: the configuration's 0.1
    if not bool(training.numpy()) or p == 0:
        return _IDENTITY
    if not 0 < p < 1 or x is None or x.shape is None or x.dtype not in _NUMPY:
        return None
    if len(node.outputs) > 1 and node.outputs[1] is not None and node.outputs[1] in graph.outputs:
        return None
    dims = []
    for dim in x.shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif isinstance(dim, ir.SymbolicDim) and dim.value in axes:
            dims.append(axes[dim.value])
        else:
            return None
    return tuple(dims), p

