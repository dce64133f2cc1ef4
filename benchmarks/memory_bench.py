"""Activation memory and step time against the recompute budget (``DebugOptions(recompute=...)``).

    python benchmarks/memory_bench.py --workloads bert gpt2 --budgets 1.0 0.75 0.5 0.25 0.0 --scale 4
    python benchmarks/memory_bench.py --workloads bert --budgets none 1.0 0.5 0.0 --rounds 2

Activation memory is measured with ``--allocator malloc`` (the default): onnxruntime without its arena
(``ONNXTRAIN_CPU_ARENA=0``) and glibc with a fixed mmap threshold, for eager PyTorch as for ORTModule, so
that what a step frees goes back to the system. ``--allocator malloc-release`` keeps onnxruntime's arena
and hands it back as each ORTModule step starts and ends (``ONNXTRAIN_CPU_ARENA=release``): fewer fresh
pages, a higher peak (docs/memory.md); ``--allocator malloc-backward`` the arena in backward only
(``ONNXTRAIN_CPU_ARENA=backward``). With onnxruntime's arena (``--allocator arena``, the library's
default) the arena keeps the step's high-water mark between steps, "peak minus between" is flat (57-60 MB
at every budget) and only the process peak moves. Eager is always run, for the peak and step
comparisons; the issue's targets are printed after each workload's table, met or not.

Each (workload, budget) runs in its own process (one thread unless --threads), so that onnxruntime's arena
and the process high-water mark belong to that budget alone; rounds alternate the order of the budgets.
A worker runs a warm-up step, then ``--steps`` timed steps with torch's AdamW. Reported per budget, as
medians over the rounds: the step time, the RSS between steps, the peak RSS during the last step
(``VmHWM`` reset through ``/proc/self/clear_refs`` before it), activation memory = that peak minus the
RSS before it, the process's peak RSS, the stash the plan keeps, and the step's peak above the RSS
between steps as the planner models it (``Plan.peak_bytes``, passes/peak.py), and each step's CPU time
(user, system) and minor page faults (CPU time still compares sides on a loaded machine, where wall time
does not), also per phase of the step (forward and loss, backward, optimizer) in a second table. Ratios are
to no recompute (``budget 1.0``). "eager" is PyTorch without ORTModule, for comparison.
``--allocator glibc`` runs both sides on glibc with its own thresholds (no onnxruntime arena): one allocator
for both, for step times without the fresh-page faults ``malloc`` charges (docs/memory.md).

ORTModule exports where it does by default: in a child process under a budget below 1.0, in-process at ``none`` and
``1.0`` (docs/memory.md, "Where the export runs by default"); ``--export-process in-process|spawn`` pins it.

``--workloads ondevice-bert`` (or ``ondevice-mlp``) runs the on-device artifacts instead, generated once per
budget with ``generate_artifacts(recompute=Recompute(budget, dims=...))`` and trained by ``onnxtrain.api``
(training and optimizer models), against eager PyTorch's step, with the same table and targets; the stash
kept and the modelled peak come from the plan's table, logged when the artifacts are generated.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ondevice_bench  # noqa: E402
from ondevice_bench import peak_rss_mb  # noqa: E402
from ortmodule_bench import make_workload  # noqa: E402

BUDGETS = ("eager", "none", "1.0", "0.75", "0.5", "0.25", "0.0")
ARTIFACTS_ENV = "MEMORY_BENCH_ARTIFACTS"  # where the parent put the on-device artifacts, one folder a budget
# A rise in peak RSS smaller than this is not counted: GPT-2-small at 4x keeps the same plan (480.7 MB of stash)
# at budgets 0.5, 0.25 and 0.0, and its peaks, all 1746 MB when rounded, still differed by a fraction of a MB.
RSS_NOISE_MB = 1.0
# "malloc": onnxruntime without its arena and glibc with a fixed mmap threshold, so that every buffer of
# 64 KiB or more (torch's and onnxruntime's alike) is returned to the system when freed: RSS between steps
# is then what stays alive (weights, gradients, optimizer state), and the peak above it is the step's.
# "malloc-release": the same glibc setting, and ORTModule's arena handed back to the system as each step starts
# and ends (ONNXTRAIN_CPU_ARENA=release; the on-device runtime does not hand it back): inside a step freed
# buffers are reused, not mapped afresh (faults and system time fall), and the arena holds what a step frees
# until the step ends (activation memory rises; docs/memory.md, "The arena handed back").
# "malloc-backward": the same, with ORTModule's forward graph run without an arena (ONNXTRAIN_CPU_ARENA=backward):
# only backward's stages reuse freed buffers, where they made most of the step's fresh pages (docs/memory.md).
# "arena": onnxruntime's shared arena (the default), which never shrinks; only the process peak moves.
# "glibc": onnxruntime without its arena and glibc with its own (dynamic) thresholds, for both sides: one
# allocator, which keeps freed memory for reuse as it sees fit. For step times: under "malloc" every buffer of
# 64 KiB or more is a fresh mmap whose pages fault on first touch, which charges the side that allocates more
# fresh buffers (ORTModule's decomposed backward: docs/memory.md, "Step time at 4x batch").
_FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}  # the "malloc" glibc setting
ALLOCATORS = {
    "malloc": {"ONNXTRAIN_CPU_ARENA": "0", **_FIXED_MMAP},
    "malloc-release": {"ONNXTRAIN_CPU_ARENA": "release", **_FIXED_MMAP},
    "malloc-backward": {"ONNXTRAIN_CPU_ARENA": "backward", **_FIXED_MMAP},
    "arena": {},
    "glibc": {"ONNXTRAIN_CPU_ARENA": "0"},
}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _usage() -> tuple[float, float, int]:
    """This process's CPU seconds (user, system) and minor page faults so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


