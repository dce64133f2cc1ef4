"""``generate_artifacts``: an ONNX model in, the four on-device training artifacts out.

    training_model.onnx   inputs: model inputs, loss inputs (labels), then every checkpoint parameter
                          outputs: loss, additional outputs, then ``<param>_grad`` per trainable parameter
    eval_model.onnx       the same inputs (parameters included) and outputs, without the gradients
    optimizer_model.onnx  one call updates every trainable parameter (see onnxtrain.blocks.optim)
    checkpoint            parameters, requires-grad flags, properties (see onnxtrain.ondevice.checkpoint)

Checkpoint parameters (the trainable and the explicitly frozen initializers) become graph inputs, so the
models hold no weights: the runtime binds the checkpoint's buffers once and updates them in place.
Initializers named in neither list stay constants baked into the models.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxtrain.autodiff.builder import GraphBuilder, is_float
from onnxtrain.autodiff.engine import (
    add_gradient_outputs,
    ir_version_for_onnxruntime,
    prepare_model,
    values_by_name,
)
from onnxtrain.blocks import optim as optim_blocks
from onnxtrain.blocks.loss_scale import LossScaler
from onnxtrain.blocks.train_step import build_train_step_model, train_step_refusal
from onnxtrain.blocks.loss import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    L1Loss,
    Loss,
    MSELoss,
)
from onnxtrain.ondevice import checkpoint as ckpt
from onnxtrain.ondevice.format import (
    LOSS_SCALE,
    LOSS_SCALING_FORMAT,
    ROW_GRADIENTS_FORMAT,
    TRAINING_METADATA_KEY,
    TRAINING_MODEL_FORMAT,
)
from onnxtrain.runtime import backends
from onnxtrain.runtime.openvino_float32 import float32_sums
from onnxtrain.ondevice.input_ranges import input_ranges
from onnxtrain.passes import pipeline
from onnxtrain.passes.defer_row_scatters import defer_row_scatters
from onnxtrain.passes.precision import apply_precision
from onnxtrain.passes.recompute import Recompute
from onnxtrain.utils.atomic import atomic_file_set, refuse_existing
from onnxtrain.utils.io import load_model, save_model_atomic


class LossType(enum.Enum):
    """The built-in losses (as in onnxruntime.training.artifacts.LossType)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(enum.Enum):
    """The built-in optimizers with ONNX Runtime Training's defaults."""

    AdamW = 1
    SGD = 2


_LOSSES = {LossType.MSELoss: MSELoss, LossType.CrossEntropyLoss: CrossEntropyLoss,
           LossType.BCEWithLogitsLoss: BCEWithLogitsLoss, LossType.L1Loss: L1Loss}
_LOSS_ALIASES = {"mse": LossType.MSELoss, "mseloss": LossType.MSELoss,
                 "crossentropy": LossType.CrossEntropyLoss, "crossentropyloss": LossType.CrossEntropyLoss,
                 "ce": LossType.CrossEntropyLoss, "bcewithlogits": LossType.BCEWithLogitsLoss,
                 "bcewithlogitsloss": LossType.BCEWithLogitsLoss, "l1": LossType.L1Loss, "l1loss": LossType.L1Loss}
_OPTIMIZERS = {OptimType.AdamW: optim_blocks.AdamW, OptimType.SGD: optim_blocks.SGD}


@dataclass
class Artifacts:
    """Where ``generate_artifacts`` wrote the files."""

    training_model: Path
    eval_model: Path
    optimizer_model: Path | None
    checkpoint: Path
    train_step_model: Path | None = None  # web artifacts only (blocks/train_step.py)


def resolve_loss(loss) -> Loss | None:
    if loss is None or isinstance(loss, Loss):
        return loss
    if isinstance(loss, str):
        key = loss.lower().replace("_", "").replace("-", "")
        if key not in _LOSS_ALIASES:
            raise ValueError(f"unknown loss {loss!r}; use one of {sorted(set(_LOSS_ALIASES))}")
        loss = _LOSS_ALIASES[key]
    if isinstance(loss, LossType):
        return _LOSSES[loss]()
    raise TypeError(f"loss must be a LossType, a loss name or an artifacts.Loss instance, got {type(loss).__name__}")


