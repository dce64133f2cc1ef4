"""The MLP's bf16 step against its floor: how fast any implementation with this CPU's bf16 kernels can be.

    python benchmarks/mlp_floor.py                          # 2 threads, wall time, 40 rounds
    python benchmarks/mlp_floor.py --threads 1 --clock cpu  # the work alone (one thread's CPU time)
    python benchmarks/mlp_floor.py --threads 1 --clock cpu --alone 3   # also each step in its own process
    MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456 python benchmarks/mlp_floor.py --alone 3
    python benchmarks/mlp_floor.py --teams                  # torch's OpenMP team in ORTModule's step (below)
    python benchmarks/mlp_floor.py --end-team               # also ORTModule's steps with the team ended before calls

The workload is ``ortmodule_bench.py``'s MLP (784-1024-1024-10 ReLU, batch 128, ``F.cross_entropy`` in
torch) under ``torch.autocast("cpu", bfloat16)``, issue 17's 1.3x target. Every part below takes its turn
once per round, in one process, so that a load that changes during the run hits them alike; printed are the
medians over the rounds (ms) and the ratios they allow. No assert: this is a measurement.

- eager autocast's step, on ``torch.optim.AdamW(fused=True)`` and on ``torch.optim.AdamW`` (torch's default
  implementation for CPU tensors), split into forward + backward (zero_grad, forward, loss, ``backward()``)
  and the optimizer's step;
- ORTModule's step on the same optimizers (``ortmodule_bench.make_optimizer``: onnxtrain's ``FusedAdam`` for
  ``fused``), split into the forward call, the backward call, the glue around them in ``ORTFunction``, the
  rest of forward and backward (torch's loss, autograd) and the optimizer;
- the products alone: every product eager autocast runs in a step (forward ``addmm`` of each layer, the input
  gradients of layers 2 and 3 and the weight gradients of all three, as ``torch.mm``/``addmm`` on bf16
  operands made beforehand, into outputs made beforehand), and the same eight products as one OpenVINO graph of just them (``Gemm``s as
  ORTModule's graphs write them; the infer alone, inputs bound once), compiled as ORTModule compiles its
  graphs, fed bf16 tensors or float32 ones (OpenVINO's bf16 hint converts them in the call, as ORTModule's
  calls convert the float32 weights now);
- the casts eager autocast adds to the products (each weight and bias to bf16, each weight and bias gradient
  back to float32), for reference.

Each part's page faults are printed too: glibc hands freed memory back to the kernel or keeps it depending on
what the process freed before (its mmap and trim thresholds move), so one step's allocations fault in fresh
pages or not depending on what else ran in the process. ``--alone N`` therefore also runs each step in its
own process, as ``ortmodule_bench.py`` does (the target's setting); the ``MALLOC_*`` line makes glibc keep its
freed memory in every process, so that no step pays for page faults.

The floor of a step is its products plus its optimizer: ``eager step / (products + optimizer)`` is the best
ratio to eager that any implementation built on these product kernels and this optimizer can reach, with
nothing else at all in its step (no casts, no activations, no loss, no Python).

``--teams`` looks at torch's OpenMP team (libgomp) beside OpenVINO's threads in ORTModule's step: which torch
ops of each step open a parallel region (each op runs with the calling thread's team ended before it, and a new
thread means the op started one), how much CPU its idle worker then spins, and what the torch region right after
an OpenVINO call costs when the worker was left spinning through the call or ended before it (libgomp's
``omp_pause_resource_all``: the next region starts a new thread). ``--end-team`` adds ORTModule's steps with
the team ended before each OpenVINO call to the parts that take turns (what onnxtrain would do if it ended it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ortmodule_bench import make_optimizer, make_workload  # noqa: E402

import bf16_step_profile  # noqa: E402  (its session instrumentation, on this script's clock)

BATCH, SIZES = 128, (784, 1024, 1024, 10)
OPTIMIZERS = ("fused", "adamw")
TARGET = 1.3


def _products():
    """The eight products of one eager autocast step, as (name, operand shapes and form): ``fwd``
    ``a @ w.T + b``, ``dx`` ``g @ w``, ``dw`` ``g.T @ a``."""
    (i0, i1, i2, i3) = SIZES
    return [
        ("fwd 1", "fwd", (BATCH, i0), (i1, i0)), ("fwd 2", "fwd", (BATCH, i1), (i2, i1)),
        ("fwd 3", "fwd", (BATCH, i2), (i3, i2)),
        ("dx 3", "dx", (BATCH, i3), (i3, i2)), ("dx 2", "dx", (BATCH, i2), (i2, i1)),
        ("dw 3", "dw", (BATCH, i3), (BATCH, i2)), ("dw 2", "dw", (BATCH, i2), (BATCH, i1)),
        ("dw 1", "dw", (BATCH, i1), (BATCH, i0)),
    ]


def _operands(torch):
    """bf16 operands for each product (random; ReLU's outputs where a product reads an activation)."""
    torch.manual_seed(1)
    operands = []
    for name, form, a_shape, b_shape in _products():
        a = torch.randn(a_shape).relu() if form == "fwd" and name != "fwd 1" else torch.randn(a_shape)
        b = torch.randn(b_shape).relu() if form == "dw" and name != "dw 1" else torch.randn(b_shape)
        bias = torch.randn(b_shape[0]) if form == "fwd" else None
        operands.append(tuple(t.to(torch.bfloat16) if t is not None else None for t in (a, b, bias)))
    return operands


def torch_products(torch):
    """The eight products by torch on bf16 operands, each into an output made beforehand (no allocation)."""
    forms = {"fwd": lambda a, w, b, out: torch.addmm(b, a, w.t(), out=out),
             "dx": lambda g, w, _, out: torch.mm(g, w, out=out), "dw": lambda g, a, _, out: torch.mm(g.t(), a, out=out)}
    calls = []
    for (name, form, *_), ops in zip(_products(), _operands(torch)):
        calls.append((name, forms[form], (*ops, forms[form](*ops, None))))

    def run(clock, into):
        for name, fn, ops in calls:
            start = clock()
            fn(*ops)
            into[name] = clock() - start
    return run


def openvino_products(dtype: str, threads: int):
    """The eight products as one OpenVINO graph, compiled as ORTModule's sessions are (bf16 hint, threads
    unpinned); ``dtype``: the graph inputs' type, "bfloat16" or "float" (converted by the hint)."""
    import numpy as np
    import openvino as ov
    import torch
    from onnx import TensorProto, helper

    from onnxtrain.runtime.openvino import OpenVINOSession

    elem = {"bfloat16": TensorProto.BFLOAT16, "float": TensorProto.FLOAT}[dtype]
    inputs, nodes, outputs, arrays = [], [], [], []
    attrs = {"fwd": {"transB": 1}, "dx": {}, "dw": {"transA": 1}}
    for k, ((name, form, a_shape, b_shape), ops) in enumerate(zip(_products(), _operands(torch))):
        names = [f"a{k}", f"b{k}"] + ([f"c{k}"] if form == "fwd" else [])
        for n, t in zip(names, ops):
            inputs.append(helper.make_tensor_value_info(n, elem, list(t.shape)))
            bits = t.view(torch.int16).numpy() if dtype == "bfloat16" else t.float().numpy()
            arrays.append(np.ascontiguousarray(bits))
        nodes.append(helper.make_node("Gemm", names, [f"y{k}"], **attrs[form]))
        outputs.append(helper.make_tensor_value_info(f"y{k}", elem, None))
    model = helper.make_model(helper.make_graph(nodes, "products", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    session = OpenVINOSession(model.SerializeToString(), "bf16", threads=threads, pin_threads=False)
    request = session._compile().create_infer_request()
    for k, array in enumerate(arrays):
        request.set_input_tensor(k, ov.Tensor(array, ov.Shape(list(array.shape)), ov.Type.bf16)
                                 if dtype == "bfloat16" else ov.Tensor(array, shared_memory=True))

    def run(clock, into, keep=(session, arrays)):  # the request reads the arrays' memory: kept alive
        start = clock()
        request.infer()
        into["products"] = clock() - start
    return run


def torch_casts(torch, model):
    """What eager autocast converts around its products in a step: each weight and bias to bf16, and each
    weight and bias gradient back to float32 (fresh tensors, as autocast's cache and autograd make them)."""
    params = [p.detach() for p in model.parameters()]
    low = [p.to(torch.bfloat16) for p in params]

    def run(clock, into):
        start = clock()
        for p in params:
            p.to(torch.bfloat16)
        middle = clock()
        for g in low:
            g.to(torch.float32)
        into["to bf16"], into["to float32"] = middle - start, clock() - middle
    return run


def step_runner(torch, runner, optimizer, loss_fn):
    def run(clock, into):
        start = clock()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(runner)
        loss.backward()
        middle = clock()
        optimizer.step()
        end = clock()
        into["forward+backward"], into["optimizer"], into["step"] = middle - start, end - middle, end - start
    return run


def ortmodule_runner(torch, runner, optimizer, loss_fn, calls: dict):
    """ORTModule's step, with its graph calls and ORTFunction's forward and backward (timed into ``calls`` by
    bf16_step_profile's instrumentation, on this script's clock)."""
    plain = step_runner(torch, runner, optimizer, loss_fn)

    def run(clock, into):
        calls.clear()
        plain(clock, into)
        fn = calls.get("ORTFunction.forward", 0.0) + calls.get("ORTFunction.backward", 0.0)
        graph = {k: v for k, v in calls.items() if not k.startswith("ORTFunction")}
        for label, seconds in graph.items():
            into[f"{label} call"] = seconds
        into["glue"] = fn - sum(graph.values())
        into["loss, autograd, Python"] = into["forward+backward"] - fn
    return run


STEPS = tuple(f"{side} ({kind})" for kind in OPTIMIZERS for side in ("eager", "ORTModule"))
ENDED = tuple(f"ORTModule, team ended ({kind})" for kind in OPTIMIZERS)
PRODUCTS = ("torch products", "OpenVINO products, bf16 inputs", "OpenVINO products, float32 inputs", "eager's casts")


def _omp_pause():
    """libgomp's ``omp_pause_resource_all`` as torch links it (ends the calling thread's team), or None."""
    import ctypes

    import torch

    try:
        torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
                                mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        pause = torch_cpu.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return lambda: pause(1)  # omp_pause_soft


_END_TEAM = [False]


def _team_ended(run):
    """``run`` with torch's OpenMP team ended before each of ORTModule's OpenVINO calls."""
    from onnxtrain.runtime.session import TorchSession

    pause = _omp_pause()
    if pause is None:
        raise SystemExit("--end-team: torch does not run on libgomp with omp_pause_resource_all here")
    if not getattr(TorchSession.run, "_ends_team", False):
        plain = TorchSession.run

        def ending(self, inputs):
            if _END_TEAM[0] and self.backend == "openvino":
                pause()
            return plain(self, inputs)
        ending._ends_team = True
        TorchSession.run = ending

    def ended(clock, into):
        _END_TEAM[0] = True
        try:
            run(clock, into)
        finally:
            _END_TEAM[0] = False
    return ended


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def teams(threads: int, rounds: int) -> None:
    """``--teams``: which ops of ORTModule's step open torch's OpenMP team; the idle worker's spin; a region
    right after an OpenVINO call with the worker left or ended before the call (module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from onnxtrain import ORTModule

    pause = _omp_pause()
    if pause is None:
        print("torch does not run on libgomp with omp_pause_resource_all here: nothing to look at")
        return
    torch.set_num_threads(threads)
    phase = [""]
    opened: dict[tuple, int] = defaultdict(int)

    class Opens(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            pause()
            before = _threads()
            out = func(*args, **(kwargs or {}))
            if _threads() - before:
                shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                opened[(phase[0], str(func), shapes)] += 1
            return out

    base, loss_fn = make_workload("mlp")
    for kind in OPTIMIZERS:
        model = copy.deepcopy(base).train()
        runner = ORTModule(model)
        optimizer = make_optimizer(model.parameters(), "ortmodule-bf16", kind)

        def step():
            phase[0] = "zero_grad"
            optimizer.zero_grad(set_to_none=True)
            phase[0] = "forward and loss"
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(runner)
            phase[0] = "backward"
            loss.backward()
            phase[0] = "optimizer"
            optimizer.step()
        for _ in range(3):
            step()
        opened.clear()
        with Opens():
            step()
        print(f"ORTModule's step ({kind}), {threads} threads: the torch ops that open an OpenMP team "
              f"({sum(opened.values())} ops; an op may run several regions)")
        for (where, op, shapes), n in opened.items():
            print(f"  {where:17} {op:40} {n} x  {shapes}")
    small = torch.randn(BATCH, SIZES[-1])

    def spin():
        torch.log_softmax(small, 1)
        time.sleep(0.02)  # the worker is asleep now
        torch.log_softmax(small, 1)
        start = time.process_time()
        time.sleep(0.02)
        return 1000 * (time.process_time() - start)
    spins = [spin() for _ in range(rounds)]
    print(f"\nCPU the process spends in 20 ms of sleep right after one region (log_softmax of [{BATCH}, "
          f"{SIZES[-1]}]), median of {rounds}: {statistics.median(spins):.2f} ms")
    call = openvino_products("bfloat16", threads)
    clock = time.perf_counter
    samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for ended in (False, True):
            torch.log_softmax(small, 1)  # the worker spins
            if ended:
                pause()
            start = clock()
            call(clock, {})
            middle = clock()
            torch.log_softmax(small, 1)
            samples[ended].append((1000 * (middle - start), 1000 * (clock() - middle)))
            time.sleep(0.005)
    print("the eight products as one OpenVINO call right after a torch region, then a region (ms, medians):")
    for ended, xs in samples.items():
        label = "worker ended before the call" if ended else "worker left spinning"
        print(f"  {label:30} call {statistics.median(x[0] for x in xs):.3f}, "
              f"the region after it {statistics.median(x[1] for x in xs):.3f}")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(rounds: int, threads: int, clock, names=STEPS + PRODUCTS) -> dict[str, dict[str, float]]:
    """{part: {label: median ms, "page faults": median count}} for the parts ``names``, taking turns."""
    import torch

    from onnxtrain import ORTModule

    torch.set_num_threads(threads)  # OpenVINO's sessions (ORTModule's and the products') take the same count
    bf16_step_profile.CLOCK[0] = clock
    base, loss_fn = make_workload("mlp")
    parts, modules = {}, []
    calls: dict[str, float] = {}
    for name in names:
        side, kind = name.split(" (")[0], name.split(" (")[-1].rstrip(")")
        model = copy.deepcopy(base).train()
        if side == "eager":
            optimizer = make_optimizer(model.parameters(), "eager-bf16", kind)
            parts[name] = step_runner(torch, model, optimizer, loss_fn)
        elif side.startswith("ORTModule"):
            modules.append(ORTModule(model))
            optimizer = make_optimizer(model.parameters(), "ortmodule-bf16", kind)
            parts[name] = ortmodule_runner(torch, modules[-1], optimizer, loss_fn, calls)
            if side != "ORTModule":
                parts[name] = _team_ended(parts[name])
    makers = {"torch products": lambda: torch_products(torch),
              "OpenVINO products, bf16 inputs": lambda: openvino_products("bfloat16", threads),
              "OpenVINO products, float32 inputs": lambda: openvino_products("float", threads),
              "eager's casts": lambda: torch_casts(torch, base)}
    parts.update({name: makers[name]() for name in names if name in makers})
    for run in parts.values():  # warm-up: export, compilation, first touches
        for _ in range(3):
            run(clock, {})
    for module in modules:
        if module.fallback_reason is not None:
            raise RuntimeError(f"ORTModule fell back to PyTorch: {module.fallback_reason}")
        bf16_step_profile._instrument(module, calls)  # its sessions exist after the first step
    if modules:
        bf16_step_profile.time_function(calls)
    samples: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in parts}
    for _ in range(rounds):
        for name, run in parts.items():
            into: dict[str, float] = {}
            faults = _faults()
            run(clock, into)
            faults = _faults() - faults
            for label, seconds in into.items():
                samples[name][label].append(1000 * seconds)
            samples[name]["page faults"].append(faults)
    return {name: {label: statistics.median(v) for label, v in s.items()} for name, s in samples.items()}


def alone(processes: int, rounds: int, threads: int, clock_name: str) -> dict[str, dict[str, float]]:
    """Each step in its own process, as ``ortmodule_bench.py`` runs them (the allocator's state is the step's
    own; in one process one step's frees decide where another's allocations fault), the processes taking
    turns; per label the median over the processes of each one's median."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for _ in range(processes):
        for name in STEPS:
            command = [sys.executable, os.path.abspath(__file__), "--child", name, "--rounds", str(rounds),
                       "--threads", str(threads), "--clock", clock_name]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    return {name: {label: statistics.median(r[label] for r in rs) for label in rs[0]} for name, rs in runs.items()}


def _table(m: dict[str, dict[str, float]]) -> None:
    for name, labels in m.items():
        times = {label: ms for label, ms in labels.items() if label != "page faults"}
        total = times.pop("step", None)
        total = _ms(times) if total is None else total
        shown = ", ".join(f"{label} {ms:.2f}" for label, ms in times.items())
        print(f"  {name:34} {total:7.2f}   ({shown}; {labels['page faults']:.0f} page faults)")


def _ms(labels: dict[str, float]) -> float:
    return sum(ms for label, ms in labels.items() if label != "page faults")


def report(m: dict[str, dict[str, float]]) -> None:
    """The floor of each optimizer's step against eager's step in ``m``."""
    products = {"torch products": _ms(m["torch products"]),
                "OpenVINO products, bf16 inputs": m["OpenVINO products, bf16 inputs"]["products"],
                "OpenVINO products, float32 inputs": m["OpenVINO products, float32 inputs"]["products"]}
    casts = _ms(m["eager's casts"])
    print("\nthe floor: eager step / (products + optimizer); what 1.3x leaves for forward + backward")
    for kind in OPTIMIZERS:
        eager, ort = m[f"eager ({kind})"], m[f"ORTModule ({kind})"]
        budget = eager["step"] / TARGET - eager["optimizer"]
        print(f"  {kind}: eager step {eager['step']:.2f} (forward+backward {eager['forward+backward']:.2f}, "
              f"optimizer {eager['optimizer']:.2f}); ORTModule step {ort['step']:.2f} "
              f"({eager['step'] / ort['step']:.2f}x eager); {TARGET}x eager leaves {budget:.2f} ms "
              f"beside eager's optimizer")
        ended = m.get(f"ORTModule, team ended ({kind})")
        if ended:
            print(f"    ORTModule with torch's team ended before each call: step {ended['step']:.2f} "
                  f"({eager['step'] / ended['step']:.2f}x eager)")
        for label, ms in products.items():
            floor = ms + eager["optimizer"]
            print(f"    {label:34} {ms:6.2f}  floor {floor:6.2f}  best ratio {eager['step'] / floor:5.2f}x")
        floor = products["torch products"] + casts + eager["optimizer"]
        print(f"    {'torch products + casts':34} {products['torch products'] + casts:6.2f}  floor {floor:6.2f}  "
              f"best ratio {eager['step'] / floor:5.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (all threads, spinning included) instead of wall time")
    parser.add_argument("--alone", type=int, default=0, metavar="N",
                        help="also run each step in its own process, N processes each (ortmodule_bench.py's way)")
    parser.add_argument("--teams", action="store_true",
                        help="torch's OpenMP team in ORTModule's step (module docstring), then exit")
    parser.add_argument("--end-team", action="store_true",
                        help="also time ORTModule's steps with torch's team ended before each OpenVINO call")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.child:
        print(json.dumps(measure(args.rounds, args.threads, clock, [args.child])[args.child]))
        return 0
    if args.teams:
        teams(args.threads, args.rounds)
        return 0
    medians = measure(args.rounds, args.threads, clock, STEPS + (ENDED if args.end_team else ()) + PRODUCTS)
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, autocast bf16: {args.rounds} rounds, {args.threads} "
          f"thread(s), {args.clock} time, medians (ms); each part in turn in this process")
    _table(medians)
    report(medians)
    if args.alone:
        steps = alone(args.alone, args.rounds, args.threads, args.clock)
        print(f"\neach step in its own process ({args.alone} processes each, taking turns; the median of their "
              f"medians), and the floor against eager's step there:")
        _table(steps)
        medians.update(steps)
        report(medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
