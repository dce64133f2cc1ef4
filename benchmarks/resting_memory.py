"""Where ORTModule's resting memory (the RSS between steps) goes, against eager PyTorch's.

    python benchmarks/resting_memory.py --workload bert --scale 4 --budget 0.5

One process per side, each under ``memory_bench.py``'s ``malloc`` allocator (onnxruntime without its arena, glibc
with a fixed mmap threshold), one thread:

- **eager**: the model, then three AdamW steps in PyTorch;
- **ortmodule in-process** and **ortmodule spawn** (``--export-process``: both by default): the same under
  ``ORTModule(DebugOptions(recompute=budget, export_process=...))``, with the RSS (anonymous and file-backed) after
  each phase of the first call. In-process: importing onnxtrain's ORTModule, the export and its preparation, the
  training graphs and the forward session. Spawn (the export and the training graphs made in a child process,
  ``ortmodule/export_process.py``): importing ORTModule, then the child's graphs landed here with the forward
  session made (the child's own memory is not this process's). Both: the backward sessions (made on the first
  backward), and between steps; then what the cheap releases give back once the sessions exist (``gc`` and
  glibc's ``malloc_trim(0)``, and dropping the exported IR model the graphs keep: none in spawn mode);
- **graphs-only**: a process that imports only what runs the graphs (``onnxtrain.runtime``: onnx,
  onnxruntime, onnx_ir) and makes the forward and backward sessions from the graphs the first ortmodule process
  saved: the floor for a process that trains on the graphs.

Printed: each side's phases, each ORTModule mode's RSS between steps above eager's split by phase, the mappings of
``/proc/self/smaps`` that grew most against eager's, and the two releases. Memory does not depend on the
machine's load; one run takes about 3 minutes (BERT-small at 4x batch, both modes, loaded).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_bench import ALLOCATORS  # noqa: E402
from ortmodule_bench import make_workload  # noqa: E402

SAVED_ENV = "RESTING_MEMORY_SAVED"  # where the ortmodule worker saves its graphs for the graphs-only worker
STEPS = 3


def status() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of this process, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024.0
    return out


def mappings() -> dict[str, float]:
    """RSS by mapping of ``/proc/self/smaps`` (a file's path, ``[heap]``, ``[anon]`` for anonymous), in MB."""
    rss: collections.Counter = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif parts and parts[0] == "Rss:":
                rss[name] += int(parts[1]) / 1024.0
    return dict(rss)


class Phases:
    def __init__(self):
        self.rows: list[tuple[str, dict[str, float]]] = []

    def mark(self, label: str) -> None:
        gc.collect()
        self.rows.append((label, status()))


def trim() -> None:
    """glibc's ``malloc_trim(0)``: hand free heap pages back to the system (Linux/glibc only)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


MODES = ("in-process", "spawn")  # DebugOptions(export_process=...)


def worker(side: str, workload: str, scale: int, budget: float) -> dict:
    import torch

    torch.set_num_threads(1)
    phases = Phases()
    model, loss_fn = make_workload(workload, scale)
    model.train()
    phases.mark("model built")
    if side == "graphs-only":
        return graphs_only(phases)
    runner = model
    forwards: dict[int, object] = {}  # spawn mode: id of a Training -> its forward graph, as the child sent it
    if side.startswith("ortmodule"):
        runner = _ortmodule(model, budget, phases, side.split()[1], forwards)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for k in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(runner).backward()
        optimizer.step()
        phases.mark(f"between steps {k}")
    result = {"phases": phases.rows, "mappings": mappings()}
    if side.startswith("ortmodule"):
        result["releases"] = _releases(runner)
        _save_graphs(runner, Path(os.environ[SAVED_ENV]), forwards)  # after the measurements: saving allocates
    return result


def _save_graphs(runner, folder: Path, forwards: dict[int, object]) -> None:
    """The forward and (unstaged) backward graphs of each training schema, for the graphs-only worker (spawn
    mode keeps no forward IR: ``forwards`` has the protos the child sent)."""
    import onnx
    import onnx_ir as ir

    from onnxtrain.autodiff.engine import ir_version_for_onnxruntime
    from onnxtrain.autodiff.stop_gradient import strip_stop_gradients

    for k, training in enumerate(t for entries in runner._cache.values() for g in entries for t in g.training.values()):
        forward = (ir_version_for_onnxruntime(ir.to_proto(training.split.forward)) if training.split.forward
                   is not None else forwards[id(training)])
        for kind, proto in (("forward", forward), ("backward", training.backward_proto)):
            onnx.save(strip_stop_gradients(proto), str(folder / f"g_{k}_{kind}.onnx"))  # as the sessions run them


def _ortmodule(model, budget: float, phases: Phases, mode: str, forwards: dict[int, object]):
    """The ORTModule, with the first call's phases marked (the build's functions wrapped: a measurement only)."""
    from onnxtrain import ORTModule
    from onnxtrain.ortmodule import DebugOptions, export_process, graphs, module

    phases.mark("onnxtrain's ORTModule imported")

    def land(ortmodule, answer, tensors):  # the forward protos, before the sessions made of them drop them
        for training, (proto, _) in answer["trainings"].values():
            forwards[id(training)] = proto
        return landed(ortmodule, answer, tensors)

    def after(function, label):
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            phases.mark(label)
            return result
        return wrapped

    module.ORTModule._export = after(module.ORTModule._export, "exported and prepared")
    module.build_training = after(module.build_training, "training graphs, forward session")
    landed = export_process._land
    export_process._land = land
    export_process.export = after(export_process.export, "child's graphs landed, forward session")
    graphs.Training._build = after(graphs.Training._build, "backward sessions (first backward)")
    model = ORTModule(model, DebugOptions(recompute=budget, export_process=mode))
    if mode == "spawn":  # in-process where the child cannot be used: then this run would measure that
        reason = export_process.why_not(model, [])
        if reason is not None:
            raise RuntimeError(f"the export would run in-process: {reason}")
    return model


def _releases(runner) -> dict[str, float]:
    """What the cheap releases give back between steps, in MB: gc + malloc_trim, then dropping the
    exported IR model and the base graph's proto the graphs keep (their sessions exist)."""
    before = status()["VmRSS"]
    trim()
    trimmed = status()["VmRSS"]
    for entries in runner._cache.values():
        for g in entries:
            g.captured.model = None
    gc.collect()
    trim()
    return {"gc + malloc_trim(0)": before - trimmed, "dropping the exported IR model": trimmed - status()["VmRSS"]}


