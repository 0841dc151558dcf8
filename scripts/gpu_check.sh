#!/usr/bin/env bash
# The GPU checks, on a machine with one CUDA GPU: the tests marked `gpu`
# (tests/gpu: MerakTrainer vs HF Trainer in bf16 and fp16 on NCCL, CUDA-event timer intervals,
# the activation meter vs the CUDA allocator, recomputation with dropout, NVML read-only
# checks), then the figures: bench/gpu_measurement.py (CUDA-event timer vs torch.profiler, NVML
# energy refresh interval) and bench/single_gpu.py (a 1.1 B Llama in bf16: tokens/s, MFU, peak
# memory against HF Trainer), bench/cp_ring_block.py (ring attention's fused blocks against
# flash attention over a whole row of 32k tokens: time, peak memory, agreement). Figures go to
# runs/gpu_check/.
#
# It runs on the machine as it is, with its own python3 (the lent GPU image: Python 3.12 with
# a CUDA torch 2.11, transformers, accelerate, peft, nvidia-ml-py and pytest, and no network):
# no virtualenv is made and nothing is downloaded. What the image lacks is installed offline
# from the wheels carried in .whl/ (scripts/gpu_wheels.sh downloads them on a machine with
# network; the device tool carries the git-ignored folder when `carry` names `.whl`), into a
# folder of its own put on PYTHONPATH; the project itself is imported from this checkout
# (PYTHONPATH), so nothing is built. PYTHON picks another interpreter, MERAK_GPU_SITE the folder,
# MERAK_GPU_OUT where the logs and figures go (default runs/gpu_check). Every part runs even when
# one before it failed; the script then names the failed parts and exits 1. The tests run on
# torch's own point-to-point (real NCCL): MERAK_TEST_BACKEND=native keeps the CPU suite's
# NCCL-contract layer (tests/nccl_contract) out of these processes.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
site=${MERAK_GPU_SITE:-/tmp/merak-gpu-site}
out=${MERAK_GPU_OUT:-runs/gpu_check}
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" MERAK_TEST_BACKEND=native
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
'no CUDA device: torch ' + torch.__version__ + ' sees no GPU')" || exit 1

# Distributions the checks import that the GPU image may lack: datasets (examples/hf_run_clm.py,
# which the trainer test runs) with dill and multiprocess; lowtime (the clock frontier's solver)
# and pydantic (the Perseus protocol), which no check here needs yet.
needed="datasets dill multiprocess lowtime pydantic pydantic-core annotated-types \
typing-inspection"
missing=$("$python" - $needed <<'EOF'
import importlib.metadata as metadata
import sys

absent = []
for name in sys.argv[1:]:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        absent.append(name)
print(" ".join(absent))
EOF
)
if [ -n "$missing" ]; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        echo "installing from .whl/ (offline, no dependencies): $missing"
        # shellcheck disable=SC2086  # one argument per distribution
        "$python" -m pip install --quiet --disable-pip-version-check --no-index \
            --find-links .whl --no-deps --target "$site" $missing || exit 1
    else
        echo "missing: $missing; no .whl/ to install them from (run scripts/gpu_wheels.sh" \
             "on a machine with network, then carry .whl to this one)" >&2
    fi
fi
if ! error=$("$python" -c "import datasets" 2>&1); then
    echo "the trainer checks (examples/hf_run_clm.py) need datasets, which does not import:" \
         "${error##*$'\n'}. Carry its wheels here in .whl/ (scripts/gpu_wheels.sh downloads" \
         "them on a machine with network)" >&2
    exit 1
fi
"$python" -c "import lowtime" 2>/dev/null || echo "lowtime is absent: the checks that need" \
    "the clock frontier are skipped (scripts/gpu_wheels.sh downloads it into .whl/)"
mkdir -p "$out"
"$python" - <<'EOF' 2>&1 | tee "$out/machine.log"
import importlib.metadata as metadata
import torch

props = torch.cuda.get_device_properties(0)
print(f"{props.name}: {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs;"
      f" torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL "
      f"{torch.cuda.nccl.version()})")
print(", ".join(f"{name} {metadata.version(name)}" for name in
                ("transformers", "accelerate", "peft", "safetensors", "datasets")))
EOF
failed=()
run() {  # run NAME COMMAND...: the command's output into $out/NAME.log; a failure is named
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || failed+=("$name (exit $status)")
}
run tests "$python" -m pytest -p no:cacheprovider tests/gpu -m gpu -v
run gpu_measurement "$python" bench/gpu_measurement.py --out "$out/gpu_measurement.json"
run single_gpu "$python" -m torch.distributed.run --nproc_per_node 1 bench/single_gpu.py \
    --out "$out/single_gpu.json" "$@"
run cp_ring_block "$python" bench/cp_ring_block.py --seq 32768 --dtype bfloat16 \
    --out "$out/cp_ring_block.json"
if [ ${#failed[@]} -gt 0 ]; then
    echo "GPU checks failed: ${failed[*]} (logs in $out/)" >&2
    exit 1
fi
echo "GPU checks passed (logs and figures in $out/)"
