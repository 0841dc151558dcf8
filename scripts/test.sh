#!/usr/bin/env bash
# The test suite (CPU only; multi-rank tests launch their own gloo process groups).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
