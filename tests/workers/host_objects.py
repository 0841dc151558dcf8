"""Objects between ranks through host memory (`merak.distributed.host_objects`), on 4 ranks in
tp_parity.py's launch: the helpers deliver in rank order, over the default group on gloo and
over a gloo group of their own where the default backend moves no CPU tensors (NCCL, simulated
here), and the evaluation's prediction gather uses no torch object collective (those stage
pickled bytes on the GPU under NCCL). `no_object_collectives` guards the export and evaluation
paths in lora_parity.py and trainer_parity.py too."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist

import merak
import merak.distributed.host_objects as host
from merak.distributed.parallel_context import make_host_groups
from merak.trainer.evaluation import EvaluationMixin

OBJECT_COLLECTIVES = ("gather_object", "all_gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list")


@contextlib.contextmanager
def no_object_collectives():
    """torch's object collectives raise while entered."""
    saved = {name: getattr(dist, name) for name in OBJECT_COLLECTIVES}

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"torch.distributed.{name} was called: under NCCL it stages "
                                 f"pickled bytes on the GPU; use merak.distributed.host_objects")
        return call

    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _helpers(group) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    ranks = dist.get_process_group_ranks(group)
    assert host.all_gather_objects({"r": rank}, group) == [{"r": r} for r in ranks]
    assert host.broadcast_object("x" * rank if rank == ranks[-1] else None, ranks[-1],
                                 group) == "x" * ranks[-1]
    got = host.gather_objects((rank, torch.arange(rank)), dst=ranks[0], group=group)
    if rank == ranks[0]:
        assert [r for r, _ in got] == ranks and all(torch.equal(t, torch.arange(r))
                                                    for r, t in got), got
    else:
        assert got is None
    assert size == 4


def host_objects() -> None:
    ctx = merak.init(dp=1, tp=1, pp=4)
    rank = dist.get_rank()
    with no_object_collectives():
        assert ctx.host_group() is dist.group.WORLD  # gloo moves CPU tensors itself
        assert ctx.host_group("pp") is ctx.pp_group
        _helpers(dist.group.WORLD)
        # beside an NCCL job: gloo groups of their own, for the world and each dimension
        groups = make_host_groups(ctx.mesh, "nccl")
        assert groups["world"] is not dist.group.WORLD
        assert all(dist.get_backend(g) == "gloo" for g in groups.values())
        assert dist.get_process_group_ranks(groups["pp"]) == [0, 1, 2, 3]
        assert dist.get_process_group_ranks(groups["dp"]) == [rank]
        _helpers(groups["world"])
        _helpers(groups["pp"])
        _last_stage_gather()


def _last_stage_gather() -> None:
    """dp2 x pp2: the last stage's two dp ranks hold shares; every rank gets both, dp order."""
    ctx = merak.init(dp=2, tp=1, pp=2)
    trainer = SimpleNamespace(ctx=ctx, engine=SimpleNamespace(interpreter=SimpleNamespace(
        split=SimpleNamespace(num_stages=2), placement=(0, 1))))
    mine = None
    if ctx.pp_rank == 1:
        mine = (torch.full((ctx.dp_rank + 1, 3), float(ctx.dp_rank)),
                torch.tensor([ctx.dp_rank] * (ctx.dp_rank + 1)))
    logits, labels = EvaluationMixin._gather_from_last_stages(trainer, mine)
    assert torch.equal(logits, torch.tensor([[0.0] * 3, [1.0] * 3, [1.0] * 3])), logits
    assert labels.tolist() == [0, 1, 1], labels


SCENARIOS = {4: {"host-objects": host_objects}}
