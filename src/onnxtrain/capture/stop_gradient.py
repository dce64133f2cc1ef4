"""Keep ``detach()`` and ``torch.no_grad()`` regions out of the gradient.

ONNX has no notion of a value that gradients do not flow through: exported as they are, ``x.detach()``
becomes an ``Identity`` (or nothing) and a ``torch.no_grad()`` block becomes ordinary ops, and the
gradient engine would differentiate through both, where PyTorch does not. Before the exporter
translates the program, this module marks those places with ``onnxtrain::stop_gradient``, a custom op
that the exporter translates to ``StopGradient`` in the ``onnxtrain`` ONNX domain; the gradient engine
gives it no gradient, and :class:`onnxtrain.passes.strip_stop_gradients.StripStopGradientsPass` (on
protos, :func:`onnxtrain.autodiff.stop_gradient.strip_stop_gradients`) makes it an ``Identity`` before a
graph reaches onnxruntime.

- ``aten.detach(x)`` becomes ``stop_gradient(x)``.
- ``aten.detach_(x)`` (in place) becomes ``y = stop_gradient(x)``, and every later use of ``x`` reads ``y``.
- ``wrap_with_set_grad_enabled(False, body, *args)`` (how ``torch.export`` keeps a ``no_grad`` block) is
  inlined, its outputs passed through ``stop_gradient``. Inlining also spares the exporter the
  decomposition re-trace it would otherwise run to remove the block (4 s of a small Llama's first step).

Only the program's top-level graph is rewritten; the bodies of other higher-order ops (``cond``, loops)
are left as they are.
"""

from __future__ import annotations

import operator

import onnx
import torch
from onnxscript.values import Op, Opset

from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN as DOMAIN
from onnxtrain.autodiff.registry import STOP_GRADIENT as OP_TYPE

_SCHEMA = onnx.defs.OpSchema(
    OP_TYPE, DOMAIN, 1, "Identity, through which no gradient flows.",
    inputs=[onnx.defs.OpSchema.FormalParameter("input", "T")],
    outputs=[onnx.defs.OpSchema.FormalParameter("output", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)",
                             "tensor(int64)", "tensor(int32)", "tensor(bool)"], "any tensor")],
)
_STOP_GRADIENT = Op(Opset(DOMAIN, 1), OP_TYPE, _SCHEMA)


@torch.library.custom_op("onnxtrain::stop_gradient", mutates_args=())
def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """``x``, through which no gradient flows (only ever traced, never run by ORTModule)."""
    return x.detach().clone()


@stop_gradient.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def translate_stop_gradient(x):
    return _STOP_GRADIENT(x)


def mark_stop_gradients(program: torch.export.ExportedProgram) -> bool:
    """Rewrite ``program`` (in place) as described above; return whether anything changed."""
    graph_module = program.graph_module
    graph = graph_module.graph
    renamed: dict[str, str] = {}  # the program's signature names its outputs: replaced nodes hand theirs on
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.detach.default:
            _replace(graph, node, node.args[0], renamed)
        elif node.target is torch.ops.aten.detach_.default:
            _replace(graph, node, node.args[0], renamed, later_uses_of_input=True)
        elif node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            _inline(graph_module, node, renamed)
        else:
            continue
        changed = True
    if not changed:
        return False
    for spec in program.graph_signature.output_specs:
        name = getattr(spec.arg, "name", None)
        while name in renamed:
            name = renamed[name]
        if name is not None and name != spec.arg.name:
            spec.arg.name = name
    graph.eliminate_dead_code()
    graph.lint()
    graph_module.recompile()
    return True


def _stop(graph: torch.fx.Graph, value: torch.fx.Node) -> torch.fx.Node:
    stopped = graph.call_function(torch.ops.onnxtrain.stop_gradient.default, (value,))
    if "val" in value.meta:
        stopped.meta["val"] = value.meta["val"]
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in value.meta:
            stopped.meta[key] = value.meta[key]
    return stopped


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, source: torch.fx.Node, renamed: dict[str, str],
             later_uses_of_input: bool = False) -> None:
    with graph.inserting_after(node):
        stopped = _stop(graph, source)
    node.replace_all_uses_with(stopped)
    renamed[node.name] = stopped.name
    if later_uses_of_input:  # an in-place detach: x itself is detached from here on
        order = {n: i for i, n in enumerate(graph.nodes)}
        for user in list(source.users):
            if user is not stopped and user is not node and order[user] > order[node]:
                user.replace_input_with(source, stopped)
    graph.erase_node(node)


def _inline(graph_module: torch.fx.GraphModule, node: torch.fx.Node, renamed: dict[str, str]) -> None:
    """Copy the HOP's body in place of ``node``; with grad disabled, its outputs go through stop_gradient."""
    enabled, body_ref, *args = node.args
    body = getattr(graph_module, body_ref.target)
    env: dict[torch.fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for placeholder, arg in zip(placeholders, args):
        env[placeholder] = arg
    graph = graph_module.graph
    results = None
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = torch.fx.node.map_arg(inner.args[0], lambda n: env[n])
                continue
            if inner.op == "get_attr":  # the body's constants become the parent's
                name = f"{body_ref.target}_{inner.target}"
                setattr(graph_module, name, getattr(body, inner.target))
                env[inner] = graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
                continue
            env[inner] = graph.node_copy(inner, lambda n: env[n])
        several = isinstance(results, (tuple, list))
        outputs = list(results) if several else [results]
        if not enabled:
            outputs = [_stop(graph, v) if isinstance(v, torch.fx.Node) else v for v in outputs]
    if several:
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise RuntimeError(f"{node.name}: its outputs are used other than by indexing; cannot inline it")
            output = outputs[user.args[1]]
            user.replace_all_uses_with(output)
            if isinstance(output, torch.fx.Node):
                renamed[user.name] = output.name
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs[0])
        if isinstance(outputs[0], torch.fx.Node):
            renamed[node.name] = outputs[0].name
    graph.erase_node(node)
    if not body_ref.users:
        graph.erase_node(body_ref)
        if not any(n.op == "get_attr" and n.target == body_ref.target for n in graph.nodes):
            delattr(graph_module, body_ref.target)
