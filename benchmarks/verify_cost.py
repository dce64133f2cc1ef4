"""What DebugOptions(verify=True) costs: the first step (export, graph building, the step) of a fresh
ORTModule with and without verification, alternated in one process, and a later step of each.

    PYTHONPATH=src python benchmarks/verify_cost.py --model bert --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ortmodule import models  # noqa: E402

from onnxtrain import DebugOptions, ORTModule  # noqa: E402

MODELS = {
    "mlp": (models.MLP, lambda: models.mlp_batch(generator=torch.Generator().manual_seed(1))),
    "bert": (models.bert, lambda: models.text_batch(classify=True, generator=torch.Generator().manual_seed(1))),
    "gpt2": (models.gpt2, lambda: models.text_batch(generator=torch.Generator().manual_seed(1))),
}


def step(runner, batch) -> float:
    start = time.perf_counter()
    models.loss_of(runner(**batch)).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bert")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    make, make_batch = MODELS[args.model]
    batch = make_batch()
    first = {False: [], True: []}
    later = {False: [], True: []}
    for _ in range(args.repeats):
        for verify in (False, True):
            torch.manual_seed(0)
            runner = ORTModule(make(), DebugOptions(verify=verify))
            runner.train()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first[verify].append(step(runner, batch))
            if runner.fallback_reason or any("verify" in str(w.message) for w in caught):
                raise SystemExit(f"not a like-for-like run: {runner.fallback_reason or caught[0].message}")
            later[verify].append(step(runner, batch))
    for name, times in (("first step", first), ("later step", later)):
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{args.model} {name}: verify off {off * 1e3:.0f} ms, on {on * 1e3:.0f} ms, ratio {on / off:.2f} "
              f"(medians of {args.repeats})")


if __name__ == "__main__":
    main()
