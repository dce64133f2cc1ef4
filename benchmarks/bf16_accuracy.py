"""bf16 accuracy over training (issue 17): BERT-small and GPT-2-small trained on a fixed synthetic task,
float32 against bf16, final losses compared (target: within 2% of the float32 run's).

    python benchmarks/bf16_accuracy.py                      # the issue's check: both models, 200 steps
    python benchmarks/bf16_accuracy.py --models bert --steps 20 --seq 32   # a short run

Variants, each from the same initial weights on the same batches (AdamW lr 5e-4):
- ``eager``: PyTorch float32, the reference;
- ``ortmodule-bf16``: ORTModule under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (OpenVINO bf16);
- ``ondevice-fp32`` / ``ondevice-bf16`` (BERT only): ``generate_artifacts(precision="fp32" | "bf16")`` trained
  by the on-device runtime (bf16: OpenVINO's bf16 hint).
The final loss is the mean of the last 10 steps' losses. Tasks: BERT classifies whether the second token
is in the lower half of the vocabulary; GPT-2 models arithmetic sequences of token ids. 16 fixed batches,
cycled. Models as BENCHMARKS.md (hidden 256, 4 layers, 4 heads; BERT batch 8, GPT-2 batch 4).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ondevice_bench import build_torch_model

TARGET = 0.02
LR = 5e-4


def make_model(name: str):
    import torch
    import transformers

    if name == "bert":  # the on-device benchmark's BERT-small, returning its logits
        return build_torch_model("bert")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=50257, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def make_batches(name: str, seq: int, count: int = 16) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(count):
        if name == "bert":
            ids = rng.integers(1, 30522, (8, seq)).astype(np.int64)
            batches.append((ids, np.ones_like(ids), (ids[:, 1] < 15261).astype(np.int64)))
        else:
            start, stride = rng.integers(0, 1000, (4, 1)), rng.integers(1, 8, (4, 1))
            batches.append(((start + stride * np.arange(seq)) % 1000,))
    return [tuple(a.astype(np.int64) for a in b) for b in batches]


def torch_loss(name: str, model, batch):
    import torch

    tensors = [torch.from_numpy(a) for a in batch]
    if name == "bert":
        return torch.nn.functional.cross_entropy(model(tensors[0], tensors[1]).float(), tensors[2])
    return model(input_ids=tensors[0], labels=tensors[0]).loss


def train_torch(name: str, model, batches, steps: int, bf16: bool, ortmodule: bool) -> list[float]:
    import torch

    from onnxtrain import ORTModule

    runner = ORTModule(model) if ortmodule else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = torch_loss(name, runner, batches[step % len(batches)])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if ortmodule:
        if runner.fallback_reason is not None:
            raise RuntimeError(f"ORTModule fell back to PyTorch: {runner.fallback_reason}")
        ran = sorted({(g.backend, g.precision) for entries in runner._cache.values() for g in entries})
        print(f"  ortmodule ran {ran}", file=sys.stderr)
    return losses


def train_ondevice(model, batches, steps: int, precision: str, d: Path) -> list[float]:
    import torch

    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module, Optimizer

    out = d / precision
    if not (d / "model.onnx").exists():
        example = tuple(torch.from_numpy(a) for a in batches[0][:2])
        program = torch.onnx.export(copy.deepcopy(model).eval(), example, dynamo=True,
                                    input_names=["input_ids", "attention_mask"], output_names=["logits"],
                                    dynamic_shapes=({0: "batch"}, {0: "batch"}), optimize=False)
        program.save(str(d / "model.onnx"))
    paths = artifacts.generate_artifacts(d / "model.onnx", requires_grad=[n for n, _ in model.named_parameters()],
                                         loss="crossentropy", optimizer=artifacts.AdamW(lr=LR),
                                         artifact_directory=out, precision=precision)
    module = Module(paths.training_model, CheckpointState.load_checkpoint(paths.checkpoint))
    print(f"  ondevice-{precision} ran {(module.backend, module.precision)}", file=sys.stderr)
    optimizer = Optimizer(paths.optimizer_model, module)
    losses = []
    for step in range(steps):
        losses.append(float(module(*batches[step % len(batches)])))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"steps={args.steps} seq={args.seq} threads={args.threads}; final loss = mean of the last 10 steps")
    print(f"{'model':6} {'variant':15} {'first loss':>10} {'final loss':>10} {'vs eager fp32':>14} {'minutes':>8}")
    met = True
    for name in args.models:
        base = make_model(name)
        batches = make_batches(name, args.seq)
        variants = ["eager", "ortmodule-bf16"] + (["ondevice-fp32", "ondevice-bf16"] if name == "bert" else [])
        finals = {}
        with tempfile.TemporaryDirectory(prefix="bf16_accuracy_") as tmp:
            for variant in variants:
                start = time.perf_counter()
                model = copy.deepcopy(base).train()
                if variant.startswith("ondevice"):
                    losses = train_ondevice(model, batches, args.steps, variant.split("-")[1], Path(tmp))
                else:
                    losses = train_torch(name, model, batches, args.steps, variant.endswith("bf16"),
                                         variant.startswith("ortmodule"))
                finals[variant] = statistics.fmean(losses[-10:])
                rel = abs(finals[variant] - finals["eager"]) / finals["eager"]
                verdict = "" if variant == "eager" else f"{rel * 100:5.2f}% " + (
                    ("met" if rel <= TARGET else "NOT met") if variant.endswith("bf16") else "(ref)")
                met &= variant == "eager" or not variant.endswith("bf16") or rel <= TARGET
                print(f"{name:6} {variant:15} {losses[0]:10.4f} {finals[variant]:10.4f} {verdict:>14} "
                      f"{(time.perf_counter() - start) / 60:8.1f}", flush=True)
    print(f"target: bf16 final loss within {TARGET * 100:.0f}% of eager float32's: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
