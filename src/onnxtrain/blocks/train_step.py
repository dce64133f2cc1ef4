"""The train-step model of web artifacts: the training model and the optimizer model joined in one graph.

onnxruntime-web copies every input into WebAssembly memory and every output out of it, each call: a
training step followed by an optimizer step moves the parameters in twice, the gradients out and back in,
and the new parameters and states out (ten vectors as long as the model for AdamW). One graph for both
takes the flat parameters and states and returns the new ones and the loss; the gradients never leave
WebAssembly memory (six vectors, one call). docs/web.md, "The train-step model".

    inputs   the training model's user inputs and frozen parameters, then the optimizer model's inputs
             except ``gradients.<T>`` (learning_rate, step, params.<T>, one <state>.<T> per state)
    outputs  the training model's outputs (the loss first), then the optimizer model's (params.<T>.out,
             <state>.<T>.out)

Inside, each trainable parameter is a ``Slice`` of ``params.<T>`` reshaped to its shape, and
``gradients.<T>`` is the ``Concat`` of the flattened gradients and the zero padding, reshaped to the
optimizer's [chunks, chunk]. One step of this graph equals a training step with reset gradients followed
by an optimizer step. The metadata holds the training model's description under its key, with
``kind: "train_step"``, and the optimizer model's under its own.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from onnxtrain.ondevice.format import (
    GRADIENTS,
    OPTIMIZER_METADATA_KEY,
    PARAMS,
    TRAINING_METADATA_KEY,
    flat_name,
)

PREFIX = "train_step/"


def _metadata(model: onnx.ModelProto, key: str) -> dict:
    return json.loads(next(p.value for p in model.metadata_props if p.key == key))


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def train_step_refusal(training: onnx.ModelProto, optimizer: onnx.ModelProto) -> str | None:
    """Why these two models cannot be joined (None when they can), decided from their metadata."""
    train_meta = _metadata(training, TRAINING_METADATA_KEY)
    opt_meta = _metadata(optimizer, OPTIMIZER_METADATA_KEY)
    if "loss_scaling" in train_meta or "loss_scaling" in opt_meta:
        return "fp16 artifacts with loss scaling"
    if [g["dtype"] for g in opt_meta["groups"]] != ["float32"]:
        return "trainable parameters of other element types than float32"
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in optimizer.graph.node for a in n.attribute):
        return "an optimizer model with control flow"
    return None


def build_train_step_model(training: onnx.ModelProto, optimizer: onnx.ModelProto) -> onnx.ModelProto:
    """Join a training model and its optimizer model (both of the same artifacts) into the train-step model."""
    reason = train_step_refusal(training, optimizer)
    if reason is not None:
        raise ValueError(f"no train-step model for {reason}")
    train_meta = _metadata(training, TRAINING_METADATA_KEY)
    opt_meta = _metadata(optimizer, OPTIMIZER_METADATA_KEY)
    opset = _opset(training)
    if _opset(optimizer) != opset:
        optimizer = version_converter.convert_version(optimizer, opset)
    (group,) = opt_meta["groups"]
    dtype = group["dtype"]
    params_in, grads_in = flat_name(PARAMS, dtype), flat_name(GRADIENTS, dtype)

    train_graph, opt_graph = training.graph, optimizer.graph
    trainable = train_meta["trainable"]
    if [p["name"] for p in group["params"]] != trainable:
        raise ValueError("the optimizer model does not update the training model's trainable parameters")
    taken = {v for n in train_graph.node for v in (*n.input, *n.output)} | {i.name for i in train_graph.input}
    opt_io = {i.name for i in opt_graph.input} | {o.name for o in opt_graph.output}
    rename = {}  # the optimizer's inner names that the training graph also uses
    for node in opt_graph.node:
        for name in (*node.input, *node.output):
            if name and name not in opt_io and name in taken:
                rename[name] = PREFIX + name

    def const(name, values, dtype=np.int64):
        return helper.make_node("Constant", [], [PREFIX + name], name=PREFIX + name,
                                value=numpy_helper.from_array(np.asarray(values, dtype=dtype), PREFIX + name))

    nodes = [const("flat_shape", [-1]), const("axis0", [0]),
             helper.make_node("Reshape", [params_in, PREFIX + "flat_shape"], [PREFIX + "params_flat"],
                              name=PREFIX + "params_flat")]
    lo = 0
    pieces, gather = [], []  # the gradients' nodes come after the training graph's
    for i, p in enumerate(group["params"]):
        size = int(np.prod(p["shape"], dtype=np.int64))
        nodes += [const(f"lo_{i}", [lo]), const(f"hi_{i}", [lo + size]), const(f"shape_{i}", p["shape"]),
                  helper.make_node("Slice", [PREFIX + "params_flat", PREFIX + f"lo_{i}", PREFIX + f"hi_{i}",
                                             PREFIX + "axis0"], [PREFIX + f"slice_{i}"], name=PREFIX + f"slice_{i}"),
                  helper.make_node("Reshape", [PREFIX + f"slice_{i}", PREFIX + f"shape_{i}"], [p["name"]],
                                   name=PREFIX + f"param_{i}")]
        grad = train_meta["gradients"][i]
        gather.append(helper.make_node("Reshape", [grad, PREFIX + "flat_shape"], [PREFIX + f"grad_{i}"],
                                       name=PREFIX + f"grad_{i}"))
        pieces.append(PREFIX + f"grad_{i}")
        lo += size
    pad = group["chunks"] * group["chunk"] - lo
    if pad:  # zeros made at run time, not stored in the file
        gather += [const("pad", [pad]),
                  helper.make_node("ConstantOfShape", [PREFIX + "pad"], [PREFIX + "padding"], name=PREFIX + "padding",
                                   value=numpy_helper.from_array(np.zeros(1, np.float32)))]
        pieces.append(PREFIX + "padding")
    gather += [const("rows", [group["chunks"], group["chunk"]]),
              helper.make_node("Concat", pieces, [PREFIX + "grads_flat"], axis=0, name=PREFIX + "grads_flat"),
              helper.make_node("Reshape", [PREFIX + "grads_flat", PREFIX + "rows"], [grads_in],
                               name=PREFIX + "gradients")]
    opt_nodes = []
    for node in opt_graph.node:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        node.input[:] = [rename.get(n, n) for n in node.input]
        node.output[:] = [rename.get(n, n) for n in node.output]
        node.name = PREFIX + node.name
        opt_nodes.append(node)

    grad_names = set(train_meta["gradients"])
    inputs = [i for i in train_graph.input if i.name not in set(trainable)]
    inputs += [i for i in opt_graph.input if i.name != grads_in]
    outputs = [o for o in train_graph.output if o.name not in grad_names] + list(opt_graph.output)
    graph = helper.make_graph(nodes + list(train_graph.node) + gather + opt_nodes, "train_step", inputs, outputs,
                              initializer=list(train_graph.initializer) + list(opt_graph.initializer))
    model = helper.make_model(graph, opset_imports=list(training.opset_import), producer_name="onnxtrain",
                              ir_version=training.ir_version)
    helper.set_model_props(model, {TRAINING_METADATA_KEY: json.dumps({**train_meta, "kind": "train_step"}),
                                   OPTIMIZER_METADATA_KEY: json.dumps(opt_meta)})
    onnx.checker.check_model(model)
    return model
