"""The example's MLP artifacts (built with onnx, no torch), shared by the federated tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "federated"


@pytest.fixture(scope="session")
def example_path():
    sys.path.insert(0, str(EXAMPLE))
    yield EXAMPLE
    sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="session")
def fl_artifacts(example_path, tmp_path_factory):
    from fedmlp.model import build_artifacts

    out = tmp_path_factory.mktemp("fl_artifacts")
    build_artifacts(out)
    return out
