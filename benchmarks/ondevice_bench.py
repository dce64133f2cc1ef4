"""On-device training runtime against PyTorch eager: median training-step time and peak RSS.

A step is forward + backward + optimizer step (AdamW, cross-entropy) on the same model, weights and
synthetic batch. Each side runs in its own fresh process (so peak RSS is its own); the parent exports
the model and generates the artifacts first.

    python benchmarks/ondevice_bench.py                 # MLP and BERT-small, 2 threads
    python benchmarks/ondevice_bench.py --models mlp --steps 50 --threads 4
    python benchmarks/ondevice_bench.py --bf16          # adds autocast-bf16 eager and OpenVINO bf16 rows
    python benchmarks/ondevice_bench.py --models bert --bf16 --account --steps 40   # where the on-device step goes

Models: MLP 784-1024-1024-10, batch 128; BERT-small (hidden 256, 4 layers, 4 heads, intermediate
1024, seq 128, batch 8, dropout off), sequence classification with 2 labels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEED = 0


# -- models and data (identical in every process) ------------------------------------------------


def build_torch_model(name: str):
    import torch

    torch.manual_seed(SEED)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                   torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    import transformers

    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, max_position_embeddings=512, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    bert = transformers.BertForSequenceClassification(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.bert = inner

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).logits

    return Logits(bert)


def make_batch(name: str):
    import numpy as np

    rng = np.random.default_rng(SEED)
    if name == "mlp":
        return [rng.standard_normal((128, 784)).astype(np.float32)], rng.integers(0, 10, 128).astype(np.int64)
    ids = rng.integers(1, 30522, (8, 128)).astype(np.int64)
    return [ids, np.ones_like(ids)], rng.integers(0, 2, 8).astype(np.int64)


# -- workers ---------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; unlike ru_maxrss, not inherited across exec on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_steps(step, steps: int, warmup: int, min_seconds: float = 0.0) -> list[float]:
    """Times of at least ``steps`` timed steps, and of more until they add up to ``min_seconds`` (a
    10 ms step then gets some 200 samples instead of 20, where one noisy second would move its median)."""
    for _ in range(warmup):
        step()
    times = []
    while len(times) < steps or sum(times) < min_seconds:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def ondevice_runtime(args):
    """The on-device Module and Optimizer over the artifacts in ``--dir``, as the workers run them."""
    from onnxtrain.api import CheckpointState, Module, Optimizer
    from onnxtrain.utils.ort_options import for_training

    options = for_training()  # what Module does when given no options
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    d = Path(args.dir)
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, session_options=options, backend=args.backend,
                    precision=args.precision)
    optimizer = Optimizer(d / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(1e-4)
    return module, optimizer


def worker_ondevice(args) -> dict:
    module, optimizer = ondevice_runtime(args)
    inputs, labels = make_batch(args.model)
    calls = {"training call": [], "optimizer call": []}  # each step's two parts (warm-up included)

    def step():
        start = time.perf_counter()
        module(*inputs, labels)
        middle = time.perf_counter()
        optimizer.step()
        calls["training call"].append(middle - start)
        calls["optimizer call"].append(time.perf_counter() - middle)
        module.lazy_reset_grad()

    times = time_steps(step, args.steps, args.warmup, args.min_seconds)
    parts = {name: statistics.median(values[args.warmup:]) for name, values in calls.items()}
    return {"times": times, "peak_rss_mb": peak_rss_mb(), "parts": parts,
            "loaded_torch": "torch" in sys.modules, "ran": [module.backend, module.precision]}


def worker_account(args) -> dict:
    """The on-device step in parts, wall and CPU (``time.process_time``: every thread), per step, medians over
    ``--steps`` steps: the training session's call (OpenVINO's infer on bf16), the embedding gradients' rows added
    (``FlatBuffers.add_rows``, bf16 artifacts), the module's other work (input checks, binding, outputs), the
    optimizer step, and the rest (``lazy_reset_grad``, the loop), from which the idle gaps follow."""
    from onnxtrain.ondevice import buffers

    module, optimizer = ondevice_runtime(args)
    inputs, labels = make_batch(args.model)
    inner = {"session": [0.0, 0.0], "rows": [0.0, 0.0]}  # this step's (wall, CPU) of the timed calls

    def timed(fn, into):
        def call(*a, **k):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                into[0] += time.perf_counter() - start
                into[1] += time.process_time() - cpu
        return call

    session = module._train.session
    session.run_with_iobinding = timed(session.run_with_iobinding, inner["session"])
    buffers.FlatBuffers.add_rows = timed(buffers.FlatBuffers.add_rows, inner["rows"])
    names = ("step", "training session call", "embedding rows added", "module's other work", "optimizer step", "rest")
    parts = {name: [] for name in names}
    for k in range(args.warmup + args.steps):
        for into in inner.values():
            into[:] = [0.0, 0.0]
        clocks = [(time.perf_counter(), time.process_time())]
        module(*inputs, labels)
        clocks.append((time.perf_counter(), time.process_time()))
        optimizer.step()
        clocks.append((time.perf_counter(), time.process_time()))
        module.lazy_reset_grad()
        clocks.append((time.perf_counter(), time.process_time()))
        if k < args.warmup:
            continue
        (w0, c0), (w1, c1), (w2, c2), (w3, c3) = clocks
        (ws, cs), (wr, cr) = inner["session"], inner["rows"]
        for name, value in zip(names, ((w3 - w0, c3 - c0), (ws, cs), (wr, cr), (w1 - w0 - ws - wr, c1 - c0 - cs - cr),
                                       (w2 - w1, c2 - c1), (w3 - w2, c3 - c2))):
            parts[name].append(value)
    medians = {name: [statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)]
               for name, values in parts.items()}
    return {"parts": medians, "loaded_torch": "torch" in sys.modules}


def worker_torch(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model = build_torch_model(args.model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.torch_optimizer == "fused")
    inputs, labels = make_batch(args.model)
    inputs = [torch.from_numpy(x) for x in inputs]
    labels = torch.from_numpy(labels)

    autocast = args.precision == "bf16"

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(*inputs)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()

    return {"times": time_steps(step, args.steps, args.warmup, args.min_seconds), "peak_rss_mb": peak_rss_mb()}


# -- driver ----------------------------------------------------------------------------------------


def generate(name: str, out: Path, precision: str = "fp32") -> None:
    """The artifacts of ``name`` in ``out``: ``precision="bf16"`` as ``generate_artifacts`` writes them for
    OpenVINO's bfloat16 (LayerNorm's row sums kept float32, GELU's slope without HardSigmoid: docs/precision.md)."""
    import torch

    from onnxtrain import artifacts

    model = build_torch_model(name).eval()
    inputs, _ = make_batch(name)
    example = tuple(torch.from_numpy(x) for x in inputs)
    names = ["x"] if name == "mlp" else ["input_ids", "attention_mask"]
    program = torch.onnx.export(model, example, dynamo=True, input_names=names, output_names=["logits"],
                                dynamic_shapes=tuple({0: "batch"} for _ in example), optimize=False)
    program.save(str(out / "model.onnx"))
    trainable = [n for n, _ in model.named_parameters()]
    artifacts.generate_artifacts(out / "model.onnx", requires_grad=trainable, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out, precision=precision)


