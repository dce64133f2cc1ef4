"""OpenVINO's thread pinning beside torch's thread pool: ORTModule's bf16 calls with ``ENABLE_CPU_PINNING`` on
(OpenVINO's default on Linux) and off (what ORTModule sets), right after a torch optimizer step and after a pause.

    python benchmarks/bf16_pinning.py                              # the MLP, 2 threads, 100 rounds, then 40 steps
    python benchmarks/bf16_pinning.py --workloads mlp bert --rounds 50 --steps 20

In a training step ORTModule's OpenVINO calls run between torch's parallel ops: the optimizer's step right
before the next forward call. Torch's OpenMP workers (libgomp in the pip wheels) spin for a while after each
parallel op (about 3.5 ms of CPU each here), and OpenVINO's threads, pinned, cannot move off the core a
spinning worker holds. Two parts, both at ``--threads`` (torch's and OpenVINO's):

1. Each OpenVINO call of one ORTModule step (the workload of ``ortmodule_bench.py`` under autocast bf16) is
   compiled twice, pinned and unpinned, and run on that step's inputs, each ``--rounds`` times in turn in
   two conditions: right after ``torch.optim.AdamW.step()`` on a copy of the model's parameters ("after
   torch") and after the same step and a 20 ms pause, when torch's workers sleep ("after pause"). Printed:
   the median wall time of the call per (pinning, condition), and unpinned / pinned.
2. Whole steps (zero_grad, forward under autocast, backward, ``torch.optim.AdamW``): eager autocast,
   ORTModule pinned and ORTModule unpinned, same weights and batch, one step each in turn per round;
   median step times and eager / ORTModule (the issue-17 ratio's form; the issue's own ratio is
   ``ortmodule_bench.py``'s, one process per mode).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_workload  # noqa: E402

PINNING = {"pinned": True, "unpinned": False}


@contextlib.contextmanager
def _pinning(pinned: bool):
    """OpenVINO sessions compiled inside compile with ``ENABLE_CPU_PINNING=pinned`` (ORTModule's are compiled
    on its first step)."""
    from onnxtrain.runtime import openvino

    compile_ = openvino.OpenVINOSession._compile

    def _compile(self, arrays=None):
        self._config["ENABLE_CPU_PINNING"] = pinned
        return compile_(self, arrays)

    openvino.OpenVINOSession._compile = _compile
    try:
        yield
    finally:
        openvino.OpenVINOSession._compile = compile_


def _step(runner, optimizer, loss_fn, torch) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(runner)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def _calls(runner, loss_fn, torch):
    """(label, OpenVINOSession, one step's input arrays) for every OpenVINO call of ``runner``'s step."""
    import numpy as np

    sessions = []
    for entries in runner._cache.values():
        for graphs in entries:
            for training in graphs.training.values():
                sessions.append(("forward", training.forward))
                if training.fused is not None:
                    sessions.append(("fused call", training.fused.session))
                for staged in training._backward.values():
                    if staged is not None:
                        sessions += [(f"backward {k}", s) for k, s in enumerate(staged.sessions)]
    captured, runs = {}, {}
    for label, session in sessions:
        if getattr(session, "_arrays", None) is None:
            continue  # not OpenVINO's
        runs[label] = session._arrays

        def capture(arrays, run=session._arrays, label=label):
            captured[label] = [np.array(a, copy=True) for a in arrays]
            return run(arrays)

        session._arrays = capture
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(runner)
    loss.backward()
    for label, session in sessions:
        if label in runs:
            session._arrays = runs[label]
    return [(label, session._session, captured[label]) for label, session in sessions if label in captured]


def calls(workload: str, rounds: int) -> None:
    import openvino as ov
    import torch

    from onnxtrain import ORTModule
    from onnxtrain.runtime.openvino import core

    model, loss_fn = make_workload(workload)
    runner = ORTModule(model.train())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(runner).backward()
    params = [p.detach().clone() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for label, ov_session, arrays in _calls(runner, loss_fn, torch):
        requests = {}
        for name, pinned in PINNING.items():
            compiled = core().compile_model(ov_session._model, "CPU", dict(ov_session._config, ENABLE_CPU_PINNING=pinned))
            request = compiled.create_infer_request()
            for k, array in enumerate(arrays):
                request.set_input_tensor(k, ov.Tensor(array, shared_memory=True))
            request.infer()
            requests[name] = request
        times = {(name, after): [] for name in requests for after in ("after torch", "after pause")}
        for _ in range(rounds):
            for (name, after), samples in times.items():
                optimizer.step()
                if after == "after pause":
                    time.sleep(0.02)
                start = time.perf_counter()
                requests[name].infer()
                samples.append(time.perf_counter() - start)
        medians = {key: statistics.median(v) for key, v in times.items()}
        print(f"\n{workload} {label} ({rounds} rounds), median ms:")
        for after in ("after torch", "after pause"):
            pinned, unpinned = medians["pinned", after], medians["unpinned", after]
            print(f"  {after:12} pinned {1e3 * pinned:7.2f}  unpinned {1e3 * unpinned:7.2f}  "
                  f"unpinned/pinned {unpinned / pinned:.2f}x")


def steps(workload: str, count: int) -> None:
    import torch

    from onnxtrain import ORTModule

    base, loss_fn = make_workload(workload)
    variants = {}
    for name in ("eager", "ortmodule pinned", "ortmodule unpinned"):
        model = copy.deepcopy(base).train()
        runner = model if name == "eager" else ORTModule(model)
        variants[name] = (runner, torch.optim.AdamW(model.parameters(), lr=1e-4), [])
    for k in range(count + 3):
        for name, (runner, optimizer, samples) in variants.items():
            pinning = PINNING.get(name.removeprefix("ortmodule "))
            with _pinning(pinning) if k == 0 and pinning is not None else contextlib.nullcontext():
                elapsed = _step(runner, optimizer, loss_fn, torch)
            if k >= 3:
                samples.append(elapsed)
    eager = statistics.median(variants["eager"][2])
    print(f"\n{workload} whole steps ({count} rounds), median ms:")
    for name, (_, _, samples) in variants.items():
        median = statistics.median(samples)
        print(f"  {name:20} {1e3 * median:8.2f}  eager/this {eager / median:.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--rounds", type=int, default=100, help="rounds of the per-call part")
    parser.add_argument("--steps", type=int, default=40, help="rounds of the whole-step part (0: skip it)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        calls(workload, args.rounds)
        if args.steps:
            steps(workload, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
