"""A job that torchrun restarts forms its process group again: each attempt's group lives
under a prefix of its own in the agent's store (`merak.distributed.attempt_store`), so the
restarted workers do not read the dead attempt's addresses. The launch: two ranks on gloo,
``--max-restarts 1``, rank 1 killed (SIGKILL) after the first attempt's all-reduce
(`workers/restart_worker.py`). Under a minute on 2 cores. Without the prefix, the restarted
attempt failed to connect in about half of the launches (whichever rank of a gloo pair connects
reads the dead attempt's address when its peer comes late)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from merak.distributed import attempt_store, liveness
from merak.distributed import parallel_context as pc

WORKER = Path(__file__).parent / "workers" / "restart_worker.py"
TIMEOUT_S = 150  # two attempts of two ranks; the worker's own timeout ends a hang sooner
SECOND = datetime.timedelta(seconds=30)


def _torchrun(nproc: int, max_restarts: int) -> tuple[int, str]:
    """Run the worker under torchrun; (exit code, output). Past `TIMEOUT_S` the launcher and
    its workers (one session) are killed and the test fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", str(WORKER)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # PYTHONPATH: conftest
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not end within {TIMEOUT_S} s\n{output[-6000:]}")
    return proc.returncode, output


def test_a_restarted_attempt_forms_its_group_and_all_reduces():
    code, output = _torchrun(2, 1)
    assert "attempt 0 rank 1 all_reduce 3" in output, output[-6000:]
    assert code == 0, output[-6000:]
    for rank in (0, 1):
        assert f"attempt 1 rank {rank} all_reduce 3" in output, output[-6000:]


def test_the_attempt_store_is_a_prefix_of_the_agents():
    agent = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=SECOND,
                          wait_for_workers=False)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(agent.port), "TORCHELASTIC_RESTART_COUNT": "3",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    store, rank, world_size = attempt_store.for_this_attempt(env, SECOND)
    assert (rank, world_size) == (1, 2) and isinstance(store, dist.PrefixStore)
    store.set("rank_1", b"address")
    assert agent.get("merak/attempt_3/rank_1") == b"address"
    assert liveness._tcp_store(dist.PrefixStore("default_pg", store)).port == agent.port
    assert attempt_store.for_this_attempt({k: v for k, v in env.items()
                                           if k != "TORCHELASTIC_RESTART_COUNT"}, SECOND) is None


@pytest.mark.parametrize("env,rank,hosts", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, 0, False),  # torchrun's agent holds it
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, 0, True),  # else rank 0, as env:// does
    ({}, 1, False),
])
def test_who_hosts_the_store(env, rank, hosts):
    assert attempt_store.hosts_store(env, rank) is hosts


def test_rank_0_hosts_the_store_without_the_agent():
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_RESTART_COUNT": "0"}
    store, _, _ = attempt_store.for_this_attempt(env, SECOND)
    store.set("k", b"v")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECOND)
    assert client.get("merak/attempt_0/k") == b"v"


def test_the_default_group_is_made_on_the_attempts_store(monkeypatch):
    calls = []
    monkeypatch.setattr(pc.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(attempt_store, "for_this_attempt", lambda env, timeout: ("S", 1, 2))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    pc._init_process_group("gloo", SECOND, device_id=None)
    assert calls == [{"backend": "gloo", "timeout": SECOND, "device_id": None, "store": "S",
                      "rank": 1, "world_size": 2}]
