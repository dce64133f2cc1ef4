"""``export_model_for_inferencing`` without the ``onnx`` package: an error that says what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("onnx", "torch"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    from onnxtrain.api import CheckpointState, Module

    d = sys.argv[1]
    module = Module(f"{d}/training_model.onnx", CheckpointState.load_checkpoint(f"{d}/checkpoint"),
                    f"{d}/eval_model.onnx")
    try:
        module.export_model_for_inferencing(f"{d}/inference.onnx", ["logits"])
    except ModuleNotFoundError as exc:
        print("ERROR:", exc)
""")


def test_export_without_onnx_says_what_to_install(mlp_artifacts):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(mlp_artifacts.checkpoint.parent)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ERROR: Module.export_model_for_inferencing needs the onnx package" in result.stdout
    assert "pip install onnx" in result.stdout
