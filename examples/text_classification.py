"""Text classification with onnxtrain's ORTTrainer, timed against transformers.Trainer on the same data.

The ORTTrainer run is a plain Trainer script with two renames (see docs/hf.md):

    -from transformers import Trainer, TrainingArguments
    +from onnxtrain.hf import ORTTrainer, ORTTrainingArguments
    -training_args = TrainingArguments(output_dir="out", optim="adamw_torch", ...)
    +training_args = ORTTrainingArguments(output_dir="out", optim="adamw_ort_fused", ...)
    -trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, ...)
    +trainer = ORTTrainer(model=model, args=training_args, train_dataset=train_dataset,
    +                     feature="sequence-classification", ...)
     trainer.train()

Nothing is downloaded: the model is a BERT built from a config with random weights, and the data set is
synthetic (the sentiment word a sentence opens with is its label), tokenized by a small in-memory
word -> id map. Run:

    python examples/text_classification.py [--steps 30] [--hidden 64] [--layers 2] [--export-path model.onnx]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from onnxtrain.hf import ORTTrainer, ORTTrainingArguments

WORDS = ["the", "a", "model", "trains", "fast", "slow", "graph", "runtime", "onnx", "torch", "data", "loss",
         "good", "bad", "great", "awful", "step", "batch", "layer", "token"]
POSITIVE, NEGATIVE = ("good", "great"), ("bad", "awful")


def make_dataset(n: int, seq_len: int, seed: int) -> Dataset:
    """Random sentences opening with a sentiment word (the label), padded to seq_len, tokenized by a word map."""
    rng = np.random.default_rng(seed)
    vocab = {word: i + 2 for i, word in enumerate(WORDS)}  # 0 = [PAD], 1 = [CLS]
    filler = [w for w in WORDS if w not in POSITIVE + NEGATIVE]
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        label = int(rng.random() < 0.5)
        words = [str(rng.choice(POSITIVE if label else NEGATIVE))]
        words += list(rng.choice(filler, size=int(rng.integers(3, seq_len - 1))))
        ids = [1] + [vocab[w] for w in words]
        pad = seq_len - len(ids)
        rows["input_ids"].append(ids + [0] * pad)
        rows["attention_mask"].append([1] * len(ids) + [0] * pad)
        rows["labels"].append(label)
    return Dataset.from_dict(rows)


def make_model(hidden: int, layers: int) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 2, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=max(1, hidden // 32), intermediate_size=4 * hidden,
                        max_position_embeddings=128, num_labels=2)
    return BertForSequenceClassification(config)


class StepTimer(TrainerCallback):
    """Wall time at the end of each optimizer step, to measure the steady state after the first step."""

    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def accuracy(eval_prediction):
    return {"accuracy": float((eval_prediction.predictions.argmax(-1) == eval_prediction.label_ids).mean())}


def run(use_ort: bool, args, train_dataset, eval_dataset) -> dict:
    common = dict(output_dir=os.path.join(args.output_dir, "ort" if use_ort else "torch"), use_cpu=True,
                  max_steps=args.steps, per_device_train_batch_size=args.batch_size, learning_rate=3e-3,
                  logging_steps=max(1, args.steps // 5), save_strategy="no", report_to=[], seed=0)
    model = make_model(args.hidden, args.layers)
    if use_ort:
        training_args = ORTTrainingArguments(optim="adamw_ort_fused", **common)
        trainer = ORTTrainer(model=model, args=training_args, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, compute_metrics=accuracy, feature="sequence-classification")
    else:
        training_args = TrainingArguments(optim="adamw_torch", **common)
        trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                          eval_dataset=eval_dataset, compute_metrics=accuracy)
    timer = StepTimer()
    trainer.add_callback(timer)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    # Steps after the first: the first includes the ONNX export and session setup of ORTTrainer.
    steady = (len(timer.times) - 1) * args.batch_size / (timer.times[-1] - timer.times[0])
    logged = [e for e in trainer.state.log_history if "loss" in e]
    metrics = trainer.evaluate()
    if use_ort and args.export:
        path = trainer.export_onnx(args.export_path)  # outside the temporary output folder: it is kept
        print(f"exported the trained model for inference: {os.path.abspath(path)}")
    return {"train_seconds": total, "samples_per_second": steady,
            "first_loss": logged[0]["loss"], "last_loss": logged[-1]["loss"],
            "eval_accuracy": metrics["eval_accuracy"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (at least 2)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--output-dir", default=None,
                        help="the trainers' output folder (default: a temporary folder, deleted at the end)")
    parser.add_argument("--export-path", default="text_classification.onnx",
                        help="where ORTTrainer exports the trained model for inference (default: %(default)s)")
    parser.add_argument("--no-export", dest="export", action="store_false", help="skip the ONNX inference export")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        args.output_dir = args.output_dir or scratch
        train_dataset = make_dataset(args.samples, args.seq_len, seed=0)
        eval_dataset = make_dataset(64, args.seq_len, seed=1)
        results = {name: run(name == "ORTTrainer", args, train_dataset, eval_dataset)
                   for name in ("Trainer", "ORTTrainer")}
    print(f"\n{'':12}{'train s':>10}{'samples/s*':>12}{'first loss':>12}{'last loss':>11}{'eval acc':>10}")
    for name, r in results.items():
        print(f"{name:12}{r['train_seconds']:>10.2f}{r['samples_per_second']:>12.1f}{r['first_loss']:>12.4f}"
              f"{r['last_loss']:>11.4f}{r['eval_accuracy']:>10.3f}")
    steady = results["ORTTrainer"]["samples_per_second"] / results["Trainer"]["samples_per_second"]
    total = results["Trainer"]["train_seconds"] / results["ORTTrainer"]["train_seconds"]
    print(f"* after the first step. ORTTrainer speed relative to Trainer: {steady:.2f}x per step, "
          f"{total:.2f}x for the whole train() (ONNX export included)")


if __name__ == "__main__":
    main()