PHASES = ("forward", "backward", "optimizer")  # the forward and the loss; loss.backward(); optimizer.step()


def phase_medians(phases: list[list[tuple[float, float, int]]]) -> dict:
    """Each phase's median user and system CPU seconds and minor page faults over the steps, as
    ``<phase>_user_s``, ``<phase>_sys_s`` and ``<phase>_faults``: where a step's CPU and fresh pages go."""
    out = {}
    for k, name in enumerate(PHASES):
        for j, key in enumerate(("user_s", "sys_s", "faults")):
            out[f"{name}_{key}"] = statistics.median(p[k][j] for p in phases) if phases else None
    return out


def measure(step, steps: int) -> dict:
    """A warm-up step, then ``steps`` timed ones: step time, RSS before each, activation (peak - before),
    and each step's CPU time (user, system) and minor page faults (a page touched for the first time: under
    the "malloc" allocator, every page of every buffer of 64 KiB or more the step allocates)."""
    step()
    times, between, step_peak, user, system, faults = [], [], [], [], [], []
    for _ in range(steps):
        gc.collect()
        before = rss_mb()
        reset = reset_peak()
        u0, s0, f0 = _usage()
        times.append(step())
        u1, s1, f1 = _usage()
        user.append(u1 - u0)
        system.append(s1 - s0)
        faults.append(f1 - f0)
        between.append(before)
        step_peak.append(peak_rss_mb() if reset else float("nan"))
    return {"median_s": statistics.median(times), "between_mb": statistics.median(between),
            "activation_mb": statistics.median(p - b for p, b in zip(step_peak, between)),
            "step_peak_mb": statistics.median(step_peak), "user_s": statistics.median(user),
            "sys_s": statistics.median(system), "faults": statistics.median(faults)}


