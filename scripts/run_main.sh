#!/usr/bin/env bash
# The main job: a small HF Llama trained with dp=2 x tp=2 x pp=2 (8 CPU ranks, gloo) on the
# Python standard library's source. Extra arguments go to examples/train_llama_3d.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m torch.distributed.run --nproc_per_node 8 \
    examples/train_llama_3d.py --dp 2 --tp 2 --pp 2 "$@"
