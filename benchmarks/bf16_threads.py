"""Thread and allocator settings for a bf16 training step: eager autocast against ORTModule on OpenVINO.

    python benchmarks/bf16_threads.py                               # the MLP, every setting, 3 rounds
    python benchmarks/bf16_threads.py --workloads mlp bert --rounds 2 --settings default omp-passive

Two thread pools share the cores in an ORTModule step under autocast bf16: torch's (OpenMP, libgomp in the
pip wheels; an idle worker spins for a while after each parallel region, GOMP_SPINCOUNT) for the loss and the
optimizer, and OpenVINO's (TBB) for the graph calls. Each setting below changes one thing; environment
variables are read when the libraries load, so every (setting, mode) runs in a fresh process (the worker of
``ortmodule_bench.py``: zero_grad, forward under autocast, backward, torch.optim.AdamW), and the settings
take turns, round after round, so that a load that changes during the run hits them alike. Printed per
setting: eager-bf16 and ortmodule-bf16 median step (the median over rounds of each run's median), their
ratio (eager / ORTModule, the issue-17 target's form) and each round's ratio.

Settings: ``default`` (what ``ortmodule_bench.py`` runs); ``omp-passive`` (OMP_WAIT_POLICY=PASSIVE: torch's
idle workers sleep at once); ``gomp-spin-10k`` (GOMP_SPINCOUNT=10000: a short spin); ``ov-1-thread``
(OpenVINO INFERENCE_NUM_THREADS=1, torch keeps 2); ``ov-pinning`` (ENABLE_CPU_PINNING=True, OpenVINO's
default, which ORTModule turns off: ``bf16_pinning.py``);
``ov-throughput`` (PERFORMANCE_HINT=THROUGHPUT); ``malloc-keep`` (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ raised: glibc keeps freed memory, so the optimizer's temporaries stop faulting in fresh
pages; docs/precision.md); ``1-thread`` (torch and OpenVINO on one thread).
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
}
MODES = ("eager-bf16", "ortmodule-bf16")


def _worker(workload: str, mode: str, setting: str, steps: int) -> dict:
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
    result = worker(workload, mode, steps, 3, SETTINGS[setting][2])
    if mode.startswith("ortmodule") and ("openvino", "bf16") not in result["ran"]:
        raise RuntimeError(f"ORTModule did not run on OpenVINO bf16: {result['ran']}")
    return result


def _run(workload: str, mode: str, setting: str, steps: int) -> float | None:
    command = [sys.executable, __file__, "--worker", workload, mode, setting, "--steps", str(steps)]
    env = dict(os.environ, **SETTINGS[setting][0])
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        print(f"  {workload} {mode} {setting}: failed: {' | '.join(tail)}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["median_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp"], choices=["mlp", "bert", "gpt2"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "MODE", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*args.worker, args.steps)))
        return 0
    for workload in args.workloads:
        times: dict[tuple[str, str], list[float]] = {}
        for k in range(args.rounds):
            for setting in args.settings:
                for mode in MODES:
                    seconds = _run(workload, mode, setting, args.steps)
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
