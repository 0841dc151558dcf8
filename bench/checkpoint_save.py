"""What a checkpoint save every step costs the main job, written synchronously and in the
background (``save_async``), against no saves.

Runs ``examples/train_llama_3d.py`` (the README's main job: a small Llama at dp=2 x tp=2 x pp=2
on 8 gloo ranks) three times in one go, each with its own output directory: without saves,
with ``--save-steps 1`` and with ``--save-steps 1 --save-async``. Each run's speed is its mean
tokens/s after the first step (a step's interval includes the save that follows the step before
it). Prints the step time of each relative to no saves; the target is async <= 1.15x.

    .venv/bin/python bench/checkpoint_save.py [--steps 12] [--ranks 8] [--every 1]

On a 2-core machine the writer threads of 8 ranks share the cores with training, so the
background write is not free there; on a GPU node the write overlaps device compute.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port

ROOT = Path(__file__).resolve().parent.parent
SPEED = re.compile(r"done: loss .* (\d+) tokens/s after the first step")
TARGET = 1.15


def run(out: Path, steps: int, ranks: int, extra: list[str]) -> tuple[float, float]:
    """(tokens/s after the first step, seconds the launch took) of one main-job run."""
    layout = {8: ["--dp", "2", "--tp", "2", "--pp", "2"], 4: ["--dp", "1", "--tp", "2",
                                                             "--pp", "2"]}[ranks]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
         f"--master_port={free_port()}", str(ROOT / "examples" / "train_llama_3d.py"),
         *layout, "--steps", str(steps), "--out", str(out), *extra],
        env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    found = SPEED.search(proc.stdout + proc.stderr)
    if proc.returncode or found is None:
        sys.exit(f"the run {extra} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return float(found.group(1)), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=8, choices=(4, 8))
    parser.add_argument("--every", type=int, default=1, help="steps between saves")
    cli = parser.parse_args()
    every = ["--save-steps", str(cli.every)]
    label = "every step" if cli.every == 1 else f"every {cli.every} steps"
    runs = {"no saves": [], f"sync, {label}": every,
            f"async, {label}": [*every, "--save-async"]}
    speed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in runs.items():
            speed[name], took = run(Path(tmp) / name.replace(" ", "_").replace(",", ""),
                                    cli.steps, cli.ranks, extra)
            print(f"{name:20} {speed[name]:8.0f} tokens/s  (launch {took:.0f} s)", flush=True)
    base = speed["no saves"]
    print(f"\nstep time against no saves ({cli.steps} steps, {cli.ranks} ranks):")
    for name in runs:
        print(f"  {name:20} {base / speed[name]:.3f}x")
    ratio = base / speed[f"async, {label}"]
    print(f"async target <= {TARGET}x: {'met' if ratio <= TARGET else 'MISSED'} ({ratio:.3f}x)")


if __name__ == "__main__":
    main()
