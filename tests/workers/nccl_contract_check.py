"""The NCCL-contract test backend itself (tests/nccl_contract), on 2 ranks: one `Work` per
group, tags ignored, receive buffers unfilled until the wait, sends complete only at the
rendezvous, groups in posting order (a send/send head-to-head deadlocks as on NCCL), and
gloo's collectives and subgroups untouched. See test_nccl_contract.py."""

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


def installed() -> None:
    assert nccl_contract.installed(), "the suite's processes must run under the NCCL contract"
    assert dist.batch_isend_irecv is nccl_contract.batch_isend_irecv


def one_work_per_group() -> None:
    out, into = torch.full((3,), float(dist.get_rank())), torch.empty(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, _peer()),
                                    dist.P2POp(dist.irecv, into, _peer())])
    assert len(works) == 1, f"NCCL returns one Work per group, got {len(works)}"
    works[0].wait()
    assert torch.equal(into, torch.full((3,), float(_peer()))), into


def tags_ignored() -> None:
    """Messages pair up in posting order whatever their tags."""
    if dist.get_rank() == 0:
        for value, tag in ((1.0, 5), (2.0, 7)):
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([value]), 1,
                                               tag=tag)])[0].wait()
    else:
        first, second = torch.empty(1), torch.empty(1)
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, 0, tag=7)])[0].wait()
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, second, 0, tag=5)])[0].wait()
        assert (first.item(), second.item()) == (1.0, 2.0), (first, second)


def unfilled_until_waited() -> None:
    """A receive's tensor holds garbage (NaN) until its group's Work was waited."""
    if dist.get_rank() == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), 1)])[0].wait()
        dist.barrier()
    else:
        into = torch.zeros(4)
        work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, 0)])[0]
        dist.barrier()  # the data has been sent
        assert torch.isnan(into).all(), f"read before the wait must not see data: {into}"
        work.wait()
        assert torch.equal(into, torch.ones(4)), into


def rendezvous_send() -> None:
    """A send is not complete before its receive is posted (gloo would have buffered it)."""
    if dist.get_rank() == 0:
        work = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 1)])[0]
        time.sleep(0.5)  # ample time for gloo to buffer it; rank 1 posts after the barrier
        assert not work.is_completed(), "a send completed before its receive was posted"
        dist.barrier()
        work.wait()
        assert work.is_completed()
    else:
        dist.barrier()
        into = torch.empty(2)
        dist.recv(into, 0)  # a plain recv: a group of one
        assert torch.equal(into, torch.ones(2))


def groups_in_order() -> None:
    """Groups complete in posting order: waiting for the second completes the first."""
    if dist.get_rank() == 0:
        dist.isend(torch.tensor([2.0]), 1).wait()
        dist.isend(torch.tensor([1.0]), 1).wait()
    else:
        first, second = torch.empty(1), torch.empty(1)
        works = [dist.irecv(first, 0), dist.irecv(second, 0)]
        works[1].wait()
        assert works[0].is_completed(), "the second group completed before the first"
        works[0].wait()
        assert (first.item(), second.item()) == (2.0, 1.0)


def collectives_and_subgroups() -> None:
    ctx = merak.init(dp=2, tp=1, pp=1)
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=ctx.dp_group)
    assert value.item() == 3.0
    gathered = torch.zeros(2)
    all_gather_single(gathered, torch.tensor([float(dist.get_rank())]),
                                group=ctx.host_group())
    assert gathered.tolist() == [0.0, 1.0], gathered


def head_to_head_sends_deadlock() -> None:
    """Each rank sends first, then receives, in separate groups: on NCCL both streams wait in
    their send forever. Here both time out (gloo alone completes it)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2))
    send = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), _peer())])[0]
    recv = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(1), _peer())])[0]
    try:
        recv.wait()
    except RuntimeError as error:
        assert "did not complete" in str(error) or "timed out" in str(error).lower(), error
        assert not send.is_success()
        # stay until the peer has timed out too: leaving closes this rank's connections, and a
        # peer still waiting (a loaded machine skews the two clocks) would see "Connection
        # closed by peer" instead of its own timeout
        time.sleep(15)
        return
    raise AssertionError("a head-to-head send/send pair completed; NCCL deadlocks on it")


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
