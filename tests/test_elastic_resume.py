"""A node lost mid-run: the elastic job goes on alone, resharded, with the same global batch and
the curve of the uninterrupted run.

Two torchrun agents on this machine (``--nnodes 1:2 --nproc_per_node 1 --max-restarts 1``,
c10d rendezvous) train a 4-layer Llama at dp=2 with a checkpoint every step
(`workers/elastic_trainer.py`). At the start of step 5 the agent of node 1 and its worker are
killed (SIGKILL). The other agent's worker fails on its lost peer and the agent restarts it
alone (world 1): `merak.init` forms the group in the new attempt, the script's layout becomes
dp=1, the trainer resumes the newest complete checkpoint (step 4) in that layout with its
optimizer state, and keeps the checkpoint's global batch (8 rows) by taking 4 micro-batches
where the script asks for 2. Steps 5-8 (loss, grad norm, learning rate) equal single-process
HF Trainer's uninterrupted run (rel 1e-5).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from elastic_trainer import KILL_AFTER, MICRO_BATCH, STEPS
from trainer_common import COMMON, build, fine_tuning_set

WORKER = Path(__file__).parent / "workers" / "elastic_trainer.py"
TIMEOUT_S = 300  # the whole job: two attempts, a rendezvous in between
# the store is this test's (a rendezvous endpoint outlives the nodes it serves, as etcd or a
# login node would); the first round waits for both agents, a later one goes on with one
RDZV = ("is_host=false,join_timeout=120,last_call_timeout=10,close_timeout=10,"
        "keep_alive_interval=1,keep_alive_max_attempt=3")


def _agent(out: Path, port: int, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--max-restarts=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
           "--rdzv_id=merak-elastic-test", f"--rdzv_conf={RDZV}", "--monitor-interval=0.5",
           str(WORKER), "--out", str(out)]
    # (both "nodes" are this host: gloo may listen on loopback, which a real multi-node job
    # must not, so Merak asks for the interface by name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",  # PYTHONPATH: conftest
               GLOO_SOCKET_IFNAME="lo")
    log = (out / f"{name}.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def reference():
    """Single-process HF Trainer on the same rows, init and fields, uninterrupted."""
    torch.set_num_threads(1)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO_BATCH * 2,
                                    save_strategy="no", **{**COMMON, "max_steps": STEPS})
        trainer = tf.Trainer(model=build("llama-deep"), args=args,
                             train_dataset=fine_tuning_set())
        trainer.train()
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def test_a_node_lost_mid_run_the_job_goes_on_alone_with_the_same_global_batch(tmp_path,
                                                                              reference):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          multi_tenant=True, timeout=datetime.timedelta(seconds=60))
    agents = [_agent(tmp_path, store.port, f"agent-{i}") for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    survivor = None
    try:
        while not (tmp_path / "kill-me").exists():
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                pytest.fail("the job did not reach the kill point\n"
                            + (tmp_path / "agent-0.log").read_text()[-6000:])
            time.sleep(0.5)
        time.sleep(0.5)  # (the pids are written)
        worker, agent = map(int, (tmp_path / "kill-me").read_text().split())
        _kill(agent)  # the agent first: it must not restart its worker
        _kill(worker)
        survivor = next(a for a in agents if a.pid != agent)
        survivor.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("the job did not end in time\n"
                    + (tmp_path / "agent-0.log").read_text()[-6000:])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    name = f"agent-{agents.index(survivor)}"
    log = (tmp_path / f"{name}.log").read_text()
    assert survivor.returncode == 0, log[-6000:]
    found = json.loads((tmp_path / "attempt-1.json").read_text())
    assert (found["world"], found["resumed"]) == (1, True), found
    assert found["gradient_accumulation_steps"] == 4, found  # 2 x dp 2 -> 4 x dp 1
    assert "gradient_accumulation_steps 2 -> 4 keeps the global batch" in log, log[-6000:]
    steps = {int(step): values for step, values in found["steps"].items()}
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    for step in range(KILL_AFTER + 1, STEPS + 1):
        want = reference[step]
        assert steps[step] == pytest.approx(
            [want["loss"], want["grad_norm"], want["learning_rate"]], rel=1e-5), (step, steps)
