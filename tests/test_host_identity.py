"""A peer's /proc state is read only when its beacon comes from this kernel boot and PID
namespace (`merak.distributed.host_identity`), not merely from a host of the same name:
containers with host networking share the node name but not their pids."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest

from merak.distributed import host_identity, liveness
from merak.distributed.peer_report import local_state

ME = "5aa274cf-6e4c-4a36-98d1-5f6cd29a4089/pid:[4026531836]"


def _beacon(host_id: str | None, pid: int | None = None) -> dict:
    value = {"pid": os.getpid() if pid is None else pid, "host": os.uname().nodename}
    if host_id is not None:
        value["host_id"] = host_id
    return value


def test_identity_is_boot_id_and_pid_namespace(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("5aa274cf-6e4c-4a36-98d1-5f6cd29a4089\n")
    namespace = tmp_path / "pid"
    namespace.symlink_to("pid:[4026531836]")
    assert host_identity.read_identity(str(boot), str(namespace)) == ME
    assert host_identity.read_identity(str(tmp_path / "none"), str(namespace)) is None
    assert host_identity.read_identity(str(boot), str(tmp_path / "none")) is None
    assert host_identity.read_identity(str(boot), str(boot)) is None  # not a link


@pytest.mark.skipif(not os.path.exists(host_identity.BOOT_ID_PATH), reason="no /proc")
def test_this_process_identity_matches_the_kernel():
    with open(host_identity.BOOT_ID_PATH) as f:
        boot = f.read().strip()
    expected = f"{boot}/{os.readlink(host_identity.PID_NAMESPACE_PATH)}"
    assert host_identity.host_identity() == expected
    load = ("import importlib.util as u, sys; s = u.spec_from_file_location('h', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.host_identity())")
    child = subprocess.run([sys.executable, "-c", load, host_identity.__file__],
                           capture_output=True, text=True, timeout=60, check=True)  # no torch
    assert child.stdout.strip() == expected  # a process of the same namespace: the same


@pytest.mark.parametrize("theirs", [
    "5aa274cf-6e4c-4a36-98d1-5f6cd29a4089/pid:[4026532999]",  # another container's namespace
    "0b7e1e0e-0000-4000-8000-000000000000/pid:[4026531836]",  # another machine's kernel
    None,                                                      # a beacon without an identity
])
def test_same_node_name_but_another_identity_is_not_local(theirs):
    assert local_state(_beacon(theirs), here=ME) is None


def test_an_unreadable_identity_here_is_not_local(monkeypatch):
    from merak.distributed import peer_report

    monkeypatch.setattr(peer_report, "host_identity", lambda: None)  # no /proc here
    assert local_state({**_beacon(None), "host_id": None}) is None
    assert local_state(_beacon(ME)) is None


@pytest.mark.skipif(host_identity.host_identity() is None, reason="no /proc identity")
def test_the_same_identity_reads_proc():
    mine = host_identity.host_identity()
    assert local_state(_beacon(mine)) == "running"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    assert local_state(_beacon(mine, gone.pid)) == "dead"
    assert local_state(_beacon(mine.replace("pid:[", "pid:[9"))) is None


def test_the_beacon_carries_the_identity():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    beacon = liveness.Beacon("127.0.0.1", store.port, 0, 1, "test/beacon/", interval_s=0.1)
    try:
        value = json.loads(bytes(store.get("test/beacon/0")))
    finally:
        beacon.stop()
    assert value["host_id"] == host_identity.host_identity()
    assert value["pid"] == os.getpid() and value["host"] == os.uname().nodename