def resolve_optimizer(optimizer):
    if optimizer is None or isinstance(optimizer, (optim_blocks.AdamW, optim_blocks.SGD)):
        return optimizer
    if isinstance(optimizer, str):
        by_name = {t.name.lower(): t for t in OptimType}
        if optimizer.lower() not in by_name:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(by_name)}")
        optimizer = by_name[optimizer.lower()]
    if isinstance(optimizer, OptimType):
        return _OPTIMIZERS[optimizer]()
    raise TypeError("optimizer must be an OptimType, 'adamw'/'sgd', or an artifacts.AdamW/SGD instance, "
                    f"got {type(optimizer).__name__}")


# -------------------------------------------------------------------------------------------------
# Parameters
# -------------------------------------------------------------------------------------------------


def _as_list(names, what: str) -> list[str]:
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    names = list(names)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{what} names repeat: {dupes}")
    return names


def select_parameters(graph: ir.Graph, requires_grad, frozen_params) -> tuple[list[str], list[str]]:
    """Check the two name lists against the model's initializers; return (trainable, frozen) in model order."""
    trainable, frozen = _as_list(requires_grad, "requires_grad"), _as_list(frozen_params, "frozen_params")
    both = sorted(set(trainable) & set(frozen))
    if both:
        raise ValueError(f"parameters {both} are in both requires_grad and frozen_params; name each in one list")
    inits = graph.initializers
    floats = [n for n, v in inits.items() if is_float(v)]
    unknown = [n for n in trainable + frozen if n not in inits]
    if unknown:
        hint = ", ".join(floats[:8]) + (", ..." if len(floats) > 8 else "")
        raise KeyError(f"{', '.join(unknown)}: not initializers of the model; its float initializers are: "
                       f"{hint or 'none'}")
    non_float = [n for n in trainable if not is_float(inits[n])]
    if non_float:
        raise TypeError(f"{non_float} are not floating-point initializers and cannot require gradients "
                        f"({', '.join(str(inits[n].dtype) for n in non_float)})")
    if not trainable:
        raise ValueError("the model has no trainable floating-point initializer: pass requires_grad=[...] with "
                         f"the names to train (float initializers: {floats[:8] or 'none'}); "
                         "initializers named in neither list are frozen")
    order = {n: i for i, n in enumerate(inits)}
    return sorted(trainable, key=order.get), sorted(frozen, key=order.get)


