#!/usr/bin/env bash
# Create or refresh the repo's virtualenv (.venv): the CPU wheel torch==2.13.0 FIRST (the
# project's torch range would otherwise let pip pull a multi-GB CUDA build), then this project
# with its test extras (torchao for the fp8 tests among them: it requires no torch), which
# keeps that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
