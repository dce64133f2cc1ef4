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

Feature and alpha dropout (``dropout2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``) reach the graph as
``aten.bernoulli.p(t, keep)``, which the exporter writes ``Less(RandomUniformLike(t), keep)``; eager draws
``empty_like(t).bernoulli_(keep)`` there, so that ``Less`` becomes a mask input as well (the exporter records
the op a node came from in its metadata). A dropout of ratio 1 becomes ``x * 0``: eager draws nothing there.

A dropout is rewritten only where its ratio and training mode are constants (``0 < p <= 1``) and its shape is
told by the user inputs' sizes (a fixed size, or a symbolic one some input axis has); where any dropout is
not, none is (a partial rewrite would draw in another order than eager), and the graph keeps ``Dropout``
(ORTModule then refuses the graph: ``graphs.RandomDrawsError``). The ratio comes as float32 from the
exporter; ``p`` is the shortest decimal that rounds to it (the ``0.1`` the model's configuration holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from onnxtrain.passes.rewrite import free_name

_DOMAINS = ("", "ai.onnx")
# The ONNX ops that draw random numbers: ORTModule refuses a graph that still has one after the masks
# (ortmodule.graphs.RandomDrawsError), and recomputation never redoes one (passes.recompute).
RANDOM_OPS = frozenset({"Dropout", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike",
                        "Bernoulli", "Multinomial"})
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
    """Rewrite every training-mode ``Dropout`` and ``aten.bernoulli.p`` of ``model`` (inputs
    ``[*user inputs (num_inputs), ...]``) as described above, appending the masks to the graph's inputs in the
    order of ``order`` (:func:`draw_order` of the exported graph, before any pass could reorder nodes); the
    masks, or ``[]`` (nothing changed) where some dropout cannot be rewritten or is not named in ``order`` once."""
    graph = model.graph
    axes = {}  # symbolic dim name -> (user input, axis)
    for k, value in enumerate(list(graph.inputs)[:num_inputs]):
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                axes.setdefault(dim.value, (k, axis))
    plans, zeros = [], []
    for node in graph:
        if node.domain not in _DOMAINS:
            continue
        if node.op_type == "Dropout":
            plan = _plan(node, axes, graph)
        elif _is_bernoulli(node):
            plan = _plan_bernoulli(node, axes)
        else:
            continue
        if plan is None:
            return []
        if plan is _ZEROS:
            zeros.append(node)
        elif plan is not _IDENTITY:
            plans.append((node, *plan))
    if len(set(order)) != len(order) or any(node.name not in order for node, *_ in plans):
        return []
    plans.sort(key=lambda plan: order.index(plan[0].name))
    taken = {v.name for v in graph.inputs} | {v.name for n in graph for v in n.outputs}
    masks = []
    for k, (node, dims, p) in enumerate(plans):
        dropout = node.op_type == "Dropout"
        mask = ir.Value(name=free_name(f"dropout_mask_{k}", taken), type=ir.TensorType(ir.DataType.BOOL),
                        shape=ir.Shape(node.inputs[0].shape if dropout else node.outputs[0].shape))
        graph.inputs.append(mask)
        if dropout:
            _scale_by_mask(graph, node, mask, p)
        else:  # the Less of a bernoulli: its boolean result is the mask (the uniform draw and its shape: unused)
            ir.convenience.replace_all_uses_with(node.outputs[0], mask, replace_graph_outputs=True)
            graph.remove(node, safe=True)
        masks.append(Mask(mask.name, dims, 1 - p if dropout else p))
    for node in zeros:
        _times_zero(graph, node)
    if len(masks) > sum(node.op_type == "Dropout" for node, *_ in plans):
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return masks


def draw_order(model: ir.Model) -> list[str]:
    """The names of the nodes :func:`dropout_masks` turns into masks, in ``model``'s order (read on the exported
    graph, which keeps the trace's order: eager's)."""
    return [n.name for n in model.graph if n.domain in _DOMAINS and (n.op_type == "Dropout" or _is_bernoulli(n))]


def _times_zero(graph: ir.Graph, node: ir.Node) -> None:
    """``Dropout(x, ratio=1)`` -> ``x * 0``: eager's (NaN where x is not finite)."""
    x = node.inputs[0]
    zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, dtype=_NUMPY[x.dtype]))})
    product = ir.node("Mul", [x, zero.outputs[0]], name=node.name)
    product.outputs[0].dtype, product.outputs[0].shape = x.dtype, ir.Shape(x.shape)
    _replace(graph, node, [zero, product])


