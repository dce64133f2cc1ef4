"""The on-device runtime imports onnxruntime and numpy only: a subprocess where importing torch (and onnx,
onnx_ir, onnxscript) fails runs a full training loop, evaluates, and saves and reloads a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.import_blocker import BLOCK_IMPORTS

SCRIPT = BLOCK_IMPORTS + textwrap.dedent("""

    import numpy as np
    from onnxtrain.api import CheckpointState, LinearLRScheduler, Module, Optimizer

    d = sys.argv[1]
    state = CheckpointState.load_checkpoint(f"{d}/checkpoint")
    module = Module(f"{d}/training_model.onnx", state, f"{d}/eval_model.onnx", backend=sys.argv[2])
    optimizer = Optimizer(f"{d}/optimizer_model.onnx", module)
    scheduler = LinearLRScheduler(optimizer, 1, 10, 1e-2)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 5, 8)
    losses = []
    for _ in range(5):
        losses.append(float(module(x, y)))
        optimizer.step()
        scheduler.step()
        module.lazy_reset_grad()
    assert losses[-1] < losses[0], losses
    module.eval()
    module(x, y)
    CheckpointState.save_checkpoint(state, f"{d}/resumed", include_optimizer_state=True)
    CheckpointState.load_checkpoint(f"{d}/resumed")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok", losses[0], losses[-1])
""")


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_runtime_imports_no_torch(mlp_artifacts, backend):
    if backend == "openvino":
        pytest.importorskip("openvino")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(mlp_artifacts.checkpoint.parent), backend],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
