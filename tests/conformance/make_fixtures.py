"""Write the conformance fixtures that every onnxtrain runtime checks (docs/format.md, "Conformance").

Each case is a folder: the four artifacts, ``case.json`` (the batches, the loop, the expected losses)
and ``expected_checkpoint`` (parameters and optimizer state after the loop, written by the Python
runtime). The Python runtime's losses are checked against PyTorch training the same model first, so
the fixtures are trusted, not just self-consistent. ``web/`` holds the training, optimizer and train-step models
of the same model generated with ``target="web"``, which must reproduce the same numbers.

    PYTHONPATH=src python tests/conformance/make_fixtures.py        # needs torch; rewrites the folders
    PYTHONPATH=src python tests/conformance/make_fixtures.py --web  # only the web/ graphs of each case
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))

from onnxtrain import artifacts  # noqa: E402
from tests.conformance.loop import linear_lr, run_case  # noqa: E402
from tests.ondevice.helpers import CNN, MLP, export  # noqa: E402


class TinyTransformer(torch.nn.Module):
    """Token embedding + position embedding, one pre-norm attention block and MLP, mean pool, classifier."""

    def __init__(self, vocab=24, seq=6, dim=16, heads=2, classes=3):
        super().__init__()
        self.heads = heads
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)  # a key bias has zero gradient: Adam would amplify noise
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, ids):
        b, t = ids.shape
        x = self.tok(ids) + self.pos
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        split = lambda z: z.reshape(b, t, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        att = torch.softmax(q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        return self.head(x.mean(1))


def _batches(rng, kind: str, n: int):
    if kind == "mlp":
        return [{"x": rng.standard_normal((8, 16)).astype(np.float32), "labels": rng.integers(0, 5, 8)} for _ in range(n)]
    if kind == "cnn":
        return [{"x": rng.standard_normal((4, 1, 8, 8)).astype(np.float32), "labels": rng.integers(0, 4, 4)}
                for _ in range(n)]
    return [{"ids": rng.integers(0, 24, (4, 6)), "labels": rng.integers(0, 3, 4)} for _ in range(n)]


CASES = {
    # name: model, example input, input names, optimizer, loop settings
    "mlp": (MLP, (torch.randn(8, 16),), ["x"], artifacts.AdamW(lr=1e-2),
            {"steps": 20, "accumulate": 2, "learning_rate": 1e-2, "schedule": None}),
    "cnn": (CNN, (torch.randn(4, 1, 8, 8),), ["x"], artifacts.SGD(lr=5e-2, momentum=0.9),
            {"steps": 20, "accumulate": 1, "learning_rate": 5e-2, "schedule": None}),
    "transformer": (TinyTransformer, (torch.zeros(4, 6, dtype=torch.int64),), ["ids"], artifacts.AdamW(lr=1e-2),
                    {"steps": 20, "accumulate": 1, "learning_rate": 1e-2,
                     "schedule": {"type": "linear", "warmup_step_count": 5, "total_step_count": 20,
                                  "initial_lr": 1e-2}}),
}


def _as_json(array: np.ndarray) -> dict:
    array = np.asarray(array)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": array.reshape(-1).tolist()}


def _torch_losses(model, optimizer_block, loop, batches, order):
    """PyTorch training the same model with the same loop: the reference the fixture is checked against."""
    model.train()
    params = list(model.parameters())
    if isinstance(optimizer_block, artifacts.AdamW):
        opt = torch.optim.AdamW(params, lr=loop["learning_rate"], betas=optimizer_block.betas,
                                eps=optimizer_block.eps, weight_decay=optimizer_block.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=loop["learning_rate"], momentum=optimizer_block.momentum)
    schedule = loop["schedule"]
    losses, calls = [], 0
    for step in range(loop["steps"]):
        if schedule:
            for group in opt.param_groups:
                group["lr"] = linear_lr(schedule, step)
        opt.zero_grad()
        for _ in range(loop["accumulate"]):
            batch = batches[order[calls]]
            calls += 1
            *inputs, labels = (torch.from_numpy(np.asarray(v)) for v in batch.values())
            loss = torch.nn.functional.cross_entropy(model(*inputs), labels)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


def make(name: str, out_root: Path = HERE) -> None:
    model_cls, example, input_names, optimizer_block, loop = CASES[name]
    torch.manual_seed(0)
    model = model_cls()
    rng = np.random.default_rng(0)
    batches = _batches(rng, name, 4)
    calls = loop["steps"] * loop["accumulate"]
    order = [i % len(batches) for i in range(calls)]
    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        reference = copy.deepcopy(model)
        path = export(model, example, Path(tmp) / "model.onnx", input_names)
        artifacts.generate_artifacts(path, requires_grad=[n for n, _ in model.named_parameters()],
                                     loss="crossentropy", optimizer=optimizer_block, artifact_directory=out)
        _web_graphs(path, model, optimizer_block, out, Path(tmp))
    case = {"format": "onnxtrain.conformance", "version": 1, "name": name, **loop,
            "inputs": list(batches[0]), "batches": [{k: _as_json(v) for k, v in b.items()} for b in batches],
            "order": order}
    losses, final = run_case(out, case, out / "expected_checkpoint")
    reference_losses = _torch_losses(reference, optimizer_block, loop, batches, order)
    rel = np.abs(np.array(losses) - reference_losses) / np.maximum(np.abs(reference_losses), 1e-6)
    assert rel.max() < 1e-4, f"{name}: the Python runtime differs from PyTorch by {rel.max():.2e}"
    case["losses"] = [float(v) for v in losses]
    case["torch_losses"] = reference_losses
    case["eval_loss"] = float(final["eval_loss"])
    (out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    print(f"{name}: {len(losses)} losses {losses[0]:.4f} -> {losses[-1]:.4f}, vs PyTorch max rel {rel.max():.1e}")


WEB_GRAPHS = ("training_model.onnx", "optimizer_model.onnx", "train_step_model.onnx")


def _web_graphs(path: Path, model, optimizer_block, out: Path, tmp: Path) -> None:
    """``out/web/``: the training, optimizer and train-step models of ``target="web"`` (the checkpoint and
    eval model are the case's own)."""
    artifacts.generate_artifacts(path, requires_grad=[n for n, _ in model.named_parameters()], loss="crossentropy",
                                 optimizer=optimizer_block, artifact_directory=tmp / "web", target="web")
    (out / "web").mkdir(exist_ok=True)
    for file in WEB_GRAPHS:
        shutil.copy(tmp / "web" / file, out / "web" / file)


def make_web(name: str, out_root: Path = HERE) -> None:
    """Only the ``web/`` graphs of an existing case, from the same seeded model."""
    model_cls, example, input_names, optimizer_block, _ = CASES[name]
    torch.manual_seed(0)
    model = model_cls()
    out = out_root / name
    with tempfile.TemporaryDirectory() as tmp:
        path = export(model, example, Path(tmp) / "model.onnx", input_names)
        _web_graphs(path, model, optimizer_block, out, Path(tmp))
    print(f"{name}: wrote {out / 'web'}")


if __name__ == "__main__":
    web_only = "--web" in sys.argv[1:]
    for case_name in [a for a in sys.argv[1:] if a != "--web"] or CASES:
        (make_web if web_only else make)(case_name)
