"""ORTModule under torch.autocast bf16 with its outputs in eager autocast's dtypes (bf16 logits: a Cast inside the
graph) against float32 outputs (the old behaviour), alternating in one process (issue 17).

    python benchmarks/bf16_output_dtype.py                              # GPT-2-small and BERT-small, 8 rounds
    python benchmarks/bf16_output_dtype.py --workloads gpt2 --rounds 4

Each round runs one training step (forward, backward, AdamW) of each variant, from the same weights on the same
batch (benchmarks/ortmodule_bench.py's workloads): ``bf16-outputs`` (the default now) and ``float32-outputs``
(onnxtrain.ortmodule.module._output_casts patched to cast nothing). Printed per variant: the step's median, and
the fused OpenVINO call's median (forward + the loss's gradients, one call: where the logits leave the graph; the
forward graph's where there is none) and
the median of each round's ratio to ``float32-outputs`` (load that drifts between rounds cancels); the outputs'
bytes per step that leave the fused call; and the first step's loss of each (they train the same function).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from ortmodule_bench import make_workload

VARIANTS = ("float32-outputs", "bf16-outputs")


def _timed(session, times: list[float], sizes: list[int], n: int):
    """``session.run`` that records its wall time and the bytes of its first ``n`` outputs (the forward's)."""
    run = session.run

    def timed_run(inputs):
        start = time.perf_counter()
        out = run(inputs)
        times.append(time.perf_counter() - start)
        sizes.append(sum(t.numel() * t.element_size() for t in out[:n]))
        return out

    session.run = timed_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "bert"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from onnxtrain import ORTModule
    from onnxtrain.ortmodule import module as ortmodule_module

    torch.set_num_threads(args.threads)
    casts = ortmodule_module._output_casts
    for workload in args.workloads:
        model, loss_fn = make_workload(workload)
        runners, optimizers, steps, calls, first, out_bytes = {}, {}, {}, {}, {}, {}
        for variant in VARIANTS:
            ortmodule_module._output_casts = casts if variant == "bf16-outputs" else (lambda *a: {})
            runner = ORTModule(copy.deepcopy(model))
            runners[variant], optimizers[variant] = runner, torch.optim.AdamW(runner.parameters(), lr=1e-4)
            steps[variant], calls[variant] = [], []
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(runner)  # builds the graphs under this variant's dtype rule
            loss.backward()
            first[variant] = loss.item()
            training = next(t for entries in runner._cache.values() for g in entries for t in g.training.values())
            if training.fused is not None:
                session, n = training.fused.session, training.fused.num_forward_outputs
            else:
                session, n = training.forward, len(training.forward.output_names)
            out_bytes[variant] = []
            _timed(session, calls[variant], out_bytes[variant], n)
            if runner.fallback_reason is not None:
                raise RuntimeError(f"{variant}: ORTModule fell back: {runner.fallback_reason}")
        ortmodule_module._output_casts = casts
        for _ in range(args.rounds):
            for variant in VARIANTS:
                runner, optimizer = runners[variant], optimizers[variant]
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(runner)
                loss.backward()
                optimizer.step()
                steps[variant].append(time.perf_counter() - start)
        base = VARIANTS[0]
        print(f"\n{workload}: {args.rounds} rounds, {args.threads} threads, variants alternating")
        print(f"{'variant':16} {'step ms':>9} {'ratio':>7} {'fused call ms':>14} {'ratio':>7} {'outputs MB':>11} "
              f"{'first loss':>11}")
        for variant in VARIANTS:
            step_ratio = statistics.median(s / b for s, b in zip(steps[variant], steps[base]))
            call_ratio = statistics.median(s / b for s, b in zip(calls[variant], calls[base]))
            print(f"{variant:16} {statistics.median(steps[variant]) * 1e3:9.1f} {step_ratio:6.2f}x "
                  f"{statistics.median(calls[variant]) * 1e3:14.1f} {call_ratio:6.2f}x "
                  f"{out_bytes[variant][-1] / 1e6:11.1f} {first[variant]:11.5f}")
    print("\nratio: median over the rounds of (this variant / float32-outputs), < 1 is faster")


if __name__ == "__main__":
    main()
