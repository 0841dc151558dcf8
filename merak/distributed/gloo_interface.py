"""The network interface of a multi-node job's gloo groups (``GLOO_SOCKET_IFNAME``).

Merak keeps gloo groups beside an NCCL job (`ParallelContext.host_group`). Without
``GLOO_SOCKET_IFNAME``, gloo listens on the first address the host name resolves to; on a
Debian-style host that is 127.0.1.1 (``/etc/hosts``), a loopback address the other nodes cannot
reach, and the group's creation hangs until the job's timeout. NCCL picks its own interface,
so the same job runs on NCCL alone and hangs in `merak.init` as soon as gloo is involved.

`ensure` runs before `merak.init` creates any group. In a multi-node job (torchrun's
``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``, or ``GROUP_WORLD_SIZE`` / ``NNODES`` above 1) with
``GLOO_SOCKET_IFNAME`` unset, it sets it to ``NCCL_SOCKET_IFNAME`` when that names one plain
interface, else to the interface holding this host's address on the route to
``MASTER_ADDR``. When neither gives an interface and the host name resolves to a loopback
address, it raises, naming the variable to set. Single-node jobs are left alone.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import subprocess
from collections.abc import Callable, Mapping, MutableMapping

logger = logging.getLogger(__name__)

ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def is_multi_node(env: Mapping[str, str]) -> bool:
    """Whether the launcher's variables describe ranks on more than one node."""
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    if world is not None and local is not None and 0 < local < world:
        return True
    return any((_int(env, name) or 0) > 1 for name in ("GROUP_WORLD_SIZE", "NNODES"))


def plain_interface(value: str | None) -> str | None:
    """`value` (an ``NCCL_SOCKET_IFNAME``) when it names exactly one interface: not empty, no
    ``^`` (exclude) or ``=`` (exact match) prefix, no comma-separated list."""
    value = (value or "").strip()
    if not value or value[0] in "^=" or "," in value or any(c.isspace() for c in value):
        return None
    return value


def route_address(host: str, port: int) -> str | None:
    """This host's address on the route to `host`: a UDP socket's address once connected
    (no packet is sent), or None when `host` does not resolve or has no route."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(address)
            return sock.getsockname()[0]
    except (OSError, IndexError, UnicodeError):
        return None


def _ipv4_by_ioctl() -> dict[str, str]:
    """interface -> primary IPv4 address (Linux ``SIOCGIFADDR``)."""
    import fcntl

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or the interface is gone
                continue
            found[name] = socket.inet_ntoa(answer[20:24])
    return found


def _addresses_by_ip_command() -> list[tuple[str, str]]:
    """(interface, address) of every address ``ip -o addr`` lists (secondary ones too)."""
    try:
        text = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True,
                              timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    pairs = []
    for line in text.splitlines():
        words = line.split()
        for kind in ("inet", "inet6"):
            if kind in words[:-1] and len(words) > 1:
                name = words[1].split("@")[0]
                pairs.append((name, words[words.index(kind) + 1].split("/")[0]))
    return pairs


def _ipv6_by_proc() -> list[tuple[str, str]]:
    """(interface, address) of every IPv6 address in ``/proc/net/if_inet6``."""
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pairs = []
    for line in lines:
        words = line.split()
        if len(words) >= 6 and len(words[0]) == 32:
            pairs.append((words[5], str(ipaddress.IPv6Address(int(words[0], 16)))))
    return pairs


def interface_holding(address: str) -> str | None:
    """The name of the local interface that holds `address`, or None."""
    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if wanted.version == 4:
        try:
            for name, held in _ipv4_by_ioctl().items():
                if ipaddress.ip_address(held) == wanted:
                    return name
        except (ImportError, OSError):  # not Linux
            pass
    for name, held in [*(_ipv6_by_proc() if wanted.version == 6 else []),
                       *_addresses_by_ip_command()]:
        try:
            if ipaddress.ip_address(held.split("%")[0]) == wanted:
                return name
        except ValueError:
            continue
    return None


def hostname_address() -> str | None:
    """The address gloo listens on without ``GLOO_SOCKET_IFNAME``: the first one this host's
    name resolves to (None when it does not resolve; gloo then uses the loopback)."""
    try:
        return socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError, UnicodeError):
        return None


def _is_loopback(address: str | None) -> bool:
    try:
        return address is None or ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def choose(env: Mapping[str, str], *,
           route: Callable[[str, int], str | None] = route_address,
           holder: Callable[[str], str | None] = interface_holding,
           own_address: Callable[[], str | None] = hostname_address) -> str | None:
    """The interface to set as ``GLOO_SOCKET_IFNAME``, or None to leave the job as it is.

    Args:
        env: the process's environment (torchrun's variables).
        route: this host's address on the route to (MASTER_ADDR, MASTER_PORT).
        holder: the interface holding an address.
        own_address: the address this host's name resolves to (what gloo would use).

    Returns:
        None for a single-node job or one with ``GLOO_SOCKET_IFNAME`` set; else the interface
        from ``NCCL_SOCKET_IFNAME`` or from the route to MASTER_ADDR (None when neither gives
        one and the host name resolves to a routable address, which gloo then uses).

    Raises:
        RuntimeError: no interface was found and the host name resolves to a loopback
            address (or to none), on which the other nodes cannot reach this one.
    """
    if env.get(ENV) or not is_multi_node(env):
        return None
    nccl = plain_interface(env.get("NCCL_SOCKET_IFNAME"))
    if nccl is not None:
        return nccl
    master, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT") or 29500
    local = route(master, port) if master else None
    name = holder(local) if local and not _is_loopback(local) else None
    if name is not None:
        return name
    own = own_address()
    if _is_loopback(own):
        raise RuntimeError(
            f"merak.init: this multi-node job's gloo groups would listen on a loopback address "
            f"(host name {socket.gethostname()!r} resolves to {own or 'nothing'}), which the "
            f"other nodes cannot reach, and no interface was found on the route to "
            f"MASTER_ADDR={master or '(unset)'} (this host's address there: {local or 'none'}). "
            f"Set {ENV} on every node to the network interface that reaches the other nodes "
            f"(e.g. `export {ENV}=eth0`; `ip -o -4 addr` lists them), or NCCL_SOCKET_IFNAME to "
            f"one interface, which Merak then gives gloo too")
    return None


def ensure(env: MutableMapping[str, str] | None = None, **resolvers) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in `env` (default ``os.environ``) as `choose` decides, before
    any gloo group of the job exists, and log the interface chosen (a warning on local rank 0,
    which shows without logging set up; information on the others).

    Args:
        env: the environment to read and update.
        **resolvers: `choose`'s ``route``, ``holder`` and ``own_address``.

    Returns:
        The interface set, or None when nothing was changed.

    Raises:
        RuntimeError: see `choose`.
    """
    env = os.environ if env is None else env
    name = choose(env, **resolvers)
    if name is not None:
        env[ENV] = name
        source = "NCCL_SOCKET_IFNAME" if name == plain_interface(
            env.get("NCCL_SOCKET_IFNAME")) else f"the route to {env.get('MASTER_ADDR')}"
        level = logging.WARNING if env.get("LOCAL_RANK", "0") == "0" else logging.INFO
        logger.log(level, "merak: multi-node job: %s=%s (from %s) for the gloo groups", ENV,
                   name, source)
    return name
