"""ORTModule's bf16 step with and without :mod:`onnxtrain.passes.shared_rows`, alternating in one process.

    python benchmarks/bf16_shared_rows.py                                # GPT-2-small, 10 rounds, 2 threads
    python benchmarks/bf16_shared_rows.py --workloads gpt2 bert --rounds 20 --clock cpu --threads 1

Two ORTModules of the same ``ortmodule_bench.py`` workload (same weights, same batch) under ``torch.autocast``
bf16, one built with the pass switched off, take turns, one training step each per round (zero_grad, forward,
backward, ``torch.optim.AdamW``). Printed: the median step and fused-call time of each, and the median of the
per-round ratios (with the pass / without). The pass rewrites only where a loss-region value is read by two
products (GPT-2's logits gradient); BERT-small's graph has no such value (its ratio is the noise).
``--clock cpu`` times CPU (all threads): steadier on a loaded machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_workload  # noqa: E402


def _fused_session(runner):
    sessions = [t.fused.session for e in runner._cache.values() for g in e for t in g.training.values()
                if t.fused is not None]
    if runner.fallback_reason is not None or not sessions:
        raise RuntimeError(f"no fused OpenVINO call: {runner.fallback_reason or 'ONNXTRAIN_LOG_LEVEL=INFO says why'}")
    return sessions[0]


def run(workload: str, rounds: int, clock) -> None:
    import onnx_ir as ir
    import torch

    from onnxtrain import ORTModule
    from onnxtrain.passes.shared_rows import SharedRowsPass

    base, loss_fn = make_workload(workload)
    variants = {}
    for name in ("without", "with"):
        model = copy.deepcopy(base).train()
        variants[name] = [ORTModule(model), torch.optim.AdamW(model.parameters(), lr=1e-4), [], []]

    def step(name):
        runner, optimizer, steps, _ = variants[name]
        start = clock()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        loss.backward()
        optimizer.step()
        steps.append(clock() - start)

    with mock.patch.object(SharedRowsPass, "call", lambda self, model: ir.passes.PassResult(model, modified=False)):
        step("without")  # its graphs are built now, without the pass
    for name, (runner, _, steps, calls) in variants.items():
        if name == "with":
            step(name)
        step(name)  # warm
        session = _fused_session(runner)
        inner = session._arrays

        def timed(arrays, inner=inner, calls=calls):
            start = clock()
            result = inner(arrays)
            calls.append(clock() - start)
            return result

        session._arrays = timed
        steps.clear()
        calls.clear()
    for _ in range(rounds):
        for name in variants:
            step(name)
    without, with_ = variants["without"], variants["with"]
    ops = [len(_fused_session(variants[n][0])._session._model.get_ordered_ops()) for n in ("without", "with")]
    if ops[0] == ops[1]:
        print(f"{workload}: the pass changed nothing in the fused graph ({ops[0]} OpenVINO ops)")
    ratio = statistics.median(b / a for a, b in zip(without[2], with_[2]))
    call_ratio = statistics.median(b / a for a, b in zip(without[3], with_[3]))
    print(f"{workload}: {rounds} rounds, medians (ms): step without {1000 * statistics.median(without[2]):.1f}, "
          f"with {1000 * statistics.median(with_[2]):.1f} (paired ratio {ratio:.3f}); fused call without "
          f"{1000 * statistics.median(without[3]):.1f}, with {1000 * statistics.median(with_[3]):.1f} "
          f"(paired ratio {call_ratio:.3f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for workload in args.workloads:
        run(workload, args.rounds, clock)


if __name__ == "__main__":
    main()
