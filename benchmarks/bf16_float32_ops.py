"""OpenVINO bf16 under ORTModule with and without the float32 loss region (issue 17): step time and gradient
error against float64, next to eager autocast bf16's, in one process with the variants alternating.

    python benchmarks/bf16_float32_ops.py                          # BERT-small and GPT-2-small, 10 rounds
    python benchmarks/bf16_float32_ops.py --workloads mlp --rounds 5
    python benchmarks/bf16_float32_ops.py --workloads mlp bert gpt2 ondevice-bert --variants none loss  # issue 17's timing

Variants (``onnxtrain.runtime.openvino_float32`` policies, each an ORTModule under
``torch.autocast("cpu", dtype=torch.bfloat16)`` from the same weights on the same batch):
- ``none``: the default; OpenVINO's bf16 hint as the plugin chooses (every op it reaches from a product in
  bfloat16);
- ``loss``: the loss and its gradient stay float32 (as autocast keeps them);
- ``all``: every op but the products stays float32.
``ondevice-bert``: the on-device runtime instead (``benchmarks/ondevice_bench.py``'s BERT-small,
``generate_artifacts(precision="bf16")``, a ``Module`` per variant; step = forward + backward, no optimizer).
Gradient error: norm-relative, per parameter, against the float64 model, divided by eager autocast bf16's on
the same batch; the table prints the median and the worst parameter. Step: forward + backward, median over the
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

VARIANTS = ("none", "loss", "all")


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


def run(workload: str, rounds: int, variants) -> None:
    from onnxtrain import ORTModule
    from onnxtrain.runtime.openvino_float32 import POLICY_ENV

    if workload == "ondevice-bert":
        base, loss_fn, make = _ondevice("bert")
    else:
        base, loss_fn = make_workload(workload)
        make = lambda: ORTModule(copy.deepcopy(base))  # noqa: E731
    names = [n for n, _ in base.named_parameters()]
    double = _Float64(copy.deepcopy(base))
    _step(double, loss_fn, False)
    reference = _grads(double)
    del double
    auto = copy.deepcopy(base)
    _step(auto, loss_fn, True)
    auto_err = _errors(_grads(auto), reference, names)
    models, errors, times = {}, {}, {v: [] for v in variants}
    for variant in variants:  # the policy is read when a graph's session is made: on the first step
        os.environ[POLICY_ENV] = variant
        models[variant] = make()
        _step(models[variant], loss_fn, True)
        if getattr(models[variant], "fallback_reason", None) is not None:
            raise RuntimeError(f"ORTModule fell back to PyTorch: {models[variant].fallback_reason}")
        err = _errors(_grads(models[variant]), reference, names)
        errors[variant] = {n: err[n] / auto_err[n] for n in err if auto_err.get(n)}
    os.environ.pop(POLICY_ENV)
    for _ in range(rounds):
        for variant in variants:
            start = time.perf_counter()
            _step(models[variant], loss_fn, True)
            times[variant].append(time.perf_counter() - start)
    for variant in variants:
        ratios = errors[variant]
        worst = max(ratios, key=ratios.get)
        ms = statistics.median(times[variant]) * 1e3
        paired = statistics.median(t / b for t, b in zip(times[variant], times[variants[0]]))  # per round: drift cancels
        print(f"{workload:13} {variant:5} {ms:9.1f} {paired:7.3f}x {statistics.median(ratios.values()):13.2f}x "
              f"{ratios[worst]:8.2f}x  {worst}", flush=True)


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
    inputs, labels = make_batch(name)
    names = [n for n, _ in base.named_parameters()]
    tmp = tempfile.TemporaryDirectory(prefix="bf16_float32_ops_")
    d = Path(tmp.name)
    program = torch.onnx.export(copy.deepcopy(base).eval(), tuple(torch.from_numpy(x) for x in inputs), dynamo=True,
                                input_names=["input_ids", "attention_mask"], output_names=["logits"],
                                dynamic_shapes=({0: "batch"}, {0: "batch"}), optimize=False)
    program.save(str(d / "model.onnx"))
    paths = artifacts.generate_artifacts(d / "model.onnx", requires_grad=names, loss="crossentropy",
                                         artifact_directory=d / "bf16", precision="bf16")

    def loss_fn(m):
        if isinstance(m, _OnDevice):
            return _Loss(m.module(*inputs, labels))
        return torch.nn.functional.cross_entropy(m(*(torch.from_numpy(x) for x in inputs)).float(),
                                                 torch.from_numpy(labels))

    def make():
        return _OnDevice(Module(paths.training_model, CheckpointState.load_checkpoint(paths.checkpoint)), names, tmp)

    return base, loss_fn, make


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
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"rounds={args.rounds} threads={args.threads}; gradient error as a multiple of eager autocast bf16's")
    print(f"{'model':13} {'ops':5} {'step ms':>9} {'vs ' + args.variants[0]:>8} {'median error':>14} {'worst':>9}  "
          "worst parameter")
    for workload in args.workloads:
        run(workload, args.rounds, args.variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
