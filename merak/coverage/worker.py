"""The coverage sweep's ranks (launched by `merak coverage` under torch.distributed.run).

    python -m torch.distributed.run --nproc_per_node W -m merak.coverage.worker \
        --families a,b --stages 2 --tp 2 --out results.jsonl

Every rank runs every family; rank 0 appends one JSON line per family to ``--out`` as soon as
it is done, so a crash loses only the family it happened in (the parent resumes after it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import signal
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from merak.coverage import HF_CANNOT_LOAD, NO_PLAN
from merak.coverage.checks import (
    compare,
    has_tp_plan,
    is_moe,
    parallel_step,
    reference,
    split_in_process,
)
from merak.coverage.shrink import TooLargeError, build_small
from merak.distributed.host_objects import all_gather_objects


class FamilyTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise FamilyTimeout("took longer than the per-family time limit")


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}"[:300]


def _agree(ok: bool, reason: str) -> tuple[bool, str]:
    """Every rank's outcome of one check: it passed only if it passed everywhere."""
    outcomes = all_gather_objects((ok, reason))
    failed = [r for ok_r, r in outcomes if not ok_r]
    return (not failed), (failed[0] if failed else "")


def _check(name: str, fn, timeout_s: float) -> tuple[bool, str]:
    signal.alarm(int(timeout_s))
    try:
        fn()
        ok, reason = True, ""
    except Exception as error:  # any failure of the family is its result, not the sweep's
        ok, reason = False, _reason(error)
        if os.environ.get("MERAK_COVERAGE_DEBUG"):
            traceback.print_exc()
    finally:
        signal.alarm(0)
    return _agree(ok, reason)


def plan_row(small, tp: int) -> dict:
    """Where the family's tp plan comes from (``tp_plan_source``: table, base_model_tp_plan,
    inferred), and for an inferred one its table (``inferred_plan``, as `merak tp-plan` prints
    it) and how many linear patterns it shards and leaves replicated; ``no_plan``: why there
    is none."""
    import transformers as tf

    from merak.tensor_parallel.apply.choice import plan_for
    from merak.tensor_parallel.apply.infer import format_plan

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(small.config)
    try:
        plan = plan_for(model, SimpleNamespace(tp=tp, device="cpu"))
    except Exception as error:  # noqa: BLE001 - a family without a plan is a result
        return {"no_plan": _reason(error)}
    row = {"tp_plan_source": plan.source}
    if plan.source == "inferred":
        row.update(inferred_plan=format_plan(plan, small.config),
                   tp_sharded=len(plan.column) + len(plan.row), tp_replicated=len(plan.notes))
    return row


