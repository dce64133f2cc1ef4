"""A new user's first run beyond BERT: ORTTrainer(bf16=True) against Trainer(bf16=True) per model family.

For each family the script does what a user switching ``Trainer`` to ``ORTTrainer`` does: the model class built
from its configuration's defaults (dropout as the config's, attention ``sdpa`` where the model has it: GPT-2
``eager``) with 2 layers and random weights, synthetic data, ``TrainingArguments(bf16=True, use_cpu=True)``,
AdamW, the same seed. Each (family, trainer) runs in a process of its own, Trainer then ORTTrainer per family,
``--repeats`` times in turn. Printed per family: the median step time over the steps after ``--warmup`` (each
step timed from ``on_step_begin`` to ``on_step_end``: forward, backward, optimizer) of each trainer, ORTTrainer's
speed as a multiple of Trainer's (above 1: faster), the first step's time (ORTTrainer's includes the export),
where ORTModule ran (``openvino/bf16``, ``openvino/products_bf16``, or ``fallback``: with the reason's first line)
and the largest difference between the two trainers' losses over the steps (the dropout masks are eager's:
passes/dropout_masks.py).

Widths: the configuration's default hidden size where a 2-core CPU runs a step in about a second or less (BERT-like
768 at batch 8 x 128, ViT 768 at 8 images of 224x224, BART 1024 and T5 512 at 4 x 64). The decoder LMs' defaults
(hidden 4096: 7B models) do not fit: two layers of them are 0.4-0.7 billion parameters, seconds a step for the
optimizer alone. They run at the width of the small members of each family that people fine-tune on one machine
(``FAMILIES``: hidden 1024, Qwen2-0.5B's layout for Qwen2), the configuration's other defaults (vocabulary, rope,
key/value heads in proportion) kept, at batch 2 x 64 (Llama at 4 x 128 took 2.4 s a Trainer step). The optimizer is
Trainer's default (``adamw_torch_fused``) on both sides.

    python benchmarks/hf_families_bf16.py [--families llama mistral ...] [--attn eager] [--steps 20] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

#: family -> (model class, configuration class, configuration keywords besides 2 layers, inputs: batch, sequence)
FAMILIES = {
    # TinyLlama-1.1B's head layout at a quarter of its width (hidden 2048 is ~1.3 s a step here)
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4), (2, 64)),
    # Mistral's 32 heads over 8 key/value heads in proportion, at Llama's width above
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=4),
                (2, 64)),
    # Qwen2-0.5B's layout (hidden 896, 14 heads over 2, tied embeddings), its 151936-token vocabulary
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                   tie_word_embeddings=True), (2, 64)),
    "roberta": ("RobertaForSequenceClassification", "RobertaConfig", dict(num_labels=2), (8, 128)),
    "distilbert": ("DistilBertForSequenceClassification", "DistilBertConfig", dict(num_labels=2), (8, 128)),
    "bert": ("BertForSequenceClassification", "BertConfig", dict(num_labels=2), (8, 128)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(attn_implementation="eager"), (4, 128)),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(num_labels=10), (8, 0)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(), (4, 64)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(decoder_start_token_id=0), (4, 64)),  # as t5-small
}
DEFAULT = ["llama", "mistral", "roberta", "distilbert", "gpt2", "vit", "bart", "t5"]

#: configuration keyword that sets the number of layers, per configuration class (default: num_hidden_layers)
LAYER_KEYS = {"DistilBertConfig": ("n_layers",), "GPT2Config": ("n_layer",), "T5Config": ("num_layers",),
              "BartConfig": ("encoder_layers", "decoder_layers")}


def build(family: str, layers: int, attn: str | None = None):
    """(model, its configuration) for ``family``, seeded; ``attn``: the ``attn_implementation`` (default: the
    family's)."""
    import torch
    import transformers

    model_class, config_class, kwargs, _ = FAMILIES[family]
    keys = LAYER_KEYS.get(config_class, ("num_hidden_layers",))
    kwargs = dict(kwargs, **({"attn_implementation": attn} if attn else {}))
    config = getattr(transformers, config_class)(**kwargs, **{key: layers for key in keys})
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config), config


def dataset(family: str, config, rows: int) -> list[dict]:
    import torch

    model_class, _, _, (_, seq) = FAMILIES[family]
    g = torch.Generator().manual_seed(1)
    if "ImageClassification" in model_class:
        return [{"pixel_values": torch.randn(3, config.image_size, config.image_size, generator=g),
                 "labels": torch.randint(0, config.num_labels, (), generator=g)} for _ in range(rows)]
    data = []
    for _ in range(rows):
        row = {"input_ids": torch.randint(0, config.vocab_size, (seq,), generator=g),
               "attention_mask": torch.ones(seq, dtype=torch.long)}
        if "SequenceClassification" in model_class:
            row["labels"] = torch.randint(0, config.num_labels, (), generator=g)
        else:  # causal LMs shift the labels themselves; seq2seq models make the decoder's inputs from them
            row["labels"] = torch.randint(0, config.vocab_size, (seq,), generator=g)
        data.append(row)
    return data


