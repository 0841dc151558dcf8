"""Shared by the distributed test workers: scenario registry, result files, references."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

import merak
from merak.distributed import parallel_context
from merak.distributed.teardown import release_process_groups
from merak.partition.trace_cache import process_trace_cache

# A scenario raises on a failure; a parity scenario returns its figures instead (`Compared`),
# which its test compares against the reference with the test's own tolerances.
Scenario = Callable[[], "dict | None"]


_OUT: list[Path] = []  # the running worker's output directory (see `out_dir`)
_SCENARIO: list[str] = []  # the running scenario's name (see `Compared.figures`)
_TASKS = Path("/proc/self/task")  # (Linux) every thread of this process, native ones too


def out_dir() -> Path:
    """The directory the running worker writes its results (and any files) to."""
    return _OUT[-1]


def _arguments(*extra: tuple[str, dict]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=None, help="comma-separated scenario names")
    for flag, options in extra:
        parser.add_argument(flag, **options)
    return parser.parse_args()


def _start() -> int:
    torch.set_num_threads(1)
    merak.init(dp=1, tp=1, pp=int(os.environ["WORLD_SIZE"]), timeout=180)
    return dist.get_rank()


def run_scenarios(scenarios: dict[str, Scenario]) -> None:
    """A worker's entry point: run every scenario on this rank, recording failures in
    ``<out>/rank<r>.json``; ranks meet at a barrier between scenarios."""
    args = _arguments()
    rank = _start()
    _run(scenarios, Path(args.out), rank, set(args.only.split(",")) if args.only else None)
    dist.destroy_process_group()


def run_workers() -> None:
    """Several workers in one launch (`run_many.py`, the suite's pool: process start-up costs
    more than most scenarios on 2 cores): each worker module's ``scenarios(world_size)`` runs
    in turn, its results in ``<out>/<worker>/rank<r>.json``."""
    import importlib

    args = _arguments(("--workers", {"required": True, "help": "comma-separated worker files"}))
    rank, world = _start(), int(os.environ["WORLD_SIZE"])
    only = set(args.only.split(",")) if args.only else None
    for worker in args.workers.split(","):
        stem = Path(worker).stem
        try:
            scenarios = importlib.import_module(stem).scenarios(world)
        except Exception:  # noqa: BLE001 - reported as the worker's failure
            scenarios = {f"{stem}-import": _raise(traceback.format_exc())}
        with _own_groups():  # (what a worker's scenarios kept, see `keeps_groups`)
            merak.init(dp=1, tp=1, pp=world)  # each worker starts from the default layout
            _run(scenarios, Path(args.out) / stem, rank, only)
        del scenarios
    dist.destroy_process_group()


@contextlib.contextmanager
def _own_groups(keep: bool = False) -> Iterator[None]:
    """Destroy the process groups made inside (every `merak.init` makes a mesh of them) on
    leaving, unless `keep`, and hand back the default context from before. Each live gloo group
    holds two native threads and a TCP loop that wakes every 10 ms: a launch that ran a few
    hundred scenarios without this held over a thousand threads per rank and spent half the
    machine's CPU time in the kernel. Leave it only when every rank is out of the work (after a
    barrier): destroying a group is local, a peer still inside would find it gone."""
    before, previous = set(_world.pg_map), parallel_context.default_context()
    try:
        yield
    finally:
        if not keep:  # (with DTensor's caches of their meshes: see merak.distributed.teardown)
            release_process_groups([g for g in _world.pg_map if g not in before
                                    and g is not dist.GroupMember.WORLD])
            parallel_context.restore_default_context(previous)
            gc.collect()  # its threads end with the last reference (builds hold cycles)


@contextlib.contextmanager
def one_call_block_samples() -> Iterator[None]:
    """The planner's block-cost samples one call each inside (``merak.strategy.costs
    .MIN_SAMPLE_S`` 0, restored after): for scenarios where the timings' quality is not the
    point, each sample otherwise lasting about 0.1 s."""
    from merak.strategy import costs

    costs.MIN_SAMPLE_S, sample_s = 0.0, costs.MIN_SAMPLE_S
    try:
        yield
    finally:
        costs.MIN_SAMPLE_S = sample_s


def _raise(text: str) -> Scenario:
    def scenario() -> None:
        raise RuntimeError(text)
    return scenario


def _run(scenarios: dict[str, Scenario], out: Path, rank: int, only: set[str] | None) -> None:
    """Each rank writes ``{scenario: {"error": traceback or null, "figures": what the scenario
    returned (a JSON object) or null}}`` to ``<out>/rank<r>.json``."""
    results: dict[str, dict] = {}
    # rank 0's wall time, exports (trace-cache misses) and threads left after each scenario:
    # rank0-seconds.json
    seconds: dict[str, list[float]] = {}
    cache = process_trace_cache()
    path = out / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _OUT.append(out)
    # MERAK_TEST_PROFILE=DIR: rank 0 prints each scenario's wall time and writes cProfile
    # stats to DIR/<scenario>.prof (to find where a slow launch spends its time)
    profile_dir = os.environ.get("MERAK_TEST_PROFILE") if rank == 0 else None
    for name, scenario in scenarios.items():
        if only and name not in only:
            continue
        # the groups it made end with it (unless the worker keeps them, `keeps_groups`)
        with _own_groups(keep=getattr(scenario, "keeps_groups", False)):
            profiler, start = cProfile.Profile() if profile_dir else None, time.perf_counter()
            misses = cache.misses
            _SCENARIO.append(name)
            try:
                figures = profiler.runcall(scenario) if profiler else scenario()
                if not isinstance(figures, dict):  # figures are a dict; other returns are not
                    figures = None
                json.dumps(figures)  # (a scenario's figures must be JSON)
                results[name] = {"error": None, "figures": figures}
            except Exception:  # noqa: BLE001 - every failure is reported to pytest
                # the innermost frames: where it failed (TB_LIMIT of them)
                error = traceback.format_exc(limit=-int(os.environ.get("TB_LIMIT", 12)))
                results[name] = {"error": error, "figures": None}
            finally:
                _SCENARIO.pop()
            if profiler:
                profiler.dump_stats(Path(profile_dir) / f"{name}.prof")
                print(f"[profile] {name}: {time.perf_counter() - start:.1f} s", flush=True)
            path.write_text(json.dumps(results, indent=1))
            seconds[name] = [round(time.perf_counter() - start, 2), cache.misses - misses]
            dist.barrier()  # (every rank is out of it)
        if rank == 0:  # with the threads this process holds after it (gloo's among them)
            seconds[name].append(threading.active_count() if not _TASKS.exists()
                                 else len(list(_TASKS.iterdir())))
            (out / "rank0-seconds.json").write_text(json.dumps(seconds, indent=1))
    _OUT.pop()


def family_scenarios(build: Callable[[str], Any], families: Iterable[str],
                     variants: Iterable[str], world_size: int) -> dict[str, Scenario]:
    """``{family}-pp{world_size}-{variant}`` -> ``build(family).check(variant)`` (its figures),
    each family built once, when its first scenario runs."""
    built: dict[str, Any] = {}

    def scenario(family: str, variant: str) -> Scenario:
        def run() -> None:
            if family not in built:
                built[family] = build(family)
            return built[family].check(variant)
        return keeps_groups(run)

    return {f"{f}-pp{world_size}-{v}": scenario(f, v) for f in families for v in variants}


def keeps_groups(scenario: Scenario) -> Scenario:
    """Mark `scenario` as leaving builds later scenarios use (their process groups live until
    the worker ends, not the scenario)."""
    scenario.keeps_groups = True
    return scenario


class Compared:
    """What a parity scenario measured next to its reference, for its test to compare with the
    test's tolerances: ``value`` pairs (floats, or tensors compared elementwise) and ``grad``
    pairs (gradients, whose test tolerance also scales with the reference's largest entry).
    `figures` is the scenario's result: float pairs in the JSON, tensor pairs in
    ``<out>/<scenario>-rank<r>.pt`` (``{"value": {what: (actual, expected)}, "grad": ...}``)."""

    def __init__(self):
        self.floats: dict[str, list] = {}
        self.tensors: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {
            "value": {}, "grad": {}}

    def value(self, what: str, actual, expected) -> None:
        if isinstance(actual, torch.Tensor):
            self._tensor("value", what, actual, expected)
        else:
            assert what not in self.floats, f"{what!r} compared twice"
            self.floats[what] = [actual, expected]

    def grad(self, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        self._tensor("grad", what, actual, expected)

    def _tensor(self, kind: str, what: str, actual: torch.Tensor, expected: torch.Tensor):
        assert what not in self.tensors[kind], f"{what!r} compared twice"
        self.tensors[kind][what] = (actual.detach().cpu().clone(), expected.detach().cpu().clone())

    def figures(self, **extra) -> dict:
        """``{"floats": {what: [actual, expected]}, "tensors": file or None, **extra}``."""
        path = None
        if any(self.tensors.values()):
            path = out_dir() / f"{_SCENARIO[-1]}-rank{dist.get_rank()}.pt"
            torch.save(self.tensors, path)
        return {"floats": self.floats, "tensors": str(path) if path else None, **extra}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def assert_close_grad(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Gradients: relative to the tensor's largest entry too, since entries that nearly cancel
    (e.g. after a LayerNorm) carry the rounding of their much larger terms, which differs with
    the order of sums (micro-batches, dp/tp all-reduces, thread counts)."""
    atol = 1e-5 + 1e-4 * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=atol,
                               msg=lambda m: f"{what}: {m}")


