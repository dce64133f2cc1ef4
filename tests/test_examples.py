"""The examples a new user runs first: help that does not run them, progress shown, outputs that are kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args, cwd=None, timeout=900):
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.parametrize("name", ["gradient_demo.py", "ortmodule_demo.py", "text_classification.py"])
def test_help_prints_usage_and_runs_nothing(name):
    result = _run(EXAMPLES / name, "--help")
    assert result.stdout.startswith("usage:")
    assert "max |onnxtrain - torch|" not in result.stdout and "loss" not in result.stderr


@pytest.mark.slow
def test_ortmodule_demo_shows_progress_and_matching_losses():
    result = _run(EXAMPLES / "ortmodule_demo.py", "--steps", "4")
    assert "ORTModule: the first step exports the model" in result.stdout
    assert "PyTorch eager: 100%" in result.stderr and "ORTModule    : 100%" in result.stderr  # tqdm bars
    rows = [line.split() for line in result.stdout.splitlines() if line[:4].strip().isdigit()]
    assert rows and all(abs(float(eager) - float(ort)) < 1e-3 for _, eager, ort in rows)
    assert "fell back" not in result.stdout


@pytest.mark.slow
def test_text_classification_keeps_the_exported_model(tmp_path):
    target = tmp_path / "exported.onnx"
    result = _run(EXAMPLES / "text_classification.py", "--steps", "2", "--samples", "32", "--hidden", "16",
                  "--layers", "1", "--export-path", target, cwd=tmp_path)
    assert f"exported the trained model for inference: {target}" in result.stdout
    assert target.is_file()
