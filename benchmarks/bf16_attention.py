"""Attention that eager computes in float32 under autocast bf16: ORTModule's PRODUCTS_BF16 step against eager's.

    python benchmarks/bf16_attention.py                                   # BERT-small and GPT-2-small, dropout 0.1
    python benchmarks/bf16_attention.py --workloads bert --rounds 6 --block 5 --optimizer adamw

With attention dropout (the configs' default 0.1) PyTorch's sdpa runs its CPU math kernel, in float32, under
``torch.autocast("cpu", dtype=torch.bfloat16)``; ORTModule then runs the graphs with the products in bfloat16 but
attention's, on OpenVINO at its float32 hint (``onnxtrain.ortmodule.graphs.PRODUCTS_BF16``). Before, it fell back
to PyTorch, which is eager's step. ``ortmodule_bench.py`` runs each side in its own process, one after the other,
which a shared machine's load hits unevenly; here both sides live in one process (``ortmodule_bench.py``'s
workloads and optimizers, 2 threads) and take turns every ``--block`` steps (the first step after a switch not
counted), so the load hits them alike. Printed per workload: the median step of each side, wall and CPU time
(all threads), and the ratio eager / ORTModule (>1: ORTModule is faster; the issue-17 targets' form).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_optimizer, make_workload  # noqa: E402


def alternate(workload: str, rounds: int, block: int, optimizer: str, dropout: float) -> dict:
    import torch

    from onnxtrain import ORTModule

    os.environ.setdefault("ONNXTRAIN_BF16_ATTENTION_FLOAT32", "1")  # the mode (the default), unless the caller says
    torch.set_num_threads(2)
    model, loss_fn = make_workload(workload, dropout=dropout)
    model.train()
    eager = copy.deepcopy(model)
    sides = {"eager-bf16": (eager, make_optimizer(eager.parameters(), "eager-bf16", optimizer)),
             "ortmodule-bf16": (ORTModule(model), make_optimizer(model.parameters(), "ortmodule-bf16", optimizer))}

    def step(runner, opt) -> tuple[float, float]:
        start = (time.perf_counter(), time.process_time())
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        loss.backward()
        opt.step()
        return time.perf_counter() - start[0], time.process_time() - start[1]

    for runner, opt in sides.values():
        for _ in range(3):
            step(runner, opt)
    ortmodule = sides["ortmodule-bf16"][0]
    if ortmodule.fallback_reason is not None:
        raise RuntimeError(f"ORTModule fell back to PyTorch: {ortmodule.fallback_reason}")
    ran = sorted({(g.backend, g.precision) for e in ortmodule._cache.values() for g in e})
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, (runner, opt) in sides.items():
            step(runner, opt)
            times[name] += [step(runner, opt) for _ in range(block)]
    medians = {name: [1000 * statistics.median(t[k] for t in rows) for k in (0, 1)] for name, rows in times.items()}
    eager_ms, ort_ms = medians["eager-bf16"], medians["ortmodule-bf16"]
    print(f"\n{workload}, dropout {dropout}, --optimizer {optimizer}, ORTModule ran {ran}, {rounds} rounds of {block} "
          f"steps each side, load average {os.getloadavg()[0]:.1f}: median step ms, wall / CPU")
    for name, (wall, cpu) in medians.items():
        print(f"  {name:15} {wall:7.1f} / {cpu:7.1f}")
    print(f"  eager / ORTModule: wall {eager_ms[0] / ort_ms[0]:.2f}x, CPU {eager_ms[1] / ort_ms[1]:.2f}x")
    return medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--optimizer", choices=["adamw", "fused"], default="fused",
                        help="as ortmodule_bench.py's: fused runs FusedAdam for ORTModule, AdamW(fused=True) for eager")
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args(argv)
    for workload in args.workloads:
        alternate(workload, args.rounds, args.block, args.optimizer, args.dropout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
