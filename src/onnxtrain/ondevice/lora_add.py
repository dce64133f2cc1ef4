"""LoRA adapters that onnxtrain adds itself to named linear layers of a plain ONNX model (no PEFT).

A linear layer exported by ``torch.onnx.export(..., optimize=False)`` is ``y = MatMul(x, Transpose(W))``
with ``W`` an initializer named ``<module>.weight`` (``[out, in]``). For each module whose name is one of
``target_modules``, or ends with ``.<target>`` (PEFT's rule), the pass adds

    y' = y + (alpha / r) * MatMul(MatMul(x, Transpose(A)), Transpose(B))

with ``A = <module>.lora_A.weight`` (``[r, in]``, uniform in ``+-1/sqrt(in)``: PEFT's default
Kaiming-uniform draw) and ``B = <module>.lora_B.weight`` (``[out, r]``, zeros), and points the readers of
``y`` at ``y'``: the graph PEFT's ``LoraLayer`` exports (a bias, if any, is added after, which is the
same sum). The adapters' names hold ``lora_A``/``lora_B``, so :func:`generate_lora_artifacts` trains
them and ``merge_adapters`` folds them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _module_of(weight_name: str) -> str | None:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else None


def _targeted(module: str, targets: Sequence[str]) -> bool:
    return any(module == t or module.endswith("." + t) for t in targets)


def _linear_product(graph: onnx.GraphProto, weight: str) -> onnx.NodeProto | None:
    """The ``MatMul(x, Transpose(weight))`` that reads ``weight``, if that is its only use."""
    readers = [n for n in graph.node if weight in n.input]
    if len(readers) != 1 or readers[0].op_type != "Transpose":
        return None
    perm = next((list(a.ints) for a in readers[0].attribute if a.name == "perm"), [1, 0])
    products = [n for n in graph.node if readers[0].output[0] in n.input]
    if perm != [1, 0] or len(products) != 1 or products[0].op_type != "MatMul" \
            or list(products[0].input).index(readers[0].output[0]) != 1:
        return None
    return products[0]


def add_lora_adapters(model: onnx.ModelProto, target_modules: Sequence[str], r: int = 8, alpha: float = 16,
                      seed: int = 0) -> onnx.ModelProto:
    """A copy of ``model`` with LoRA adapters on the linear layers ``target_modules`` names (module docstring)."""
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if not target_modules:
        raise ValueError("target_modules is empty: name the linear layers to adapt (e.g. ['q_proj', 'v_proj'])")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be a positive int, got {r!r}")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    existing = [t.name for t in graph.initializer if "lora_" in t.name]
    if existing:
        raise ValueError(f"the model already has LoRA adapters ({existing[:3]}); pass target_modules only for a "
                         "model without them")
    rng = np.random.default_rng(seed)
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    matrices = [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2]
    chosen = [t for t in matrices if _module_of(t.name) and _targeted(_module_of(t.name), target_modules)]
    if not chosen:
        raise ValueError(f"no linear layer matches target_modules {list(target_modules)}; the model's float "
                         f"matrices are {[t.name for t in matrices][:8]}")
    scaling = f"lora.scaling.{alpha}/{r}"
    # a Constant node, not an initializer: float initializers are the frozen base's parameters
    graph.node.insert(0, helper.make_node("Constant", [], [scaling], name=scaling,
                                          value=numpy_helper.from_array(np.array(alpha / r, dtype=np.float32))))
    for weight in chosen:
        module = _module_of(weight.name)
        product = _linear_product(graph, weight.name)
        if product is None:
            raise ValueError(f"cannot add an adapter to {module!r}: its weight is not read only as "
                             "MatMul(x, Transpose(W)), as torch.onnx.export(..., optimize=False) writes a Linear")
        out_features, in_features = weight.dims
        a_name, b_name = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        clash = [n for n in (a_name, b_name) if n in taken]
        if clash:
            raise ValueError(f"cannot add an adapter to {module!r}: the model already has values named {clash}")
        bound = 1.0 / np.sqrt(in_features)
        graph.initializer.extend([
            numpy_helper.from_array(rng.uniform(-bound, bound, (r, in_features)).astype(np.float32), a_name),
            numpy_helper.from_array(np.zeros((out_features, r), dtype=np.float32), b_name)])
        x, y = product.input[0], product.output[0]
        for output in graph.output:
            if output.name == y:
                raise ValueError(f"cannot add an adapter to {module!r}: its output {y!r} is a graph output")
        p = f"{module}.lora"
        nodes = [
            helper.make_node("Transpose", [a_name], [f"{p}.A_t"], perm=[1, 0], name=f"{p}/transpose_A"),
            helper.make_node("MatMul", [x, f"{p}.A_t"], [f"{p}.xA"], name=f"{p}/A"),
            helper.make_node("Transpose", [b_name], [f"{p}.B_t"], perm=[1, 0], name=f"{p}/transpose_B"),
            helper.make_node("MatMul", [f"{p}.xA", f"{p}.B_t"], [f"{p}.xAB"], name=f"{p}/B"),
            helper.make_node("Mul", [f"{p}.xAB", scaling], [f"{p}.scaled"], name=f"{p}/scale"),
            helper.make_node("Add", [y, f"{p}.scaled"], [f"{p}.out"], name=f"{p}/add"),
        ]
        for node in graph.node:  # the layer's readers now read y'
            for k, name in enumerate(node.input):
                if name == y:
                    node.input[k] = f"{p}.out"
        at = list(graph.node).index(product) + 1
        for k, node in enumerate(nodes):
            graph.node.insert(at + k, node)
    return model


__all__ = ["add_lora_adapters"]
