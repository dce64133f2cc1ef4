#!/usr/bin/env bash
# The project's test command (README "The two commands", and what .ci/run calls).
# Installs what the tests need on a fresh machine, then runs every tier CI runs, in order.
# Each tier is one block below; a tier that needs more than `.[test]` installs it itself.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== install: .[test]"
python -m pip install -q -e ".[test]"

echo "== tier: default pytest suite"
python -m pytest

echo "== tier: newest supported torch (2.15, in its own cached venv): OpInfo subset and model parity"
# The oldest end of the supported range (torch 2.13, pinned by .[test]) ran above. The newest runs in a venv of
# its own under ~/.cache/onnxtrain/, made once and reused while its torch matches: the registry's 2.15 is a
# CUDA build (about 5.3 GB installed, about 4.5 minutes to install here) that runs on CPU.
NEWEST_TORCH=2.15.0
NEWEST_VENV="${ONNXTRAIN_NEWEST_TORCH_VENV:-$HOME/.cache/onnxtrain/torch-$NEWEST_TORCH}"
if ! "$NEWEST_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$NEWEST_TORCH')" 2>/dev/null; then
    rm -rf "$NEWEST_VENV"
    python -m venv "$NEWEST_VENV"
fi
"$NEWEST_VENV/bin/python" -m pip install -q "torch==$NEWEST_TORCH" -e ".[hf]" "pytest>=8" "psutil>=5"
NEWEST_TESTS=(tests/ortmodule/test_parity.py tests/ortmodule/test_trust.py)
if [ -d tests/opinfo ]; then NEWEST_TESTS+=(tests/opinfo); fi
PYTHONPATH="$PWD/src" "$NEWEST_VENV/bin/python" -m pytest -p no:cacheprovider "${NEWEST_TESTS[@]}"
