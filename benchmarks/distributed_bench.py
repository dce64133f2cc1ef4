"""Two-process throughput: ORTModule against eager PyTorch, both inside DeepSpeed ZeRO-1, on CPU.

    python benchmarks/distributed_bench.py                          # BERT-small, ZeRO-1 (a few minutes)
    python benchmarks/distributed_bench.py --workloads bert gpt2 --stage 1 --steps 10 --rounds 3

Launches ``torchrun --nproc_per_node=2`` (gloo, DeepSpeed's CPU accelerator, one thread per process,
``OMP_NUM_THREADS=1``). Each process builds the workload of ``ortmodule_bench.py`` twice (eager, and in
ORTModule), each in its own ``deepspeed.initialize`` engine with ``torch.optim.AdamW``, and takes a first
(warm-up) step with each: ORTModule's includes the export. Then, ``--rounds`` times, each engine runs
``--steps`` steps, alternating, so that a load change on a shared machine hits both alike. A step is
``engine(...)``, ``engine.backward``, ``engine.step`` (gradients averaged across the two processes, optimizer
states partitioned). Printed by rank 0: the median step time of each, the ratio eager / ORTModule (> 1:
ORTModule faster), samples per second of the two processes together, and ORTModule's first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = {"bert": 8, "gpt2": 4, "mlp": 128}  # ortmodule_bench.py's per-process batches (samples per step)


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from ortmodule_bench import make_workload

    from onnxtrain import ORTModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = {"train_micro_batch_size_per_gpu": BATCH.get(args.workload, 1), "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": args.stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engines, losses, first = {}, {}, {}
    for variant in ("eager", "ortmodule"):
        model, loss_fn = make_workload(args.workload)
        if variant == "ortmodule":
            model = ORTModule(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engines[variant], *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        losses[variant] = loss_fn

    def step(variant):
        engine = engines[variant]
        start = time.perf_counter()
        loss = losses[variant](engine)
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - start

    for variant in engines:
        first[variant] = step(variant)
    times = {variant: [] for variant in engines}
    for _ in range(args.rounds):
        for variant in engines:
            times[variant] += [step(variant) for _ in range(args.steps)]
    fallback = engines["ortmodule"].module.fallback_reason
    if dist.get_rank() == 0:
        eager, ort = (statistics.median(times[v]) for v in ("eager", "ortmodule"))
        samples = 2 * BATCH.get(args.workload, 1)
        print(json.dumps({"workload": args.workload, "stage": args.stage, "eager_ms": 1e3 * eager,
                          "ortmodule_ms": 1e3 * ort, "ratio": eager / ort, "eager_samples_s": samples / eager,
                          "ortmodule_samples_s": samples / ort, "ortmodule_first_s": first["ortmodule"],
                          "eager_first_s": first["eager"], "steps_each": len(times["eager"]),
                          "fallback": fallback}), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # tearing down the process group and engines at exit has hung a rank (tests/hf/ddp_train.py)


def launch(workload: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), "--worker", workload, "--stage", str(args.stage), "--steps",
               str(args.steps), "--rounds", str(args.rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise SystemExit(f"distributed_bench: {workload} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(rows[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["bert"], choices=sorted(BATCH))
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=5, help="steps of each variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds for one workload's launch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.workload = args.worker
        worker(args)
        return 0
    print("| workload | ZeRO stage | eager step | ORTModule step | eager / ORTModule | samples/s eager, ORTModule "
          "| ORTModule first step |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        started = time.perf_counter()
        r = launch(workload, args)
        note = f" (falls back: {r['fallback']})" if r["fallback"] else ""
        print(f"| {workload} | {r['stage']} | {r['eager_ms']:.0f} ms | {r['ortmodule_ms']:.0f} ms | "
              f"{r['ratio']:.2f}x | {r['eager_samples_s']:.1f}, {r['ortmodule_samples_s']:.1f} | "
              f"{r['ortmodule_first_s']:.1f} s |{note}", flush=True)
        print(f"<!-- {workload}: {r['steps_each']} timed steps each, launch took "
              f"{time.perf_counter() - started:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())
