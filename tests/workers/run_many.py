"""Several workers in one torchrun launch (the suite's pool, see dist_harness.WorkerPool):

    torchrun --nproc_per_node N run_many.py --out DIR --workers tp_parity.py,pipeline_parity.py

Each worker's scenarios (its ``scenarios(world_size)``) write to ``DIR/<worker>/rank<r>.json``.
"""

from common import run_workers

if __name__ == "__main__":
    run_workers()
