"""``Module.export_model_for_inferencing``: the eval model with the trained parameters baked in.

This is the only part of the on-device runtime that imports ``onnx`` (to edit the model file); the
training path imports onnxruntime and numpy only.
"""

from __future__ import annotations

import os

import numpy as np

try:
    import onnx
    from onnx import numpy_helper
except ModuleNotFoundError as exc:  # the training path runs without onnx; this one edits a model file
    raise ModuleNotFoundError(
        "Module.export_model_for_inferencing needs the onnx package, which is not installed: "
        "pip install onnx (training itself needs only onnxruntime and numpy)", name="onnx") from exc

from onnxtrain.utils.io import load_model, save_model_atomic


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def _needed_nodes(graph: onnx.GraphProto, outputs: list[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in the graph's (topological) order."""
    producers = _producers(graph)
    keep, stack = set(), list(outputs)
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in keep:
            continue
        keep.add(id(node))
        stack.extend(i for i in node.input if i)
        for attr in node.attribute:  # values a subgraph reads from this scope
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                stack.extend(i for n in sub.node for i in n.input if i)
    return [n for n in graph.node if id(n) in keep]


def _value_infos(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    infos = {v.name: v for v in graph.value_info}
    infos.update({v.name: v for v in graph.input})
    infos.update({v.name: v for v in graph.output})
    return infos


def export_inference_model(eval_model_uri, parameters: dict[str, np.ndarray], graph_output_names,
                           path: str | os.PathLike, merge_adapters: bool = False) -> None:
    """Write the eval model's subgraph that computes ``graph_output_names`` to ``path``, the parameters
    baked in as initializers (what ``Module.export_model_for_inferencing`` does). ``merge_adapters``: fold
    LoRA adapters into their base weights (:mod:`onnxtrain.ondevice.lora_merge`) instead of keeping them
    as initializers of their own."""
    if isinstance(graph_output_names, str):
        graph_output_names = [graph_output_names]
    outputs = list(graph_output_names)
    if not outputs:
        raise ValueError("graph_output_names is empty: name the eval model values the inference model returns")
    model = load_model(eval_model_uri)
    if merge_adapters:
        from onnxtrain.ondevice.lora_merge import merge_adapters as merge

        model, parameters = merge(model, parameters)
    graph = model.graph
    infos = _value_infos(graph)
    producers = _producers(graph)
    known = set(producers) | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    missing = [n for n in outputs if n not in known]
    if missing:
        raise KeyError(f"graph_output_names {missing} are not values of the eval model; its outputs are "
                       f"{[o.name for o in graph.output]} and its inputs {[i.name for i in graph.input]}")
    nodes = _needed_nodes(graph, outputs)
    used = {i for n in nodes for i in n.input} | set(outputs)
    for n in nodes:
        for attr in n.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                used |= {i for sn in sub.node for i in sn.input}
    new_inputs = [i for i in graph.input if i.name in used and i.name not in parameters]
    baked = [numpy_helper.from_array(np.asarray(parameters[i.name]), i.name)
             for i in graph.input if i.name in used and i.name in parameters]
    kept_inits = [t for t in graph.initializer if t.name in used]
    new_outputs = []
    for name in outputs:
        info = infos.get(name)
        new_outputs.append(info if info is not None else onnx.ValueInfoProto(name=name))
    new_graph = onnx.helper.make_graph(nodes, graph.name or "inference", new_inputs, new_outputs,
                                       initializer=kept_inits + baked)
    new_graph.value_info.extend(v for v in graph.value_info if v.name in used and v.name not in outputs)
    result = onnx.helper.make_model(new_graph, opset_imports=list(model.opset_import),
                                    ir_version=model.ir_version, producer_name="onnxtrain")
    for prop in model.metadata_props:
        if not prop.key.startswith("onnxtrain."):
            result.metadata_props.append(prop)
    save_model_atomic(result, path)
