#!/usr/bin/env bash
# Run on a machine with network (a developer's), not on the GPU machine: downloads into .whl/
# (git-ignored) the wheels the lent GPU image lacks, for CPython 3.12 on x86-64 Linux, so a
# session can carry them there (the device tool's `carry: [".whl"]`) and scripts/gpu_check.sh
# installs them offline. The versions are those of this checkout's .venv where it has them
# (the ones the CPU suite passes with), else the pins below; each is downloaded without its
# dependencies (--no-deps), so every one the image lacks is named here: lowtime's own (attrs,
# matplotlib, networkx, numpy, scikit-learn) are in the image, datasets needs dill and
# multiprocess, pydantic its core, annotated-types and typing-inspection.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
pins="lowtime==0.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pydantic==2.14.4 \
pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"
specs=()
for pin in $pins; do
    name=${pin%%==*}
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))" \
              2>/dev/null || echo "${pin##*==}")
    specs+=("$name==$version")
    rm -f .whl/"${name//-/_}"-*.whl  # one version of each: two stop the offline install
done
mkdir -p .whl
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
ls -l .whl
