"""Objects between ranks through host memory (`merak.distributed.host_objects`), on 4 ranks in
the tensor-parallel launch (workers/host_objects.py): delivered in rank order over the default
group on gloo and over gloo groups of their own where the default backend moves no CPU tensors
(NCCL, simulated), and the evaluation's gather from the last stages; torch's object collectives
(which stage pickled bytes on the GPU under NCCL) refuse to run throughout."""

from __future__ import annotations

import torch
from dist_harness import scenario_result

WORKER = "tp_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4,)


def test_objects_reach_every_rank_in_rank_order_through_host_memory(launches):
    figures = scenario_result(*launches(4), "host-objects")
    assert len(figures) == 4
    for rank, ours in enumerate(figures):
        where = f"rank {rank}: {ours}"
        assert ours["rank"] == rank, where
        # gloo moves CPU tensors itself: the job's own groups serve; beside NCCL, gloo ones
        assert ours["default_host_group_is_world"] and ours["pp_host_group_is_pp_group"], where
        assert ours["own_world_group"] and ours["own_group_backends"] == ["gloo"], where
        assert ours["own_group_ranks"] == {"pp": [0, 1, 2, 3], "dp": [rank]}, where
        for group, got in ours["delivered"].items():
            ranks = got["ranks"]
            assert got["all_gather"] == [{"r": r} for r in ranks], f"{group}: {where}"
            assert got["broadcast"] == "x" * ranks[-1], f"{group}: {where}"
            expected = [[r, torch.arange(r).tolist()] for r in ranks]
            assert got["gather"] == (expected if rank == ranks[0] else None), f"{group}: {where}"
        # dp2 x pp2: both last-stage shares, in dp order, on every rank
        assert ours["last_stage_gather"] == [[[0.0] * 3, [1.0] * 3, [1.0] * 3], [0, 1, 1]], where