def worker(workload: str, budget: str, steps: int, scale: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    if workload.startswith("ondevice-"):
        return ondevice_worker(workload, budget, steps, scale, threads)
    model, loss_fn = make_workload(workload, scale)
    model.train()
    runner = model
    if budget != "eager":
        from onnxtrain import ORTModule
        from onnxtrain.ortmodule import DebugOptions

        runner = ORTModule(model, DebugOptions(recompute=None if budget == "none" else float(budget)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    phases: list[list[tuple[float, float, int]]] = []  # each step's (user, sys, faults) per phase

    def step() -> float:
        start = time.perf_counter()
        marks = [_usage()]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(runner)
        marks.append(_usage())
        loss.backward()
        marks.append(_usage())
        optimizer.step()
        del loss
        marks.append(_usage())
        phases.append([tuple(b - a for a, b in zip(m0, m1)) for m0, m1 in zip(marks, marks[1:])])
        return time.perf_counter() - start

    measured = measure(step, steps)
    measured.update(phase_medians(phases[1:]))  # the timed steps (the first is the warm-up)
    kept = modelled = None
    if budget != "eager":
        if runner.fallback_reason is not None:
            raise RuntimeError(f"ORTModule fell back to PyTorch: {runner.fallback_reason}")
        plans = [t.recompute for entries in runner._cache.values() for g in entries for t in g.training.values()]
        kept = sum(p.kept_bytes for p in plans if p is not None) / 2**20
        peaks = [p.peak_bytes for p in plans if p is not None and p.peak_bytes is not None]
        modelled = max(peaks) / 2**20 if peaks else None
    return {"workload": workload, "budget": budget, **measured, "process_peak_mb": peak_rss_mb(), "kept_mb": kept,
            "modelled_mb": modelled}


# -- the on-device artifacts (ondevice_bench.py's BERT-small at ``scale`` x its batch of 8) ---------------


def _ondevice_batch(name: str, scale: int):
    import numpy as np

    inputs, labels = ondevice_bench.make_batch(name)
    return [np.tile(x, (scale,) + (1,) * (x.ndim - 1)) for x in inputs], np.tile(labels, scale)


def generate_ondevice(name: str, budgets: list[str], scale: int, out: Path) -> None:
    """Export once, then one artifact directory per budget (``out/<budget>``), all with the same weights."""
    import onnx
    import torch

    from onnxtrain import artifacts
    from onnxtrain.passes.recompute import Recompute

    model = ondevice_bench.build_torch_model(name).eval()
    inputs, _ = _ondevice_batch(name, scale)
    example = tuple(torch.from_numpy(x) for x in inputs)
    names = ["x"] if name == "mlp" else ["input_ids", "attention_mask"]
    program = torch.onnx.export(model, example, dynamo=True, input_names=names, output_names=["logits"],
                                dynamic_shapes=tuple({0: "batch"} for _ in example), optimize=False)
    program.save(str(out / "model.onnx"))
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    dims = {d.dim_param: int(x.shape[k]) for i, x in zip(graph.input, inputs)
            for k, d in enumerate(i.type.tensor_type.shape.dim) if d.dim_param}
    trainable = [n for n, _ in model.named_parameters()]
    for budget in budgets:
        if budget == "eager":
            continue
        plan = None if budget == "none" else Recompute(budget=float(budget), dims=dims)
        (out / budget).mkdir()
        with _plan_log() as lines:
            artifacts.generate_artifacts(out / "model.onnx", requires_grad=trainable,
                                         loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=out / budget, recompute=plan)
        (out / budget / PLAN_FILE).write_text(json.dumps(_plan_numbers(lines)))


PLAN_FILE = "plan.json"  # the stash kept and the modelled peak of the plan, as the table logged them (MiB)


@contextlib.contextmanager
def _plan_log():
    """The messages of the ``onnxtrain.passes`` logger at INFO while the block runs (the recompute table)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("onnxtrain.passes")
    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _plan_numbers(lines: list[str]) -> dict:
    text = "\n".join(lines)
    kept = re.search(r"stash kept: ([0-9.]+) MiB", text)
    peak = re.search(r"modelled peak of a step: ([0-9.]+) MiB", text)
    return {"kept_mb": float(kept.group(1)) if kept else None,
            "modelled_mb": float(peak.group(1)) if peak else None}


def ondevice_worker(workload: str, budget: str, steps: int, scale: int, threads: int) -> dict:
    name = workload.removeprefix("ondevice-")
    inputs, labels = _ondevice_batch(name, scale)
    if budget == "eager":
        import torch

        model = ondevice_bench.build_torch_model(name).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tensors, target = [torch.from_numpy(x) for x in inputs], torch.from_numpy(labels)

        def step() -> float:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(*tensors), target).backward()
            optimizer.step()
            return time.perf_counter() - start
    else:
        from onnxtrain.api import CheckpointState, Module, Optimizer
        from onnxtrain.utils.ort_options import for_training

        options = for_training()
        options.intra_op_num_threads = threads
        d = Path(os.environ[ARTIFACTS_ENV]) / budget
        module = Module(d / "training_model.onnx", CheckpointState.load_checkpoint(d / "checkpoint"),
                        session_options=options)
        optimizer = Optimizer(d / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(1e-4)

        def step() -> float:
            start = time.perf_counter()
            module(*inputs, labels)
            optimizer.step()
            module.lazy_reset_grad()
            return time.perf_counter() - start
    plan = {"kept_mb": None, "modelled_mb": None}
    if budget not in ("eager", "none") and (d / PLAN_FILE).is_file():
        plan = json.loads((d / PLAN_FILE).read_text())
    return {"workload": workload, "budget": budget, **measure(step, steps), "process_peak_mb": peak_rss_mb(), **plan}


def run_one(workload: str, budget: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", workload, budget, "--steps", str(args.steps),
           "--scale", str(args.scale), "--threads", str(args.threads)]
    env = {**os.environ, **ALLOCATORS[args.allocator], ARTIFACTS_ENV: str(args.artifacts or "")}
    env.pop("ONNXTRAIN_EXPORT_PROCESS", None)
    if args.export_process != "default":
        env["ONNXTRAIN_EXPORT_PROCESS"] = args.export_process
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{workload} {budget} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"])
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scale", type=int, default=4, help="batch multiplier (4: the issue's 4x batch)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allocator", choices=sorted(ALLOCATORS), default="malloc")
    parser.add_argument("--export-process", choices=("default", "in-process", "spawn"), default="default",
                        help="where ORTModule exports (ONNXTRAIN_EXPORT_PROCESS; default: unset, so in a child "
                             "process under a budget below 1.0 and here at 'none' and 1.0; docs/memory.md)")
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "BUDGET"))
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.scale, args.threads)))
        return 0
    if "eager" not in args.budgets:
        args.budgets = ["eager", *args.budgets]  # the peak and the step are also held against eager's
    for workload in args.workloads:
        with tempfile.TemporaryDirectory(prefix="memory_bench_") as tmp:
            if workload.startswith("ondevice-"):
                generate_ondevice(workload.removeprefix("ondevice-"), args.budgets, args.scale, Path(tmp))
            args.artifacts = tmp
            report(workload, args)
    return 0


def report(workload: str, args) -> None:
    """Run every budget of ``workload`` (rounds alternate their order); print the table and the targets."""
    results: dict[str, list[dict]] = {b: [] for b in args.budgets}
    for k in range(args.rounds):
        for budget in (args.budgets if k % 2 == 0 else args.budgets[::-1]):
            results[budget].append(run_one(workload, budget, args))
    med = {b: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key not in ("workload", "budget")
               and rs[0][key] is not None} for b, rs in results.items()}
    base = med.get("1.0")
    print(f"\n{workload} at {args.scale}x batch, {args.threads} thread(s), {args.allocator} allocator, "
          f"{args.rounds} round(s), {args.steps} steps each; medians")
    print(f"{'budget':>7} {'step':>9} {'vs 1.0':>7} {'activation':>11} {'vs 1.0':>7} {'between':>9} "
          f"{'step peak':>10} {'proc peak':>10} {'stash kept':>11} {'modelled':>9} {'user':>8} {'sys':>7} "
          f"{'faults':>7}")
    for b in args.budgets:
        m = med[b]
        t_ratio = f"{m['median_s'] / base['median_s']:.2f}x" if base else "-"
        a_ratio = f"{m['activation_mb'] / base['activation_mb']:.2f}x" if base and base['activation_mb'] > 0 else "-"
        kept = f"{m['kept_mb']:9.1f}MB" if "kept_mb" in m else "-"
        modelled = f"{m['modelled_mb']:7.0f}MB" if "modelled_mb" in m else "-"
        print(f"{b:>7} {m['median_s'] * 1e3:7.1f}ms {t_ratio:>7} {m['activation_mb']:9.0f}MB {a_ratio:>7} "
              f"{m['between_mb']:7.0f}MB {m['step_peak_mb']:8.0f}MB {m['process_peak_mb']:8.0f}MB {kept:>11} "
              f"{modelled:>9} {m['user_s'] * 1e3:6.0f}ms {m['sys_s'] * 1e3:5.0f}ms {m['faults'] / 1e3:6.0f}k")
    phased = [b for b in args.budgets if med[b].get("backward_faults") is not None]
    if phased:
        print("per phase, user / sys ms and faults (forward: the forward and the loss; backward: loss.backward(); "
              "optimizer: AdamW's step)")
        for b in phased:
            m = med[b]
            print(f"{b:>7} " + "  ".join(
                f"{name} {m[name + '_user_s'] * 1e3:5.0f} / {m[name + '_sys_s'] * 1e3:4.0f} ms "
                f"{m[name + '_faults'] / 1e3:5.1f}k" for name in PHASES))
    for line in targets(med):
        print(line)


def targets(med: dict[str, dict]) -> list[str]:
    """Issue 18's targets, each with the numbers it is checked on and whether it is met."""
    base, eager = med.get("1.0"), med.get("eager")
    lines = ["targets (issue 18):"]
    if base is None:
        return lines + ["  no budget 1.0 (no recompute) to compare with"]

    def row(name: str, ok: bool, numbers: str) -> str:
        return f"  {'met' if ok else 'NOT met':>7}  {name}: {numbers}"

    def reduction(b: str) -> tuple[float, float]:
        # nan where no activation memory shows (the "glibc" and "arena" allocators may keep it all between steps)
        less = 1 - med[b]["activation_mb"] / base["activation_mb"] if base["activation_mb"] > 0 else float("nan")
        return less, med[b]["median_s"] / base["median_s"] - 1

    def cpu(b: str, against: dict) -> str:
        # CPU time (user + system) still compares the sides on a loaded machine, where wall time does not
        return f"; CPU {(med[b]['user_s'] + med[b]['sys_s']) / (against['user_s'] + against['sys_s']) - 1:+.0%}"

    budgets = sorted((b for b in med if b not in ("eager", "none")), key=float, reverse=True)
    if "0.5" in med:
        less, slower = reduction("0.5")
        lines.append(row("budget 0.5: activation memory >= 40% lower, step <= 15% slower", less >= 0.40 and slower <= 0.15,
                         f"{less:.0%} lower, {slower:+.0%} step time" + cpu("0.5", base)))
    smallest = budgets[-1]
    if smallest != "1.0":
        less, slower = reduction(smallest)
        lines.append(row(f"smallest budget {smallest}: >= 70% lower, <= 35% slower", less >= 0.70 and slower <= 0.35,
                         f"{less:.0%} lower, {slower:+.0%} step time" + cpu(smallest, base)))
    peaks = [med[b]["process_peak_mb"] for b in budgets]
    rises = [f"{a}->{b} (+{pb - pa:.1f} MB)" for a, b, pa, pb in zip(budgets, budgets[1:], peaks, peaks[1:])
             if pb > pa + RSS_NOISE_MB]
    lines.append(row(f"peak RSS never rises as the budget falls ({len(budgets)} budgets)", not rises,
                     " ".join(f"{b}:{p:.0f}MB" for b, p in zip(budgets, peaks))
                     + (f"; rises at {', '.join(rises)}" if rises else "")))
    if eager is not None and "0.5" in med:
        half = med["0.5"]
        lines.append(row("budget 0.5: peak RSS below eager's", half["process_peak_mb"] < eager["process_peak_mb"],
                         f"{half['process_peak_mb']:.0f} MB vs {eager['process_peak_mb']:.0f} MB"))
        lines.append(row("budget 0.5: step faster than eager's", half["median_s"] < eager["median_s"],
                         f"{half['median_s'] * 1e3:.0f} ms vs {eager['median_s'] * 1e3:.0f} ms" + cpu("0.5", eager)))
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