def load_check(small, family: str, scratch: Path, stages: int, tp: int, timeout_s: float,
               layouts_ok: dict[str, bool]) -> tuple[bool, str]:
    """The family's model written by `save_pretrained` (the Hub layout, conversions reverted)
    and loaded per rank under `init_empty_weights` (each rank reads and converts only its own
    tensors) against HF's own `from_pretrained` of the same directory: one 1F1B step at
    pp=`stages` and one at tp=`tp`, each where the family runs at that layout on its own
    (`layouts_ok`: "pp" / "tp" -> whether it does; a failure there is the pp or tp column's).
    A directory HF itself cannot load back is reported as such (`HF_CANNOT_LOAD`)."""
    import transformers as tf

    world, hub = dist.get_world_size(), scratch / family

    def save():
        if dist.get_rank() == 0:
            small.build().save_pretrained(hub)

    ok, reason = _check("load", save, timeout_s)  # every rank agrees: also a barrier
    if ok:
        ok, reason = _check("load", lambda: tf.AutoModelForCausalLM.from_pretrained(hub),
                            timeout_s)
        reason = f"{HF_CANNOT_LOAD}: {reason}"
    else:
        reason = f"save_pretrained: {reason}"
    if not ok:
        _remove(hub)
        return ok, reason

    def load():
        def build():
            return tf.AutoModelForCausalLM.from_pretrained(hub)

        layouts = []
        if stages > 1 and world % stages == 0 and layouts_ok.get("pp", True):
            layouts.append((world // stages, 1, stages))
        if tp > 1 and layouts_ok.get("tp", True):
            layouts.append((world // tp, tp, 1))
        if not layouts:
            raise ValueError("no layout to load at: the family runs at neither pp nor tp")
        for dp, tp_size, pp in layouts:
            ref = reference(small, dp, tf.AutoModelForCausalLM.from_pretrained(hub))
            loss, grads, stage = parallel_step(small, dp, tp_size, pp, build)
            compare(loss, grads, stage, *ref)

    try:
        return _check("load", load, timeout_s)
    finally:
        _remove(hub)


NOT_EXPERTS = "no experts module"  # an ep row's prefix: the family's MoE is not one ep splits


def expert_step(small, ep: int, ref) -> None:
    """One 1F1B step at dp = ep = `ep` (tp = pp = 1) against the single-process model on the
    same micro-batches: each rank holds 1/ep of every experts module's experts and the tokens
    travel to them by all-to-all (`merak.expert_parallel`). A family whose experts are not a
    transformers experts module (``use_experts_implementation``) has nothing ep splits."""
    from merak.expert_parallel import experts_modules

    loss, grads, stage = parallel_step(small, ep, 1, 1, ep=ep)
    modules = experts_modules(stage)
    if not modules:
        raise ValueError(f"{NOT_EXPERTS}: the family's experts do not go through "
                         f"transformers' experts interface (use_experts_implementation)")
    whole = [f"{name}.{p}" for name, m in modules.items()
             for p, param in m.named_parameters(recurse=False)
             if getattr(param, "ep_shard", None) is None]
    if whole:
        raise ValueError(f"experts parameters {whole[:2]} were not split over ep={ep}")
    compare(loss, grads, stage, *ref)  # (each rank's experts against theirs: `ep_shard`)


def _remove(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def run_family(family: str, index: int, stages: int, tp: int, timeout_s: float,
               checks: tuple[str, ...] = ("pp", "tp", "load", "ep"),
               scratch: Path | None = None
               ) -> dict:
    world = dist.get_world_size()
    row: dict = {"family": family}
    start = time.perf_counter()
    small = None
    try:
        small = build_small(family)
        row["parameters"] = small.parameters
        row["moe"] = is_moe(small.config)
        row["tp_plan"] = has_tp_plan(small.config)
    except TooLargeError as error:
        row["build"] = f"too large: {error}"
    except Exception as error:  # noqa: BLE001 - a config that does not build is a result
        row["build"] = _reason(error)
    ok, reason = _agree(small is not None, row.get("build", ""))
    row["build"] = "ok" if ok else reason
    if not ok:
        return row
    refs = {}

    expert_check = "ep" in checks and row["moe"] and world > 1

    def single():
        for dp in {1, world // tp} | ({world} if expert_check else set()):
            refs[dp] = reference(small, dp)

    ok, reason = _check("single", single, timeout_s)
    row["single"] = "ok" if ok else reason
    if not ok:
        return row
    if stages > 1 and "pp" in checks:  # in one process, on one rank (the ranks take turns)
        def split():
            if dist.get_rank() == index % world:
                compare(*split_in_process(small, stages), *refs[1])

        ok, reason = _check("pp", split, timeout_s)
        row["pp"] = "ok" if ok else reason
    if tp > 1 and "tp" in checks:
        row.update(plan_row(small, tp))
    plan = tp > 1 and "no_plan" not in row
    if tp > 1 and not plan and "tp" in checks:
        row["tp"] = f"{NO_PLAN}: {row['no_plan']}"
    elif tp > 1 and "tp" in checks:  # the user's path on every rank: parallelize + 1F1B interpreter
        def step():
            loss, grads, stage = parallel_step(small, world // tp, tp, 1)
            compare(loss, grads, stage, *refs[world // tp])

        ok, reason = _check("tp", step, timeout_s)
        row["tp"] = "ok" if ok else reason
    if expert_check:  # every rank a dp replica, the experts split over all of them
        ok, reason = _check("ep", lambda: expert_step(small, world, refs[world]), timeout_s)
        row["ep"] = "ok" if ok else reason
    if "load" in checks and scratch is not None:
        layouts_ok = {"pp": row.get("pp", "ok") == "ok",  # not run: try it
                      "tp": plan and row.get("tp", "ok") == "ok"}
        ok, reason = load_check(small, family, scratch, stages, tp, timeout_s, layouts_ok)
        row["load"] = "ok" if ok else reason
    gc.collect()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", default="pp,tp,load,ep")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout + 60))
    signal.signal(signal.SIGALRM, _alarm)
    for index, family in enumerate(args.families.split(",")):
        row = run_family(family, index, args.stages, args.tp, args.timeout,
                         tuple(args.checks.split(",")), Path(args.out).parent / "hub")
        if dist.get_rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
