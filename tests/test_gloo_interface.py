"""A multi-node job's gloo groups get a routable interface (``GLOO_SOCKET_IFNAME``) before
`merak.init` creates any group, or a clear error (`merak.distributed.gloo_interface`)."""

from __future__ import annotations

import socket
import sys

import pytest

from merak.distributed import gloo_interface as gi

MULTI = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "node0",
         "MASTER_PORT": "29400", "LOCAL_RANK": "0"}


def _never(*args):
    raise AssertionError(f"a resolver was asked {args}")


@pytest.mark.parametrize("env,multi", [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),
    ({"WORLD_SIZE": "2"}, False),
    ({"GROUP_WORLD_SIZE": "2"}, True),
    ({"NNODES": "4"}, True),
    ({"NNODES": "1", "GROUP_WORLD_SIZE": "1"}, False),
    ({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "1"}, False),
])
def test_multi_node_comes_from_the_launcher(env, multi):
    assert gi.is_multi_node(env) is multi


@pytest.mark.parametrize("value,plain", [
    ("eth0", "eth0"), (" ib0 ", "ib0"), ("^docker0,lo", None), ("=eth0", None),
    ("eth0,eth1", None), ("", None), (None, None), ("^lo", None),
])
def test_only_one_plain_nccl_interface_is_taken(value, plain):
    assert gi.plain_interface(value) == plain


def test_nccl_socket_ifname_gives_gloo_its_interface():
    env = {**MULTI, "NCCL_SOCKET_IFNAME": "ens5"}
    assert gi.ensure(env, route=_never, holder=_never, own_address=_never) == "ens5"
    assert env[gi.ENV] == "ens5"


def test_the_route_to_master_gives_the_interface():
    asked = []

    def route(host, port):
        asked.append((host, port))
        return "10.1.2.3"

    env = {**MULTI, "NCCL_SOCKET_IFNAME": "^docker0,lo"}  # an exclusion: not one interface
    holder = {"10.1.2.3": "eth7"}.get
    assert gi.ensure(env, route=route, holder=holder, own_address=_never) == "eth7"
    assert env[gi.ENV] == "eth7" and asked == [("node0", 29400)]


def test_a_loopback_host_name_without_an_interface_is_a_clear_error():
    for route in (lambda host, port: None, lambda host, port: "127.0.1.1"):
        env = dict(MULTI)
        with pytest.raises(RuntimeError, match=r"resolves to 127\.0\.1\.1.*Set "
                                               r"GLOO_SOCKET_IFNAME on every node"):
            gi.ensure(env, route=route, holder=lambda address: "lo",
                      own_address=lambda: "127.0.1.1")
        assert gi.ENV not in env
    with pytest.raises(RuntimeError, match="resolves to nothing"):  # gloo falls back to lo
        gi.choose(MULTI, route=lambda host, port: None, holder=_never, own_address=lambda: None)


def test_a_routable_host_name_is_left_to_gloo_when_no_interface_is_found():
    env = dict(MULTI)
    assert gi.ensure(env, route=lambda host, port: "10.0.0.9", holder=lambda address: None,
                     own_address=lambda: "10.0.0.9") is None
    assert gi.ENV not in env


@pytest.mark.parametrize("env", [
    {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},  # one node
    {},                                                                         # no launcher
    {**MULTI, gi.ENV: "bond0"},                                                 # the user's
])
def test_single_node_jobs_and_a_set_interface_are_left_alone(env):
    before = dict(env)
    assert gi.ensure(env, route=_never, holder=_never, own_address=_never) is None
    assert env == before


def test_the_choice_is_logged(caplog):
    env = {**MULTI, "NCCL_SOCKET_IFNAME": "ens5"}
    with caplog.at_level("INFO", logger=gi.__name__):
        gi.ensure(env)
    assert "GLOO_SOCKET_IFNAME=ens5 (from NCCL_SOCKET_IFNAME)" in caplog.text


def test_init_chooses_before_creating_any_group(monkeypatch):
    from merak.distributed import parallel_context as pc

    created = []
    monkeypatch.setattr(pc.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pc, "_create_group", lambda *args: created.append(args))
    monkeypatch.setattr(gi, "ensure", lambda: _never("ensure"))
    with pytest.raises(AssertionError, match="ensure"):
        pc.init(1, 1, 1, backend="gloo")
    assert created == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")
def test_real_route_to_the_loopback_finds_lo():
    assert gi.route_address("127.0.0.1", 29500) == "127.0.0.1"
    assert gi.interface_holding("127.0.0.1") == "lo"
    assert gi.interface_holding("203.0.113.254") is None  # held by no interface here
    names = {name for _, name in socket.if_nameindex()}
    assert "lo" in names
