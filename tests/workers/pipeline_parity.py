"""Pipeline x data parallel runs against a single-process reference: the parity scenarios
return their losses, gradients and final parameters next to the reference's (`Compared`);
test_pipeline_parity compares them."""

from __future__ import annotations

import datetime
import functools
import time

import torch
import torch.distributed as dist
from common import Compared, run_scenarios
from models import SKIP_LAYOUT, build, global_batch

import merak

NUM_STEPS = 3
NUM_MICROBATCHES = 4
MICRO_BATCH_SIZE = 2
LR = 0.1


def layouts(world_size: int) -> list[tuple[int, int]]:
    """(pp, dp) pairs tested on a world of this size."""
    return {2: [(2, 1)], 4: [(2, 2), (4, 1)], 8: [(4, 2)]}[world_size]


def scenario_names(world_size: int) -> list[str]:
    names = [f"parity-{kind}-pp{pp}-dp{dp}-{schedule}"
             for pp, dp in layouts(world_size) for kind in ("gpt", "skip")
             for schedule in ("ds_default", "1f1b")]
    extra = {2: ["host-reads-pp2-dp1"], 4: ["context-positional-order", "host-reads-pp2-dp2"],
             8: []}[world_size]
    return names + extra


# Scenarios that leave the process group unusable, each run in a launch of its own: gloo closes
# the connection of a pair whose receive timed out, so no scenario may follow in that launch.
ALONE = ("p2p-timeout",)


class GradSnapshot(merak.InstructionHook):
    def __init__(self, stage):
        self.stage, self.grads = stage, []

    def on_instruction_begin(self, name, action):
        if name == "optimizer_step":
            self.grads.append({n: p.grad.clone() for n, p in self.stage.named_parameters()})


class OverlapProbe(merak.InstructionHook):
    """dp > 1: when the step's tail begins, every bucket but the late ones (tied weights) has
    started its all-reduce, in order, from a gradient hook inside the last backward; at the
    optimizer step every averaged gradient is a view of its bucket's buffer."""

    def __init__(self, engine):
        self.averager, self.checked = engine.grad_averager, 0

    def on_instruction_begin(self, name, action):
        averager = self.averager
        if name == "reduce_tied_grads":
            early = [i for i, b in enumerate(averager.buckets) if not b.late]
            assert averager.launch_log[:len(early)] == [(i, "backward") for i in early], \
                averager.launch_log
            assert len(averager.launch_log) == len(early), averager.launch_log
        if name == "optimizer_step":
            assert [i for i, _ in averager.launch_log] == list(range(len(averager.buckets)))
            for bucket in averager.buckets:
                base = bucket.buffer.untyped_storage().data_ptr()
                for p in bucket.params:
                    assert p.grad.untyped_storage().data_ptr() == base, "a copied gradient"
            self.checked += 1


def reference(kind: str, global_size: int):
    """Losses, grads (by every name, tied ones included) and final params of one process."""
    model, _ = build(kind)
    params = dict(model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(NUM_STEPS):
        loss = model(**global_batch(kind, step, global_size))
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in params.items()}


def parity(kind: str, pp: int, dp: int, schedule: str) -> dict:
    ctx = merak.init(dp=dp, tp=1, pp=pp)
    model, pieces = build(kind)
    layout = {"pieces_per_stage": SKIP_LAYOUT[pp]} if kind == "skip" else {"num_stages": pp}
    split = merak.manual_split(model, pieces, **layout)
    if kind == "skip" and pp == 4:
        assert (0, 2) in split.edges and len(split.transfers[(1, 2)]) == 2, split.describe()
    if kind == "gpt":
        assert split.tied_weights, "the GPT's tied embedding/head was not detected"
    stage = merak.PipelineStage(model, split, ctx.pp_rank)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    snapshot = GradSnapshot(stage)
    engine = merak.PipelineInterpreter(stage, ctx, optimizer, num_microbatches=NUM_MICROBATCHES,
                                       schedule=schedule, hooks=[snapshot],
                                       bucket_bytes=16 * 1024)  # several dp buckets
    if dp > 1:
        probe = OverlapProbe(engine)
        engine.hooks.append(probe)
    rows = NUM_MICROBATCHES * MICRO_BATCH_SIZE
    losses = []
    for step in range(NUM_STEPS):
        full = global_batch(kind, step, rows * dp)
        batch = {k: v[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for k, v in full.items()}
        losses.append(engine.train_step(batch if engine.batch_keys else None))
    ref_losses, ref_grads, ref_params = reference(kind, rows * dp)
    compared = Compared()
    compared.value("losses", losses, ref_losses)
    for step, grads in enumerate(snapshot.grads):
        for name, grad in grads.items():
            compared.value(f"step {step} grad of {name}", grad, ref_grads[step][name])
    for name, param in stage.named_parameters():
        compared.value(f"parameter {name} after {NUM_STEPS} steps", param, ref_params[name])
    missing = sorted(set(dict(stage.named_parameters())) - set(snapshot.grads[0]))
    return compared.figures(
        params_without_grad=missing, grad_snapshots=[len(grads) for grads in snapshot.grads],
        overlap_checked_steps=probe.checked if dp > 1 else None,
        dp_buckets=len(engine.grad_averager.buckets) if dp > 1 else None)


def p2p_timeout() -> None:
    """Stage 1 waits for activations stage 0 never sends: it must fail once the process group's
    timeout (here set to 2 s) has passed, naming both ranks. (Stage 0 takes part in the step's
    batch-shape exchange first, a collective.)"""
    ctx = merak.init(dp=1, tp=1, pp=2)
    model, pieces = build("gpt")
    split = merak.manual_split(model, pieces, num_stages=2)
    stage = merak.PipelineStage(model, split, ctx.pp_rank)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                       num_microbatches=2, schedule="1f1b")
    batch = global_batch("gpt", 0, 4)
    c10d = dist.distributed_c10d
    before = c10d._get_default_group()._get_backend(ctx.device).options._timeout
    c10d._set_pg_timeout(datetime.timedelta(seconds=2))
    try:
        if ctx.pp_rank == 0:
            engine._begin(batch, 2, None)  # the step's batch-shape exchange, then silence
            time.sleep(8.0)  # alive but silent
            return
        start = time.perf_counter()
        try:
            engine.train_step(batch)
        except merak.P2PTimeoutError as error:
            elapsed = time.perf_counter() - start
            message = str(error)
            for part in ("rank 1 gave up on recv_act of micro-batch 0 (stage 1 <-> rank 0, "
                         "stage 0) after 2.", "the job's timeout: 2 s", "rank(s) [0]",
                         "although every rank answers: rank 0 is alive"):
                assert part in message, f"{part!r} missing from the timeout message: {message}"
            # the timeout, then two reads of the ranks' beacons 2 s apart
            assert elapsed < 9.0, f"the timeout of 2 s took {elapsed:.1f} s to fire"
            return
        raise AssertionError("stage 1 did not time out although stage 0 never sent")
    finally:
        c10d._set_pg_timeout(before)


