"""The store of one torchrun attempt: a restarted job's process groups start from clean keys.

Under ``torchrun --max-restarts N`` the agent keeps one TCPStore for the whole run and every
attempt's workers meet in it (``TORCHELASTIC_USE_AGENT_STORE``). torch's env:// rendezvous
prefixes its keys with the group's name only, so the workers of a restarted attempt read the
keys the dead attempt left: gloo's full mesh then connects to the old workers' addresses and
fails ("Connection refused"), or pairs a new worker with an old one. The group built here uses
the same store under a prefix of the attempt (``TORCHELASTIC_RESTART_COUNT``), so each
attempt, and every group made from the default store later, sees only its own keys.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch.distributed as dist

PREFIX = "merak/attempt_{}"


def hosts_store(env: Mapping[str, str], rank: int) -> bool:
    """Whether this process starts the store's server: never under torchrun's agent store
    (the agent holds it), else rank 0 (as torch's env:// rendezvous does)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0


def for_this_attempt(env: Mapping[str, str], timeout: datetime.timedelta,
                     ) -> tuple[dist.Store, int, int] | None:
    """The default group's store for this attempt, with this rank and the world size.

    Args:
        env: the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
            TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE).
        timeout: how long connecting to the store and each of its waits may last.

    Returns:
        ``(PrefixStore("merak/attempt_<restart count>", TCPStore), rank, world size)`` for
        `dist.init_process_group`'s ``store``, ``rank`` and ``world_size``; None where no
        launcher's restart count is set (torch's env:// rendezvous then, as before).
    """
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    port = int(env["MASTER_PORT"])
    if not 0 <= port < 2 ** 16:
        raise ValueError(f"MASTER_PORT must be a port number (0 to 65535), got {port}")
    master = hosts_store(env, rank)
    store = dist.TCPStore(env["MASTER_ADDR"], port, world_size, is_master=master,
                          timeout=timeout, multi_tenant=master)
    return dist.PrefixStore(PREFIX.format(attempt.strip() or "0"), store), rank, world_size
