"""What bounds ORTModule's bf16 step on a language model: OpenVINO's own time per node group of the fused call,
and PyTorch's time for the same output-layer products.

    python benchmarks/bf16_node_profile.py                          # GPT-2-small, 3 profiled calls
    python benchmarks/bf16_node_profile.py --workloads gpt2 bert --calls 5 --threads 1

For each workload of ``ortmodule_bench.py``, ORTModule under ``torch.autocast`` bf16 builds its fused forward +
backward call (``onnxtrain.ortmodule.fused``) on OpenVINO; its inputs of one step are captured, and the same
model is compiled again with OpenVINO's ``PERF_COUNT`` and run ``--calls`` times. Printed, the mean per call:
the infer call's wall time, the sum of node times, and the node times grouped: the products whose operand or
result has the vocabulary as a dimension (a language model's output layer: its forward, input gradient and
weight gradient), the float32 ops over vocabulary-sized tensors (the loss and its gradient), the bf16/f32
conversions (``Reorder``, ``Convert``), the other products, and the rest by the layer each node comes from
(LayerNorm, GELU, attention's softmax, the loss, each with its gradient; a ``Gelu`` node the plugin fused is
GELU's) or by kind (Transposes and other nodes on OpenVINO's reference kernels, Transposes and Reshapes, other
elementwise ops, those at the MLP's inner width apart: GPT-2's GELU gradient and the bias adds); then the largest
nodes. Then,
where the workload has a vocabulary-sized output layer, the same three products run by ``torch.mm`` on
bfloat16 tensors (what eager autocast and torch.compile call for them), alternating with OpenVINO running each
product alone (its float32 inputs converted in the call, as in the graph), medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_workload  # noqa: E402

VOCAB = {"gpt2": 50257}  # workloads whose output layer is vocabulary-sized (BERT-small's classifier has 2 classes)
# The MLP blocks' inner width: GPT-2's tanh GELU is exported as its formula, which the plugin fuses into a Gelu node
# forward, but its gradient's nodes carry the formula's op names (pow, add, mul), not "gelu"
MLP_WIDTH = {"bert": 1024, "gpt2": 1024}


def _fused_inputs(workload: str):
    """ORTModule's fused OpenVINO session for ``workload`` under autocast bf16 and one step's inputs."""
    import numpy as np
    import torch

    from onnxtrain import ORTModule

    model, loss_fn = make_workload(workload)
    runner = ORTModule(model.train())
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        loss.backward()
    if runner.fallback_reason is not None:
        raise RuntimeError(f"ORTModule fell back to PyTorch: {runner.fallback_reason}")
    fused = [t.fused for e in runner._cache.values() for g in e for t in g.training.values() if t.fused is not None]
    if not fused:
        raise RuntimeError(f"{workload}: no fused call (ONNXTRAIN_LOG_LEVEL=INFO says why)")
    session = fused[0].session
    captured = []
    run_arrays = session._arrays

    def capture(arrays):
        captured[:] = [np.array(a, copy=True) for a in arrays]
        return run_arrays(arrays)

    session._arrays = capture
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(runner)
    loss.backward()
    session._arrays = run_arrays
    return session._session, captured


def _group(node_type: str, exec_type: str, shapes: list[str], vocab: int | None, name: str = "",
           width: int | None = None) -> str:
    wide = vocab is not None and any(str(vocab) in s for s in shapes)
    if node_type == "MatMul":
        return "output-layer products" if wide else "other products"
    if node_type == "Reorder":
        return "conversions (Reorder)" + (", vocabulary-sized" if wide else "")
    if wide:
        return "vocabulary-sized ops, " + ("float32" if exec_type.endswith("f32") else "bf16")
    kind = _kind(node_type, exec_type, name)
    if kind == "other elementwise ops and reductions" and width is not None and shapes and \
            shapes[0].endswith(f",{width}]"):
        return "elementwise at MLP width (GELU grad, bias adds)"
    return kind


#: The rest of the call by the layer a node comes from, read from the exporter's node names (OpenVINO keeps them):
#: (group, words of which one is in the node's name), the first match wins.
_LAYERS = (("LayerNorm and its gradient", ("layer_norm",)), ("GELU and its gradient", ("gelu",)),
           ("attention softmax and scale, and their gradients", ("softmax", "scaled_dot_product")),
           ("loss region (cross-entropy and its gradient)", ("cross_entropy", "log_softmax", "logsumexp")))


def _kind(node_type: str, exec_type: str, name: str) -> str:
    """What a node that is not a product or a conversion does: the layer it comes from, else its kind."""
    if node_type == "Convert":
        return "conversions (Reorder)"
    if exec_type.startswith(("ref", "unknown")):
        return ("Transposes" if node_type == "Transpose" else "other nodes") + " on reference kernels"
    lowered = name.lower()
    for group, words in _LAYERS:
        if any(w in lowered for w in words) or (node_type in ("MVN", "RMS") and group.startswith("LayerNorm")) \
                or (node_type == "Gelu" and group.startswith("GELU")):
            return group
    if node_type in ("Transpose", "Reshape", "Concat", "Gather", "StridedSlice", "Broadcast"):
        return "Transposes, Reshapes, Gathers (jit)"
    return "other elementwise ops and reductions"


def profile_nodes(workload: str, calls: int) -> None:
    import openvino as ov

    from onnxtrain.runtime.openvino import core

    ov_session, arrays = _fused_inputs(workload)
    config = dict(ov_session._config, PERF_COUNT=True)
    compiled = core().compile_model(ov_session._model, "CPU", config)
    request = compiled.create_infer_request()
    for k, array in enumerate(arrays):
        request.set_input_tensor(k, ov.Tensor(array, shared_memory=True))
    request.infer()
    shapes = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        shapes[op.get_friendly_name()] = [str(op.get_output_partial_shape(i)) for i in range(op.get_output_size())] + \
            [str(i.get_source_output().get_partial_shape()) for i in op.inputs()]
    vocab = VOCAB.get(workload)
    width = MLP_WIDTH.get(workload)
    groups, nodes, kinds, walls = collections.Counter(), collections.Counter(), {}, []
    for _ in range(calls):
        start = time.perf_counter()
        request.infer()
        walls.append(time.perf_counter() - start)
        for info in request.profiling_info:
            ms = info.real_time.total_seconds() * 1000 / calls
            groups[_group(info.node_type, info.exec_type, shapes.get(info.node_name, []), vocab, info.node_name,
                          width)] += ms
            nodes[info.node_name] += ms
            kinds[info.node_name] = (info.node_type, info.exec_type)
    total = sum(groups.values())
    print(f"\n{workload}: fused call, mean of {calls}: infer {1000 * statistics.mean(walls):.1f} ms, "
          f"node time {total:.1f} ms")
    for name, ms in groups.most_common():
        print(f"  {name:50} {ms:8.1f} ms  {100 * ms / total:5.1f}%")
    print("  largest nodes:")
    for name, ms in nodes.most_common(10):
        print(f"    {ms:8.1f} ms  {kinds[name][0]:10} {kinds[name][1]:20} {name[:70]}")


def compare_products(workload: str, rounds: int) -> None:
    """The output layer's three products: torch.mm on bfloat16 against OpenVINO's product alone (bf16 hint)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops
    import torch

    from onnxtrain.runtime.openvino import core

    vocab = VOCAB.get(workload)
    if vocab is None:
        return
    model, _ = make_workload(workload)
    rows, hidden = 4 * 128, model.config.n_embd  # ortmodule_bench.py's GPT-2-small batch
    rng = np.random.default_rng(0)
    h = rng.standard_normal((rows, hidden), dtype=np.float32)
    w = rng.standard_normal((vocab, hidden), dtype=np.float32)
    g = rng.standard_normal((rows, vocab), dtype=np.float32)
    th, tw, tg = (torch.from_numpy(x).bfloat16() for x in (h, w, g))
    threads = torch.get_num_threads()

    def compiled(a, b, ta, tb):
        pa, pb = ops.parameter(list(a.shape), np.float32), ops.parameter(list(b.shape), np.float32)
        net = ov.Model([ops.matmul(pa, pb, ta, tb)], [pa, pb])
        request = core().compile_model(net, "CPU", {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY",
                                                    "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads}
                                       ).create_infer_request()
        request.set_input_tensor(0, ov.Tensor(a, shared_memory=True))
        request.set_input_tensor(1, ov.Tensor(b, shared_memory=True))
        return request.infer

    cases = {"forward h @ W^T": (compiled(h, w, False, True), lambda: torch.mm(th, tw.t())),
             "input gradient g @ W": (compiled(g, w, False, False), lambda: torch.mm(tg, tw)),
             "weight gradient g^T @ h": (compiled(g, h, True, False), lambda: torch.mm(tg.t(), th))}
    times = {name: ([], []) for name in cases}
    for _ in range(rounds + 1):  # the first round warms up
        for name, (ours, theirs) in cases.items():
            for k, fn in enumerate((ours, theirs)):
                start = time.perf_counter()
                fn()
                times[name][k].append(time.perf_counter() - start)
    print(f"  output layer [{rows}, {hidden}] x [{hidden}, {vocab}], medians of {rounds} (ms): "
          "OpenVINO alone (f32 inputs converted in the call) / torch.mm on bf16")
    for name, (ours, theirs) in times.items():
        print(f"    {name:26} {1000 * statistics.median(ours[1:]):7.1f} / {1000 * statistics.median(theirs[1:]):7.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["gpt2"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        profile_nodes(workload, args.calls)
        compare_products(workload, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
