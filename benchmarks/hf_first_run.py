"""A new user's first run: ORTTrainer(bf16=True) against Hugging Face Trainer(bf16=True) on a default BERT or GPT-2.

The script as a new user writes it: ``BertForSequenceClassification`` from ``BertConfig`` with its defaults
(dropout 0.1, attention ``sdpa`` unless ``--attn eager``) but 2 layers, random weights, synthetic token ids and
labels (``--model gpt2``: ``GPT2LMHeadModel`` from ``GPT2Config``'s defaults, hidden 768, dropouts 0.1, but 2
layers, its labels the token ids), ``TrainingArguments(bf16=True, use_cpu=True)``, batch 16, sequence 128, AdamW. Each (trainer, attention)
pair runs in a process of its own, the pairs in turn (``--repeats``), so that the trainers are compared in one
sitting. Printed per run: the median step time over the steps after ``--warmup`` (each step timed from
``on_step_begin`` to ``on_step_end``: forward, backward, optimizer), what ORTModule fell back with (if it did),
and the 20 losses; then per attention the medians, ORTTrainer's speed as a multiple of Trainer's (above 1:
faster) and the largest difference between the two trainers' losses, step by step from the same seed (the
dropout masks are eager's: passes/dropout_masks.py).

    python benchmarks/hf_first_run.py [--attn sdpa eager] [--steps 20] [--repeats 2] [--model bert|gpt2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def run(trainer_kind: str, attn: str, steps: int, batch: int, seq: int, layers: int, kind: str = "bert") -> dict:
    import torch
    import transformers

    from hf_families_bf16 import timed_training  # this directory: the same timing, losses and fallback read

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, use_cache=False, attn_implementation=attn)
        model = transformers.GPT2LMHeadModel(config)
        ids = [torch.randint(0, config.vocab_size, (seq,), generator=g) for _ in range(steps * batch)]
        data = [{"input_ids": x, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": x} for x in ids]
    else:
        config = transformers.BertConfig(num_hidden_layers=layers, num_labels=2, attn_implementation=attn)
        model = transformers.BertForSequenceClassification(config)
        data = [{"input_ids": torch.randint(0, config.vocab_size, (seq,), generator=g),
                 "attention_mask": torch.ones(seq, dtype=torch.long),
                 "labels": torch.randint(0, 2, (), generator=g)} for _ in range(steps * batch)]
    return timed_training(trainer_kind, model, data, batch, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attn", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median (the export)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model", default="bert", choices=["bert", "gpt2"])
    parser.add_argument("--child", nargs=2, metavar=("TRAINER", "ATTN"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        result = run(opts.child[0], opts.child[1], opts.steps, opts.batch, opts.seq, opts.layers, opts.model)
        print("RESULT " + json.dumps(result))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(opts.repeats):
        for attn in opts.attn:
            for kind in ("hf", "ort"):
                out = subprocess.run([sys.executable, __file__, "--child", kind, attn, "--steps", str(opts.steps),
                                      "--batch", str(opts.batch), "--seq", str(opts.seq), "--layers",
                                      str(opts.layers), "--model", opts.model], capture_output=True, text=True,
                                     check=False)
                line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{kind}/{attn} failed:\n{out.stderr[-3000:]}")
                result = json.loads(line[len("RESULT "):])
                results.setdefault((kind, attn), []).append(result)
                median = statistics.median(result["times"][opts.warmup:]) * 1e3
                print(f"{kind:3s} {attn:5s} step {median:7.1f} ms  fallback: {result['fallback']}  "
                      f"notes: {result['notes']}", flush=True)
    for attn in opts.attn:
        hf, ort = results[("hf", attn)], results[("ort", attn)]
        med = {k: statistics.median(statistics.median(r["times"][opts.warmup:]) for r in rs) * 1e3
               for k, rs in (("hf", hf), ("ort", ort))}
        worst = max(abs(a - b) for a, b in zip(hf[0]["losses"], ort[0]["losses"]))
        print(f"{attn}: Trainer bf16 {med['hf']:.1f} ms, ORTTrainer bf16 {med['ort']:.1f} ms "
              f"({med['hf'] / med['ort']:.2f}x); losses over {opts.steps} steps differ by at most {worst:.4f}")
        print(f"  Trainer losses    {[round(x, 4) for x in hf[0]['losses']]}")
        print(f"  ORTTrainer losses {[round(x, 4) for x in ort[0]['losses']]}")


if __name__ == "__main__":
    main()