def _scale_by_mask(graph: ir.Graph, node: ir.Node, mask: ir.Value, p: float) -> None:
    """``Dropout(x)`` -> ``x * (Cast(mask) * scale)``, scale ``float32(1) / float32(1 - p)`` (torch's rounding)."""
    x = node.inputs[0]
    scale = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(
        np.float32(1) / np.float32(1 - p), dtype=np.float32).astype(_NUMPY[x.dtype]))})
    cast = ir.node("Cast", [mask], attributes={"to": x.dtype})
    noise = ir.node("Mul", [cast.outputs[0], scale.outputs[0]])
    product = ir.node("Mul", [x, noise.outputs[0]], name=node.name)
    for new in (cast, noise, product):
        new.outputs[0].dtype, new.outputs[0].shape = x.dtype, ir.Shape(x.shape)
    for new in (scale, cast, noise, product):  # where the node came from (attention: kept float32 as a whole)
        new.metadata_props.update(node.metadata_props)
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        ir.convenience.replace_all_uses_with(node.outputs[1], mask)
    _replace(graph, node, [scale, cast, noise, product])


def _replace(graph: ir.Graph, node: ir.Node, new: list[ir.Node]) -> None:
    """Put ``new`` before ``node``, its last node's output taking the place and the name of ``node``'s first
    output (a graph output keeps its name), and remove ``node``."""
    y, out = node.outputs[0], new[-1].outputs[0]
    graph.insert_before(node, new)
    out.name, y.name = y.name, f"{y.name}_dropout"
    ir.convenience.replace_all_uses_with(y, out, replace_graph_outputs=True)
    graph.remove(node, safe=True)


_IDENTITY = ()  # a dropout in inference mode or of ratio 0: eager draws nothing, onnxruntime copies
_ZEROS = ((),)  # a training-mode dropout of ratio 1: eager draws nothing and returns x * 0


def draws_nothing(node: ir.Node) -> bool:
    """Whether ``node``, a ``Dropout``, draws no random number (inference mode, ratio 0) where its ratio and mode
    are constants."""
    return _plan(node, {}, None) is _IDENTITY


def _plan(node: ir.Node, axes: dict[str, tuple[int, int]], graph: ir.Graph | None):
    """(the mask's dims, p) for a training-mode dropout this pass rewrites, ``_IDENTITY`` for one that draws
    nothing, ``_ZEROS`` for one of ratio 1, or None for one it cannot rewrite."""
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
    if graph is None or not 0 < p <= 1 or x is None or x.shape is None or x.dtype not in _NUMPY:
        return None
    if len(node.outputs) > 1 and node.outputs[1] is not None and (node.outputs[1] in graph.outputs or p == 1):
        return None
    if p == 1:
        return _ZEROS
    dims = _dims(x.shape, axes)
    return None if dims is None else (dims, p)


def _dims(shape: ir.Shape, axes: dict[str, tuple[int, int]]):
    """A mask's dims as :class:`Mask` holds them, or None where some size is not told by the inputs' sizes."""
    dims = []
    for dim in shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif isinstance(dim, ir.SymbolicDim) and dim.value in axes:
            dims.append(axes[dim.value])
        else:
            return None
    return tuple(dims)


_BERNOULLI = "target=torch.ops.aten.bernoulli.p]"  # how the exporter names the op a node came from


def _is_bernoulli(node: ir.Node) -> bool:
    """The ``Less(RandomUniformLike(t), p)`` the exporter writes for ``aten.bernoulli.p(t, p)`` (feature and alpha
    dropout draw with it): eager draws ``empty_like(t).bernoulli_(p)`` there, the draws a mask makes."""
    if node.op_type != "Less" or _BERNOULLI not in node.metadata_props.get("pkg.torch.onnx.fx_node", ""):
        return False
    uniform = node.inputs[0].producer() if node.inputs[0] is not None else None
    return uniform is not None and uniform.op_type == "RandomUniformLike" and uniform.domain in _DOMAINS


def _plan_bernoulli(node: ir.Node, axes: dict[str, tuple[int, int]]):
    """(the mask's dims, the probability of a one) for ``aten.bernoulli.p``'s ``Less``, or None."""
    uniform = node.inputs[0].producer()
    low, high = uniform.attributes.get_float("low", 0.0), uniform.attributes.get_float("high", 1.0)
    keep = ir.convenience.get_const_tensor(node.inputs[1])
    out = node.outputs[0]
    if (low, high) != (0.0, 1.0) or keep is None or keep.size != 1 or out.shape is None:
        return None
    keep = float(str(np.float32(keep.numpy().reshape(()))))  # the shortest decimal, as for Dropout's ratio
    dims = _dims(out.shape, axes)
    return None if dims is None or not 0 < keep < 1 else (dims, keep)

