"""OpenVINO bf16 under ORTModule with and without the float32 loss region (issue 17): step time and gradient
error against float64, next to eager autocast bf16's, in one process with the variants alternating.

    python benchmarks/bf16_float32_ops.py                          # BERT-small and GPT-2-small, 10 rounds
    python benchmarks/bf16_float32_ops.py --workloads mlp --rounds 5

Variants (``onnxtrain.runtime.openvino_float32`` policies, each an ORTModule under
``torch.autocast("cpu", dtype=torch.bfloat16)`` from the same weights on the same batch):
- ``none``: the default; OpenVINO's bf16 hint as the plugin chooses (every op it reaches from a product in
  bfloat16);
- ``loss``: the loss and its gradient stay float32 (as autocast keeps them);
- ``all``: every op but the products stays float32.
Gradient error: norm-relative, per parameter, against the float64 model, divided by eager autocast bf16's on
the same batch; the table prints the median and the worst parameter. Step: forward + backward, median over the
rounds (each round runs every variant once, in turn). Target (issue 17): error no worse than autocast's (ratio
<= 1 at the median; the worst is reported), at a step time within a few percent of ``none``'s.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import numpy as np
from ortmodule_bench import make_workload

VARIANTS = ("none", "loss", "all")


class _Float64:
    """The model in float64, its float inputs cast to float64 (the MLP's batch is float32)."""

    def __init__(self, model):
        self.model = model.double()

    def __call__(self, *args, **kwargs):
        import torch

        cast = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return self.model(*cast, **{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                                    for k, v in kwargs.items()})

    def parameters(self):
        return self.model.parameters()

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.double().numpy().copy() for p in model.parameters()]


def _step(model, loss_fn, bf16: bool):
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_fn(model)
    loss.backward()
    return loss


def _errors(grads, reference, names) -> dict[str, float]:
    out = {}
    for name, got, want in zip(names, grads, reference):
        if got is not None and want is not None and np.linalg.norm(want) > 0:
            out[name] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return out


def run(workload: str, rounds: int) -> None:
    import torch

    from onnxtrain import ORTModule
    from onnxtrain.runtime.openvino_float32 import POLICY_ENV

    base, loss_fn = make_workload(workload)
    names = [n for n, _ in base.named_parameters()]
    double = _Float64(copy.deepcopy(base))
    _step(double, loss_fn, False)
    reference = _grads(double)
    del double
    auto = copy.deepcopy(base)
    _step(auto, loss_fn, True)
    auto_err = _errors(_grads(auto), reference, names)
    models, errors, times = {}, {}, {v: [] for v in VARIANTS}
    for variant in VARIANTS:  # the policy is read when a graph's session is made: on the first step
        os.environ[POLICY_ENV] = variant
        models[variant] = ORTModule(copy.deepcopy(base))
        _step(models[variant], loss_fn, True)
        if models[variant].fallback_reason is not None:
            raise RuntimeError(f"ORTModule fell back to PyTorch: {models[variant].fallback_reason}")
        err = _errors(_grads(models[variant]), reference, names)
        errors[variant] = {n: err[n] / auto_err[n] for n in err if auto_err.get(n)}
    os.environ.pop(POLICY_ENV)
    for _ in range(rounds):
        for variant in VARIANTS:
            start = time.perf_counter()
            _step(models[variant], loss_fn, True)
            times[variant].append(time.perf_counter() - start)
    base_ms = statistics.median(times["none"]) * 1e3
    for variant in VARIANTS:
        ratios = errors[variant]
        worst = max(ratios, key=ratios.get)
        ms = statistics.median(times[variant]) * 1e3
        print(f"{workload:5} {variant:5} {ms:9.1f} {ms / base_ms:7.3f}x {statistics.median(ratios.values()):13.2f}x "
              f"{ratios[worst]:8.2f}x  {worst}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"rounds={args.rounds} threads={args.threads}; gradient error as a multiple of eager autocast bf16's")
    print(f"{'model':5} {'ops':5} {'step ms':>9} {'vs none':>8} {'median error':>14} {'worst':>9}  worst parameter")
    for workload in args.workloads:
        run(workload, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
