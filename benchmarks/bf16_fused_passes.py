"""ORTModule's bf16 step with and without this session's fused-graph passes, alternating in one process.

    python benchmarks/bf16_fused_passes.py                               # BERT-small and GPT-2-small, 10 rounds
    python benchmarks/bf16_fused_passes.py --workloads gpt2 --rounds 20 --clock cpu --threads 1

The passes (:func:`onnxtrain.passes.pipeline.ortmodule_fused`, run only on the fused OpenVINO graph):
``shared_rows`` (:mod:`onnxtrain.passes.shared_rows`: the loss gradient read by the output layer's two gradient
products as one row view, converted to bf16 once; GPT-2's ``lm_head``) and ``erf_cdf``
(:mod:`onnxtrain.passes.erf_cdf`: GELU's gradient's ``HardSigmoid`` as ``Mul`` and ``Add``; BERT's GELU).
Variants, each an ORTModule of the same ``ortmodule_bench.py`` workload (same weights, same batch) under
``torch.autocast`` bf16: ``both`` (the default build), ``neither``, and one without each pass. They take turns,
one training step each per round (zero_grad, forward, backward, ``torch.optim.AdamW``). Printed per variant:
the median step and fused-call time, and the medians of the per-round ratios to ``neither`` (the change the
passes make). A variant whose fused graph equals another's is said so (the pass found nothing to rewrite).
``--clock cpu`` times CPU (all threads): steadier on a loaded machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_workload  # noqa: E402

VARIANTS = {"neither": ("shared_rows", "erf_cdf"), "without shared_rows": ("shared_rows",),
            "without erf_cdf": ("erf_cdf",), "both": ()}  # name -> the passes switched off


def _pass_classes() -> dict:
    from onnxtrain.passes.erf_cdf import ErfCdfPass
    from onnxtrain.passes.shared_rows import SharedRowsPass

    return {"shared_rows": SharedRowsPass, "erf_cdf": ErfCdfPass}


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

    classes = _pass_classes()
    base, loss_fn = make_workload(workload)
    variants = {}

    def step(name):
        runner, optimizer, steps, _ = variants[name]
        start = clock()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        loss.backward()
        optimizer.step()
        steps.append(clock() - start)

    for name, off in VARIANTS.items():
        model = copy.deepcopy(base).train()
        variants[name] = [ORTModule(model), torch.optim.AdamW(model.parameters(), lr=1e-4), [], []]
        with contextlib.ExitStack() as stack:
            for pass_name in off:  # the graphs are built at the first step, without these passes
                stack.enter_context(mock.patch.object(
                    classes[pass_name], "call", lambda self, model: ir.passes.PassResult(model, modified=False)))
            step(name)
    sizes = {}
    for name, (runner, _, steps, calls) in variants.items():
        step(name)  # warm
        session = _fused_session(runner)
        sizes[name] = len(session._session._model.get_ordered_ops())
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
    print(f"{workload}: {rounds} rounds, medians (ms); ratios to 'neither' (median of the per-round ratios)")
    reference = variants["neither"]
    for name, (_, _, steps, calls) in variants.items():
        ratio = statistics.median(b / a for a, b in zip(reference[2], steps))
        call_ratio = statistics.median(b / a for a, b in zip(reference[3], calls))
        note = "" if name == "neither" or sizes[name] != sizes["neither"] else "  (graph as 'neither')"
        print(f"  {name:20} step {1000 * statistics.median(steps):7.1f} ({ratio:.3f})   fused call "
              f"{1000 * statistics.median(calls):7.1f} ({call_ratio:.3f})   {sizes[name]} OpenVINO ops{note}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
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
