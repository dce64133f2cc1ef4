"""Optimizer blocks: AdamW and SGD as one standard-op ONNX graph that updates every parameter per call.

The trainable parameters are laid out, per element type, in one flat vector (the runtime keeps them
that way in memory, each parameter a view into it), so a step is a handful of elementwise nodes over a
few long vectors instead of a dozen nodes per parameter. The vectors are cut into chunks (rows), and a
``Scan`` runs the update chunk by chunk so that each chunk stays in cache through all of its operations
(:mod:`onnxtrain.utils.chunks`). The graph's interface, for each element type ``T`` present (e.g.
``float32``):

    inputs   learning_rate (float32 scalar), step (int64 scalar: the step being taken, 1 for the first),
             params.T, gradients.T, then one ``<state>.T`` per optimizer state, each [chunks, chunk]:
             the flat vector, zero-padded to whole chunks
    outputs  params.T.out, then ``<state>.T.out``: the new values, which the runtime writes into a second
             copy of each vector and then swaps the copies (no buffer is both an input and an output)

The layout (parameter names, shapes, order) and the hyperparameters are stored as JSON in the model's
metadata under ``onnxtrain.optimizer``; the runtime checks it against the module it steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import onnx
import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder
from onnxtrain.blocks import loss_scale
from onnxtrain.blocks.loss_scale import LossScaler
from onnxtrain.ondevice.format import (
    GOOD_STEPS,
    GRADIENTS,
    LEARNING_RATE,
    LOSS_SCALE,
    OPTIMIZER_METADATA_KEY,
    PARAMS,
    STEP,
    flat_name,
    updated_name,
)
from onnxtrain.utils.chunks import chunking

OPSET = 17
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclass
class AdamW:
    """AdamW as ``torch.optim.AdamW`` (decoupled weight decay); defaults are ONNX Runtime Training's.

    ``max_grad_norm`` clips the gradients by their global L2 norm first (``clip_grad_norm_``).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    bias_correction: bool = True
    max_grad_norm: float | None = None

    states = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {self.betas}")
        if self.eps < 0 or self.weight_decay < 0 or self.lr < 0:
            raise ValueError(f"AdamW lr, eps and weight_decay must be >= 0, got {self}")
        _check_clip(self.max_grad_norm)

    def scalars(self, op: GraphBuilder, lr, step, dtype: ir.DataType) -> dict[str, ir.Value]:
        """The step's scalar factors, computed once per step outside the per-chunk loop.

        With bias corrections bc1 = 1 - b1^t and bc2 = 1 - b2^t, torch's update
        ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` is ``p -= step_size * m / (sqrt(v) + eps_hat)``
        with ``step_size = lr * sqrt(bc2) / bc1`` and ``eps_hat = eps * sqrt(bc2)``: two passes fewer.
        """
        c = lambda x: op.const(x, dtype=dtype)
        b1, b2 = self.betas
        step_size, eps = lr, c(self.eps)
        if self.bias_correction:
            t = op.Cast(step, to=dtype)
            root_bc2 = op.Sqrt(op.Sub(c(1.0), op.Pow(c(b2), t)))
            step_size = op.Div(op.Mul(lr, root_bc2), op.Sub(c(1.0), op.Pow(c(b1), t)))
            eps = op.Mul(eps, root_bc2)
        return {"decay": op.Sub(c(1.0), op.Mul(lr, c(self.weight_decay))), "step_size": step_size, "eps": eps}

    def update(self, op: GraphBuilder, p, g, states, k: dict[str, ir.Value]):
        """The new parameter and states (first and second moments) of one parameter ``p`` with gradient ``g``
        (PyTorch's AdamW)."""
        m, v = states
        b1, b2 = self.betas
        c = lambda x: op.const(x, dtype=p.dtype)
        if self.weight_decay:
            p = op.Mul(p, k["decay"])
        m = op.Add(op.Mul(m, c(b1)), op.Mul(g, c(1.0 - b1)))
        v = op.Add(op.Mul(v, c(b2)), op.Mul(op.Mul(g, g), c(1.0 - b2)))
        p = op.Sub(p, op.Mul(op.Div(m, op.Add(op.Sqrt(v), k["eps"])), k["step_size"]))
        return p, [m, v]


