"""Where a training step's time goes: onnxruntime's profiler, aggregated per op type.

Runs on-device training steps (forward + backward graph, then the AdamW graph) with onnxruntime
profiling on, and prints the share of kernel time per op type for each graph, plus the top nodes.

    python benchmarks/profile_ops.py                    # BERT-small, 2 threads, 10 steps
    python benchmarks/profile_ops.py --model mlp --steps 20
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ondevice_bench as bench  # noqa: E402  (models, batches and artifact generation are shared)

CONTROL_FLOW = frozenset({"Scan", "Loop", "If"})


def aggregate(profile_file: str) -> tuple[collections.Counter, collections.Counter, int]:
    """Kernel microseconds per op type and per node, and the number of runs, from a profile file."""
    with open(profile_file) as f:
        text = f.read()
    events = json.loads(text) if text.strip() else []  # a session still open has written nothing yet
    by_op: collections.Counter = collections.Counter()
    by_node: collections.Counter = collections.Counter()
    runs = 0
    for event in events:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        op = event.get("args", {}).get("op_name", "?")
        if op in CONTROL_FLOW:
            continue  # its body's nodes are profiled one by one: counting both would count twice
        by_op[op] += event["dur"]
        by_node[(op, event["name"][: -len("_kernel_time")])] += event["dur"]
    return by_op, by_node, max(runs, 1)


def report(title: str, profile_file: str, top: int) -> None:
    by_op, by_node, runs = aggregate(profile_file)
    total = sum(by_op.values())
    print(f"\n{title}: {total / runs / 1e3:.2f} ms of kernel time per run ({runs} runs)")
    print(f"  {'op type':<28} {'ms/run':>8} {'share':>7}")
    for op, us in by_op.most_common(top):
        print(f"  {op:<28} {us / runs / 1e3:>8.2f} {100 * us / total:>6.1f}%")
    print("  top nodes:")
    for (op, node), us in by_node.most_common(5):
        print(f"    {op:<18} {node[:60]:<60} {us / runs / 1e3:>7.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert", choices=["mlp", "bert"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()


    from onnxtrain.api import CheckpointState, Module, Optimizer
    from onnxtrain.utils.ort_options import for_training

    with tempfile.TemporaryDirectory(prefix="profile_ops_") as tmp:
        d = Path(tmp)
        bench.generate(args.model, d)
        options = for_training()  # as the runtime's defaults, plus profiling
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.enable_profiling = True
        options.profile_file_prefix = str(d / "profile")
        state = CheckpointState.load_checkpoint(d / "checkpoint")
        module = Module(d / "training_model.onnx", state, session_options=options)
        optimizer = Optimizer(d / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(1e-4)
        inputs, labels = bench.make_batch(args.model)
        for _ in range(args.steps):
            module(*inputs, labels)
            optimizer.step()
            module.lazy_reset_grad()
        del optimizer, module
        gc.collect()  # onnxruntime writes a session's profile when the session is destroyed
        files = sorted(glob.glob(str(d / "profile*.json")))
        if not files:
            print("onnxruntime wrote no profile", file=sys.stderr)
            return 1
        print(f"model={args.model} threads={args.threads} steps={args.steps}")
        # Profile files are named by session creation time: the training session comes first.
        titles = ["training graph (forward + loss + backward)", "optimizer graph (AdamW)"]
        for i, f in enumerate(files):
            report(titles[i] if len(files) == len(titles) else f"session {i}", f, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
