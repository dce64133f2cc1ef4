"""A captured graph's structure, to tell whether two captures of a module are the same graph.

Used when a forward changed a value it reads while it was exported (Hugging Face's classifiers set
``config.problem_type`` on their first call): the next call must trace again from the new value, and when
that trace gives the same graph, ORTModule keeps the graphs it built from the first (``ortmodule/module.py``).
Two captures are the same graph when their nodes (op, domain, input and output names, attributes), graph
inputs and outputs, functions, and the values of their constant initializers are equal. The parameters'
and buffers' values (``state``) are left out: they are the module's, read afresh at every step. Any
difference at all (value names included) says "different", the safe answer: a new graph is then built.
"""

from __future__ import annotations

import onnx_ir as ir


def structure(model: ir.Model, state: set[str]) -> tuple:
    """What identifies ``model``'s graph, without the values of the initializers named in ``state``."""
    return (_graph(model.graph, state),
            tuple((key, _graph(function, state)) for key, function in sorted(model.functions.items())),
            tuple(sorted(model.opset_imports.items())))


def _graph(graph, state: set[str]) -> tuple:
    constants = tuple((name, _value(value, skip=name in state))
                      for name, value in sorted(getattr(graph, "initializers", {}).items()))
    return (tuple(_value(v) for v in graph.inputs), tuple(_value(v) for v in graph.outputs), constants,
            tuple(_node(node, state) for node in graph))


def _node(node: ir.Node, state: set[str]) -> tuple:
    return (node.domain, node.op_type, node.overload,
            tuple(v.name if v is not None else "" for v in node.inputs),
            tuple(v.name for v in node.outputs),
            tuple((name, _attr(attr, state)) for name, attr in sorted(node.attributes.items())))


def _attr(attr, state: set[str]):
    if attr.is_ref():
        return ("ref", attr.ref_attr_name)
    value = attr.value
    if attr.type == ir.AttributeType.GRAPH:
        return _graph(value, state)
    if attr.type == ir.AttributeType.GRAPHS:
        return tuple(_graph(g, state) for g in value)
    if attr.type == ir.AttributeType.TENSOR:
        return _tensor(value)
    if attr.type == ir.AttributeType.TENSORS:
        return tuple(_tensor(t) for t in value)
    return (attr.type, repr(value))


def _value(value: ir.Value, skip: bool = False) -> tuple:
    const = None if skip or value.const_value is None else _tensor(value.const_value)
    return (value.name, str(value.type), str(value.shape), const)


def _tensor(tensor) -> tuple:
    return (str(tensor.dtype), tuple(str(d) for d in tensor.shape), tensor.tobytes())
