"""Where an ORTModule training step under torch.autocast bf16 goes, beside eager autocast, in one process.

    python benchmarks/bf16_step_profile.py                      # BERT-small and GPT-2-small, 10 rounds
    python benchmarks/bf16_step_profile.py --workloads mlp bert gpt2 --rounds 20
    python benchmarks/bf16_step_profile.py --workloads mlp --rounds 40 --threads 1 --clock cpu

Three variants of each workload of ``ortmodule_bench.py`` (same weights, same batch) take turns, one step
each per round, so that a load that changes during the run hits them alike: eager under autocast, ORTModule
with the fused forward + backward call (``onnxtrain.ortmodule.fused``, the default) and ORTModule with the
two graphs (``ONNXTRAIN_FUSED_STEP=0``: forward, then backward in stages). A step is zero_grad, forward,
backward and ``torch.optim.AdamW`` (``--optimizer fused``: the one-pass kernels). Printed: median step
times and their ratios to eager, then, for the ORTModule variants, the median time of each graph call
(binding, run and copies out), of the rest of forward and backward (torch glue: the embedding rows'
``index_add_``, scaling), of the optimizer step, and what is left (Python, torch's loss, autograd).
The ratios of ``ortmodule_bench.py`` (separate processes) are the issue's targets; these are the profile.
``--clock cpu`` times CPU (all threads) instead of wall: steadier on a loaded machine, at one thread
(``--threads 1``) a measure of the work alone.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_optimizer, make_workload  # noqa: E402

CLOCK = [time.perf_counter]  # --clock cpu: time.process_time (every thread's CPU time, spinning included)
FUSED_STEP_ENV = "ONNXTRAIN_FUSED_STEP"  # onnxtrain.ortmodule.options; read when the graphs are built


def _variants(workload: str, optimizer_kind: str):
    import torch

    from onnxtrain import ORTModule

    base, loss_fn = make_workload(workload)
    variants = {}
    for name in ("eager", "fused", "two-graph"):
        model = copy.deepcopy(base).train()
        runner = model if name == "eager" else ORTModule(model)
        optimizer = make_optimizer(model.parameters(), "eager" if name == "eager" else "ortmodule", optimizer_kind)
        variants[name] = (runner, optimizer, defaultdict(list))
    return variants, loss_fn, torch


def _instrument(runner, current: dict) -> None:
    """Time every session call of ``runner`` (after its first step built them) into ``current``."""
    for entries in runner._cache.values():
        for graphs in entries:
            for training in graphs.training.values():
                sessions = [("forward", training.forward)]
                if training.fused is not None:
                    sessions.append(("fused call", training.fused.session))
                for staged in training._backward.values():
                    if staged is not None:
                        sessions += [(f"backward stage {k}", s) for k, s in enumerate(staged.sessions)]
                for label, session in sessions:
                    run = session.run

                    def timed(inputs, run=run, label=label):
                        start = CLOCK[0]()
                        try:
                            return run(inputs)
                        finally:
                            current[label] = current.get(label, 0.0) + CLOCK[0]() - start

                    session.run = timed


def time_function(current: dict) -> None:
    """Time every ``ORTFunction.forward`` and ``.backward`` (graph calls and the glue around them) into
    ``current`` under the labels "ORTFunction.forward" and "ORTFunction.backward"."""
    from onnxtrain.ortmodule import function

    def timed(fn, label):
        def wrapper(*args):
            start = CLOCK[0]()
            try:
                return fn(*args)
            finally:
                current[label] = current.get(label, 0.0) + CLOCK[0]() - start
        return staticmethod(wrapper)

    for label in ("forward", "backward"):
        setattr(function.ORTFunction, label, timed(getattr(function.ORTFunction, label), f"ORTFunction.{label}"))


def profile(workload: str, rounds: int, optimizer_kind: str) -> None:
    variants, loss_fn, torch = _variants(workload, optimizer_kind)
    current: dict[str, float] = {}
    time_function(current)

    def step(name):
        runner, optimizer, _ = variants[name]
        current.clear()
        start = CLOCK[0]()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        loss.backward()
        middle = CLOCK[0]()
        optimizer.step()
        end = CLOCK[0]()
        current["optimizer step"] = end - middle
        current["step"] = end - start

    for name, (runner, _, timings) in variants.items():
        os.environ[FUSED_STEP_ENV] = "0" if name == "two-graph" else "1"  # read when the first step builds the graphs
        for _ in range(3):
            step(name)
        os.environ.pop(FUSED_STEP_ENV)
        if name != "eager":
            made = any(t.fused is not None for e in runner._cache.values() for g in e for t in g.training.values())
            if name == "two-graph" and made:
                raise RuntimeError(f"{FUSED_STEP_ENV}=0 was not read")
            if name == "fused" and not made:
                print(f"{workload}: no fused call (ONNXTRAIN_LOG_LEVEL=INFO says why): both variants run two graphs")
            if runner.fallback_reason is not None:
                raise RuntimeError(f"ORTModule fell back to PyTorch: {runner.fallback_reason}")
            _instrument(runner, current)
    for _ in range(rounds):
        for name, (_, _, timings) in variants.items():
            step(name)
            for label, seconds in current.items():
                timings[label].append(seconds)
    medians = {name: statistics.median(t["step"]) for name, (_, _, t) in variants.items()}
    print(f"\n{workload}: {rounds} rounds, medians (ms); ratio = eager-bf16 / this")
    for name, median in medians.items():
        print(f"  {name:10} step {1000 * median:8.1f}   ratio {medians['eager'] / median:5.2f}x")
    for name in ("fused", "two-graph"):
        timings = variants[name][2]
        calls = {k: statistics.median(v) for k, v in timings.items()
                 if k.startswith(("forward", "fused", "backward"))}
        med = {k: statistics.median(v) for k, v in timings.items()}
        glue = med.get("ORTFunction.forward", 0) + med.get("ORTFunction.backward", 0) - sum(calls.values())
        rest = med["step"] - med.get("ORTFunction.forward", 0) - med.get("ORTFunction.backward", 0) - med["optimizer step"]
        parts = [*calls.items(), ("glue in forward/backward", glue), ("optimizer step", med["optimizer step"]),
                 ("rest (Python, torch loss, autograd)", rest)]
        print(f"  {name}: " + ", ".join(f"{k} {1000 * v:.1f}" for k, v in parts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "fused"], default="adamw")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time instead of wall time; on a shared machine it counts "
                             "the work (and any spinning), not the waits for a core")
    args = parser.parse_args(argv)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    import torch

    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        profile(workload, args.rounds, args.optimizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
