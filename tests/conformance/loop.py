"""The conformance loop, as every runtime runs it (docs/format.md, "Conformance fixtures"): onnxruntime and
numpy only, so the test that replays the fixtures needs no torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnxtrain.api import CheckpointState, LinearLRScheduler, Module, Optimizer


def linear_lr(schedule: dict, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under LinearLRScheduler."""
    warmup, total = schedule["warmup_step_count"], schedule["total_step_count"]
    factor = step / max(1, warmup) if step < warmup else max(0.0, (total - step) / max(1, total - warmup))
    return schedule["initial_lr"] * factor


def batch_arrays(case: dict, index: int) -> list[np.ndarray]:
    batch = case["batches"][index]
    return [np.asarray(batch[n]["data"], dtype=batch[n]["dtype"]).reshape(batch[n]["shape"]) for n in case["inputs"]]


def run_case(folder: Path, case: dict, checkpoint: Path, graphs: Path | None = None) -> tuple[list[float], dict]:
    """Train ``case`` from the artifacts in ``folder``: the losses of every training call, then the eval
    loss on batch 0 and ``checkpoint``, the path the trained state is saved to with the optimizer state
    (the caller owns its folder: pytest's ``tmp_path``). ``graphs``: a folder with other training and
    optimizer models for the same checkpoint (``<case>/web/``, the ``target="web"`` artifacts)."""
    graphs = folder if graphs is None else graphs
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(graphs / "training_model.onnx", state, folder / "eval_model.onnx")
    optimizer = Optimizer(graphs / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(case["learning_rate"])
    scheduler = None
    if case["schedule"]:
        s = case["schedule"]
        scheduler = LinearLRScheduler(optimizer, s["warmup_step_count"], s["total_step_count"], s["initial_lr"])
    losses, calls = [], 0
    for _ in range(case["steps"]):
        for _ in range(case["accumulate"]):
            losses.append(float(module(*batch_arrays(case, case["order"][calls]))))
            calls += 1
        optimizer.step()
        module.lazy_reset_grad()
        if scheduler is not None:
            scheduler.step()
    module.eval()
    eval_loss = float(module(*batch_arrays(case, 0)))
    CheckpointState.save_checkpoint(state, checkpoint, include_optimizer_state=True)
    return losses, {"eval_loss": eval_loss, "checkpoint": checkpoint}
