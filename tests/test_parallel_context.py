"""`merak.init` pieces that decide the device, the host groups and the teardown, without NCCL."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch

from merak.distributed import parallel_context as pc
from merak.distributed.backends import handles_cpu_tensors


@pytest.mark.parametrize("local_rank,count,expected",
                         [(0, 1, 0), (3, 1, 0), (5, 8, 5), (9, 8, 1), (7, 4, 3)])
def test_local_device_is_local_rank_modulo_visible_devices(local_rank, count, expected):
    assert pc.local_device_index(local_rank, count) == expected


def test_no_visible_device_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        pc.local_device_index(0, 0)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        pc.local_device_index(-1, 2)


@pytest.mark.parametrize("backend,cpu", [("gloo", True), ("nccl", False),
                                         ("cpu:gloo,cuda:nccl", True), ("NCCL", False)])
def test_which_backends_take_host_tensors(backend, cpu):
    assert handles_cpu_tensors(backend) is cpu


def test_nccl_device_comes_from_local_rank_and_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert pc._local_device("nccl") == torch.device("cuda", 1)
    assert pc._local_device("gloo") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert pc._local_device("nccl") == torch.device("cuda", 0)


@pytest.mark.parametrize("torchrun", [True, False])
def test_process_group_is_bound_to_the_device(monkeypatch, torchrun):
    calls = []
    monkeypatch.setattr(pc.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)  # env:// (no attempt store)
    if torchrun:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    else:
        monkeypatch.delenv("RANK", raising=False)
    device = torch.device("cuda", 1)
    pc._init_process_group("nccl", datetime.timedelta(seconds=5), device_id=device)
    pc._init_process_group("gloo", datetime.timedelta(seconds=5))
    assert [c["device_id"] for c in calls] == [device, None]
    assert [c["backend"] for c in calls] == ["nccl", "gloo"]


def test_init_joins_an_existing_nccl_group_with_one_collective(monkeypatch):
    """A group made before `init` (HF's TrainingArguments, accelerate) started NCCL lazily: the
    first `init` runs one all-reduce of every rank so no subset p2p comes first; later `init`s
    (another layout) do not."""
    previous = pc._default_context
    if not torch.distributed.is_initialized():
        pc.init(1, 1, 1, backend="gloo")
    calls = []
    monkeypatch.setattr(pc, "_is_nccl", lambda backend: True)
    monkeypatch.setattr(pc, "_local_device", lambda backend: torch.device("cpu"))
    monkeypatch.setattr(pc, "_join_existing", lambda device: calls.append(device))
    try:
        pc._default_context = None
        ctx = pc.init(1, 1, 1)
        pc.init(1, 1, 1)
        assert calls == [torch.device("cpu")]
        assert ctx.host_group("pp") is ctx.pp_group  # gloo: the mesh's own
    finally:
        if previous is not None:
            pc._default_context = previous


def test_init_destroys_the_process_group_at_exit(tmp_path):
    """Left to the destructors, gloo's threads can abort the exiting process (SIGABRT)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import atexit, torch.distributed as dist, merak\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
        "merak.init(1, 1, 1, backend='gloo')\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "initialized at exit: False" in run.stdout, run.stdout + run.stderr[-3000:]
