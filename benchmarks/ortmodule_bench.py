"""ORTModule against PyTorch eager and torch.compile on CPU training steps.

    python benchmarks/ortmodule_bench.py                       # everything (a few minutes)
    python benchmarks/ortmodule_bench.py --workloads bert --modes eager ortmodule --steps 30
    python benchmarks/ortmodule_bench.py --modes eager-bf16 compile-bf16 ortmodule-bf16   # torch.autocast bf16

Each (workload, mode) runs in its own process, one after another, so that peak RSS and first-step times
are not polluted by the others. A step is forward + backward + AdamW step, float32, 2 threads. Printed:
first-step time (export / compilation included), median and min step time after warm-up, the ratio of
median step times to eager and to torch.compile (>1 means faster than it), and peak RSS. With bf16 modes, the
issue 17 targets' rows follow, under a line naming the AdamW each side ran (``--optimizer``); a target is
decided by a run in which every side runs the same AdamW kernel (``--optimizer adamw`` or ``fused``; the verdict
names which), never by ``ort``, where ORTModule's optimizer differs from eager's.

``--rounds N`` (N > 1) runs each workload's modes N times in turn (mode A, B, C, then A, B, C again, each in its
own process), prints each round's medians and ratios as it ends (with the 1-minute load average as each of its
processes ended), then each mode's per-round medians and each
ratio's per-round values with their median, and the targets' rows decided by the median of the per-round ratios
(with how many rounds met them): eager's own median moves 15-25% between quiet rounds, so one run's ratio is one
draw. N = 1 (the default) prints what it always did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from ondevice_bench import peak_rss_mb  # VmHWM: ru_maxrss would count the driver's RSS (inherited across exec)

WORKLOADS = ("mlp", "bert", "gpt2", "llama", "resnet")
DEFAULT_WORKLOADS = ("mlp", "bert", "gpt2")  # the issue's; llama and resnet on request (no target)
MODES = ("eager", "compile", "ortmodule")
# The same under torch.autocast("cpu", dtype=torch.bfloat16); ORTModule runs it on OpenVINO's bf16
# (onnxtrain.runtime.backends). Their ratios are against eager-bf16 and compile-bf16.
BF16_MODES = tuple(f"{m}-bf16" for m in MODES)
DESCRIPTIONS = {
    "mlp": "MLP 784-1024-1024-10, ReLU, batch 128",
    "bert": "BertForSequenceClassification hidden 256, 4 layers, 4 heads, seq 128, batch 8",
    "gpt2": "GPT2LMHeadModel n_embd 256, 4 layers, 4 heads, seq 128, batch 4",
    "llama": "LlamaForCausalLM hidden 256, 4 layers, 4 heads (2 KV), MLP 1024, vocab 32000, seq 128, batch 4, "
             "default config (use_cache on)",
    "resnet": "ResNetForImageClassification ResNet-18 layout (basic blocks 2-2-2-2, 64-512 channels), 10 classes, "
              "3x64x64 images, batch 16",
}


# -- workloads (random weights, synthetic data) -------------------------------------------------
def make_workload(name: str, scale: int = 1, dropout: float = 0.0):
    """The workload's model and loss function; ``scale`` multiplies the batch; ``dropout``: BERT's and GPT-2's
    dropout probabilities (0 by default, as the timings in BENCHMARKS.md were taken)."""
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))

        def loss_fn(m):
            return torch.nn.functional.cross_entropy(m(x), y)

        return model, loss_fn
    if name == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                            vocab_size=30522, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model = BertForSequenceClassification(config)
        ids = torch.randint(0, 30522, (8 * scale, 128))
        mask = torch.ones(8 * scale, 128, dtype=torch.int64)
        labels = torch.randint(0, 2, (8 * scale,))
        return model, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=50257, use_cache=False,
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 50257, (4 * scale, 128))
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 32000, (4, 128))
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    if name == "resnet":
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                              layer_type="basic", num_labels=10)
        model = ResNetForImageClassification(config)
        images, labels = torch.randn(16 * scale, 3, 64, 64), torch.randint(0, 10, (16 * scale,))
        return model, lambda m: m(pixel_values=images, labels=labels).loss
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def wrap(model, mode: str):
    import torch

    mode = mode.removesuffix("-bf16")
    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model)
    if mode == "ortmodule":
        from onnxtrain import ORTModule

        return ORTModule(model)
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


OPTIMIZERS = ("adamw", "fused", "ort")


def make_optimizer(params, mode: str, kind: str):
    """AdamW (lr 1e-4). ``kind="fused"``: torch's one-pass kernel for eager and compile, onnxtrain's
    FusedAdam (which uses the same kernel) for ORTModule, so no side gets an optimizer the other lacks.
    ``kind="ort"``: ONNX Runtime Training's users' setup, ORTModule with FusedAdam and eager and compile
    with ``torch.optim.AdamW`` as in "adamw"; its ratios mix the optimizers' speed into ORTModule's."""
    import torch

    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; choose from {OPTIMIZERS}")
    if kind == "adamw" or (kind == "ort" and not mode.startswith("ortmodule")):
        return torch.optim.AdamW(params, lr=1e-4)
    if mode.startswith("ortmodule"):
        from onnxtrain.optim import FusedAdam

        return FusedAdam(params, lr=1e-4, eps=1e-8, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def worker(workload: str, mode: str, steps: int, warmup: int, threads: int, optimizer_kind: str = "adamw",
           min_seconds: float = 0.0, dropout: float = 0.0) -> dict:
    import torch

    torch.set_num_threads(threads)
    model, loss_fn = make_workload(workload, dropout=dropout)
    model.train()
    runner = wrap(model, mode)
    optimizer = make_optimizer(model.parameters(), mode, optimizer_kind)
    bf16 = mode.endswith("-bf16")

    def step():
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(runner)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start, loss.item()

    first, first_loss = step()
    for _ in range(warmup):
        step()
    times: list[float] = []
    while len(times) < steps or sum(times) < min_seconds:  # short steps: more samples for a stable median
        times.append(step()[0])
    if mode.startswith("ortmodule") and runner.fallback_reason is not None:
        raise RuntimeError(f"ORTModule fell back to PyTorch: {runner.fallback_reason}")
    ran = sorted({(g.backend, g.precision) for entries in runner._cache.values() for g in entries}) \
        if mode.startswith("ortmodule") else []
    peak = peak_rss_mb()
    return {"workload": workload, "mode": mode, "optimizer": optimizer_kind, "first_s": first, "median_s": statistics.median(times),
            "min_s": min(times), "peak_rss_mb": peak, "first_loss": first_loss, "steps": len(times),
            "times": times, "ran": ran, "load": os.getloadavg()[0]}  # the 1-minute load average as it ended


# -- driver ---------------------------------------------------------------------------------------
def run_one(workload: str, mode: str, args) -> dict:
    command = [sys.executable, __file__, "--worker", workload, mode, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--threads", str(args.threads),
               "--optimizer", getattr(args, "optimizer", "adamw"),
               "--min-seconds", str(getattr(args, "min_seconds", 0.0)), "--dropout", str(getattr(args, "dropout", 0.0))]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"workload": workload, "mode": mode, "error": " | ".join(tail)}
    return json.loads(lines[-1])


def ratios(r: dict, by_key: dict) -> tuple[str, str]:
    """``r``'s speed against eager and torch.compile of its workload, as printed ("-" where not run)."""
    suffix = "-bf16" if r["mode"].endswith("-bf16") else ""
    eager = by_key.get((r["workload"], "eager" + suffix), {}).get("median_s")
    compiled = by_key.get((r["workload"], "compile" + suffix), {}).get("median_s")
    return (f"{eager / r['median_s']:.2f}x" if eager else "-",
            f"{compiled / r['median_s']:.2f}x" if compiled else "-")


