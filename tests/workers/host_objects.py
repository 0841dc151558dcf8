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
from merak.distributed.backends import make_host_groups
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


def _helpers(group) -> dict:
    """What each helper delivered over `group` on this rank."""
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group)
    got = host.gather_objects((rank, torch.arange(rank)), dst=ranks[0], group=group)
    return {"ranks": ranks,
            "all_gather": host.all_gather_objects({"r": rank}, group),
            "broadcast": host.broadcast_object("x" * rank if rank == ranks[-1] else None,
                                               ranks[-1], group),
            "gather": None if got is None else [[r, t.tolist()] for r, t in got]}


def host_objects() -> dict:
    """Each helper's deliveries over the default group (gloo), over gloo groups of its own
    beside an (simulated) NCCL job, and the evaluation's gather from the last stages; with
    torch's object collectives refused throughout."""
    ctx = merak.init(dp=1, tp=1, pp=4)
    with no_object_collectives():
        groups = make_host_groups(ctx.mesh, "nccl")
        return {"rank": dist.get_rank(),
                "default_host_group_is_world": ctx.host_group() is dist.group.WORLD,
                "pp_host_group_is_pp_group": ctx.host_group("pp") is ctx.pp_group,
                "own_world_group": groups["world"] is not dist.group.WORLD,
                "own_group_backends": sorted({dist.get_backend(g) for g in groups.values()}),
                "own_group_ranks": {name: dist.get_process_group_ranks(groups[name])
                                    for name in ("pp", "dp")},
                "delivered": {"default": _helpers(dist.group.WORLD),
                              "own-world": _helpers(groups["world"]),
                              "own-pp": _helpers(groups["pp"])},
                "last_stage_gather": _last_stage_gather()}


def _last_stage_gather() -> list:
    """dp2 x pp2: the last stage's two dp ranks hold shares; every rank gets both (logits and
    labels as lists)."""
    ctx = merak.init(dp=2, tp=1, pp=2)
    trainer = SimpleNamespace(ctx=ctx, engine=SimpleNamespace(interpreter=SimpleNamespace(
        split=SimpleNamespace(num_stages=2), placement=(0, 1))))
    mine = None
    if ctx.pp_rank == 1:
        mine = (torch.full((ctx.dp_rank + 1, 3), float(ctx.dp_rank)),
                torch.tensor([ctx.dp_rank] * (ctx.dp_rank + 1)))
    logits, labels = EvaluationMixin._gather_from_last_stages(trainer, mine)
    return [logits.tolist(), labels.tolist()]


SCENARIOS = {4: {"host-objects": host_objects}}