def _lift_to_inputs(graph: ir.Graph, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Turn the named initializers into graph inputs; return their values."""
    values = {}
    for name in names:
        value = graph.initializers.pop(name)
        tensor = value.const_value
        values[name] = tensor.numpy()
        value.const_value = None
        value.type = ir.TensorType(tensor.dtype)
        value.shape = ir.Shape(list(tensor.shape))
        graph.inputs.append(value)
    return values


# -------------------------------------------------------------------------------------------------
# Loss and outputs
# -------------------------------------------------------------------------------------------------


def _loss_sources(graph: ir.Graph, loss_input_names) -> list[ir.Value]:
    outputs = {v.name: v for v in graph.outputs}
    if loss_input_names is None:
        if not graph.outputs:
            raise ValueError("the model has no outputs to compute a loss from")
        return [graph.outputs[0]]
    names = _as_list(loss_input_names, "loss_input_names")
    missing = [n for n in names if n not in outputs]
    if missing:
        raise KeyError(f"loss_input_names {missing} are not outputs of the model (outputs: {list(outputs)})")
    return [outputs[n] for n in names]


def _append_loss(graph: ir.Graph, loss: Loss | None, sources: list[ir.Value], taken: set[str]) -> ir.Value:
    """Add the loss block's inputs and nodes to ``graph``; return the scalar loss value."""
    if loss is None:  # the model computes its own loss
        value = sources[0]
        if not is_float(value) or (value.shape is not None and len(value.shape) != 0):
            raise ValueError(f"with loss=None the model output {value.name!r} is the loss and must be a float "
                             f"scalar (shape [] ); it has type {value.dtype} and shape {value.shape}. "
                             "Pass loss=LossType... or an artifacts.Loss block.")
        return value
    extra = [spec.to_value() for spec in loss.inputs(*sources)]
    clash = [v.name for v in extra if v.name in taken]
    if clash:
        raise ValueError(f"the loss input names {clash} are already used in the model; "
                         "give the loss other names (e.g. CrossEntropyLoss(labels_name=...))")
    user_inputs = [v for v in graph.inputs]
    graph.inputs.clear()
    graph.inputs.extend([*user_inputs, *extra])
    op = GraphBuilder(taken_names=taken | {v.name for v in extra}, prefix="loss",
                      opset=graph.opset_imports.get("", optim_blocks.OPSET))
    value = loss.build(op, *sources, *extra)
    if not isinstance(value, ir.Value):
        raise TypeError(f"{type(loss).__name__}.build must return the loss ir.Value, got {type(value).__name__}")
    graph.extend(op.nodes)
    return value


def _set_outputs(graph: ir.Graph, loss_value: ir.Value, loss_dtype: ir.DataType, additional: list[str],
                 taken: set[str]) -> None:
    values = values_by_name(graph)
    missing = [n for n in additional if n not in values]
    if missing:
        raise KeyError(f"additional_output_names {missing} are not values of the model "
                       f"(its outputs: {[v.name for v in graph.outputs]})")
    op = GraphBuilder(taken_names=taken | set(values), prefix="output")
    if loss_value.is_graph_input() or loss_value.is_initializer():
        loss_value = op.Identity(loss_value)
    if loss_value.name not in {v.name for v in graph.outputs} and "loss" not in values:
        loss_value.name = "loss"
    outs = [loss_value]
    for name in additional:
        v = values[name]
        if v.is_graph_input() or v.is_initializer() or v in outs:
            v = op.Identity(v)
        outs.append(v)
    graph.extend(op.nodes)
    graph.outputs.clear()
    graph.outputs.extend(outs)
    loss_value.shape = ir.Shape([])
    if loss_value.type is None:  # a loss block's value: its type is the logits' (checked by ORT on load)
        loss_value.type = ir.TensorType(loss_dtype)


def build_eval_model(proto: onnx.ModelProto, requires_grad, frozen_params, loss, additional_output_names,
                     loss_input_names) -> tuple[onnx.ModelProto, dict]:
    """The eval model (forward + loss) and a description: parameters, user inputs, outputs."""
    model = ir.from_proto(proto)
    graph = model.graph
    trainable, frozen = select_parameters(graph, requires_grad, frozen_params)
    n_user = len(graph.inputs)
    params = _lift_to_inputs(graph, trainable + frozen)
    model = pipeline.artifacts_forward()(model)
    graph = model.graph
    sources = _loss_sources(graph, loss_input_names)
    taken = set(values_by_name(graph))
    loss_value = _append_loss(graph, loss, sources, taken)  # its inputs go after the model's
    lifted = graph.inputs[n_user:n_user + len(params)]
    rest = [v for v in graph.inputs if v not in lifted]
    graph.inputs.clear()
    graph.inputs.extend(rest + lifted)  # model inputs, loss inputs, then the parameters
    user_inputs = [v.name for v in rest]
    _set_outputs(graph, loss_value, sources[0].dtype, _as_list(additional_output_names, "additional_output_names"), taken)
    model = pipeline.artifacts_eval()(model)
    graph = model.graph
    info = {"user_inputs": user_inputs, "outputs": [v.name for v in graph.outputs],
            "trainable": trainable, "frozen": frozen,
            "input_checks": input_ranges(graph, loss, sources, user_inputs)}
    graph.metadata_props.clear()
    model.metadata_props[TRAINING_METADATA_KEY] = json.dumps({**info, "kind": "eval"})
    proto = _infer_shapes(ir_version_for_onnxruntime(ir.to_proto(model)))
    return proto, {**info, "values": params}


def _infer_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Shapes of the loss nodes, which the gradient engine needs to un-broadcast."""
    if proto.ByteSize() >= 2**31 - 1:
        return proto  # only unlisted constants can make it this big; prepare_model inferred the rest
    try:
        return onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as exc:
        raise ValueError(f"ONNX shape inference failed on the model with its loss ({exc}); check that the "
                         "loss block's inputs match the model outputs in type and rank") from exc


def build_training_model(eval_proto: onnx.ModelProto, info: dict, recompute: Recompute | None = None,
                         scaler: LossScaler | None = None, target: str = "default",
                         chunk_loss: bool = True, float32_sums: bool = False,
                         erf_cdf: bool = False, conv_patches: bool = False,
                         row_gradients: bool = False) -> onnx.ModelProto:
    """Add the gradients of the loss w.r.t. the trainable parameters to the eval model. ``chunk_loss``: a
    language model's loss may be computed in row blocks where ``recompute`` asks for a budget below 1
    (:mod:`onnxtrain.passes.chunk_cross_entropy`). ``float32_sums``: the row sums that no product also reads
    (LayerNorm's gradients) stay ``ReduceSum`` (bf16 artifacts: OpenVINO runs a product in bfloat16, a
    ``ReduceSum`` in float32). ``erf_cdf``: GELU's gradient's ``HardSigmoid`` as ``Mul`` and ``Add``
    (:mod:`onnxtrain.passes.erf_cdf`; bf16 artifacts, run on OpenVINO). ``conv_patches``: convolution weight
    gradients as products over input windows (:mod:`onnxtrain.passes.conv_patches`; bf16 artifacts too).
    ``row_gradients``: an embedding's gradient leaves the graph as its token ids and rows, which the runtime adds
    (:mod:`onnxtrain.passes.defer_row_scatters`; training model format 4, bf16 artifacts: OpenVINO's scatter
    wrote the whole table of zeros every step).

    With a ``scaler`` the gradients are those of ``loss * loss_scale``, a float32 scalar input after the
    parameters (the gradient seed is the scale; :mod:`onnxtrain.blocks.loss_scale`)."""
    before = pipeline.before_autodiff(recompute, chunk_loss)
    model = before(ir.from_proto(eval_proto))
    graph = model.graph
    by_name = {v.name: v for v in graph.inputs}
    wrt = [by_name[n] for n in info["trainable"]]
    loss_value = graph.outputs[0]
    num_outputs = len(graph.outputs)
    seeds, extra = None, {"format": TRAINING_MODEL_FORMAT}
    if scaler is not None:
        scale = ir.Value(name=LOSS_SCALE, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
        graph.inputs.append(scale)
        seed = scale
        if loss_value.dtype != ir.DataType.FLOAT:
            cast = ir.node("Cast", [scale], attributes={"to": loss_value.dtype}, name="loss_scale/cast")
            graph.append(cast)
            seed = cast.outputs[0]
        seeds = [seed]
        extra = {"format": LOSS_SCALING_FORMAT, "loss_scaling": scaler.to_json()}
    elif recompute is not None:  # the order_backward pass starts from the seed: a value of its own
        seeds = [_seed_of_one(graph, loss_value)]
    grads = add_gradient_outputs(model, wrt, [loss_value], seeds=seeds, names=info["trainable"])
    passes = pipeline.artifacts_training(num_outputs, recompute, sum_rows_by_matmul=target != "web",
                                         seeds=seeds if recompute is not None else (), saved=pipeline.presaved(before),
                                         transposed_gemm=target != "web", float32_sums=float32_sums, erf_cdf=erf_cdf,
                                         conv_patches=conv_patches)
    model = passes(model)
    meta = {k: info[k] for k in ("user_inputs", "outputs", "trainable", "frozen", "input_checks")}
    if row_gradients:
        rows = _defer_row_gradients(model, num_outputs, info["trainable"], [g.name for g in grads])
        if rows:
            extra, meta["row_gradients"] = {**extra, "format": ROW_GRADIENTS_FORMAT}, rows
    if recompute is not None and any(c.on for c in passes.step("recompute").plan.candidates):
        meta["recomputed"] = True  # the runtime keeps onnxruntime from merging the clones back (module.py)
    model.metadata_props[TRAINING_METADATA_KEY] = json.dumps({**meta, "kind": "training", **extra,
                                                              "gradients": [g.name for g in grads]})
    return ir_version_for_onnxruntime(ir.to_proto(model))


def _defer_row_gradients(model: ir.Model, num_outputs: int, trainable: list[str], names: list[str]) -> dict:
    """The gradients of ``trainable`` (outputs ``names``, after the first ``num_outputs``) made by row scatters,
    rewritten to return their ids and rows; the training metadata's ``row_gradients`` (docs/format.md)."""
    plan = defer_row_scatters(model, only=range(num_outputs, num_outputs + len(trainable)))
    outputs = list(model.graph.outputs)
    rows: dict[str, dict] = {}
    for scatter in plan.scatters:
        k = scatter.gradient - num_outputs
        entry = rows.setdefault(trainable[k], {"ids": [], "rows": [], "base": False})
        entry["ids"].append(outputs[scatter.ids].name)
        entry["rows"].append(outputs[scatter.rows].name)
        if scatter.base is not None:  # the sum's other terms: the gradient output, which the rows are added into
            entry["base"] = True
            outputs[scatter.base].name = names[k]
    return rows


def _seed_of_one(graph: ir.Graph, loss_value: ir.Value) -> ir.Value:
    """A Constant 1 of the loss's type (the gradient's seed, as autodiff would make it), added to ``graph``."""
    node = ir.node("Constant", [], attributes={"value": ir.tensor(np.ones((), loss_value.dtype.numpy()))},
                   name="loss_grad/seed")
    seed = node.outputs[0]
    seed.name, seed.type, seed.shape = "loss_grad/seed", ir.TensorType(loss_value.dtype), ir.Shape([])
    graph.append(node)
    return seed


def _artifact_precision(precision: str) -> str:
    if str(precision).lower() in ("fp16", "float16", "half"):
        return "fp16"
    try:
        return backends.normalize_precision(precision)
    except ValueError:
        raise ValueError(f"unknown precision {precision!r} for artifacts; use 'fp32', 'bf16' or 'fp16'") from None


def _loss_scaler(precision: str, loss_scaler) -> LossScaler | None:
    if precision != "fp16":
        if loss_scaler is not None:
            raise ValueError(f"loss_scaler is for precision='fp16' artifacts; these are {precision!r} "
                             "(bf16 and fp32 have float32's range and need no loss scaling)")
        return None
    if loss_scaler is None:
        return LossScaler()
    if not isinstance(loss_scaler, LossScaler):
        raise TypeError(f"loss_scaler must be an artifacts.LossScaler, got {type(loss_scaler).__name__}")
    return loss_scaler


def _set_precision(proto: onnx.ModelProto, precision: str) -> None:
    """Record ``precision`` in the model's onnxtrain metadata (read by the runtime's Module)."""
    for entry in proto.metadata_props:
        if entry.key == TRAINING_METADATA_KEY:
            entry.value = json.dumps({**json.loads(entry.value), "precision": precision})


# -------------------------------------------------------------------------------------------------
# The public entry point
# -------------------------------------------------------------------------------------------------


def generate_artifacts(model: onnx.ModelProto | str | os.PathLike, requires_grad: Sequence[str] | None = None,
                       frozen_params: Sequence[str] | None = None, loss=None, optimizer=None,
                       artifact_directory: str | os.PathLike | None = None, prefix: str = "",
                       additional_output_names: Sequence[str] | None = None, nominal_checkpoint: bool = False,
                       loss_input_names: Sequence[str] | None = None, overwrite: bool = False,
                       precision: str = "fp32", recompute=None, loss_scaler: LossScaler | None = None,
                       target: str = "default") -> Artifacts:
    """Write the training, eval and optimizer models and the checkpoint for on-device training.

    ``requires_grad`` names the initializers to train; ``frozen_params`` the ones to keep in the
    checkpoint unchanged; others stay constants in the models. ``loss`` is a :class:`LossType`, a name
    ("crossentropy", "mse", ...), a :class:`Loss` block, or None when the model's first output (or
    ``loss_input_names[0]``) already is the scalar loss. ``optimizer`` is an :class:`OptimType`, "adamw"
    or "sgd", an ``AdamW(...)``/``SGD(...)`` instance for other hyperparameters, or None for no
    optimizer model. ``loss_input_names`` picks the model outputs the loss reads (default: the first).

    A folder that already holds artifacts with this ``prefix`` is refused unless ``overwrite=True``; the
    new set then replaces the old one as a whole (:func:`onnxtrain.utils.atomic.atomic_file_set`), stale
    files of the old set (an optimizer model the new set lacks) included.

    ``precision="bf16"`` marks the training and eval models to run in bfloat16: the graphs stay float32 (so
    they run on any ONNX runtime), and the runtime's ``Module`` runs them on OpenVINO with its bfloat16
    hint where it can, else warns once and runs float32 (docs/precision.md). ``precision="fp16"`` writes
    the training and eval models with their matmul-class products in float16 (:mod:`onnxtrain.passes.precision`;
    parameters, gradients and optimizer state stay float32) and dynamic loss scaling in the training and
    optimizer models, with ``loss_scaler`` (a :class:`LossScaler`, default ``torch.amp.GradScaler``'s
    settings) as the policy and its state in the checkpoint (:mod:`onnxtrain.blocks.loss_scale`).

    ``recompute`` (default None: nothing) has the training model recompute forward values for the
    gradients instead of keeping them, as ORTModule's option (:mod:`onnxtrain.passes.recompute`): a
    fraction of the stashed bytes to keep, a number of bytes, a string, or a ``Recompute``, whose ``dims``
    give the sizes of the model's symbolic dims (dims it does not name make sizes unknown, and those values
    are left as they are). The plan is logged at INFO.

    ``target="web"`` writes artifacts for onnxruntime-web (``web/``, docs/web.md): the same files, inputs,
    outputs and checkpoint, built from other standard ops where onnxruntime-web is slow or fails: the
    optimizer updates the whole flat vectors without a ``Scan``, and bias gradients stay ``ReduceSum``
    (the WebGPU provider refuses the row-of-ones ``MatMul``). Any runtime runs either kind. With an
    fp32 or bf16 optimizer model they also hold ``train_step_model.onnx``, the training and optimizer
    models joined in one graph, so that onnxruntime-web runs a step in one call
    (:mod:`onnxtrain.blocks.train_step`).
    """
    if target not in _TARGETS:
        raise ValueError(f"target must be one of {sorted(_TARGETS)}, got {target!r}")
    precision = _artifact_precision(precision)
    scaler = _loss_scaler(precision, loss_scaler)
    loss_block = resolve_loss(loss)
    optimizer_block = resolve_optimizer(optimizer)
    out_dir = Path(artifact_directory if artifact_directory is not None else os.getcwd())
    # The set's members, the checkpoint last; train_step_model.onnx only in web artifacts, but a member of
    # every set, so that default artifacts written over web ones remove it.
    names = [f"{prefix}{n}" for n in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx",
                                      "train_step_model.onnx", "checkpoint")]
    if not overwrite:  # before the work, not after it
        refuse_existing(out_dir, names, "artifacts", _OVERWRITE_HINT)
    proto = prepare_model(load_model(model))
    eval_proto, info = build_eval_model(proto, requires_grad, frozen_params, loss_block,
                                        additional_output_names, loss_input_names)
    plan = None if recompute is None else Recompute.of(recompute)
    # The chunked loss's loop body stays float32 (fp16 products, OpenVINO's bf16) and is left out of web artifacts.
    training_proto = build_training_model(eval_proto, info, plan, scaler, target,
                                          chunk_loss=precision == "fp32" and target != "web",
                                          float32_sums=float32_sums(precision),
                                          erf_cdf=precision == "bf16" and target != "web",
                                          conv_patches=precision == "bf16" and target != "web",
                                          row_gradients=precision == "bf16" and target != "web")
    eval_proto = ir.to_proto(pipeline.artifacts_eval_export()(ir.from_proto(eval_proto)))
    if precision == "fp16":  # the products run in float16 in the graphs themselves, on any runtime
        training_proto, eval_proto = (apply_precision(p, "fp16") for p in (training_proto, eval_proto))
    if precision != "fp32":
        for model_proto in (training_proto, eval_proto):
            _set_precision(model_proto, precision)

    values = info["values"]
    opt_proto = None
    if optimizer_block is not None:
        layout = [(n, values[n].dtype, values[n].shape) for n in info["trainable"]]
        opt_proto = optim_blocks.build_optimizer_model(optimizer_block, layout, scaler, scan=target != "web")
    # Web artifacts also join the two models in one graph where they can (blocks/train_step.py).
    step_proto = None
    if target == "web" and opt_proto is not None and train_step_refusal(training_proto, opt_proto) is None:
        step_proto = build_train_step_model(training_proto, opt_proto)
    data = ckpt.CheckpointData(
        parameters={n: values[n] for n in info["trainable"] + info["frozen"]},
        requires_grad={n: n in info["trainable"] for n in info["trainable"] + info["frozen"]},
        nominal=nominal_checkpoint,
        loss_scale=None if scaler is None else ckpt.LossScaleState(scaler.init_scale, 0),
    )
    # One generation: written into a staging folder, then swapped in with the checkpoint last.
    with atomic_file_set(out_dir, names, overwrite=overwrite, what="artifacts", hint=_OVERWRITE_HINT) as staging:
        save_model_atomic(training_proto, staging / names[0])
        save_model_atomic(eval_proto, staging / names[1])
        if opt_proto is not None:
            save_model_atomic(opt_proto, staging / names[2])
        if step_proto is not None:
            save_model_atomic(step_proto, staging / names[3])
        ckpt.save(data, staging / names[4])
    return Artifacts(out_dir / names[0], out_dir / names[1], out_dir / names[2] if opt_proto is not None else None,
                     out_dir / names[4], out_dir / names[3] if step_proto is not None else None)


_OVERWRITE_HINT = "pass overwrite=True (onnxtrain artifacts --force)"
_TARGETS = ("default", "web")


__all__ = ["Artifacts", "LossScaler", "LossType", "OptimType", "generate_artifacts"]