def report(results: list[dict]) -> None:
    by_key = {(r["workload"], r["mode"]): r for r in results}
    header = f"{'workload':9} {'mode':14} {'first step':>11} {'median':>9} {'min':>9} {'vs eager':>9} " \
             f"{'vs compile':>10} {'peak RSS':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['workload']:9} {r['mode']:14} failed: {r['error']}")
            continue
        vs_eager, vs_compile = ratios(r, by_key)
        print(f"{r['workload']:9} {r['mode']:14} {r['first_s']:10.2f}s {r['median_s'] * 1e3:7.1f}ms "
              f"{r['min_s'] * 1e3:7.1f}ms {vs_eager:>9} {vs_compile:>10} {r['peak_rss_mb']:7.0f}MB")
    print("\nratios: eager (or compile) median step time / this median step time; >1 is faster (bf16 rows: "
          "against eager-bf16 and compile-bf16)")
    report_targets(by_key)


# Issue 17's bf16 targets: ORTModule under torch.autocast bf16 against eager and torch.compile under it.
BF16_TARGETS = {("mlp", "eager-bf16"): 1.3, ("bert", "eager-bf16"): 1.4, ("bert", "compile-bf16"): 1.2,
                ("gpt2", "eager-bf16"): 1.4, ("gpt2", "compile-bf16"): 1.2}
