"""The NCCL-contract test backend itself (tests/nccl_contract), on 2 ranks: one `Work` per
group, tags ignored, receive buffers unfilled until the wait, sends complete only at the
rendezvous, groups in posting order (a send/send head-to-head deadlocks as on NCCL), and
gloo's collectives and subgroups untouched. Each scenario returns what it saw;
test_nccl_contract.py asserts it."""

from __future__ import annotations

import datetime
import time

import nccl_contract
import torch
import torch.distributed as dist
from common import run_scenarios

import merak
from merak.distributed.compat import all_gather_single


def _peer() -> int:
    return 1 - dist.get_rank()


def installed() -> dict:
    return {"installed": nccl_contract.installed(),
            "batch_isend_irecv_is_the_contracts":
                dist.batch_isend_irecv is nccl_contract.batch_isend_irecv}


def one_work_per_group() -> dict:
    out, into = torch.full((3,), float(dist.get_rank())), torch.empty(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, _peer()),
                                    dist.P2POp(dist.irecv, into, _peer())])
    works[0].wait()
    return {"works": len(works), "received": into.tolist(), "peer": _peer()}


def tags_ignored() -> dict:
    """Messages pair up in posting order whatever their tags (rank 1 receives tag 7 first)."""
    if dist.get_rank() == 0:
        for value, tag in ((1.0, 5), (2.0, 7)):
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([value]), 1,
                                               tag=tag)])[0].wait()
        return {}
    first, second = torch.empty(1), torch.empty(1)
    dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, 0, tag=7)])[0].wait()
    dist.batch_isend_irecv([dist.P2POp(dist.irecv, second, 0, tag=5)])[0].wait()
    return {"received_in_order": [first.item(), second.item()]}


def unfilled_until_waited() -> dict:
    """What a receive's tensor holds before its group's Work was waited (after the data was
    sent) and after."""
    if dist.get_rank() == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), 1)])[0].wait()
        dist.barrier()
        return {}
    into = torch.zeros(4)
    work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, 0)])[0]
    dist.barrier()  # the data has been sent
    before = into.clone()
    work.wait()
    return {"all_nan_before_wait": bool(torch.isnan(before).all()),
            "after_wait": into.tolist()}


def rendezvous_send() -> dict:
    """Whether a send completed before its receive was posted (gloo would have buffered it)."""
    if dist.get_rank() == 0:
        work = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 1)])[0]
        time.sleep(0.5)  # ample time for gloo to buffer it; rank 1 posts after the barrier
        early = work.is_completed()
        dist.barrier()
        work.wait()
        return {"completed_before_the_receive": early, "completed_after": work.is_completed()}
    dist.barrier()
    into = torch.empty(2)
    dist.recv(into, 0)  # a plain recv: a group of one
    return {"received": into.tolist()}


def groups_in_order() -> dict:
    """Groups complete in posting order: waiting for the second completes the first."""
    if dist.get_rank() == 0:
        dist.isend(torch.tensor([2.0]), 1).wait()
        dist.isend(torch.tensor([1.0]), 1).wait()
        return {}
    first, second = torch.empty(1), torch.empty(1)
    works = [dist.irecv(first, 0), dist.irecv(second, 0)]
    works[1].wait()
    first_done = works[0].is_completed()
    works[0].wait()
    return {"first_done_with_the_second": first_done,
            "received": [first.item(), second.item()]}


def collectives_and_subgroups() -> dict:
    ctx = merak.init(dp=2, tp=1, pp=1)
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=ctx.dp_group)
    gathered = torch.zeros(2)
    all_gather_single(gathered, torch.tensor([float(dist.get_rank())]),
                      group=ctx.host_group())
    return {"all_reduced": value.item(), "all_gathered": gathered.tolist()}


def head_to_head_sends_deadlock() -> dict:
    """Each rank sends first, then receives, in separate groups: on NCCL both streams wait in
    their send forever. Here both time out (gloo alone completes it)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2))
    send = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), _peer())])[0]
    recv = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(1), _peer())])[0]
    try:
        recv.wait()
    except RuntimeError as error:
        # stay until the peer has timed out too: leaving closes this rank's connections, and a
        # peer still waiting (a loaded machine skews the two clocks) would see "Connection
        # closed by peer" instead of its own timeout
        time.sleep(15)
        return {"completed": False, "error": str(error), "send_succeeded": send.is_success()}
    return {"completed": True}


ALONE = ["head-to-head-sends-deadlock"]  # leaves the pairs unusable: a launch of its own


def scenarios(world_size: int) -> dict:
    if world_size != 2:
        return {}
    return {"installed": installed, "one-work-per-group": one_work_per_group,
            "tags-ignored": tags_ignored, "unfilled-until-waited": unfilled_until_waited,
            "rendezvous-send": rendezvous_send, "groups-in-order": groups_in_order,
            "collectives-and-subgroups": collectives_and_subgroups}


if __name__ == "__main__":
    run_scenarios({**scenarios(2), "head-to-head-sends-deadlock": head_to_head_sends_deadlock})
