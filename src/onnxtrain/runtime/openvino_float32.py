"""Which ops OpenVINO keeps in float32 under its bfloat16 hint, as ``torch.autocast`` keeps its losses (issue 17).

OpenVINO's CPU plugin, given ``INFERENCE_PRECISION_HINT=bf16``, lowers every float32 op it reaches from a
product (``MatMul``, convolutions), elementwise ops, scatters and reductions included: only the graph's tail
(the ops between the last product and an output) stays float32. A training graph's backward starts with the
loss's gradient, ``softmax - one_hot`` (a ``ScatterElementsUpdate`` adding -1/N at each label into p/N): in
bfloat16 that difference cancels, and the gradients of the layers under it came out up to 8.5x further from
float64 than eager autocast's (BERT-small's ``classifier.bias``). Autocast computes the loss and its gradient in
float32.

The policy (:func:`float32_region`, a function of the graph alone), ``ONNXTRAIN_OPENVINO_FLOAT32=sums``, the
default (``loss`` is the same without the row sums below): the **loss region** is kept in float32: starting from ``LogSoftmax`` and from an ``Exp`` that reads a
log-softmax, a graph input (the cross-entropy's gradient is ``Exp`` of the saved log-probabilities) or ``x -
ReduceMax(x)`` (a log-softmax written as a log-sum-exp, :mod:`onnxtrain.passes.log_sum_exp_loss`), and from a
``Log`` of a ``Sigmoid`` (binary cross-entropy with logits), every
float32 op connected to them, in either direction, without crossing a product or a non-float op. The
products themselves still run in bfloat16 (their inputs are cast down at the region's edge). Not seeds:
scatters (BERT's gradient of its first-token select is one, and from it the region ran through the whole
residual stream's gradient), attention's ``Softmax`` and GELU's gradient's ``Exp`` (from them the region took
in every layer's attention and GELU, 125 of BERT-small's fused graph's 2536 ops instead of 61, and its step
took 1.10-1.24x instead of 0.96x the plugin's own choice, with no better gradients). ``none`` is the plugin's
own choice (every op it reaches from a product in bfloat16), ``all`` keeps every op but the products in
float32 (BERT-small's step 1.17x). Under ``sums`` and ``all`` the **row sums** of LayerNorm's gradients stay
``ReduceSum`` when the graphs are built (:func:`float32_sums`): as a ``MatMul`` by ones the plugin ran them in
bfloat16, and GPT-2-small's ``ln_f.bias`` gradient was 1.23x further from float64 than autocast's (1.01x as
``ReduceSum``). Numbers in docs/precision.md.

How the ops are kept: the CPU plugin leaves a node's precision alone when the node carries OpenVINO's
``DisablePrecisionConversion`` runtime attribute (``ov::disable_conversion``, read in the plugin's
``EnforceInferencePrecision``; checked on the installed ``openvino`` 2026.4 by its runtime model, see
tests/ondevice/test_openvino_float32.py). The Python API cannot make that typed attribute (a string set in
``get_rt_info()`` is not it), but OpenVINO's IR reader makes it from ``<rt_info>``: :func:`keep_float32` writes
the model as IR to a temporary directory, marks the chosen layers there, and reads it back.
This module imports neither torch nor onnx (the on-device runtime uses it).
"""

from __future__ import annotations

import os
import tempfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable

PRODUCTS = frozenset({"MatMul", "Convolution", "ConvolutionBackpropData", "GroupConvolution",
                      "GroupConvolutionBackpropData", "Einsum"})
LOSS_SEEDS = frozenset({"LogSoftmax", "Exp", "Log"})
# An Exp seeds the region only when it reads a LogSoftmax or a graph input (the saved log-probabilities in a
# backward graph): GELU's gradient has an Exp too, and from it the region took in every layer's GELU.
_EXP_SOURCES = frozenset({"LogSoftmax", "Parameter"})
# A Log seeds the region only as a log-sigmoid, Log(Sigmoid(x)): binary cross-entropy with logits, as exported
# (autocast keeps it float32). ELECTRA's discriminator head: its gradients 1.5-2.3x further from float64 than
# autocast's overall (the head's bias 3.6x) with the loss's gradient in bfloat16; 0.97-1.10x float32
# (tests/ortmodule/test_families_bf16.py).
_LOG_SOURCES = frozenset({"Sigmoid"})
# Running sums: the plugin's bfloat16 CumSum rounds each partial sum, so its error grows with the axis (torch's
# bfloat16 cumsum accumulates in float32 and rounds each output once). A cumsum over 512 features mid-graph: the
# gradients under it 38-74x further from float64 than eager autocast's, a logcumsumexp's 130-150x; 1.0-1.1x kept
# float32 (tests/ortmodule/test_autocast_policy.py). Kept under every policy but "none".
ACCUMULATIONS = frozenset({"CumSum"})
POLICIES = ("none", "loss", "sums", "all")
POLICY_ENV = "ONNXTRAIN_OPENVINO_FLOAT32"  # "sums" (the default), "loss", "none" (the plugin's own choice) or "all"
DEFAULT_POLICY = "sums"
# The policies under which the gradients' row sums stay ReduceSum (float32) rather than becoming products
_FLOAT32_SUMS = frozenset({"sums", "all"})
_NOT_OPS = frozenset({"Parameter", "Constant", "Result"})
# Ops that move values without arithmetic (no rounding of their own)
_MOVES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "VariadicSplit", "Slice",
                    "StridedSlice", "Gather", "Broadcast"})
