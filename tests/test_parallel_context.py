"""`merak.init` pieces that decide the device and the point-to-point rules, without NCCL."""

from __future__ import annotations

import datetime

import pytest
import torch

from merak.distributed import parallel_context as pc


@pytest.mark.parametrize("local_rank,count,expected",
                         [(0, 1, 0), (3, 1, 0), (5, 8, 5), (9, 8, 1), (7, 4, 3)])
def test_local_device_is_local_rank_modulo_visible_devices(local_rank, count, expected):
    assert pc.local_device_index(local_rank, count) == expected


def test_no_visible_device_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        pc.local_device_index(0, 0)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        pc.local_device_index(-1, 2)


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" On ", True),
    ("0", False), ("false", False), ("off", False), ("", False), ("2", False), ("y", False),
])
def test_p2p_rules_environment_variable(monkeypatch, value, expected):
    monkeypatch.setenv(pc.NCCL_P2P_RULES_ENV, value)
    assert pc.resolve_nccl_p2p_rules("gloo", None) is expected


def test_p2p_rules_keyword_wins_over_the_environment_and_nccl_always_has_them(monkeypatch):
    monkeypatch.delenv(pc.NCCL_P2P_RULES_ENV, raising=False)
    assert pc.resolve_nccl_p2p_rules("gloo", None) is False
    assert pc.resolve_nccl_p2p_rules("gloo", True) is True
    monkeypatch.setenv(pc.NCCL_P2P_RULES_ENV, "1")
    assert pc.resolve_nccl_p2p_rules("gloo", False) is False
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        assert pc.resolve_nccl_p2p_rules(backend, False) is True
        assert pc.resolve_nccl_p2p_rules(backend, None) is True


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


def test_init_records_the_p2p_rules(monkeypatch):
    monkeypatch.delenv(pc.NCCL_P2P_RULES_ENV, raising=False)
    previous = pc._default_context
    try:
        ctx = pc.init(1, 1, 1, backend=None if torch.distributed.is_initialized() else "gloo")
        if ctx.backend == "gloo":
            assert ctx.nccl_p2p_rules is False and ctx.device == torch.device("cpu")
        assert pc.init(1, 1, 1, nccl_p2p_rules=True).nccl_p2p_rules is True
        monkeypatch.setenv(pc.NCCL_P2P_RULES_ENV, "yes")
        assert pc.init(1, 1, 1).nccl_p2p_rules is True
    finally:
        if previous is not None:
            pc._default_context = previous