@dataclass
class SGD:
    """SGD as ``torch.optim.SGD`` (momentum, dampening, Nesterov, L2 weight decay); plain by default."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    max_grad_norm: float | None = None

    def __post_init__(self):
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"SGD lr, momentum and weight_decay must be >= 0, got {self}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening 0 (as in torch.optim.SGD)")
        _check_clip(self.max_grad_norm)

    @property
    def states(self) -> tuple[str, ...]:
        """The optimizer state per parameter: a momentum buffer when ``momentum`` is set, else none."""
        return ("momentum_buffer",) if self.momentum else ()

    def scalars(self, op: GraphBuilder, lr, step, dtype: ir.DataType) -> dict[str, ir.Value]:
        """Values shared by every parameter's update: the learning rate and whether this is the first step."""
        return {"lr": lr, "first": op.Equal(step, op.const(np.array(1, np.int64)))}

    def update(self, op: GraphBuilder, p, g, states, k: dict[str, ir.Value]):
        """The new parameter and states of one parameter ``p`` with gradient ``g`` (PyTorch's SGD)."""
        c = lambda x: op.const(x, dtype=p.dtype)
        if self.weight_decay:
            g = op.Add(g, op.Mul(p, c(self.weight_decay)))
        new_states = []
        if self.momentum:
            (buf,) = states
            buf = op.Add(op.Mul(buf, c(self.momentum)), op.Mul(g, c(1.0 - self.dampening)) if self.dampening else g)
            if self.dampening:  # torch starts the buffer at the first gradient, undamped
                buf = op.Where(k["first"], g, buf)
            new_states = [buf]
            g = op.Add(g, op.Mul(buf, c(self.momentum))) if self.nesterov else buf
        return op.Sub(p, op.Mul(g, k["lr"])), new_states


def _check_clip(max_grad_norm) -> None:
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")


# -------------------------------------------------------------------------------------------------
# The optimizer model
# -------------------------------------------------------------------------------------------------


def _group_layout(params: list[tuple[str, np.dtype, tuple[int, ...]]]) -> list[dict]:
    groups: dict[str, dict] = {}
    for name, dtype, shape in params:
        key = np.dtype(dtype).name
        group = groups.setdefault(key, {"dtype": key, "params": [], "size": 0})
        group["params"].append({"name": name, "shape": list(shape)})
        group["size"] += int(np.prod(shape, dtype=np.int64))
    for group in groups.values():
        group["chunks"], group["chunk"] = chunking(group["size"])
    return list(groups.values())


def _clip_coefficient(op: GraphBuilder, grads: list[ir.Value], max_norm: float) -> ir.Value:
    """``min(1, max_norm / (||g||_2 + 1e-6))`` over every parameter together (float32 scalar)."""
    sq = [op.Cast(op.ReduceSum(op.Mul(g, g), keepdims=0), to=ir.DataType.FLOAT) for g in grads]
    total = op.Sqrt(sq[0] if len(sq) == 1 else op.Sum(*sq))
    f = lambda x: op.const(np.array(x, np.float32))
    return op.Min(op.Div(f(max_norm), op.Add(total, f(CLIP_EPS))), f(1.0))


def _flat_input(name: str, group: dict, per_row: bool) -> ir.Value:
    """``per_row``: the first axis is symbolic (``chunks.T``): a runtime may run the model on a range of rows."""
    dtype = ir.DataType.from_numpy(np.dtype(group["dtype"]))
    rows = f"chunks.{group['dtype']}" if per_row else group["chunks"]
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([rows, group["chunk"]]))


def _as_outputs(op: GraphBuilder, values: list[ir.Value], sources: list[ir.Value]) -> list[ir.Value]:
    """``values`` as the graph outputs that replace ``sources``: named ``<source>.out`` and typed like them
    (through an Identity where a value is a source passed through unchanged)."""
    outs = []
    for value, source in zip(values, sources):
        if value.producer() is None:
            value = op.Identity(value)
        value.name = updated_name(source.name)
        value.type, value.shape = source.type, source.shape
        outs.append(value)
    return outs


def _chunk_loop(op: GraphBuilder, optimizer, flat: list[ir.Value], coef: ir.Value | None,
                k: dict[str, ir.Value], length: int) -> list[ir.Value]:
    """``Scan`` the optimizer's update over the chunks (rows) of ``flat`` = [params, grads, *states]:
    returns the new [params, *states]. The body reads the step's scalars from the outer graph."""
    body = GraphBuilder(prefix="optimizer/chunk", opset=OPSET)
    rows = [ir.Value(name=f"{v.name}.chunk", type=v.type, shape=ir.Shape([length])) for v in flat]
    p, g, *states = rows
    if coef is not None:
        g = body.Mul(g, coef)
    new_p, new_states = optimizer.update(body, p, g, states, k)
    outs = _as_outputs(body, [new_p, *new_states], [p, *states])
    graph = ir.Graph(rows, outs, nodes=body.nodes, opset_imports={"": OPSET}, name="optimizer_chunk")
    new = op.op("Scan", *flat, body=graph, num_scan_inputs=len(flat), num_outputs=len(outs))
    return list(new) if len(outs) > 1 else [new]


def _whole(op: GraphBuilder, optimizer, flat: list[ir.Value], coef: ir.Value | None,
           k: dict[str, ir.Value]) -> list[ir.Value]:
    """The optimizer's update over the whole [chunks, chunk] vectors at once, without a ``Scan``."""
    p, g, *states = flat
    if coef is not None:
        g = op.Mul(g, coef)
    new_p, new_states = optimizer.update(op, p, g, states, k)
    return [new_p, *new_states]


