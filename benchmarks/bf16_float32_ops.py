"""OpenVINO bf16 under ORTModule with and without the float32 loss region (issue 17): step time and gradient
error against float64, next to eager autocast bf16's, in one process with the variants alternating.

    python benchmarks/bf16_float32_ops.py                          # BERT-small and GPT-2-small, 10 rounds
    python benchmarks/bf16_float32_ops.py --workloads mlp --rounds 5
    python benchmarks/bf16_float32_ops.py --workloads mlp bert gpt2 ondevice-bert --variants loss sums --batches 4

Variants (``onnxtrain.runtime.openvino_float32`` policies, each an ORTModule under
``torch.autocast("cpu", dtype=torch.bfloat16)`` from the same weights on the same batch):
- ``none``: OpenVINO's bf16 hint as the plugin chooses (every op it reaches from a product in bfloat16);
- ``loss``: the loss and its gradient stay float32 (as autocast keeps them); the gradients' row sums are
  products (a ``MatMul`` by ones), which the plugin runs in bfloat16;
- ``sums``, the default: ``loss``, and the row sums (bias and LayerNorm gradients) stay ``ReduceSum``s, which
  the plugin runs in float32;
- ``all``: every op but the products stays float32 (row sums as ``sums``).
``ondevice-bert``: the on-device runtime instead (``benchmarks/ondevice_bench.py``'s BERT-small,
``generate_artifacts(precision="bf16")`` made under each variant's policy, a ``Module`` per variant; step =
forward + backward, no optimizer).
Gradient error: norm-relative, per parameter, against the float64 model, divided by eager autocast bf16's on
the same batch (parameters whose gradient is zero up to rounding, where autocast's error exceeds the gradient,
are left out: BERT's key biases); with ``--batches N`` each parameter's ratio is its median over N batches (one batch's ratio
moves as much as autocast's own error moves between batches, which is printed); the table prints the median
over the parameters and the worst parameter. Step: forward + backward, median over the
rounds (each round runs every variant once, in turn); the ratio is the median of each round's ratio to the
first variant's step (load that drifts between rounds cancels). Target (issue 17): error no worse than autocast's (ratio
<= 1 at the median; the worst is reported), at a step time within a few percent of ``none``'s.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import numpy as np
from ondevice_bench import build_torch_model, make_batch
from ortmodule_bench import make_workload

VARIANTS = ("none", "loss", "sums", "all")
# A parameter whose gradient autocast gets wrong by more than this (norm-relative) is left out of the ratios: its
# float64 gradient is zero up to rounding (BERT's key biases: softmax ignores a shift shared by every score).
NOISE = 1.0


class _Float64:
    """The model in float64, its float inputs cast to float64 (the MLP's batch is float32)."""

    def __init__(self, model):
        self.model = model.double()

    def __call__(self, *args, **kwargs):
        import torch

        cast = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return self.model(*cast, **{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                                    for k, v in kwargs.items()})

    def parameters(self):
        return self.model.parameters()

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def _grads(model) -> list:
    if isinstance(model, _OnDevice):
        return model.grads()
    return [None if p.grad is None else p.grad.double().numpy().copy() for p in model.parameters()]


def _step(model, loss_fn, bf16: bool):
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_fn(model)
    loss.backward()
    return loss


def _errors(grads, reference, names) -> dict[str, float]:
    out = {}
    for name, got, want in zip(names, grads, reference):
        if got is not None and want is not None and np.linalg.norm(want) > 0:
            out[name] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return out


def _extra_loss(workload: str, seed: int):
    """Another batch of the workload's shapes (seed >= 1; batch 0 is the workload's own): a loss function."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if workload == "mlp":
        x, y = torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)
        return lambda m: torch.nn.functional.cross_entropy(m(x), y)
    if workload == "bert":
        ids, labels = torch.randint(0, 30522, (8, 128), generator=g), torch.randint(0, 2, (8,), generator=g)
        mask = torch.ones(8, 128, dtype=torch.int64)
        return lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss
    ids = torch.randint(0, 50257, (4, 128), generator=g)
    return lambda m: m(input_ids=ids, labels=ids).loss


def run(workload: str, rounds: int, variants, batches: int = 1) -> None:
    from onnxtrain import ORTModule
    from onnxtrain.runtime.openvino_float32 import POLICY_ENV

    if workload == "ondevice-bert":
        base, loss_for, make = _ondevice("bert")
        rng = np.random.default_rng(1)
        extra = [(ids := rng.integers(1, 30522, (8, 128)).astype(np.int64), np.ones_like(ids),
                  rng.integers(0, 2, 8).astype(np.int64)) for _ in range(1, batches)]
        loss_fns = [loss_for(*make_batch("bert"))] + [loss_for([ids, mask], labels) for ids, mask, labels in extra]
    else:
        base, loss_fn = make_workload(workload)
        loss_fns = [loss_fn] + [_extra_loss(workload, seed) for seed in range(1, batches)]
        make = lambda: ORTModule(copy.deepcopy(base))  # noqa: E731
    names = [n for n, _ in base.named_parameters()]
    double, auto = _Float64(copy.deepcopy(base)), copy.deepcopy(base)
    references, auto_errors = [], []
    for loss_fn in loss_fns:
        _step(double, loss_fn, False)
        references.append(_grads(double))
        _step(auto, loss_fn, True)
        auto_errors.append(_errors(_grads(auto), references[-1], names))
    del double
    models, errors, times = {}, {}, {v: [] for v in variants}
    for variant in variants:  # the policy is read when the graphs are built: on the first step
        os.environ[POLICY_ENV] = variant
        models[variant] = make()
        per_batch = []
        for loss_fn, reference, auto_err in zip(loss_fns, references, auto_errors):
            _step(models[variant], loss_fn, True)
            if getattr(models[variant], "fallback_reason", None) is not None:
                raise RuntimeError(f"ORTModule fell back to PyTorch: {models[variant].fallback_reason}")
            err = _errors(_grads(models[variant]), reference, names)
            per_batch.append({n: err[n] / auto_err[n] for n in err if n in auto_err and 0 < auto_err[n] < NOISE})
        errors[variant] = {n: statistics.median(b[n] for b in per_batch) for n in per_batch[0]
                           if all(n in b for b in per_batch)}
    os.environ.pop(POLICY_ENV)
    for _ in range(rounds):
        for variant in variants:
            start = time.perf_counter()
            _step(models[variant], loss_fns[0], True)
            times[variant].append(time.perf_counter() - start)
    for variant in variants:
        ratios = errors[variant]
        worst = max(ratios, key=ratios.get)
        ms = statistics.median(times[variant]) * 1e3
        paired = statistics.median(t / b for t, b in zip(times[variant], times[variants[0]]))  # per round: drift cancels
        print(f"{workload:13} {variant:5} {ms:9.1f} {paired:7.3f}x {statistics.median(ratios.values()):13.2f}x "
              f"{ratios[worst]:8.2f}x  {worst}", flush=True)
    if batches > 1:  # how much autocast's own error moves between batches: what a ratio of 1.1 is worth
        spread = [max(e[n] for e in auto_errors) / min(e[n] for e in auto_errors) for n in auto_errors[0]
                  if all(e.get(n) for e in auto_errors)]
        print(f"{workload:13} autocast's own error, max / min over the {batches} batches, per parameter: median "
              f"{statistics.median(spread):.2f}x, 25th percentile {np.percentile(spread, 25):.2f}x", flush=True)


class _OnDevice:
    """An on-device ``Module`` over bf16 artifacts, stepped as ``_step`` steps a torch model."""

    def __init__(self, module, names, directory):
        self.module, self.names = module, names
        self.directory = directory  # the artifacts' TemporaryDirectory, kept while the module reads them

    def zero_grad(self, set_to_none=True):
        self.module.lazy_reset_grad()

    def grads(self) -> list:
        views = self.module.buffers.grad_views
        return [views[n].astype(np.float64).copy() if n in views else None for n in self.names]


def _ondevice(name: str):
    """(the torch model, a loss function that steps torch models and on-device modules alike, a maker of
    on-device modules over bf16 artifacts)."""
    import tempfile
    from pathlib import Path

    import torch

    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module

    base = build_torch_model(name).train()
    inputs, _ = make_batch(name)
    names = [n for n, _ in base.named_parameters()]
    tmp = tempfile.TemporaryDirectory(prefix="bf16_float32_ops_")
    d = Path(tmp.name)
    program = torch.onnx.export(copy.deepcopy(base).eval(), tuple(torch.from_numpy(x) for x in inputs), dynamo=True,
                                input_names=["input_ids", "attention_mask"], output_names=["logits"],
                                dynamic_shapes=({0: "batch"}, {0: "batch"}), optimize=False)
    program.save(str(d / "model.onnx"))
    made = []

    def loss_for(inputs, labels):
        def loss_fn(m):
            if isinstance(m, _OnDevice):
                return _Loss(m.module(*inputs, labels))
            return torch.nn.functional.cross_entropy(m(*(torch.from_numpy(x) for x in inputs)).float(),
                                                     torch.from_numpy(labels))
        return loss_fn

    def make():  # artifacts per variant: whether their row sums are products is decided when they are made
        made.append(artifacts.generate_artifacts(d / "model.onnx", requires_grad=names, loss="crossentropy",
                                                 artifact_directory=d / f"bf16_{len(made)}", precision="bf16"))
        state = CheckpointState.load_checkpoint(made[-1].checkpoint)
        return _OnDevice(Module(made[-1].training_model, state), names, tmp)

    return base, loss_for, make


class _Loss:
    """An on-device loss as ``_step`` treats a torch one (the runtime's call already ran the backward)."""

    def __init__(self, value):
        self.value = value

    def backward(self):
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["bert", "gpt2"],
                        choices=["mlp", "bert", "gpt2", "ondevice-bert"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="policies to compare, the first the baseline of the time ratio (default: all)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=1,
                        help="batches the gradient error is measured on: each parameter's ratio is its median over "
                        "them, and autocast's own spread between them is printed (default: 1, the workload's own)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"rounds={args.rounds} threads={args.threads}; gradient error as a multiple of eager autocast bf16's")
    print(f"{'model':13} {'ops':5} {'step ms':>9} {'vs ' + args.variants[0]:>8} {'median error':>14} {'worst':>9}  "
          "worst parameter")
    for workload in args.workloads:
        run(workload, args.rounds, args.variants, args.batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
