"""Train a small GPT-2 with ORTModule and with PyTorch eager, side by side.

    python examples/ortmodule_demo.py [--steps 20] [--threads 2]

Both runs start from the same random weights and see the same synthetic batches (a learnable pattern:
each sequence counts upward from a random start), so their losses agree step by step; the script shows
each run's progress, then prints the losses and the step times. No weights or data are downloaded.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from onnxtrain import ORTModule


def make_model() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batches(steps: int, batch: int = 8, seq: int = 64):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, 512, (batch, 1), generator=generator)
        yield (start + torch.arange(seq)) % 512


def train(model: torch.nn.Module, steps: int, label: str) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    with tqdm(total=steps, desc=label, unit="step", dynamic_ncols=True) as bar:
        for ids in batches(steps):
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
    return losses, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eager_model = make_model()
    ort_model = ORTModule(copy.deepcopy(eager_model))

    print(f"GPT-2 ({sum(p.numel() for p in eager_model.parameters()) / 1e6:.1f}M parameters), {args.steps} steps "
          f"of AdamW on {args.threads} threads", flush=True)
    eager_losses, eager_times = train(eager_model, args.steps, "PyTorch eager")
    print("ORTModule: the first step exports the model to ONNX and builds the training graphs (the longest "
          "step), later steps run in onnxruntime", flush=True)
    ort_losses, ort_times = train(ort_model, args.steps, "ORTModule    ")

    print(f"{'step':>4}  {'eager loss':>10}  {'ORTModule loss':>14}")
    for step in range(0, args.steps, 5):
        print(f"{step:4d}  {eager_losses[step]:10.4f}  {ort_losses[step]:14.4f}")
    print(f"{args.steps - 1:4d}  {eager_losses[-1]:10.4f}  {ort_losses[-1]:14.4f}")
    eager_step = statistics.median(eager_times[3:])
    ort_step = statistics.median(ort_times[3:])
    print(f"\nfirst step: eager {eager_times[0]:.2f}s, ORTModule {ort_times[0]:.2f}s (export + graph building)")
    print(f"median step: eager {eager_step * 1e3:.1f} ms, ORTModule {ort_step * 1e3:.1f} ms "
          f"({eager_step / ort_step:.2f}x eager speed)")
    if ort_model.fallback_reason:
        print(f"note: ORTModule fell back to PyTorch: {ort_model.fallback_reason}")


if __name__ == "__main__":
    main()
