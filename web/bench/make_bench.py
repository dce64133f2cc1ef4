"""Benchmark artifacts for the browser runtime, and the Python runtime's step time on the same threads.

    PYTHONPATH=src python web/bench/make_bench.py        # writes web/bench/<model>[-web]/ (ignored by git)
    cd web && node bench/bench.mjs                       # the browser's and Node's step times, the table

Models: an MLP 784-512-512-10 (batch 64, and ``mlp256``: batch 256) and a 2-layer transformer classifier
(dim 128, 4 heads, seq 64, batch 16), each as default artifacts (<model>/) and as ``target="web"`` artifacts
(<model>-web/); ``--models`` picks some. Python times the default artifacts (its own best), alternating 1
and 2 intra-op threads in one process; medians of the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))

from onnxtrain import artifacts  # noqa: E402
from onnxtrain.api import CheckpointState, Module, Optimizer  # noqa: E402
from onnxtrain.utils.ort_options import for_training  # noqa: E402
from tests.ondevice.helpers import MLP, export  # noqa: E402

HERE = Path(__file__).parent


class Transformer(torch.nn.Module):
    def __init__(self, vocab=1000, seq=64, dim=128, heads=4, layers=2, classes=4):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(dim), "qkv": torch.nn.Linear(dim, 3 * dim), "proj": torch.nn.Linear(dim, dim),
                "ln2": torch.nn.LayerNorm(dim), "fc1": torch.nn.Linear(dim, 4 * dim), "fc2": torch.nn.Linear(4 * dim, dim)}))
        self.heads = heads
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, ids):
        b, t = ids.shape
        x = self.tok(ids) + self.pos
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).chunk(3, dim=-1)
            split = lambda z: z.reshape(b, t, self.heads, -1).transpose(1, 2)  # noqa: E731
            att = torch.softmax(split(q) @ split(k).transpose(-1, -2) / (q.shape[-1] // self.heads) ** 0.5, dim=-1)
            x = x + blk["proj"]((att @ split(v)).transpose(1, 2).reshape(b, t, -1))
            x = x + blk["fc2"](torch.nn.functional.gelu(blk["fc1"](blk["ln2"](x))))
        return self.head(x.mean(1))


MODELS = {
    "mlp": (lambda: MLP((784, 512, 512, 10)), [("x", "float32", [64, 784], 0)], ("labels", [64], 10)),
    # the same MLP at batch 256: its products outweigh the optimizer's passes over the 670k parameters
    "mlp256": (lambda: MLP((784, 512, 512, 10)), [("x", "float32", [256, 784], 0)], ("labels", [256], 10)),
    "transformer": (Transformer, [("ids", "int64", [16, 64], 1000)], ("labels", [16], 4)),
}


def feeds(spec, rng):
    (name, dtype, shape, high), (lname, lshape, classes) = spec[0][0], spec[1]
    x = rng.integers(0, high, shape) if dtype == "int64" else rng.uniform(-1, 1, shape).astype(np.float32)
    return [x, rng.integers(0, classes, lshape)]


def make(name: str, target: str = "default") -> Path:
    factory, inputs, labels = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    out = HERE / (name if target == "default" else f"{name}-{target}")
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        example = tuple(torch.zeros(s, dtype=torch.int64) if d == "int64" else torch.randn(s) for _, d, s, _ in inputs)
        path = export(model, example, Path(tmp) / "m.onnx", [n for n, *_ in inputs])
        artifacts.generate_artifacts(path, requires_grad=[n for n, _ in model.named_parameters()], loss="crossentropy",
                                     optimizer="adamw", artifact_directory=out, overwrite=True, target=target)
    spec = {"inputs": [{"name": n, "dtype": d, "shape": s, "high": h} for n, d, s, h in inputs]
            + [{"name": labels[0], "dtype": "int64", "shape": labels[1], "high": labels[2]}], "warmup": 5, "steps": 30,
            "train_step": (out / "train_step_model.onnx").exists()}  # web artifacts: one session call a step
    (out / "bench.json").write_text(json.dumps(spec))
    return out


def python_times(folder: Path, spec: tuple, threads: int, steps: int = 30) -> float:
    options = for_training()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, session_options=options)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    batch = feeds(spec, np.random.default_rng(1))
    times = []
    for i in range(5 + steps):
        t0 = time.perf_counter()
        module(*batch)
        optimizer.step()
        module.lazy_reset_grad()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="the bench models to write and time (bench.mjs runs those of python_results.json)")
    results = {}
    for name in parser.parse_args().models:
        make(name, "web")
        folder = make(name)
        spec = (MODELS[name][1], MODELS[name][2])
        rounds = {1: [], 2: []}
        for _ in range(3):  # alternate the thread counts
            for threads in (1, 2):
                rounds[threads].append(python_times(folder, spec, threads))
        results[name] = {t: statistics.median(v) for t, v in rounds.items()}
        print(f"python {name}: " + ", ".join(f"{t} thread(s) {m:.2f} ms" for t, m in results[name].items()))
    (HERE / "python_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
