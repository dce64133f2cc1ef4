"""Dropout on onnxruntime: masks drawn by torch (the default) against onnxruntime's own ``Dropout``.

Two ORTModules of the same BERT (dropout 0.1, onnxruntime, float32) in one process, one exported with
``ONNXTRAIN_TORCH_DROPOUT=0`` (the graphs keep ``Dropout``, seeded from torch's generator), one with the masks as
graph inputs drawn by ``bernoulli_`` (passes/dropout_masks.py); their training steps (forward, backward, AdamW)
alternate, so that both see the same load. Prints the median step time of each, over ``--steps`` steps after
``--warmup``, the ratio (torch masks / onnxruntime's: below 1 is faster), and eager's median for scale.

    python benchmarks/dropout_masks.py [--model small|base2] [--steps 20]

``small``: ortmodule_bench.py's BERT (hidden 256, 4 layers, batch 8, sequence 128); ``base2``: the default
BertConfig with 2 layers, batch 16, sequence 128 (hf_first_run.py's model).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch


def model_and_batch(name: str):
    from transformers import BertConfig, BertForSequenceClassification

    if name == "small":
        config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
        batch = 8
    else:
        config = BertConfig(num_hidden_layers=2)
        batch = 16
    model = BertForSequenceClassification(config)  # dropout 0.1, the configuration's default
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, config.vocab_size, (batch, 128), generator=g),
              "attention_mask": torch.ones(batch, 128, dtype=torch.int64),
              "labels": torch.randint(0, 2, (batch,), generator=g)}
    return model, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "base2"], default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    from onnxtrain import ORTModule

    torch.manual_seed(0)
    base, inputs = model_and_batch(opts.model)
    runners = {}
    for name, flag in (("onnxruntime Dropout", "0"), ("torch masks", "1"), ("eager", None)):
        model = copy.deepcopy(base).train()
        runner = model if flag is None else ORTModule(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        runners[name] = (runner, optimizer, flag)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(opts.warmup + opts.steps):
        for name, (runner, optimizer, flag) in runners.items():
            if flag is not None:
                os.environ["ONNXTRAIN_TORCH_DROPOUT"] = flag  # read when the graphs are built (the first step)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            runner(**inputs).loss.backward()
            optimizer.step()
            if step >= opts.warmup:
                times[name].append(time.perf_counter() - start)
    for name, (runner, _, flag) in runners.items():
        if flag is not None:
            masks = [len(g.masks) for entries in runner._cache.values() for g in entries]
            assert (masks[0] > 0) == (flag == "1"), (name, masks)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:20s} median {median:8.1f} ms  min {min(times[name]) * 1e3:8.1f} ms")
    print(f"torch masks / onnxruntime Dropout: {medians['torch masks'] / medians['onnxruntime Dropout']:.3f}")


if __name__ == "__main__":
    main()