class HostReads:
    """Counts the reads that make the host wait for the device (on CUDA): `.item()`,
    `.tolist()`, `.cpu()`, `bool()`, `int()` and `float()` of a tensor, by kind, while entered."""

    KINDS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")

    def __init__(self):
        self.counts: dict[str, int] = {}

    def __enter__(self) -> HostReads:  # noqa: PYI034 - py3.10 has no typing.Self
        self._original = {k: getattr(torch.Tensor, k) for k in self.KINDS}
        for kind, method in self._original.items():
            def counted(tensor, *args, _kind=kind, _method=method, **kwargs):
                self.counts[_kind] = self.counts.get(_kind, 0) + 1
                return _method(tensor, *args, **kwargs)
            setattr(torch.Tensor, kind, counted)
        return self

    def __exit__(self, *exc) -> None:
        for kind, method in self._original.items():
            setattr(torch.Tensor, kind, method)


def host_reads(pp: int, dp: int) -> None:
    """A 1F1B step after the first reads nothing from the device but the step's loss: the
    activations' metadata travel only in the first step of a batch shape, the batch-shape key
    goes over the host group, and dp buckets and tied weights reduce without host reads."""
    ctx = merak.init(dp=dp, tp=1, pp=pp)
    model, pieces = build("gpt")
    stage = merak.PipelineStage(model, merak.manual_split(model, pieces, num_stages=pp),
                                ctx.pp_rank)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                       num_microbatches=NUM_MICROBATCHES, schedule="1f1b")
    rows = NUM_MICROBATCHES * MICRO_BATCH_SIZE
    batch = global_batch("gpt", 0, rows)
    engine.train_step(batch)  # discovery and the metadata-carrying first step
    for step in (1, 2):
        with HostReads() as reads:
            engine.train_step(global_batch("gpt", step, rows))
        assert reads.counts == {"item": 1}, f"step {step}: host reads {reads.counts}"


def context_positional_order() -> None:
    ctx = merak.init(2, 1, 2)  # Merak's README order: init(dp, tp, pp)
    assert (ctx.dp, ctx.tp, ctx.pp) == (2, 1, 2)
    assert ctx.rank == dist.get_rank()
    assert ctx.rank == (ctx.pp_rank * 2 + ctx.dp_rank)
    assert ctx.is_first_pp_rank == (ctx.pp_rank == 0) and ctx.is_last_pp_rank == (ctx.pp_rank == 1)
    assert dist.get_world_size(ctx.dp_group) == 2 and dist.get_world_size(ctx.pp_group) == 2
    assert ctx.rank_of(pp_rank=1 - ctx.pp_rank) != ctx.rank
    try:
        merak.init(2, 1, 2, backend="nccl")
    except ValueError as error:
        assert "already initialized with 'gloo'" in str(error), error
    else:
        raise AssertionError("a backend different from the running one was silently ignored")
    for bad in ({"dp": 3, "tp": 1, "pp": 1}, {"dp": 0, "tp": 4, "pp": 1}):
        try:
            merak.init(**bad)
        except ValueError as error:
            assert "dp" in str(error), error
        else:
            raise AssertionError(f"merak.init(**{bad}) did not raise")


def scenarios(world_size: int) -> dict:
    table = {}
    for name in scenario_names(world_size):
        if name.startswith("parity-"):
            _, kind, pp, dp, schedule = name.split("-")
            table[name] = functools.partial(parity, kind, int(pp[2:]), int(dp[2:]), schedule)
    table["context-positional-order"] = context_positional_order
    table["host-reads-pp2-dp1"] = functools.partial(host_reads, 2, 1)
    table["host-reads-pp2-dp2"] = functools.partial(host_reads, 2, 2)
    return {n: table[n] for n in scenario_names(world_size)}


if __name__ == "__main__":
    import os

    run_scenarios({**scenarios(int(os.environ["WORLD_SIZE"])), "p2p-timeout": p2p_timeout})
