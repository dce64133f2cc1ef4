"""A LoRA training step: onnxtrain's LoRA artifacts (float32, int8 and int4 base) against PEFT + PyTorch eager.

A step is forward + backward + AdamW on the adapters only, on Llama-style causal LMs from a config (random
weights, vocab 8192), LoRA r=8 (alpha 16) on q_proj and v_proj. Three models:

- "step", the issue's tiny model (hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 688: about
  7.1M parameters; batch 4 x 64 tokens): step time against PEFT eager, artifact sizes, loss curves, and
  its peak RSS (``--steps``);
- "mid" (hidden 768, 8 layers, 12 heads / 4 KV heads, intermediate 2048: about 63M parameters) and
  "memory" (hidden 1024, 8 layers, 16 heads / 4 KV heads, intermediate 4096: about 139M parameters, 555 MB
  of float32), both at batch 1 x 64 tokens: peak RSS (``--memory-steps``).

Each worker records its RSS after its imports (the baseline: Python, numpy, onnxruntime, or torch +
transformers + peft), after loading the checkpoint, after creating the sessions, and its peak (VmHWM);
"the model's peak" is peak - baseline, what the weights, sessions and activations add. A "floor" worker
measures the fixed cost of the on-device runtime (its imports and a first onnxruntime session on a
one-node model), which no model can avoid.

Each variant runs in a fresh process, the variants in turn for ``--rounds`` rounds; medians. Every
printed number that has a target says "target ...: met / NOT met".

    python benchmarks/lora_bench.py [--steps 20] [--memory-steps 4] [--rounds 3] [--threads 1]
                                    [--only step mid memory]
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
import tempfile
import time
from pathlib import Path

SEED, VOCAB, BATCH, SEQ, LR = 0, 8192, 4, 64, 1e-3
BASES = ("float32", "int8", "int4")
VARIANTS = ("peft_eager", *(f"ondevice_{b}" for b in BASES))
# "step": the tiny model, for step time (about 7.1M parameters, batch 4 x 64 tokens); "mid" and
# "memory": larger ones whose weights outweigh the activations kept for backward (about 63M and 139M
# parameters; batch 1 x 64 tokens, a device's batch). Peak RSS is reported for all three.
MODELS = {"step": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4),
          "mid": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                      num_key_value_heads=4),
          "memory": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4)}


def build_peft_model(size: str = "step"):
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, **MODELS[size])
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(LlamaForCausalLM(config), lora)

    class WithLoss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, labels):
            logits = self.model(input_ids=input_ids).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return WithLoss(model)


BATCHES = {"step": BATCH, "mid": 1, "memory": 1}


def batches(steps: int, size: str = "step"):
    import numpy as np

    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(steps):
        start, stride = rng.integers(0, VOCAB, (BATCHES[size], 1)), rng.integers(1, 4, (BATCHES[size], 1))
        seq = (start + stride * np.arange(SEQ + 1)) % VOCAB
        out.append((seq[:, :-1].astype(np.int64), seq[:, 1:].astype(np.int64)))
    return out


def rss_mb(field: str) -> float:
    """This process's current (VmRSS) or peak (VmHWM) resident memory. Not getrusage's ru_maxrss: Linux
    carries that over exec, so a worker started by the parent would report the parent's peak if higher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(variant: str, directory: Path, size: str, steps: int, threads: int) -> dict:
    """Train ``steps`` steps; the baseline is the RSS after the imports, before the model exists."""
    data = batches(steps, size)
    times, losses, stages = [], [], {}
    if variant == "floor":  # the runtime's fixed cost: its imports and a first session on a one-node model
        import numpy as np
        import onnxruntime as ort

        import onnxtrain.api  # noqa: F401
        from onnxtrain.utils.ort_options import for_training

        baseline = rss_mb("VmRSS")
        ort.InferenceSession(str(directory / "floor.onnx"), for_training(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones(2, np.float32)})
        return {"peak_rss_mb": rss_mb("VmHWM"), "baseline_mb": baseline}
    if variant == "peft_eager":
        import peft  # noqa: F401  (imported before the baseline, as onnxruntime is for the others)
        import torch
        import transformers  # noqa: F401

        torch.set_num_threads(threads)
        baseline = rss_mb("VmRSS")
        model = build_peft_model(size).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        for x, y in data:
            t = time.perf_counter()
            optimizer.zero_grad()
            loss = model(torch.from_numpy(x), torch.from_numpy(y))
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
    else:
        from onnxtrain.api import CheckpointState, Module, Optimizer
        from onnxtrain.utils.ort_options import for_training

        options = for_training()
        options.intra_op_num_threads = threads
        baseline = rss_mb("VmRSS")
        d = directory / size / variant.removeprefix("ondevice_")
        state = CheckpointState.load_checkpoint(d / "checkpoint")
        stages["checkpoint_mb"] = rss_mb("VmRSS")
        module = Module(d / "training_model.onnx", state, session_options=options)
        optimizer = Optimizer(d / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(LR)
        stages["sessions_mb"] = rss_mb("VmRSS")
        for x, y in data:
            t = time.perf_counter()
            loss = module(x, y)
            optimizer.step()
            module.lazy_reset_grad()
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
    return {"median_ms": 1e3 * statistics.median(times[1:] or times), "first_ms": 1e3 * times[0], "losses": losses,
            "peak_rss_mb": rss_mb("VmHWM"), "baseline_mb": baseline, **stages}


def prepare(directory: Path, size: str) -> dict:
    import onnx
    import torch

    from onnxtrain.ondevice.lora import generate_lora_artifacts

    model = build_peft_model(size).eval()
    x, y = (torch.from_numpy(a) for a in batches(1)[0])
    path = directory / f"{size}.onnx"
    program = torch.onnx.export(copy.deepcopy(model), (x, y), dynamo=True, input_names=["input_ids", "labels"],
                                output_names=["loss"], optimize=False, verbose=False,
                                dynamic_shapes=({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}))
    program.save(str(path))
    del program
    sizes = {}
    for base in BASES:
        out = directory / size / base
        generate_lora_artifacts(path, base=base, loss=None, optimizer="adamw", artifact_directory=out)
        sizes[base] = {f.name: f.stat().st_size for f in out.iterdir()}
    path.unlink()
    floor = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "floor",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    onnx.save(onnx.helper.make_model(floor, opset_imports=[onnx.helper.make_opsetid("", 17)]), directory / "floor.onnx")
    counts = {"all": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    return {"sizes": sizes, "parameters": counts}


def run_rounds(directory: Path, size: str, steps: int, rounds: int, threads: int) -> dict:
    """Each variant in a fresh process (its peak RSS is its own), the variants in turn, ``rounds`` times."""
    runs = {v: [] for v in (*VARIANTS, "floor")}
    for _ in range(rounds):
        for v in runs:
            out = subprocess.run([sys.executable, __file__, "--worker", v, "--dir", str(directory), "--size", size,
                                  "--steps", str(steps), "--threads", str(threads)], capture_output=True, text=True,
                                 check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report_sizes(info: dict) -> None:
    print(f"parameters: {info['parameters']['all']:,} ({info['parameters']['trainable']:,} trainable: adapters)")
    total = {base: sum(files.values()) for base, files in info["sizes"].items()}
    for base, files in info["sizes"].items():
        print(f"  artifacts, {base} base: {total[base] / 2**20:.2f} MiB "
              f"({', '.join(f'{k} {v / 2**20:.2f}' for k, v in sorted(files.items()))})")
    ratio = total["float32"] / total["int8"]
    print(f"  size float32 / int8: {ratio:.2f}x (target >= 3x: {met(ratio >= 3)}); "
          f"float32 / int4: {total['float32'] / total['int4']:.2f}x (no target)")


def report_step_time(runs: dict) -> None:
    med = {v: statistics.median(r["median_ms"] for r in runs[v]) for v in VARIANTS}
    for v in VARIANTS:
        print(f"  {v:18s} step {med[v]:7.1f} ms (per round {[round(r['median_ms'], 1) for r in runs[v]]}), "
              f"first {runs[v][0]['first_ms']:.0f} ms")
    for v in VARIANTS[1:]:
        speed = med["peft_eager"] / med[v]
        print(f"  {v} vs PEFT eager: {speed:.2f}x (target: a step measured against PEFT + PyTorch eager; "
              f"faster: {met(speed > 1)})")


def report_memory(runs: dict, info: dict) -> None:
    """Peak RSS per variant, where it goes (checkpoint, sessions, the steps), and the two ratios with the
    2x target: the model's peak (peak - RSS after imports) and the whole process."""
    median = lambda v, key: statistics.median(r[key] for r in runs[v])  # noqa: E731
    floor = median("floor", "baseline_mb"), median("floor", "peak_rss_mb") - median("floor", "baseline_mb")
    print(f"  the runtime's fixed cost: imports (Python, numpy, onnxruntime, onnxtrain.api) {floor[0]:.0f} MB, "
          f"a first onnxruntime session {floor[1]:.0f} MB")
    model_peak = {}
    for v in VARIANTS:
        peak, base = median(v, "peak_rss_mb"), median(v, "baseline_mb")
        model_peak[v] = peak - base
        parts = ""
        if "checkpoint_mb" in runs[v][0]:
            ckpt, sessions = median(v, "checkpoint_mb"), median(v, "sessions_mb")
            parts = (f" = checkpoint {ckpt - base:4.0f} + sessions {sessions - ckpt:3.0f} + steps {peak - sessions:4.0f}")
        print(f"  {v:18s} peak RSS {peak:6.0f} MB, after imports {base:4.0f} MB, model's peak {peak - base:6.0f} MB"
              f"{parts} (per round {[round(r['peak_rss_mb'] - r['baseline_mb']) for r in runs[v]]})")
    f32, i8 = (f"ondevice_{b}" for b in ("float32", "int8"))
    ratio, whole = model_peak[f32] / model_peak[i8], median(f32, "peak_rss_mb") / median(i8, "peak_rss_mb")
    saved = (info["sizes"]["float32"]["checkpoint"] - info["sizes"]["int8"]["checkpoint"]) / 2**20
    print(f"  model's peak RSS float32 / int8: {ratio:.2f}x (target >= 2x: {met(ratio >= 2)}); whole process "
          f"{whole:.2f}x (target >= 2x: {met(whole >= 2)}); float32 / int4 model's peak "
          f"{model_peak[f32] / model_peak['ondevice_int4']:.2f}x (no target)")
    print(f"  if int8 saved exactly its {saved:.0f} MB of smaller weights and nothing else changed: model's peak "
          f"{model_peak[f32] / (model_peak[f32] - saved):.2f}x, whole process "
          f"{median(f32, 'peak_rss_mb') / (median(f32, 'peak_rss_mb') - saved):.2f}x")


def report_losses(runs: dict, steps: int) -> None:
    ref, f32, i8, i4 = (runs[v][0]["losses"] for v in VARIANTS)
    rel = lambda a, b: max(abs(p - q) / abs(q) for p, q in zip(a, b))  # noqa: E731
    print(f"  losses over {steps} steps: float32 vs PEFT max rel {rel(f32, ref):.2e} (target <= 1e-4: "
          f"{met(rel(f32, ref) <= 1e-4)}); int8 vs float32 max rel {rel(i8, f32):.2e} (target <= 2%: "
          f"{met(rel(i8, f32) <= 0.02)}); int4 vs float32 max rel {rel(i4, f32):.2e} (2%: {met(rel(i4, f32) <= 0.02)}); "
          f"PEFT {ref[0]:.4f} -> {ref[-1]:.4f}, int4 {i4[0]:.4f} -> {i4[-1]:.4f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run of the step-time model")
    parser.add_argument("--memory-steps", type=int, default=4, help="steps per run of the memory model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=tuple(MODELS), help="run only these models")
    parser.add_argument("--worker", choices=(*VARIANTS, "floor"))
    parser.add_argument("--size", choices=tuple(MODELS), default="step")
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.size, args.steps, args.threads)))
        return 0
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        directory = Path(tmp)
        for size in args.only or MODELS:
            started = time.perf_counter()
            info = prepare(directory, size)
            steps = args.steps if size == "step" else args.memory_steps
            runs = run_rounds(directory, size, steps, args.rounds, args.threads)
            print(f"== {size} model, batch {BATCHES[size]} x {SEQ} tokens ({time.perf_counter() - started:.0f} s) ==")
            report_sizes(info)
            if size == "step":
                report_step_time(runs)
            report_memory(runs, info)
            report_losses(runs, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