# what the IR reader turns into ov::DisablePrecisionConversion: no conversion to float16 or bfloat16
_ATTRIBUTE = {"name": "DisablePrecisionConversion", "version": "0", "value": "dynamic:f16,bf16"}


def float32_region(nodes: Iterable[tuple[str, str, bool, list[str]]], seeds=LOSS_SEEDS) -> set[str]:
    """The names of the nodes to keep in float32: ``nodes`` are (name, op type, whether every output is
    float32, the names of the nodes its inputs come from). The loss region: the float32 nodes connected to a
    loss seed (:data:`LOSS_SEEDS`) without crossing a product (:data:`PRODUCTS`) or a non-float32 node."""
    nodes = list(nodes)
    inside = {name for name, op_type, f32, _ in nodes if f32 and op_type not in PRODUCTS and op_type not in _NOT_OPS}
    neighbours: dict[str, set[str]] = {name: set() for name in inside}
    for name, _, _, sources in nodes:
        if name in inside:
            for source in sources:
                if source in inside and source != name:
                    neighbours[name].add(source)
                    neighbours[source].add(name)
    if seeds is None:  # every float32 op but the products
        return inside
    types = {name: op_type for name, op_type, _, _ in nodes}
    reads = {name: sources for name, _, _, sources in nodes}
    todo = [name for name, op_type, _, sources in nodes if name in inside and op_type in seeds
            and (op_type == "LogSoftmax"
                 or op_type == "Log" and all(types.get(source) in _LOG_SOURCES for source in sources)
                 or op_type == "Exp" and (all(types.get(source) in _EXP_SOURCES for source in sources)
                                          or _log_sum_exp(sources, types, reads)))]
    region = set(todo)
    while todo:
        for other in neighbours[todo.pop()] - region:
            region.add(other)
            todo.append(other)
    return region


def output_tails(nodes: Iterable[tuple[str, str, bool, list[str]]]) -> set[str]:
    """What makes a low-type graph output (a ``Convert`` to bfloat16 read by a ``Result``: ORTModule casts the
    outputs eager autocast returns in bfloat16, :mod:`onnxtrain.passes.cast_outputs`) round once, as eager's
    ``addmm`` rounds its product and bias once: the float32 ops walked back from the ``Convert`` up to the
    products, and those products themselves where the walk met arithmetic (a bias ``Add``), not only moves
    (``Reshape``). Left to itself the plugin rounds the product to bfloat16, adds the bias and rounds again:
    a linear layer's bias gradient was then 1.2-1.6x further from float64 than autocast's (the loss's
    gradient is made of those logits; tests/ortmodule/test_autocast.py), 0.7-1.1x with the product float32.
    A product that is the output itself (GPT-2's ``lm_head``, no bias) stays bfloat16: it rounds once."""
    nodes = list(nodes)
    inside = {name for name, op_type, f32, _ in nodes if f32 and op_type not in PRODUCTS and op_type not in _NOT_OPS}
    reads = {name: sources for name, _, _, sources in nodes}
    types = {name: op_type for name, op_type, _, _ in nodes}
    outputs = {source for _, op_type, _, sources in nodes if op_type == "Result" for source in sources}
    tails: set[str] = set()
    for convert in (name for name in outputs if types.get(name) == "Convert"):
        todo = [source for source in reads[convert] if source in inside]
        walked, products = set(todo), set()
        while todo:
            for source in reads[todo.pop()]:
                if source in inside and source not in walked:
                    walked.add(source)
                    todo.append(source)
                elif types.get(source) in PRODUCTS:
                    products.add(source)
        tails |= walked
        if any(types[name] not in _MOVES for name in walked):
            tails |= products
    return tails


