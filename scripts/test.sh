#!/usr/bin/env bash
# The test suite (CPU only; multi-rank tests launch their own gloo process groups).
# Two pytest-xdist workers: a launch's ranks leave a core idle much of the time. Tests that
# share a launch run on one worker (tests/conftest.py). Later options win: `-n 0` runs the
# tests in this process, as plain pytest does.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m pytest -n "${MERAK_TEST_WORKERS:-2}" --dist loadgroup "$@"
