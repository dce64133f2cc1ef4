"""ORTModule's bf16 step with and without this session's fused-graph passes, alternating in one process.

    python benchmarks/bf16_fused_passes.py                               # BERT-small and GPT-2-small, 10 rounds
    python benchmarks/bf16_fused_passes.py --workloads gpt2 --rounds 20 --clock cpu --threads 1
    python benchmarks/bf16_fused_passes.py --workloads gpt2 --variants "without reused_exp" both

The passes (:func:`onnxtrain.passes.pipeline.ortmodule_fused`, run only on the fused OpenVINO graph):
``shared_rows`` (:mod:`onnxtrain.passes.shared_rows`: the loss gradient read by the output layer's two gradient
products as one row view, converted to bf16 once; GPT-2's ``lm_head``) and ``erf_cdf``
(:mod:`onnxtrain.passes.erf_cdf`: GELU's gradient's ``HardSigmoid`` as ``Mul`` and ``Add``; BERT's GELU); and
``reused_exp``, the log-sum-exp loss's gradient reading the forward's exponentials
(:mod:`onnxtrain.passes.log_sum_exp_loss`; switched off, the gradient's probabilities are the former
``Exp(x - lse)``, a second exponential over the logits; GPT-2's loss).
Variants, each an ORTModule of the same ``ortmodule_bench.py`` workload (same weights, same batch) under
``torch.autocast`` bf16: ``both`` (the default build), ``neither`` (``shared_rows`` and ``erf_cdf`` off), one
without each of the three. They take turns,
one training step each per round (zero_grad, forward, backward, ``torch.optim.AdamW``). Printed per variant:
the median step and fused-call time, and the medians of the per-round ratios to the first variant run
(``neither`` unless ``--variants`` names others: the change the rewrites make). A variant whose fused graph equals another's is said so (the pass found nothing to rewrite).
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
            "without erf_cdf": ("erf_cdf",), "without reused_exp": ("reused_exp",),
            "both": ()}  # name -> the rewrites switched off


def _switches() -> dict:
    """Rewrite name -> a patch that switches it off while the graphs are built."""
    import onnx_ir as ir

    from onnxtrain.passes import log_sum_exp_loss
    from onnxtrain.passes.erf_cdf import ErfCdfPass
    from onnxtrain.passes.shared_rows import SharedRowsPass

    def unchanged(self, model):
        return ir.passes.PassResult(model, modified=False)

    def exp_again(b, x, exp, inverse, negative):  # the gradient's probabilities before reused_exp
        return b.op("Exp", b.op("Add", x, negative, like=x, shape=x.shape), like=x, shape=x.shape)

    return {"shared_rows": lambda: mock.patch.object(SharedRowsPass, "call", unchanged),
            "erf_cdf": lambda: mock.patch.object(ErfCdfPass, "call", unchanged),
            "reused_exp": lambda: mock.patch.object(log_sum_exp_loss, "_probabilities", exp_again)}


def _fused_session(runner):
    sessions = [t.fused.session for e in runner._cache.values() for g in e for t in g.training.values()
                if t.fused is not None]
    if runner.fallback_reason is not None or not sessions:
        raise RuntimeError(f"no fused OpenVINO call: {runner.fallback_reason or 'ONNXTRAIN_LOG_LEVEL=INFO says why'}")
    return sessions[0]


def run(workload: str, rounds: int, clock, names=tuple(VARIANTS)) -> None:
    import torch

    from onnxtrain import ORTModule

    switches = _switches()
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

    for name in names:
        off = VARIANTS[name]
        model = copy.deepcopy(base).train()
        variants[name] = [ORTModule(model), torch.optim.AdamW(model.parameters(), lr=1e-4), [], []]
        with contextlib.ExitStack() as stack:
            for rewrite in off:  # the graphs are built at the first step, without these rewrites
                stack.enter_context(switches[rewrite]())
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
    first = names[0]
    print(f"{workload}: {rounds} rounds, medians (ms); ratios to {first!r} (median of the per-round ratios)")
    reference = variants[first]
    for name, (_, _, steps, calls) in variants.items():
        ratio = statistics.median(b / a for a, b in zip(reference[2], steps))
        call_ratio = statistics.median(b / a for a, b in zip(reference[3], calls))
        note = "" if name == first or sizes[name] != sizes[first] else f"  (graph as {first!r})"
        print(f"  {name:20} step {1000 * statistics.median(steps):7.1f} ({ratio:.3f})   fused call "
              f"{1000 * statistics.median(calls):7.1f} ({call_ratio:.3f})   {sizes[name]} OpenVINO ops{note}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="which to run, the first being the one the ratios are to")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for workload in args.workloads:
        run(workload, args.rounds, clock, tuple(args.variants))


if __name__ == "__main__":
    main()
