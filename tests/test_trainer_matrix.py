"""The schedule grid: 1F1B, interleaved 1F1B, zero-bubble and Merak's shifted critical path
(with recomputation), and the V schedules ZB-V and DualPipeV (2 stages per rank in a V; also on a
Mixtral, whose router loss makes its reference step in Merak's micro-batches) through
MerakTrainer at (dp, tp, pp) = (1,1,2), (2,1,2), (1,2,4) and (2,2,2) train at loss parity with
single-process HF Trainer, on the NCCL-contract backend (the very path NCCL takes: one Work per
group, rendezvous sends, one stream) and on plain gloo.
Each world size and backend is one pooled launch (workers/trainer_matrix.py). The suite runs the
2-rank layout on the NCCL contract (every other multi-rank test runs on it too; Merak has one
p2p path, so plain gloo differs only below it; dp > 1 on padded rows is test_trainer's); the
whole grid, with plain gloo and the 4- and 8-rank layouts:

    MERAK_TEST_MATRIX=full .venv/bin/python -m pytest tests/test_trainer_matrix.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dist_harness import WORKERS, check
from trainer_common import MATRIX_LAYOUTS, MATRIX_STEPS, matrix_runs

WORKER = "trainer_matrix.py"  # pooled: launches(world_size, backend), see conftest.py
WORLD_SIZES = tuple(MATRIX_LAYOUTS)
BACKENDS = ("nccl-contract", "gloo") if os.environ.get("MERAK_TEST_MATRIX") == "full" \
    else ("nccl-contract",)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix-reference")
    run = subprocess.run([sys.executable, str(WORKERS / "trainer_reference.py"), "--out",
                          str(out), "--matrix"], capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in matrix_runs(w)])
def test_schedule_and_layout_match_hf_trainer(launches, worker_pool, references, backend,
                                              world_size, scenario):
    results, output = launches(world_size, backend)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, world_size, backend)
                       / f"merak-{scenario}.json").read_text())
    theirs = json.loads((references / f"reference-{ours['reference']}.json").read_text())
    assert len(ours["loss"]) == len(theirs["loss"]) == MATRIX_STEPS
    for key in ("loss", "grad_norm", "learning_rate"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    # padded evaluation rows, HF's token-weighted loss per evaluation batch (not for an MoE at
    # dp > 1: each dp rank's share of a batch has its own router loss, see trainer_common)
    if ours["reference"] != "matrix-moe-dp2":
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
