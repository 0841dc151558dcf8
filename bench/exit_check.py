"""Does a finished run exit cleanly? Runs the main job's script N times on 4 ranks (dp 2 x pp
2 by default, a few steps) and counts the launches that did not exit 0, and those whose ranks
aborted at exit ("terminate called without an active exception", SIGABRT), which torchrun
reports as a failed job although training finished.

    .venv/bin/python bench/exit_check.py --runs 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import free_port

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--layout", default="2,1,2", help="dp,tp,pp (4 ranks in all)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dp, tp, pp = (int(x) for x in args.layout.split(","))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failed = aborted = 0
    for index in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run",
                 f"--nproc_per_node={dp * tp * pp}", f"--master_port={free_port()}",
                 str(ROOT / "examples" / "train_llama_3d.py"), "--dp", str(dp), "--tp",
                 str(tp), "--pp", str(pp), "--steps", str(args.steps), "--layers", "2",
                 "--hidden", "64", "--out", out],
                cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        text = proc.stdout + proc.stderr
        abort = "terminate called" in text or "SIGABRT" in text
        failed += proc.returncode != 0
        aborted += abort
        print(f"run {index + 1}/{args.runs}: exit {proc.returncode}"
              f"{' (aborted at exit)' if abort else ''}", flush=True)
        if proc.returncode != 0:
            print(text[-3000:], flush=True)
    print(f"{args.runs} runs of {dp * tp * pp} ranks: {failed} failed, {aborted} aborted at exit")
    sys.exit(1 if failed or aborted else 0)


if __name__ == "__main__":
    main()
