"""The words of a failed wait (`merak.distributed.liveness.diagnose`): from two reads of every
rank's beacon, which ranks did not arrive and why, and what to check."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from merak.distributed.host_identity import host_identity


def local_state(value: dict, here: str | None = None) -> str | None:
    """The state of a beacon's process when it shares this process's view of /proc.

    A peer is local only when its beacon's ``host_id`` equals this process's
    (`merak.distributed.host_identity`: kernel boot id and PID namespace); the node name alone
    would take a container with host networking for this host and read the wrong /proc/<pid>.

    Args:
        value: one rank's beacon (its ``pid`` and ``host_id``).
        here: this process's host identity (default: `host_identity()`).

    Returns:
        "stopped", "dead" or "running" (from /proc/<pid>/stat), else None (another host or
        PID namespace, or an identity that cannot be read on either side).
    """
    here = host_identity() if here is None else here
    if here is None or value.get("host_id") != here or not os.path.isdir("/proc"):
        return None
    try:
        with open(f"/proc/{int(value['pid'])}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, KeyError, ValueError, IndexError):
        return "dead"
    return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(state, "running")


def _first_line(text: str, limit: int = 240) -> str:
    text = str(text).strip()
    return (text.splitlines()[0] if text else "")[:limit]


def _classify(rank: int, first: dict, second: dict) -> tuple[str, str]:
    """(kind, sentence) of one peer: kind in missing, failed, exited, silent, alive."""
    now, value = time.time(), second.get(rank)
    if value is None:
        return "missing", f"rank {rank} never showed a sign of life (did it reach merak.init?)"
    where, message = value.get("where", "?"), value.get("message", "")
    if value.get("state") == "failed":
        return "failed", f"rank {rank} gave up first: {_first_line(message, 600)}"
    if value.get("state") == "exited":
        return "exited", (f"rank {rank} has exited" + (f" after {_first_line(message)}"
                                                       if message else "") +
                          f" (last in {where})")
    age = max(now - float(value.get("t", now)), 0.0)
    here = local_state(value)
    if here == "stopped":
        return "silent", (f"rank {rank} is stopped (SIGSTOP or a debugger: pid "
                          f"{value.get('pid')} on this host, state T); its last sign of life, "
                          f"{age:.0f} s ago, was in {where}")
    if here == "dead":
        return "silent", (f"rank {rank} is dead (pid {value.get('pid')} on this host is gone: "
                          f"killed, or crashed without a Python error); its last sign of life, "
                          f"{age:.0f} s ago, was in {where}")
    before = first.get(rank)
    if first is not second and before is not None and before.get("n") == value.get("n"):
        return "silent", (f"rank {rank} does not answer: its sign of life stopped {age:.0f} s "
                          f"ago, last in {where} (its process is stopped, hung in native code, "
                          f"or dead; pid {value.get('pid')} on {value.get('host')})")
    return "alive", f"rank {rank} is alive, in {where}"


def _listed(sentences: list[str], limit: int = 8) -> str:
    more = f"; and {len(sentences) - limit} more" if len(sentences) > limit else ""
    return "; ".join(sentences[:limit]) + more


def describe(rank: int, action: str, waited_s: float, timeout_s: float | None,
             error: BaseException | None, peers: Sequence[int] | None,
             first: dict | str, second: dict | str, world_size: int = 0) -> str:
    """`first` and `second`: every rank's beacon, read 2 s apart (or why they cannot be)."""
    head = f"rank {rank} gave up on {action} after {waited_s:.1f} s"
    if timeout_s:
        head += f" (the job's timeout: {timeout_s:g} s, ddp_timeout / merak.init(timeout=))"
    if peers:
        head += f" waiting for rank(s) {sorted(set(peers) - {rank})}"
    cause = f" (backend: {_first_line(error)})" if error is not None else ""
    if isinstance(second, str):  # the beacons cannot be read
        return f"{head}: {second}.{cause}"
    peers = set(peers or ()) - {rank}
    order = sorted((set(second) | set(first) | peers | set(range(world_size))) - {rank},
                   key=lambda r: (r not in peers, r))
    found = {r: _classify(r, first, second) for r in order}
    missing = [r for r in order if found[r][0] in ("silent", "exited", "missing")]
    failed = [r for r in order if found[r][0] == "failed"]
    if missing:
        sentences = _listed([found[r][1] for r in missing])
        pids = ", ".join(str(r) for r in missing[:8]) + (", ..." if len(missing) > 8 else "")
        shown = missing if len(missing) <= 32 else [*missing[:32], "..."]
        return (f"{head}: rank(s) {shown} did not arrive. {sentences}. Check rank(s) {pids}: "
                f"its log; whether it was suspended (SIGSTOP, a debugger) or killed (its exit "
                f"code, the kernel's OOM killer in dmesg); `py-spy dump --pid` if it hangs. If "
                f"a step can take longer than the timeout, raise ddp_timeout.{cause}")
    if failed:
        return f"{head}: {_listed([found[r][1] for r in failed], 2)}.{cause}"
    alive = _listed([found[r][1] for r in order if r in peers]) or "every rank answers"
    return (f"{head}, although every rank answers: {alive}. Check that every rank runs the "
            f"same program (steps, schedule, evaluation and save settings) and that the "
            f"timeout covers the slowest rank's work.{cause}")
