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
    """dp > 1, what its test checks: when the step's tail begins (``tails``: the buckets not
    late, i.e. not tied weights, and the all-reduces launched so far, with where from), every
    early bucket has started its all-reduce, in order, from a gradient hook inside the last
    backward; at the optimizer step (``steps``: the launches' buckets, the number of buckets,
    the gradients not a view of their bucket's buffer), every bucket's all-reduce was launched
    in order and every averaged gradient is a view of its bucket's buffer."""

    def __init__(self, engine):
        self.averager, self.tails, self.steps = engine.grad_averager, [], []

    def on_instruction_begin(self, name, action):
        averager = self.averager
        if name == "reduce_tied_grads":
            self.tails.append({
                "early": [i for i, b in enumerate(averager.buckets) if not b.late],
                "launched": [[i, where] for i, where in averager.launch_log]})
        if name == "optimizer_step":
            copied = sum(p.grad.untyped_storage().data_ptr()
                         != bucket.buffer.untyped_storage().data_ptr()
                         for bucket in averager.buckets for p in bucket.params)
            self.steps.append({"launched": [i for i, _ in averager.launch_log],
                               "buckets": len(averager.buckets), "copied_grads": copied})


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
    seen = {"split": split.describe(), "tied_weights": bool(split.tied_weights),
            "skip_edge_0_2": (0, 2) in split.edges,
            "transfers_1_2": len(split.transfers.get((1, 2), ()))}
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
        overlap_tails=probe.tails if dp > 1 else None,
        overlap_steps=probe.steps if dp > 1 else None,
        dp_buckets=len(engine.grad_averager.buckets) if dp > 1 else None, **seen)


def p2p_timeout() -> dict:
    """Stage 1 waits for activations stage 0 never sends: it should fail once the process
    group's timeout (here set to 2 s) has passed, naming both ranks; stage 1 returns the
    P2PTimeoutError's ``message`` (None where none was raised) and the seconds it took. (Stage 0
    takes part in the step's batch-shape exchange first, a collective.)"""
    ctx = merak.init(dp=1, tp=1, pp=2)
    model, pieces = build("gpt")
    split = merak.manual_split(model, pieces, num_stages=2)
    stage = merak.PipelineStage(model, split, ctx.pp_rank)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                       num_microbatches=2, schedule="1f1b")
    batch = global_batch("gpt", 0, 4)
    c10d = dist.distributed_c10d
    before = c10d._get_default_group()._get_backend(ctx.device).options._timeout
    dist.barrier()  # both built: stage 1's step does not wait 2 s for a slower build of stage 0
    c10d._set_pg_timeout(datetime.timedelta(seconds=2))
    try:
        if ctx.pp_rank == 0:
            engine._begin(batch, 2, None)  # the step's batch-shape exchange, then silence
            time.sleep(8.0)  # alive but silent
            return {"stage": 0}
        start = time.perf_counter()
        try:
            engine.train_step(batch)
        except merak.P2PTimeoutError as error:
            return {"stage": 1, "message": str(error), "seconds": time.perf_counter() - start}
        return {"stage": 1, "message": None, "seconds": time.perf_counter() - start}
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


def host_reads(pp: int, dp: int) -> dict:
    """The host reads of the two 1F1B steps after the first (``reads``, by kind): its test
    checks they read nothing from the device but the step's loss (the activations' metadata
    travel only in the first step of a batch shape, the batch-shape key goes over the host
    group, and dp buckets and tied weights reduce without host reads)."""
    ctx = merak.init(dp=dp, tp=1, pp=pp)
    model, pieces = build("gpt")
    stage = merak.PipelineStage(model, merak.manual_split(model, pieces, num_stages=pp),
                                ctx.pp_rank)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                       num_microbatches=NUM_MICROBATCHES, schedule="1f1b")
    rows = NUM_MICROBATCHES * MICRO_BATCH_SIZE
    batch = global_batch("gpt", 0, rows)
    engine.train_step(batch)  # discovery and the metadata-carrying first step
    counts = []
    for step in (1, 2):
        with HostReads() as reads:
            engine.train_step(global_batch("gpt", step, rows))
        counts.append(reads.counts)
    return {"reads": counts}


def context_positional_order() -> dict:
    """``merak.init(2, 1, 2)`` (Merak's README order: init(dp, tp, pp)): the context's sizes,
    ranks and groups; then the refusals (their messages, None where none was raised) of another
    backend than the running one and of sizes the world does not divide."""
    ctx = merak.init(2, 1, 2)
    seen = {"sizes": [ctx.dp, ctx.tp, ctx.pp], "rank": ctx.rank, "world_rank": dist.get_rank(),
            "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank,
            "first": ctx.is_first_pp_rank, "last": ctx.is_last_pp_rank,
            "dp_group_size": dist.get_world_size(ctx.dp_group),
            "pp_group_size": dist.get_world_size(ctx.pp_group),
            "other_stage_rank": ctx.rank_of(pp_rank=1 - ctx.pp_rank)}
    seen["backend_refusal"] = _refusal(lambda: merak.init(2, 1, 2, backend="nccl"))
    seen["bad_sizes_refusals"] = [_refusal(lambda bad=bad: merak.init(**bad))
                                  for bad in ({"dp": 3, "tp": 1, "pp": 1},
                                              {"dp": 0, "tp": 4, "pp": 1})]
    return seen


def _refusal(call) -> str | None:
    """The message of the ValueError `call` raised, or None where it raised none."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


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
