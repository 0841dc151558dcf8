#!/usr/bin/env bash
# The test suite (CPU only; multi-rank tests launch their own gloo process groups), in two
# pytest processes (pytest-xdist): each pool of multi-rank checks (one torchrun launch per world
# size) in one of them, the 2- and 4-rank pools side by side, every other module whole
# (tests/conftest.py groups them). Arguments go to pytest; `-n 0` runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m pytest -n 2 --dist loadscope "$@"