def accumulations(nodes: Iterable[tuple[str, str, bool, list[str]]]) -> set[str]:
    """The float32 running sums (:data:`ACCUMULATIONS`) of the graph, to keep in float32."""
    return {name for name, op_type, f32, _ in nodes if f32 and op_type in ACCUMULATIONS}


def _log_sum_exp(sources: list[str], types: dict[str, str], reads: dict[str, list[str]]) -> bool:
    """An ``Exp`` of ``x - ReduceMax(x)``: a log-softmax written as a log-sum-exp
    (:mod:`onnxtrain.passes.log_sum_exp_loss`), a loss seed as ``LogSoftmax`` is."""
    if len(sources) != 1 or types.get(sources[0]) != "Subtract":
        return False
    operands = reads.get(sources[0], [])
    return len(operands) == 2 and types.get(operands[1]) == "ReduceMax" and operands[0] in reads.get(operands[1], [])


def graph_of(model) -> list[tuple[str, str, bool, list[str]]]:
    """An ``ov.Model`` as :func:`float32_region` reads it."""
    return [(op.get_friendly_name(), op.get_type_name(),
             op.get_output_size() > 0 and all(op.get_output_element_type(i).get_type_name() == "f32"
                                               for i in range(op.get_output_size())),
             [i.get_source_output().get_node().get_friendly_name() for i in op.inputs()])
            for op in model.get_ordered_ops()]


def policy(name: str | None = None) -> str:
    """The policy to apply: ``name``, else ``ONNXTRAIN_OPENVINO_FLOAT32``, else "sums"."""
    name = name or os.environ.get(POLICY_ENV) or DEFAULT_POLICY
    if name not in POLICIES:
        raise ValueError(f"unknown OpenVINO float32 policy {name!r} ({POLICY_ENV}); choose one of {list(POLICIES)}")
    return name


def float32_sums(precision: str, name: str | None = None) -> bool:
    """Whether a graph run in ``precision`` keeps the gradients' row sums that no product reads (LayerNorm's
    weight and bias gradients) as ``ReduceSum`` rather than a ``MatMul`` by a row of ones
    (:mod:`onnxtrain.passes.sum_rows_by_matmul`): in "bf16" under the "sums" and "all" policies. OpenVINO runs
    such a product in bfloat16 (its rows and its result rounded), the ``ReduceSum`` in float32, as autocast sums
    a LayerNorm's gradients. A linear layer's bias gradient stays a product: its rows are a product's output
    gradient, which autocast sums in bfloat16 too, and as ``ReduceSum`` the step took 1.14-1.22x (BERT-small).
    Decided when the graphs are built, before any session is made."""
    return precision == "bf16" and policy(name) in _FLOAT32_SUMS


def keep_float32(model, core, name: str | None = None):
    """``model`` (an ``ov.Model``) with the policy's nodes marked to stay float32 under the bfloat16 hint: a new
    model read by ``core``, or ``model`` itself when the policy is "none" or chooses no node."""
    chosen = policy(name)
    if chosen == "none":
        return model  # "sums" marks the loss region as "loss" does: its row sums are ReduceSums already
    nodes = graph_of(model)
    names = (float32_region(nodes, seeds=None if chosen == "all" else LOSS_SEEDS) | output_tails(nodes)
             | accumulations(nodes))
    if not names:
        return model
    import openvino as ov

    with tempfile.TemporaryDirectory(prefix="onnxtrain_ov_") as tmp:
        xml_path, bin_path = os.path.join(tmp, "model.xml"), os.path.join(tmp, "model.bin")
        ov.save_model(model, xml_path, compress_to_fp16=False)
        tree = ElementTree.parse(xml_path)
        for layer in tree.getroot().iter("layer"):
            if layer.get("name") in names:
                rt_info = layer.find("rt_info")
                if rt_info is None:
                    rt_info = ElementTree.SubElement(layer, "rt_info")
                ElementTree.SubElement(rt_info, "attribute", _ATTRIBUTE)
        tree.write(xml_path)
        with open(bin_path, "rb") as f:
            weights = f.read()
        with open(xml_path, "rb") as f:
            marked = core.read_model(f.read(), weights)
    _copy_model_info(model, marked)
    return marked


def _copy_model_info(source, target) -> None:
    """The model-level runtime info (the ONNX metadata in ``framework``) as the source had it."""
    info = source.get_rt_info()
    if "framework" in list(info.keys()):
        for key, value in info["framework"].items():
            target.set_rt_info(value.astype(str), ["framework", key])
