"""Where a bench model's training step goes in Python onnxruntime: the native side of ``profile.mjs --ops``.

    PYTHONPATH=src python web/bench/profile_python.py web/bench/transformer-web [--threads 1] [--steps 15]

Runs the training model of a bench folder (make_bench.py) with onnxruntime's profiler on, and prints the
median time of each node over the runs (after 3 warm-up runs), summed by op type, as ``profile.mjs``
prints it for onnxruntime-web, and the sum over the matrix products (MatMul, FusedMatMul, Gemm,
FusedGemm). The two side by side show which ops make the gap between WebAssembly and native code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnxtrain.api import CheckpointState

PRODUCTS = ("MatMul", "FusedMatMul", "Gemm", "FusedGemm")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args(argv)
    spec = json.loads((args.folder / "bench.json").read_text())
    meta_model = args.folder / "training_model.onnx"
    state = CheckpointState.load_checkpoint(args.folder / "checkpoint")
    rng = np.random.default_rng(1)
    feeds = {}
    for item in spec["inputs"]:
        shape = item["shape"]
        feeds[item["name"]] = (rng.integers(0, item["high"], shape) if item["dtype"] == "int64"
                               else rng.uniform(-1, 1, shape).astype(np.float32))
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(meta_model), options, providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}
        feeds.update({n: p.data for n, p in state.parameters.items() if n in names})
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            session.run(None, feeds)
            times.append((time.perf_counter() - t0) * 1e3)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_node = defaultdict(list)
    op_of = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_node[e["name"]].append(e["dur"] / 1e3)
            op_of[e["name"]] = e["args"]["op_name"]
    by_op = defaultdict(float)
    for name, ms in per_node.items():
        by_op[op_of[name]] += statistics.median(ms[3:] or ms)
    print(f"training step {statistics.median(times[3:]):.2f} ms (median, {args.threads} thread(s), Python onnxruntime "
          f"{ort.__version__})")
    print("training model: ops by time (ms per run, median per node)")
    for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {op:<22} {ms:.2f}")
    print(f"matrix products ({', '.join(PRODUCTS)}): {sum(by_op[o] for o in PRODUCTS):.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
