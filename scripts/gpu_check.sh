#!/usr/bin/env bash
# The GPU checks (issue 19), on a machine with one CUDA GPU: the tests marked `gpu`
# (tests/gpu: MerakTrainer vs HF Trainer in bf16 and fp16 on NCCL, CUDA-event timer intervals,
# the activation meter vs the CUDA allocator, recomputation with dropout, NVML read-only
# checks), then the figures: bench/gpu_measurement.py (CUDA-event timer vs torch.profiler, NVML
# energy refresh interval) and bench/single_gpu.py (a 1.1 B Llama in bf16: tokens/s, MFU, peak
# memory against HF Trainer). Figures go to runs/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check nvidia-ml-py
.venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
'no CUDA device: torch ' + torch.__version__ + ' sees no GPU')"
mkdir -p runs/gpu_check
.venv/bin/python -m pytest tests/gpu -m gpu -v 2>&1 | tee runs/gpu_check/tests.log
.venv/bin/python bench/gpu_measurement.py --out runs/gpu_check/gpu_measurement.json \
    2>&1 | tee runs/gpu_check/gpu_measurement.log
.venv/bin/python -m torch.distributed.run --nproc_per_node 1 bench/single_gpu.py \
    --out runs/gpu_check/single_gpu.json "$@" 2>&1 | tee runs/gpu_check/single_gpu.log
