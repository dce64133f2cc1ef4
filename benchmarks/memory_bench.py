"""Activation memory and step time against the recompute budget (``DebugOptions(recompute=...)``).

    python benchmarks/memory_bench.py                       # BERT-small and GPT-2-small at 4x batch
    python benchmarks/memory_bench.py --workloads bert --budgets none 1.0 0.5 0.0 --rounds 2

Each (workload, budget) runs in its own process (one thread unless --threads), so that onnxruntime's arena
and the process high-water mark belong to that budget alone; rounds alternate the order of the budgets.
A worker runs a warm-up step, then ``--steps`` timed steps with torch's AdamW. Reported per budget, as
medians over the rounds: the step time, the RSS between steps, the peak RSS during the last step
(``VmHWM`` reset through ``/proc/self/clear_refs`` before it), activation memory = that peak minus the
RSS before it, the process's peak RSS, and the stash the plan keeps. Ratios are to no recompute
(``budget 1.0``). "eager" is PyTorch without ORTModule, for comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ondevice_bench import peak_rss_mb  # noqa: E402
from ortmodule_bench import make_workload  # noqa: E402

BUDGETS = ("eager", "none", "1.0", "0.75", "0.5", "0.25", "0.0")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(workload: str, budget: str, steps: int, scale: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    model, loss_fn = make_workload(workload, scale)
    model.train()
    runner = model
    if budget != "eager":
        from onnxtrain import ORTModule
        from onnxtrain.ortmodule import DebugOptions

        runner = ORTModule(model, DebugOptions(recompute=None if budget == "none" else float(budget)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(runner)
        loss.backward()
        optimizer.step()
        del loss
        return time.perf_counter() - start

    step()
    times, between, step_peak = [], [], []
    for _ in range(steps):
        gc.collect()
        before = rss_mb()
        reset = reset_peak()
        times.append(step())
        between.append(before)
        step_peak.append(peak_rss_mb() if reset else float("nan"))
    kept = None
    if budget != "eager":
        if runner.fallback_reason is not None:
            raise RuntimeError(f"ORTModule fell back to PyTorch: {runner.fallback_reason}")
        plans = [t.recompute for entries in runner._cache.values() for g in entries for t in g.training.values()]
        kept = sum(p.stashed_bytes - p.saved_bytes for p in plans if p is not None) / 2**20
    return {"workload": workload, "budget": budget, "median_s": statistics.median(times),
            "between_mb": statistics.median(between),
            "activation_mb": statistics.median(p - b for p, b in zip(step_peak, between)),
            "step_peak_mb": statistics.median(step_peak), "process_peak_mb": peak_rss_mb(), "kept_mb": kept}


def run_one(workload: str, budget: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", workload, budget, "--steps", str(args.steps),
           "--scale", str(args.scale), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{workload} {budget} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"])
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scale", type=int, default=4, help="batch multiplier (4: the issue's 4x batch)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "BUDGET"))
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.scale, args.threads)))
        return 0
    for workload in args.workloads:
        results: dict[str, list[dict]] = {b: [] for b in args.budgets}
        for k in range(args.rounds):
            for budget in (args.budgets if k % 2 == 0 else args.budgets[::-1]):
                results[budget].append(run_one(workload, budget, args))
        med = {b: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key not in ("workload", "budget")
                   and rs[0][key] is not None} for b, rs in results.items()}
        base = med.get("1.0")
        print(f"\n{workload} at {args.scale}x batch, {args.threads} thread(s), {args.rounds} round(s), "
              f"{args.steps} steps each; medians")
        print(f"{'budget':>7} {'step':>9} {'vs 1.0':>7} {'activation':>11} {'vs 1.0':>7} {'between':>9} "
              f"{'step peak':>10} {'proc peak':>10} {'stash kept':>11}")
        for b in args.budgets:
            m = med[b]
            t_ratio = f"{m['median_s'] / base['median_s']:.2f}x" if base else "-"
            a_ratio = f"{m['activation_mb'] / base['activation_mb']:.2f}x" if base and base['activation_mb'] > 0 else "-"
            kept = f"{m['kept_mb']:9.1f}MB" if "kept_mb" in m else "-"
            print(f"{b:>7} {m['median_s'] * 1e3:7.1f}ms {t_ratio:>7} {m['activation_mb']:9.0f}MB {a_ratio:>7} "
                  f"{m['between_mb']:7.0f}MB {m['step_peak_mb']:8.0f}MB {m['process_peak_mb']:8.0f}MB {kept:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
