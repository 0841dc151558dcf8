#!/usr/bin/env bash
# Create or refresh the repo's virtualenv (.venv): torch==2.13.0 FIRST (an unpinned torch pulls
# multi-GB CUDA builds), then this project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