# The --optimizer settings that decide a target: those where every side runs the same AdamW kernel. "adamw" is
# torch's default (on CPU tensors its single-tensor loop: torch takes foreach only on CUDA), what a user gets;
# "fused" is eager's fastest (the one-pass kernel: the MLP's step at one thread 5.4-5.7 ms CPU against 11.5 with
# the default) and ORTModule's FusedAdam runs that kernel too. One rule
# for every workload: a target is reported under each setting it was run with (docs/precision.md).
SAME_OPTIMIZER = ("adamw", "fused")
# What each side ran under each --optimizer (make_optimizer): (eager and compile, ORTModule).
OPTIMIZER_SIDES = {
    "adamw": ("torch.optim.AdamW (torch's default: the single-tensor loop on CPU)", "the same"),
    "fused": ("torch.optim.AdamW(fused=True)", "onnxtrain.optim.FusedAdam (the same one-pass kernel)"),
    "ort": ("torch.optim.AdamW (torch's default)", "onnxtrain.optim.FusedAdam"),
}


def _verdict(ratio: float, target: float, optimizer: str, by: str = "") -> str:
    """Whether ``ratio`` meets ``target`` under ``--optimizer optimizer``: "met" or "NOT met" (``by`` after it,
    e.g. " by the median") with the setting, or that the run decides nothing, its optimizers not being the same
    on both sides (:data:`SAME_OPTIMIZER`)."""
    if optimizer not in SAME_OPTIMIZER:  # the optimizers differ (or the rounds mixed them): printed, decides nothing
        return "(decides nothing: ORTModule's optimizer is not eager's)"
    return f"{'met' if ratio >= target else 'NOT met'}{by} (--optimizer {optimizer})"


def target_rows(by_key: dict) -> list[str]:
    """One row per bf16 target whose two runs are present: the ratio, the target and whether it is met, or why
    this run does not decide it (its optimizers are not the ones the target is judged under)."""
    rows = []
    for (workload, against), target in BF16_TARGETS.items():
        ours, theirs = by_key.get((workload, "ortmodule-bf16"), {}), by_key.get((workload, against), {})
        if "median_s" not in ours or "median_s" not in theirs:
            continue
        ratio = theirs["median_s"] / ours["median_s"]
        note = ("" if ours.get("ran") == [["openvino", "bf16"]]
                else "  (OpenVINO at f32, products bf16 but attention's: eager's attention was float32)"
                if ours.get("ran") == [["openvino", "bf16-products"]]
                else f"  (ORTModule ran {ours.get('ran')}, not OpenVINO bf16)")
        verdict = _verdict(ratio, target, ours.get("optimizer", "adamw"))
        rows.append(f"{workload:9} ortmodule-bf16 vs {against:13} {ratio:6.2f}x  target >= {target}x  {verdict}{note}")
    return rows


def report_targets(by_key: dict) -> None:
    """The bf16 targets' rows (:func:`target_rows`), under a line naming the optimizer each side ran."""
    rows = target_rows(by_key)
    if rows:
        kinds = sorted({r.get("optimizer", "adamw") for r in by_key.values() if "median_s" in r})
        sides = "; ".join(f"--optimizer {k}: eager and compile on {OPTIMIZER_SIDES[k][0]}, ORTModule on "
                          f"{OPTIMIZER_SIDES[k][1]}" for k in kinds)
        print(f"\nbf16 targets (issue 17; {sides}):")
        print("\n".join(rows))


def round_ratios(rounds: list[dict]) -> dict:
    """Per-round ratios: {(workload, mode, "eager" or "compile"): [ratio of each round where both ran]}; ``rounds``
    holds one ``by_key`` (``{(workload, mode): result}``) per round."""
    out: dict = {}
    for by_key in rounds:
        for (workload, mode), r in by_key.items():
            if "median_s" not in r:
                continue
            suffix = "-bf16" if mode.endswith("-bf16") else ""
            for against in ("eager", "compile"):
                other = by_key.get((workload, against + suffix), {})
                if "median_s" in other and against + suffix != mode:
                    out.setdefault((workload, mode, against), []).append(other["median_s"] / r["median_s"])
    return out


