#!/usr/bin/env bash
# The main job: a small GPT trained with pp=2 x dp=2 (4 CPU ranks, gloo) on the Python
# standard library's source. Extra arguments go to examples/train_gpt_pipeline.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m torch.distributed.run --nproc_per_node 4 \
    examples/train_gpt_pipeline.py --pp 2 --dp 2 "$@"
