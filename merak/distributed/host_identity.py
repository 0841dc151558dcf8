"""Which processes share this process's view of /proc: the same kernel boot and PID namespace.

A beacon (`merak.distributed.liveness`) carries its process's pid so that a rank diagnosing a
failed wait can read the peer's state from ``/proc/<pid>``. That read is only meaningful when
the peer's pid names a process in this process's PID namespace on this very kernel. The node
name does not say so: containers started with host networking share the node name while each
has a PID namespace of its own, so ``/proc/<pid>`` there names some other process, or none.
The identity here is the kernel's boot id (``/proc/sys/kernel/random/boot_id``, new at every
boot, one per kernel) joined to the PID namespace (``/proc/self/ns/pid``, e.g.
``pid:[4026531836]``); two processes with equal identities see each other's pids.
"""

from __future__ import annotations

import functools
import os

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE_PATH = "/proc/self/ns/pid"


def read_identity(boot_id_path: str = BOOT_ID_PATH,
                  pid_namespace_path: str = PID_NAMESPACE_PATH) -> str | None:
    """The host identity read from the given paths (see the module doc).

    Args:
        boot_id_path: the file holding the kernel's boot id.
        pid_namespace_path: the link naming this process's PID namespace.

    Returns:
        ``"<boot id>/<pid namespace>"``, or None when either cannot be read (no /proc, a
        restricted one, another operating system).
    """
    try:
        with open(boot_id_path) as f:
            boot_id = f.read().strip()
        namespace = os.readlink(pid_namespace_path).strip()
    except (OSError, ValueError):
        return None
    if not boot_id or not namespace:
        return None
    return f"{boot_id}/{namespace}"


@functools.cache
def host_identity() -> str | None:
    """This process's host identity (`read_identity`), read once: neither part changes while
    the process runs."""
    return read_identity()
