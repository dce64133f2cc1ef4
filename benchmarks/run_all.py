"""Every system side by side, in one invocation: PyTorch eager, torch.compile, ORTModule, on-device.

    python benchmarks/run_all.py                 # the issue's workloads, 2 threads, >= 20 timed steps and >= 2 s (~5 min)
    python benchmarks/run_all.py --rounds 3      # each system three times, interleaved (~30 min)
    python benchmarks/run_all.py --workloads bert --steps 30
    python benchmarks/run_all.py --workloads llama --systems eager compile ortmodule   # a small Llama too

Each (workload, system) runs in its own process, one after another (the workers of
ortmodule_bench.py and ondevice_bench.py); with ``--rounds R``, R times, the systems taking turns, and
the timed steps of all rounds pooled. A step is forward + backward + AdamW, float32. Printed per
workload: median step time of each system, ratios to eager and to torch.compile, achieved GFLOP/s
(matmul FLOPs of forward and backward per step, counted analytically: 3x the forward matmul FLOPs) and
that as a share of the GFLOP/s of a large float32 matmul measured in the same run, first-step time and
peak RSS (each worker's own high-water mark, VmHWM: ru_maxrss would inherit the parent's across exec,
and the parent generates the on-device artifacts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ondevice_bench
import ortmodule_bench

SYSTEMS = ("eager", "compile", "ortmodule", "ondevice")
ONDEVICE_WORKLOADS = ("mlp", "bert")  # the on-device benchmark builds these two


def forward_matmul_flops(workload: str) -> float:
    """Multiply-add FLOPs (2 per MAC) of the forward pass's matrix products, per step."""
    if workload == "mlp":
        batch, dims = 128, (784, 1024, 1024, 10)
        return 2 * batch * sum(a * b for a, b in zip(dims, dims[1:]))
    if workload in ("bert", "gpt2"):
        batch, seq, hidden, inner = (8, 128, 256, 1024) if workload == "bert" else (4, 128, 256, 1024)
        tokens, layers = batch * seq, 4
        per_layer = 2 * tokens * (4 * hidden * hidden + 2 * hidden * inner)  # q, k, v, out; two MLP matmuls
        per_layer += 2 * 2 * batch * seq * seq * hidden  # scores and attention-weighted values, all heads
        if workload == "bert":
            head = 2 * batch * hidden * hidden + 2 * batch * hidden * 2  # pooler, classifier
        else:
            head = 2 * tokens * hidden * 50257  # LM head over the vocabulary
        return layers * per_layer + head
    if workload == "llama":  # GQA: k and v project to 2 of the 4 heads; gated MLP: three matmuls
        batch, seq, hidden, inner, kv, vocab = 4, 128, 256, 1024, 128, 32000
        tokens = batch * seq
        per_layer = 2 * tokens * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner)
        per_layer += 2 * 2 * batch * seq * seq * hidden
        return 4 * per_layer + 2 * tokens * hidden * vocab
    raise ValueError(workload)


PEAK_SCRIPT = r"""
import json, sys, time
import numpy as np
threads, n = int(sys.argv[1]), 2048
import torch
torch.set_num_threads(threads)
a, b = torch.randn(n, n), torch.randn(n, n)
def best(fn, reps=7):
    fn(); times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times) / 1e9
torch_gflops = best(lambda: torch.mm(a, b))
import onnxruntime as ort
from onnx import TensorProto, helper
g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm",
    [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in "ab"],
    [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
opts = ort.SessionOptions(); opts.intra_op_num_threads = threads
s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString(), opts)
feeds = {"a": a.numpy(), "b": b.numpy()}
ort_gflops = best(lambda: s.run(None, feeds))
print(json.dumps({"torch": torch_gflops, "onnxruntime": ort_gflops}))
"""