def build_optimizer_model(optimizer: AdamW | SGD, params: list[tuple[str, np.dtype, tuple[int, ...]]],
                          scaler: LossScaler | None = None, scan: bool = True) -> onnx.ModelProto:
    """The optimizer model for ``params`` (name, element type, shape of each trainable parameter, in order).

    With a ``scaler`` (fp16 artifacts) the gradients come scaled: the model also takes ``loss_scale`` and
    ``good_steps``, unscales the gradients, skips the update when one is inf or NaN, and returns the new
    scale and count (:mod:`onnxtrain.blocks.loss_scale`).

    ``scan=False`` applies the update to the whole vectors instead of chunk by chunk (same inputs, outputs
    and layout): onnxruntime-web's ``Scan`` costs more than the cache it saves (docs/web.md, "Web artifacts").
    With ``scan`` and neither clipping nor a scaler, the vectors' first axis is symbolic (``chunks.T``): each
    row's update reads only that row, so a runtime may run the model on ranges of rows (docs/format.md)."""
    if not params:
        raise ValueError("the optimizer needs at least one trainable parameter")
    groups = _group_layout(params)
    op = GraphBuilder(prefix="optimizer", opset=OPSET)
    lr = ir.Value(name=LEARNING_RATE, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    step = ir.Value(name=STEP, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    inputs, outputs = [lr, step], []
    if scaler is not None:
        scale = ir.Value(name=LOSS_SCALE, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
        good = ir.Value(name=GOOD_STEPS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
        inputs += [scale, good]
    # Without a sum over every gradient (clipping's norm, loss scaling's inf check) the update is row by row: the
    # Scan form declares its rows symbolic, and the runtime may update ranges of rows in parallel (ondevice/optimizer.py).
    per_row = scan and scaler is None and optimizer.max_grad_norm is None
    flat = {}
    for group in groups:
        p, g, *states = (_flat_input(flat_name(n, group["dtype"]), group, per_row)
                         for n in (PARAMS, GRADIENTS, *optimizer.states))
        inputs += [p, g, *states]
        flat[group["dtype"]] = (p, g, states)
    grads = [g for _, g, _ in flat.values()]
    coef = None
    if scaler is not None:
        inf = loss_scale.found_inf(op, grads)
        coef = op.Reciprocal(scale)
        grads = [op.Mul(g, coef if g.dtype == ir.DataType.FLOAT else op.Cast(coef, to=g.dtype)) for g in grads]
    if optimizer.max_grad_norm is not None:
        clip = _clip_coefficient(op, grads, optimizer.max_grad_norm)
        coef = clip if coef is None else op.Mul(clip, coef)
    # With loss scaling the update runs in the else branch of an If on ``inf``; the then branch keeps all.
    body = op if scaler is None else GraphBuilder(prefix="optimizer/apply", opset=OPSET)
    sources, new = [], []
    for group, (p, g, states) in zip(groups, flat.values()):
        cast = (lambda x: x) if p.dtype == ir.DataType.FLOAT else (lambda x: op.Cast(x, to=p.dtype))  # noqa: E731
        k = optimizer.scalars(op, cast(lr), step, p.dtype)
        coef_t = None if coef is None else cast(coef)
        new += (_chunk_loop(body, optimizer, [p, g, *states], coef_t, k, group["chunk"]) if scan
                else _whole(body, optimizer, [p, g, *states], coef_t, k))
        sources += [p, *states]
    if scaler is not None:
        new = _skip_if(op, body, inf, new, sources)
        new_scale, new_good = loss_scale.update_scale(op, scaler, scale, good, inf)
        outputs += _as_outputs(op, [new_scale, new_good], [scale, good])
    outputs = _as_outputs(op, new, sources) + outputs
    graph = ir.Graph(inputs, outputs, nodes=op.nodes, opset_imports={"": OPSET}, name="optimizer")
    model = ir.Model(graph, ir_version=8, producer_name="onnxtrain")
    meta = {"type": type(optimizer).__name__, "hyperparameters": asdict(optimizer),
            "states": list(optimizer.states), "groups": groups}
    if scaler is not None:
        meta["loss_scaling"] = scaler.to_json()
    model.metadata_props[OPTIMIZER_METADATA_KEY] = json.dumps(meta)
    return ir.to_proto(model)


def _skip_if(op: GraphBuilder, body: GraphBuilder, inf: ir.Value, new: list[ir.Value],
             sources: list[ir.Value]) -> list[ir.Value]:
    """``sources`` unchanged where ``inf`` is true, else ``new`` (built by ``body``): one If node, so a
    skipped step costs nothing."""
    keep = GraphBuilder(prefix="optimizer/skip", opset=OPSET)
    kept = [keep.Identity(v) for v in sources]
    for value, source in zip([*kept, *new], [*sources, *sources]):
        value.type, value.shape = source.type, source.shape
    then_branch = ir.Graph([], kept, nodes=keep.nodes, opset_imports={"": OPSET}, name="optimizer_skip")
    else_branch = ir.Graph([], new, nodes=body.nodes, opset_imports={"": OPSET}, name="optimizer_apply")
    outs = op.op("If", inf, then_branch=then_branch, else_branch=else_branch, num_outputs=len(sources))
    return list(outs) if len(sources) > 1 else [outs]


__all__ = ["SGD", "AdamW", "LossScaler", "build_optimizer_model"]
