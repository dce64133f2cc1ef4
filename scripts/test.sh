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

echo "== tier: the whole OpInfo sweep through ORTModule (tests/opinfo, -m opinfo_full)"
python -m pytest -m opinfo_full tests/opinfo