# The rows: (label, worker, backend, precision). bf16: PyTorch eager under torch.autocast, and the on-device
# runtime on OpenVINO with its bf16 hint (onnxtrain.runtime.backends), on generate_artifacts(precision="bf16")'s
# artifacts (until the seventeenth session, the float32 artifacts run with the hint).
SIDES = {"ondevice": ("ondevice", "onnxruntime", "fp32"), "torch": ("torch", "", "fp32"),
         "ondevice-bf16": ("ondevice", "openvino", "bf16"), "torch-bf16": ("torch", "", "bf16")}


# Issue 17's target: on-device BERT-small bf16 at least 1.5x PyTorch eager under torch.autocast bf16.
BF16_TARGETS = {"bert": 1.5}


def run_worker(side: str, name: str, d: Path, args) -> dict:
    kind, backend, precision = SIDES[side]
    d = d / precision if kind == "ondevice" else d  # the artifacts of its precision (main generates both)
    cmd = [sys.executable, __file__, "--worker", kind, "--model", name, "--dir", str(d), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--min-seconds", str(getattr(args, "min_seconds", 0.0)), "--precision", precision,
           "--torch-optimizer", getattr(args, "torch_optimizer", "adamw")]
    if backend:
        cmd += ["--backend", backend]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{side} worker for {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def account(args) -> int:
    """``--account``: the on-device step's parts, per model (see :func:`worker_account`)."""
    side = "ondevice-bf16" if args.bf16 else "ondevice"
    _, backend, precision = SIDES[side]
    print(f"{side}, threads={args.threads}, {args.steps} steps (after {args.warmup}); median ms a step, wall / CPU "
          "(all threads)")
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix=f"ondevice_account_{name}_") as tmp:
            d = Path(tmp) / precision
            d.mkdir()
            generate(name, d, precision)
            cmd = [sys.executable, __file__, "--worker", "account", "--model", name, "--dir", str(d),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
                   "--precision", precision, "--backend", backend]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"account worker for {name} failed:\n{result.stderr[-3000:]}")
            r = json.loads(result.stdout.strip().splitlines()[-1])
        for part, (wall, cpu) in r["parts"].items():
            print(f"{name:<6} {part:<24} {wall * 1e3:8.2f} / {cpu * 1e3:7.2f}")
        if r["loaded_torch"]:
            print("warning: the on-device worker imported torch")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "bert"], choices=["mlp", "bert"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=2.0,
                        help="time more steps than --steps until they add up to this many seconds")
    parser.add_argument("--bf16", action="store_true",
                        help="add bf16 rows: torch.autocast bf16 eager, and on-device on OpenVINO with bf16")
    parser.add_argument("--torch-optimizer", choices=["adamw", "fused"], default="adamw",
                        help="PyTorch's AdamW: adamw, torch's default (on CPU its single-tensor loop); fused, its one-pass kernel "
                             "(eager's fastest). The on-device side runs its own optimizer graph either way")
    parser.add_argument("--account", action="store_true",
                        help="instead of the comparison: the on-device step in parts, wall and CPU (bf16 artifacts "
                             "on OpenVINO with --bf16)")
    parser.add_argument("--worker", choices=["ondevice", "torch", "account"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = {"ondevice": worker_ondevice, "torch": worker_torch, "account": worker_account}[args.worker](args)
        print(json.dumps(result))
        return 0
    if args.account:
        return account(args)

    print(f"threads={args.threads} steps={args.steps} (after {args.warmup} warm-up); step = forward+backward+AdamW; "
          f"PyTorch's AdamW: {'fused=True' if args.torch_optimizer == 'fused' else 'torch default (single-tensor loop on CPU)'}")
    print(f"{'model':<6} {'side':<13} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'peak RSS MB':>12}")
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix=f"ondevice_bench_{name}_") as tmp:
            d = Path(tmp)
            sides = ["ondevice", "torch"] + (["ondevice-bf16", "torch-bf16"] if args.bf16 else [])
            for precision in sorted({SIDES[side][2] for side in sides}):
                (d / precision).mkdir()
                generate(name, d / precision, precision)
            rows = {side: run_worker(side, name, d, args) for side in sides}
        medians = {}
        for kind, r in rows.items():
            times = sorted(t * 1e3 for t in r["times"])
            medians[kind] = statistics.median(times)
            p10, p90 = times[len(times) // 10], times[(9 * len(times)) // 10]
            print(f"{name:<6} {kind:<13} {medians[kind]:>10.2f} {p10:>8.2f} {p90:>8.2f} {r['peak_rss_mb']:>12.0f}")
        for kind, r in rows.items():  # the on-device step's two session calls, medians (glue: the rest)
            if "parts" in r:
                print(f"{name:<6} {kind:<13} " + ", ".join(f"{part} {t * 1e3:.2f} ms" for part, t in r["parts"].items()))
        if rows["ondevice"].get("loaded_torch"):
            print("warning: the on-device worker imported torch")
        print(f"{name:<6} ratio     torch/ondevice = {medians['torch'] / medians['ondevice']:.2f}x")
        if args.bf16:
            ran = rows["ondevice-bf16"].get("ran")
            if ran != ["openvino", "bf16"]:
                print(f"warning: the ondevice-bf16 row ran {ran}, not OpenVINO bf16: its ratio is not the target's")
            ratio = medians["torch-bf16"] / medians["ondevice-bf16"]
            target = BF16_TARGETS.get(name)
            verdict = f"target >= {target}x: {'met' if ratio >= target else 'NOT met'}" if target else "no target"
            print(f"{name:<6} ratio     torch-bf16/ondevice-bf16 = {ratio:.2f}x ({verdict}), "
                  f"ondevice/ondevice-bf16 = {medians['ondevice'] / medians['ondevice-bf16']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