class GradSnapshot(merak.InstructionHook):
    """Copies every gradient of `stage` just before each optimizer step: ``self.grads[step]``;
    ZeRO-2/3's sharded gradients gathered whole (a collective: every rank of their group takes
    each, in one order)."""

    def __init__(self, stage):
        self.stage, self.grads = stage, []

    def on_instruction_begin(self, name, action):
        from merak.data_parallel.shards import whole

        if name == "optimizer_step":
            self.grads.append({n: whole(p.grad).clone() for n, p in self.stage.named_parameters()
                               if p.grad is not None})


def train_reference(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], lr: float,
                    ) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Train the single-process `model` with SGD, one step per batch: each step's loss and
    gradients, and the final parameters (for `trained_like`)."""
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for data in batches:
        out = model(**data)
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append({n: p.grad.clone() for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in params.items()}


def trained_like(losses: list[float], snapshot: GradSnapshot, stage: torch.nn.Module,
                 ref_losses: list[float], ref_grads: list[dict[str, torch.Tensor]],
                 ref_final: dict[str, torch.Tensor]) -> dict:
    """The figures of a training run against the single-process reference (`Compared`): the
    steps' losses, every gradient `snapshot` took, every parameter of `stage` at the end, and
    ``params_without_grad`` (the parameters of `stage` that got no gradient)."""
    compared = Compared()
    compared.value("losses", list(losses), list(ref_losses[:len(losses)]))
    for step, grads in enumerate(snapshot.grads):
        for name, grad in grads.items():
            compared.grad(f"step {step} {name}", grad, ref_grads[step][name])
    own = dict(stage.named_parameters())
    for name, param in own.items():
        compared.value(f"{name} after training", param, ref_final[name])
    missing = sorted(set(own) - set(snapshot.grads[0])) if snapshot.grads else sorted(own)
    return compared.figures(params_without_grad=missing)