def peak_matmul_gflops(threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(threads)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ondevice(workload: str, artifacts: Path, args) -> dict:
    if not (artifacts / "checkpoint").exists():
        ondevice_bench.generate(workload, artifacts)
    r = ondevice_bench.run_worker("ondevice", workload, artifacts, args)
    return {"workload": workload, "mode": "ondevice", "times": r["times"], "first_s": None,
            "peak_rss_mb": r["peak_rss_mb"]}


def merge(runs: list[dict]) -> dict:
    """One row from the rounds of one (workload, system): median and min over all their timed steps,
    the median first step, the highest peak RSS."""
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    times = sorted(t for r in runs for t in r["times"])
    firsts = sorted(r["first_s"] for r in runs if r["first_s"] is not None)
    return {"workload": runs[0]["workload"], "mode": runs[0]["mode"], "median_s": statistics.median(times),
            "min_s": times[0], "first_s": firsts[len(firsts) // 2] if firsts else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "rounds": len(runs), "times": times}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(ortmodule_bench.DEFAULT_WORKLOADS),
                        choices=ortmodule_bench.WORKLOADS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--min-seconds", type=float, default=2.0,
                        help="each worker times more steps than --steps until they add up to this many "
                             "seconds (the MLP's 10 ms steps: about 200 instead of 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "fused"], default="adamw",
                        help="adamw: torch.optim.AdamW; fused: torch's fused AdamW for eager/compile and "
                             "onnxtrain's FusedAdam for ORTModule (on-device always runs its AdamW graph)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every (workload, system) this many times, interleaved, and pool the steps: "
                             "a noisy spell of the host then falls on every system instead of on one")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    worker_args = SimpleNamespace(steps=args.steps, warmup=args.warmup, threads=args.threads,
                                  optimizer=args.optimizer, min_seconds=args.min_seconds)

    peak = peak_matmul_gflops(args.threads)
    print(f"optimizer: {args.optimizer}")
    print(f"large float32 matmul (2048^3), {args.threads} threads: torch {peak['torch']:.0f} GFLOP/s, "
          f"onnxruntime {peak['onnxruntime']:.0f} GFLOP/s", flush=True)
    reference = max(peak.values())

    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="run_all_") as tmp:
        for workload in args.workloads:
            for round_ in range(args.rounds):
                for system in args.systems:
                    if system == "ondevice" and workload not in ONDEVICE_WORKLOADS:
                        continue
                    print(f"  {workload} / {system} (round {round_ + 1} of {args.rounds}) ...", flush=True)
                    if system == "ondevice":
                        artifacts = Path(tmp) / workload
                        artifacts.mkdir(exist_ok=True)
                        r = run_ondevice(workload, artifacts, worker_args)
                    else:
                        r = ortmodule_bench.run_one(workload, system, worker_args)
                    runs.setdefault((workload, system), []).append(r)
    results = [merge(group) for group in runs.values()]

    print(f"\n{'workload':9} {'system':10} {'median':>9} {'min':>9} {'vs eager':>9} {'vs compile':>10} "
          f"{'GFLOP/s':>8} {'of peak':>8} {'1st step':>9} {'peak RSS':>9}")
    by_key = {(r["workload"], r["mode"]): r for r in results}
    for r in results:
        if "error" in r:
            print(f"{r['workload']:9} {r['mode']:10} failed: {r['error']}")
            continue
        gflops = 3 * forward_matmul_flops(r["workload"]) / r["median_s"] / 1e9
        first = f"{r['first_s']:.2f}s" if r.get("first_s") is not None else "-"
        vs_eager, vs_compile = ortmodule_bench.ratios(r, by_key)
        print(f"{r['workload']:9} {r['mode']:10} {r['median_s'] * 1e3:7.1f}ms {r['min_s'] * 1e3:7.1f}ms "
              f"{vs_eager:>9} {vs_compile:>10} {gflops:8.0f} {100 * gflops / reference:7.0f}% {first:>9} "
              f"{r['peak_rss_mb']:7.0f}MB")
    print("\nratios: median step time of eager (compile) / this one; >1 is faster. 'of peak': achieved matmul "
          "GFLOP/s over the large-matmul GFLOP/s above. On-device first step is not timed (artifacts are "
          "generated ahead of time).")
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_gflops": peak, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