def rounds_summary(rounds: list[dict]) -> list[str]:
    """The lines printed after N rounds: each mode's per-round medians (ms) and their median, each ratio's
    per-round values and their median, then the bf16 targets decided by the median of the per-round ratios."""
    lines, keys = [], []
    for by_key in rounds:
        keys += [k for k in by_key if k not in keys]
    per_ratio = round_ratios(rounds)
    lines.append(f"{'workload':9} {'mode':14} per-round medians (ms) -> median; ratios per round -> median")
    for workload, mode in keys:
        medians = [b[(workload, mode)]["median_s"] * 1e3 for b in rounds if "median_s" in b.get((workload, mode), {})]
        if not medians:
            lines.append(f"{workload:9} {mode:14} failed in every round")
            continue
        text = f"{workload:9} {mode:14} {' '.join(f'{m:.1f}' for m in medians)} -> {statistics.median(medians):.1f}"
        for against in ("eager", "compile"):
            values = per_ratio.get((workload, mode, against))
            if values:
                text += f"; vs {against} {' '.join(f'{v:.2f}' for v in values)} -> {statistics.median(values):.2f}x"
        lines.append(text)
    targets = []
    for (workload, against), target in BF16_TARGETS.items():
        values = per_ratio.get((workload, "ortmodule-bf16", against.removesuffix("-bf16")))
        if not values:
            continue
        ran = {b[(workload, "ortmodule-bf16")].get("optimizer", "adamw") for b in rounds
               if "median_s" in b.get((workload, "ortmodule-bf16"), {})}
        ran_kind = ran.pop() if len(ran) == 1 else "mixed"
        middle, met = statistics.median(values), sum(v >= target for v in values)
        verdict = _verdict(middle, target, ran_kind, " by the median") + \
            (f"; met in {met} of {len(values)} rounds" if ran_kind in SAME_OPTIMIZER else "")
        targets.append(f"{workload:9} ortmodule-bf16 vs {against:13} median {middle:5.2f}x of "
                       f"{' '.join(f'{v:.2f}' for v in values)}  target >= {target}x  {verdict}")
    if targets:
        lines.append(f"\nbf16 targets over {len(rounds)} rounds (issue 17; the median of the per-round ratios):")
        lines += targets
    return lines


def run_rounds(args) -> list[dict]:
    """``--rounds N``: each workload's modes N times in turn, each round's medians and ratios printed as it ends;
    returns one ``by_key`` per round (all workloads)."""
    rounds: list[dict] = [{} for _ in range(args.rounds)]
    for workload in args.workloads:
        print(f"# {workload}: {DESCRIPTIONS[workload]}", file=sys.stderr)
        for k in range(args.rounds):
            results = [run_one(workload, mode, args) for mode in args.modes]
            by_key = {(r["workload"], r["mode"]): r for r in results}
            rounds[k].update(by_key)
            cells = []
            for r in results:
                if "error" in r:
                    cells.append(f"{r['mode']} failed: {r['error']}")
                    continue
                against = [f"{v} {name}" for v, name in zip(ratios(r, by_key), ("eager", "compile"))
                           if v != "-" and not r["mode"].startswith(name)]
                cells.append(f"{r['mode']} {r['median_s'] * 1e3:.1f}ms" + (f" ({', '.join(against)})" if against else ""))
            loads = [r["load"] for r in results if "load" in r]
            load = f" [load average {min(loads):.1f}-{max(loads):.1f}]" if loads else ""
            print(f"round {k + 1} {workload}: " + "; ".join(cells) + load, flush=True)
    print()
    print("\n".join(rounds_summary(rounds)))
    return rounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + BF16_MODES)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up (at least 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="adamw: torch.optim.AdamW (torch's default: its single-tensor loop on CPU) everywhere; fused: one-pass AdamW kernels "
                             "everywhere (eager's fastest AdamW); both decide the targets; ort: "
                             "onnxtrain.optim.FusedAdam for ORTModule only, as ONNX Runtime Training's users ran "
                             "it (decides no target)")
    parser.add_argument("--min-seconds", type=float, default=2.0,
                        help="time more steps than --steps until they add up to this many seconds")
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="BERT's and GPT-2's dropout probabilities (their configurations' default is 0.1)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each workload's modes this many times in turn and report each round's ratios "
                             "and the median of the per-round ratios (1: one run, the table as before)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.warmup, args.threads, args.optimizer,
                                args.min_seconds, args.dropout)))
        return 0
    if args.steps < 20:
        parser.error("--steps must be at least 20")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.rounds > 1:
        rounds = run_rounds(args)
        if args.json:
            write_json(args.json, [dict(r, round=k + 1) for k, by_key in enumerate(rounds) for r in by_key.values()])
        return 0
    results = []
    for workload in args.workloads:
        print(f"# {workload}: {DESCRIPTIONS[workload]}", file=sys.stderr)
        for mode in args.modes:
            results.append(run_one(workload, mode, args))
            print(f"  {mode}: done", file=sys.stderr)
    report(results)
    if args.json:
        write_json(args.json, results)
    return 0


def write_json(path: str, results: list[dict]) -> None:
    """``results`` to ``path``, atomically (a temporary file beside it, then renamed)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
