"""A LoRA training step: onnxtrain's LoRA artifacts (float32 and int8 base) against PEFT + PyTorch eager.

A step is forward + backward + AdamW on the adapters only, on a Llama-style causal LM from a config
(random weights; hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 688, vocab 8192: about 7.1M
parameters), LoRA r=8 (alpha 16) on q_proj and v_proj, batch 4 x 64 tokens. Each variant runs in a
fresh process (its peak RSS is its own), the variants in turn for ``--rounds`` rounds; the parent
exports the model once and prints medians, ratios, artifact sizes and the loss curves' distance.

    python benchmarks/lora_bench.py [--steps 20] [--rounds 2] [--threads 2]
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
VARIANTS = ("peft_eager", "ondevice_float32", "ondevice_int8")


def build_peft_model():
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
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


def batches(steps: int):
    import numpy as np

    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(steps):
        start, stride = rng.integers(0, VOCAB, (BATCH, 1)), rng.integers(1, 4, (BATCH, 1))
        seq = (start + stride * np.arange(SEQ + 1)) % VOCAB
        out.append((seq[:, :-1].astype(np.int64), seq[:, 1:].astype(np.int64)))
    return out


def worker(variant: str, directory: Path, steps: int, threads: int) -> dict:
    data = batches(steps)
    times, losses = [], []
    if variant == "peft_eager":
        import torch

        torch.set_num_threads(threads)
        model = build_peft_model().train()
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
        d = directory / variant.removeprefix("ondevice_")
        state = CheckpointState.load_checkpoint(d / "checkpoint")
        module = Module(d / "training_model.onnx", state, session_options=options)
        optimizer = Optimizer(d / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(LR)
        for x, y in data:
            t = time.perf_counter()
            loss = module(x, y)
            optimizer.step()
            module.lazy_reset_grad()
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
    return {"median_ms": 1e3 * statistics.median(times[1:]), "first_ms": 1e3 * times[0], "losses": losses,
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that over exec, so a
    worker started by the parent would report the parent's peak if higher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prepare(directory: Path) -> dict:
    import torch

    from onnxtrain.ondevice.lora import generate_lora_artifacts

    model = build_peft_model().eval()
    x, y = (torch.from_numpy(a) for a in batches(1)[0])
    path = directory / "model.onnx"
    program = torch.onnx.export(copy.deepcopy(model), (x, y), dynamo=True, input_names=["input_ids", "labels"],
                                output_names=["loss"], optimize=False, verbose=False,
                                dynamic_shapes=({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}))
    program.save(str(path))
    sizes = {}
    for base in ("float32", "int8"):
        out = directory / base
        generate_lora_artifacts(path, base=base, loss=None, optimizer="adamw", artifact_directory=out)
        sizes[base] = {f.name: f.stat().st_size for f in out.iterdir()}
    counts = {"all": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    return {"sizes": sizes, "parameters": counts}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.steps, args.threads)))
        return 0
    directory = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    info = prepare(directory)
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--worker", v, "--dir", str(directory), "--steps",
                                  str(args.steps), "--threads", str(args.threads)], capture_output=True, text=True,
                                 check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"parameters: {info['parameters']['all']:,} ({info['parameters']['trainable']:,} trainable: adapters)")
    for base, files in info["sizes"].items():
        print(f"artifacts, {base} base: {sum(files.values()) / 2**20:.2f} MiB "
              f"({', '.join(f'{k} {v / 2**20:.2f}' for k, v in sorted(files.items()))})")
    ratio = sum(info["sizes"]["float32"].values()) / sum(info["sizes"]["int8"].values())
    print(f"size float32 / int8: {ratio:.2f}x")
    med = {v: statistics.median(r["median_ms"] for r in runs[v]) for v in VARIANTS}
    rss = {v: statistics.median(r["peak_rss_mb"] for r in runs[v]) for v in VARIANTS}
    for v in VARIANTS:
        print(f"{v:18s} step {med[v]:7.1f} ms (per round {[round(r['median_ms'], 1) for r in runs[v]]}), "
              f"first {runs[v][0]['first_ms']:.0f} ms, peak RSS {rss[v]:.0f} MB")
    print(f"speed vs PEFT eager: float32 {med['peft_eager'] / med['ondevice_float32']:.2f}x, "
          f"int8 {med['peft_eager'] / med['ondevice_int8']:.2f}x; "
          f"peak RSS float32 / int8 {rss['ondevice_float32'] / rss['ondevice_int8']:.2f}x")
    ref, f32, i8 = (runs[v][0]["losses"] for v in VARIANTS)
    rel = lambda a, b: max(abs(p - q) / abs(q) for p, q in zip(a, b))  # noqa: E731
    print(f"losses over {args.steps} steps: float32 vs PEFT max rel {rel(f32, ref):.2e}; "
          f"int8 vs float32 max rel {rel(i8, f32):.2e}; PEFT {ref[0]:.4f} -> {ref[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
