"""What ``import merak`` costs on top of what a training script imports anyway.

Each measurement is a fresh interpreter timing its imports (the median of `--repeats`, runs of
the variants interleaved so a busy machine slows them alike):

- baseline: ``import torch, transformers; from transformers import Trainer,
  AutoModelForCausalLM`` (what an HF training script starts with);
- ``import merak`` after the baseline (target: at most 1.1x the baseline);
- ``from merak import MerakTrainer`` after the baseline (the trainer's stack, for reference);
- ``import merak.energy`` alone (what the background clock planner's process imports).

    python bench/import_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

TARGET = 1.1
BASELINE = ("import torch, transformers\n"
            "from transformers import Trainer, AutoModelForCausalLM\n")
VARIANTS = {
    "baseline": BASELINE,
    "import merak": BASELINE + "import merak\n",
    "from merak import MerakTrainer": BASELINE + "from merak import MerakTrainer\n",
    "import merak.energy (alone)": "import merak.energy\n",
}
_TIMED = ("import time\nstart = time.perf_counter()\n{code}"
          "print(time.perf_counter() - start)\n")


def measure(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", _TIMED.format(code=code)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    measure(VARIANTS["from merak import MerakTrainer"])  # warm the file cache
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, code in VARIANTS.items():
            times[name].append(measure(code))
    base = statistics.median(times["baseline"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34s} {median:6.2f} s  {median / base:5.2f}x the baseline")
    ratio = statistics.median(times["import merak"]) / base
    print(f"import merak: {ratio:.2f}x the baseline (target <= {TARGET}x): "
          f"{'met' if ratio <= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
