"""Thread and allocator settings for a bf16 training step: eager autocast against ORTModule on OpenVINO.

    python benchmarks/bf16_threads.py                               # the MLP, every setting, 3 rounds
    python benchmarks/bf16_threads.py --workloads mlp bert --rounds 2 --settings default omp-passive
    python benchmarks/bf16_threads.py --workloads bert gpt2 --optimizer fused --alternate --rounds 10

Two thread pools share the cores in an ORTModule step under autocast bf16: torch's (OpenMP, libgomp in the
pip wheels; an idle worker spins for a while after each parallel region, GOMP_SPINCOUNT) for the loss and the
optimizer, and OpenVINO's (TBB) for the graph calls. Each setting below changes one thing; environment
variables are read when the libraries load, so every (setting, mode) runs in a fresh process (the worker of
``ortmodule_bench.py``: zero_grad, forward under autocast, backward, torch.optim.AdamW, or with
``--optimizer fused`` FusedAdam for ORTModule and AdamW(fused=True) for eager), and the settings
take turns, round after round, so that a load that changes during the run hits them alike. Printed per
setting: eager-bf16 and ortmodule-bf16 median step (the median over rounds of each run's median), their
ratio (eager / ORTModule, the issue-17 target's form) and each round's ratio.

Settings: ``default`` (what ``ortmodule_bench.py`` runs); ``omp-passive`` (OMP_WAIT_POLICY=PASSIVE: torch's
idle workers sleep at once); ``gomp-spin-10k`` (GOMP_SPINCOUNT=10000: a short spin); ``ov-1-thread``
(OpenVINO INFERENCE_NUM_THREADS=1, torch keeps 2); ``ov-pinning`` (ENABLE_CPU_PINNING=True, OpenVINO's
default, which ORTModule turns off: ``bf16_pinning.py``);
``ov-throughput`` (PERFORMANCE_HINT=THROUGHPUT); ``malloc-keep`` (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ raised: glibc keeps freed memory, so the optimizer's temporaries stop faulting in fresh
pages; docs/precision.md); ``1-thread`` (torch and OpenVINO on one thread); ``torch-threads-glue``
(ONNXTRAIN_ONE_OMP_THREAD=0: onnxtrain's torch work between OpenVINO calls at torch's two threads, as before
the one-thread default of :mod:`onnxtrain.runtime.torch_threads`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SETTINGS = {  # name: (environment, OpenVINO compile properties, threads)
    "default": ({}, {}, 2),
    "omp-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, {}, 2),
    "gomp-spin-10k": ({"GOMP_SPINCOUNT": "10000"}, {}, 2),
    "ov-1-thread": ({}, {"INFERENCE_NUM_THREADS": 1}, 2),
    "ov-pinning": ({}, {"ENABLE_CPU_PINNING": True}, 2),
    "ov-throughput": ({}, {"PERFORMANCE_HINT": "THROUGHPUT"}, 2),
    "malloc-keep": ({"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}, {}, 2),
    "1-thread": ({}, {}, 1),
    "torch-threads-glue": ({"ONNXTRAIN_ONE_OMP_THREAD": "0"}, {}, 2),
}
MODES = ("eager-bf16", "ortmodule-bf16")


def _worker(workload: str, mode: str, setting: str, steps: int, optimizer: str = "adamw") -> dict:
    """One run in this process: OpenVINO's compile properties for ``setting`` added, then the bench's worker."""
    from ortmodule_bench import worker

    properties = SETTINGS[setting][1]
    if properties:
        from onnxtrain.runtime import openvino

        compile_ = openvino.OpenVINOSession._compile

        def _compile(self, arrays=None):
            self._config.update(properties)
            return compile_(self, arrays)

        openvino.OpenVINOSession._compile = _compile
    result = worker(workload, mode, steps, 3, SETTINGS[setting][2], optimizer)
    if mode.startswith("ortmodule") and ("openvino", "bf16") not in result["ran"]:
        raise RuntimeError(f"ORTModule did not run on OpenVINO bf16: {result['ran']}")
    return result


def _run(workload: str, mode: str, setting: str, steps: int, optimizer: str = "adamw") -> float | None:
    command = [sys.executable, __file__, "--worker", workload, mode, setting, "--steps", str(steps),
               "--optimizer", optimizer]
    env = dict(os.environ, **SETTINGS[setting][0])
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        print(f"  {workload} {mode} {setting}: failed: {' | '.join(tail)}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["median_s"]


def alternate(workload: str, rounds: int, block: int, optimizer: str) -> None:
    """ORTModule bf16 with onnxtrain's torch work between OpenVINO calls at one OpenMP thread (the default) and at
    torch's two (``torch_threads.enabled = False``), alternating every ``block`` steps in one process; prints the
    median step's wall and CPU time (all threads) for each, and the same for the call, backward and optimizer."""
    import time

    import torch
    from ortmodule_bench import make_optimizer, make_workload

    from onnxtrain import ORTModule
    from onnxtrain.runtime import session, torch_threads

    torch.set_num_threads(2)
    model, loss_fn = make_workload(workload)
    model.train()
    runner = ORTModule(model)
    opt = make_optimizer(model.parameters(), "ortmodule-bf16", optimizer)
    call: list[tuple[float, float]] = []
    run = session.TorchSession.run

    def timed_run(self, inputs):
        start = (time.perf_counter(), time.process_time())
        try:
            return run(self, inputs)
        finally:
            call.append((time.perf_counter() - start[0], time.process_time() - start[1]))

    session.TorchSession.run = timed_run

    def step() -> list[float]:
        marks = [(time.perf_counter(), time.process_time())]
        opt.zero_grad(set_to_none=True)
        call.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        marks.append((time.perf_counter(), time.process_time()))
        loss.backward()
        marks.append((time.perf_counter(), time.process_time()))
        opt.step()
        marks.append((time.perf_counter(), time.process_time()))
        whole = [marks[3][k] - marks[0][k] for k in (0, 1)]
        parts = [sum(c[k] for c in call) for k in (0, 1)]
        parts += [marks[i + 1][k] - marks[i][k] for i in (1, 2) for k in (0, 1)]
        return whole + parts

    variants = {"one thread": True, "torch's threads": False}
    for _ in range(4):
        step()
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, enabled in variants.items():
            torch_threads.enabled = enabled
            step()  # the first step after a switch is not counted
            times[name] += [step() for _ in range(block)]
    if ("openvino", "bf16") not in {(g.backend, g.precision) for e in runner._cache.values() for g in e}:
        raise RuntimeError("ORTModule did not run on OpenVINO bf16")
    print(f"\n{workload}, ORTModule bf16 on {optimizer}, {rounds} rounds of {block} steps each way, load average "
          f"{os.getloadavg()[0]:.1f}: median ms, wall / CPU")
    for name, rows in times.items():
        m = [1000 * statistics.median(r[k] for r in rows) for k in range(8)]
        print(f"  {name:16} step {m[0]:6.1f} / {m[1]:6.1f}   call {m[2]:6.1f} / {m[3]:6.1f}   "
              f"backward {m[4]:5.2f} / {m[5]:5.2f}   optimizer {m[6]:5.2f} / {m[7]:5.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--optimizer", choices=["adamw", "fused"], default="adamw",
                        help="as ortmodule_bench.py's: fused runs FusedAdam for ORTModule, AdamW(fused=True) for eager")
    parser.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "MODE", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--alternate", action="store_true",
                        help="instead: one process per workload, ORTModule only, onnxtrain's torch work between "
                             "OpenVINO calls at one OpenMP thread and at torch's, alternating (--rounds, --block)")
    parser.add_argument("--block", type=int, default=5, help="--alternate: steps per variant in a round")
    args = parser.parse_args(argv)
    if args.alternate:
        for workload in args.workloads:
            alternate(workload, args.rounds, args.block, args.optimizer)
        return 0
    if args.worker:
        print(json.dumps(_worker(*args.worker, args.steps, args.optimizer)))
        return 0
    for workload in args.workloads:
        times: dict[tuple[str, str], list[float]] = {}
        for k in range(args.rounds):
            for setting in args.settings:
                for mode in MODES:
                    seconds = _run(workload, mode, setting, args.steps, args.optimizer)
                    if seconds is not None:
                        times.setdefault((setting, mode), []).append(seconds)
            print(f"  {workload}: round {k + 1} of {args.rounds} done", file=sys.stderr)
        print(f"\n{workload}: median step (ms) over {args.rounds} rounds; ratio = eager-bf16 / ortmodule-bf16")
        for setting in args.settings:
            eager, ort = times.get((setting, MODES[0]), []), times.get((setting, MODES[1]), [])
            if not eager or not ort:
                print(f"  {setting:14} (failed)")
                continue
            rounds = " ".join(f"{e / o:.2f}" for e, o in zip(eager, ort))
            print(f"  {setting:14} eager {1000 * statistics.median(eager):7.1f}   ortmodule "
                  f"{1000 * statistics.median(ort):7.1f}   ratio {statistics.median(eager) / statistics.median(ort):5.2f}x"
                  f"   (rounds: {rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