def graphs_only(phases: Phases) -> dict:
    """Import only what runs the graphs and make the forward and backward sessions the ortmodule worker saved."""
    import onnx
    import torch

    from onnxtrain.runtime.session import TorchSession, session_options

    phases.mark("onnxtrain.runtime imported")
    folder = Path(os.environ[SAVED_ENV])
    sessions = [TorchSession(onnx.load(str(path)), torch.device("cpu"), session_options())
                for path in sorted(folder.glob("g_*_forward.onnx")) + sorted(folder.glob("g_*_backward.onnx"))]
    phases.mark(f"{len(sessions)} sessions made")
    return {"phases": phases.rows, "mappings": mappings()}


def run_worker(side: str, args, saved: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--workload", args.workload, "--scale", str(args.scale),
           "--budget", str(args.budget)]
    env = {**os.environ, **ALLOCATORS["malloc"], SAVED_ENV: saved}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict]) -> None:
    for side, result in results.items():
        print(f"\n{side}: RSS (anonymous + file-backed), MB")
        previous = None
        for label, s in result["phases"]:
            grew = f"{s['VmRSS'] - previous:+7.1f}" if previous is not None else " " * 7
            print(f"  {label:38s} {s['VmRSS']:7.1f} {grew}   ({s['RssAnon']:6.1f} + {s['RssFile']:5.1f})")
            previous = s["VmRSS"]
    before_steps = {}
    for side in results:
        if side.startswith("ortmodule"):
            before_steps[side] = _compare(results, side)
    only = results["graphs-only"]["phases"]
    held = ", ".join(f"{side.split()[1]} {mb:.1f} MB" for side, mb in before_steps.items())
    print(f"\na process that only runs the graphs holds {only[-1][1]['VmRSS'] - only[0][1]['VmRSS']:.1f} MB above the "
          f"model (imports and sessions); ORTModule before its first step: {held}")


def _compare(results: dict[str, dict], side: str) -> float:
    """Print ``side``'s RSS between steps above eager's, by phase; return what it held before its first step."""
    eager, ort = results["eager"]["phases"], results[side]["phases"]
    gap = ort[-1][1]["VmRSS"] - eager[-1][1]["VmRSS"]
    print(f"\n{side}: between steps above eager's: {gap:.1f} MB. By phase (ORTModule's growth minus eager's "
          f"over the same steps):")
    base = ort[0][1]["VmRSS"]
    labelled = {label: s["VmRSS"] for label, s in ort}
    order = [label for label, _ in ort if not label.startswith(("between", "backward"))]  # built before a step
    for before, label in zip(order, order[1:]):
        print(f"  {label:38s} {labelled[label] - labelled[before]:+7.1f}")
    steps = ort[-1][1]["VmRSS"] - labelled[order[-1]] - (eager[-1][1]["VmRSS"] - eager[0][1]["VmRSS"])
    # the backward sessions are made inside the first step, among its live values: counted with the steps
    print(f"  {'the steps, backward sessions included':38s} {steps:+7.1f}")
    print(f"  (both start from the model: eager {eager[0][1]['VmRSS']:.1f}, ORTModule {base:.1f})")
    grown = results[side]["mappings"]
    old = results["eager"]["mappings"]
    diff = sorted(((grown.get(k, 0.0) - old.get(k, 0.0), k) for k in set(grown) | set(old)), reverse=True)
    print("mappings that grew most against eager's, MB:")
    for d, name in diff[:6]:
        print(f"  {d:+7.1f} {name}")
    for name, mb in results[side]["releases"].items():
        print(f"release between steps, {name}: {mb:.1f} MB")
    return labelled[order[-1]] - base


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="bert")
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--export-process", choices=(*MODES, "both"), default="both",
                        help="where ORTModule exports (DebugOptions(export_process=...)); both: one process each")
    parser.add_argument("--worker", choices=("eager", *(f"ortmodule {mode}" for mode in MODES), "graphs-only"))
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.workload, args.scale, args.budget)))
        return 0
    modes = MODES if args.export_process == "both" else (args.export_process,)
    sides = ("eager", *(f"ortmodule {mode}" for mode in modes), "graphs-only")
    with tempfile.TemporaryDirectory(prefix="resting_memory_") as saved:
        results = {side: run_worker(side, args, saved) for side in sides}
    print(f"{args.workload} at {args.scale}x batch, budget {args.budget}, malloc allocator, one thread")
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