def run(trainer_kind: str, family: str, steps: int, layers: int, attn: str | None = None) -> dict:
    model, config = build(family, layers, attn)
    batch = FAMILIES[family][3][0]
    return timed_training(trainer_kind, model, dataset(family, config, steps * batch), batch, steps)


def timed_training(trainer_kind: str, model, data: list[dict], batch: int, steps: int) -> dict:
    """Train ``model`` ``steps`` steps on ``data`` with Trainer (``"hf"``) or ORTTrainer (``"ort"``), bf16 on the
    CPU: {"times": each step's seconds, "losses", "fallback": ORTModule's reason's first line or None, "ran": the
    graphs' backend/precision, "notes": ORTModule's and OpenVINO's warnings, "parameters"}."""
    import transformers

    from onnxtrain.hf import ORTTrainer, ORTTrainingArguments

    times, losses = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    base = ORTTrainer if trainer_kind == "ort" else transformers.Trainer
    args_class = ORTTrainingArguments if trainer_kind == "ort" else transformers.TrainingArguments

    class Recording(base):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    with tempfile.TemporaryDirectory() as output_dir, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = args_class(output_dir=output_dir, bf16=True, use_cpu=True, per_device_train_batch_size=batch,
                          max_steps=steps, learning_rate=5e-5, report_to=[], save_strategy="no",
                          logging_strategy="no", seed=0, disable_tqdm=True)
        trainer = Recording(model=model, args=args, train_dataset=data, callbacks=[Clock()])
        trainer.train()
    wrapped = getattr(trainer, "model_wrapped", None)
    reason = getattr(wrapped, "fallback_reason", None)
    ran = sorted({f"{g.backend}/{g.precision}" for entries in getattr(wrapped, "_cache", {}).values()
                  for g in entries})
    notes = sorted({str(w.message).splitlines()[0][:160] for w in caught if "ORTModule" in str(w.message)
                    or "OpenVINO" in str(w.message)})
    return {"times": times, "losses": losses, "fallback": reason and reason.splitlines()[0][:300], "ran": ran,
            "notes": notes, "parameters": sum(p.numel() for p in model.parameters())}


def where(result: dict, width: int = 300) -> str:
    """Where ORTModule ran: its graphs' backend/precision, or the fallback's reason (its first ``width``
    characters)."""
    if result["fallback"]:
        return f"fallback: {result['fallback'][:width]}"
    return ", ".join(result["ran"]) or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=DEFAULT, choices=sorted(FAMILIES))
    parser.add_argument("--steps", type=int, default=20, help="steps timed after --warmup")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median (the export)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--attn", choices=["eager", "sdpa"], help="every family's attn_implementation (default: "
                        "the family's; eager is what the sdpa-with-dropout fallback's reason suggests)")
    parser.add_argument("--trainers", nargs="+", default=["hf", "ort"], choices=["hf", "ort"])
    parser.add_argument("--child", nargs=2, metavar=("TRAINER", "FAMILY"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    total = opts.steps + opts.warmup
    if opts.child:
        print("RESULT " + json.dumps(run(opts.child[0], opts.child[1], total, opts.layers, opts.attn)))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(opts.repeats):
        for family in opts.families:
            for kind in opts.trainers:
                out = subprocess.run([sys.executable, __file__, "--child", kind, family, "--steps", str(opts.steps),
                                      "--warmup", str(opts.warmup), "--layers", str(opts.layers)]
                                     + (["--attn", opts.attn] if opts.attn else []),
                                     capture_output=True, text=True, check=False)
                line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
                if line is None:
                    print(f"{family} {kind} failed:\n{out.stderr[-3000:]}", flush=True)
                    continue
                result = json.loads(line[len("RESULT "):])
                results.setdefault((kind, family), []).append(result)
                median = statistics.median(result["times"][opts.warmup:]) * 1e3
                print(f"{family:10s} {kind:3s} step {median:7.1f} ms  first {result['times'][0]:6.1f} s  "
                      f"{where(result) if kind == 'ort' else ''}", flush=True)
    print(f"\n{'family':10s} {'params':>7s} {'batch':>7s} {'Trainer':>9s} {'ORTTrainer':>10s} {'ratio':>6s} "
          f"{'first (s)':>11s} {'max |dloss|':>11s}  ORTModule")
    for family in opts.families:
        hf, ort = results.get(("hf", family)), results.get(("ort", family))
        if not (hf and ort):
            continue
        med = [statistics.median(statistics.median(r["times"][opts.warmup:]) for r in rs) * 1e3 for rs in (hf, ort)]
        worst = max(abs(a - b) for a, b in zip(hf[0]["losses"], ort[0]["losses"]))
        batch, seq = FAMILIES[family][3]
        shape = f"{batch}x{seq}" if seq else f"{batch}"
        print(f"{family:10s} {ort[0]['parameters'] / 1e6:6.0f}M {shape:>7s} {med[0]:7.1f}ms {med[1]:8.1f}ms "
              f"{med[0] / med[1]:5.2f}x {hf[0]['times'][0]:4.1f}/{ort[0]['times'][0]:5.1f} {worst:11.4f}  "
              f"{where(ort[0], 90)}")


if __name__ == "__main__":
    main()
