"""`merak coverage`: which Hugging Face causal-LM families Merak splits and shards at parity.

    python -m merak coverage [--stages 2] [--tp 2] [--families a,b] [--json out.json]
                             [--trainer olmo2,mixtral] [--plans]

Every causal-LM model type of the installed transformers is shrunk (`shrink`), built, and checked on
a small gloo job of `--tp` ranks (`worker`): a single-process forward/backward; the automatic split
into `--stages` stages, run stage after stage in one process (the ranks take turns); and one 1F1B
step at tp=`--tp` through `merak.parallelize` and the interpreter; each with its loss and every
gradient compared with the single-process model; and the load check: the model written by
`save_pretrained` (the Hub layout) and loaded per rank at pp=`--stages` and tp=`--tp` against HF's
own `from_pretrained` of the same directory; and for MoE families the ep check: one step with
every rank a dp replica and the experts split over all of them (ep = the job's `--tp` ranks,
tokens sent to their experts by all-to-all). Every family that runs counts in the tp column,
whatever its plan (Merak's table, the config's ``base_model_tp_plan``, or inferred from its
blocks and proven before use; a family inference places nothing of counts as a failure), and
the tp failures are listed with their reasons; `--plans` prints each inferred plan as
`merak tp-plan` does. `--trainer` also trains the named families through
MerakTrainer at dp x tp x pp = 2 x 2 x 2 against single-process HF Trainer (`trainer_check`). A
family that crashes its worker is recorded as such and the sweep goes on with the next one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from merak.coverage import HF_CANNOT_LOAD, NO_PLAN
from merak.inputs import InputError, positive_float, positive_int

CHECKS = ("build", "single", "pp", "tp", "load", "ep")
OPTIONAL = ("pp", "tp", "load", "ep")  # what --checks can choose


def add_coverage(subparsers) -> None:
    parser = subparsers.add_parser(
        "coverage", help="check every HF causal-LM family: split at pp, shard at tp, at parity")
    parser.add_argument("--stages", type=positive_int, default=2,
                        help="pipeline stages (default 2)")
    parser.add_argument("--tp", type=positive_int, default=2,
                        help="tensor-parallel degree (default 2)")
    parser.add_argument("--families", default="",
                        help="comma-separated model types (default: every causal-LM family)")
    parser.add_argument("--json", default=None, help="write the per-family results here")
    parser.add_argument("--timeout", type=positive_float, default=180.0,
                        help="seconds per family and check before it counts as a failure")
    parser.add_argument("--checks", default=",".join(OPTIONAL),
                        help="which checks to run after build and single (default: "
                             "pp,tp,load,ep; load = save_pretrained, then per-rank "
                             "from_pretrained at pp and tp against HF's from_pretrained; ep = "
                             "MoE families at dp = ep = the job's ranks)")
    parser.add_argument("--plans", action="store_true",
                        help="print each plan inferred from the blocks (families with neither "
                             "Merak's plan nor a base_model_tp_plan) as `merak tp-plan` does")
    parser.add_argument("--trainer", default="",
                        help="families to also train through MerakTrainer at dp=2 x tp=2 x "
                             "pp=2 against HF Trainer (8 ranks), e.g. olmo2,mixtral,qwen3_moe")
    parser.set_defaults(run=run_coverage)


def _families(text: str) -> list[str]:
    from merak.coverage.shrink import causal_lm_families

    known = causal_lm_families()
    if not text:
        return known
    chosen = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in known]
    if unknown:
        raise InputError(f"{unknown} are not causal-LM model types of this transformers; "
                         f"choose from {', '.join(known)}")
    return chosen


def _launch(families: list[str], args, out: Path) -> subprocess.Popen:
    world = args.tp  # the pp check runs in one process; the tp check on tp ranks
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(29400 + os.getpid() % 1000),
               "-m", "merak.coverage.worker", "--families", ",".join(families),
               "--stages", str(args.stages), "--tp", str(args.tp),
               "--timeout", str(args.timeout), "--out", str(out), "--checks", args.checks]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _new_rows(out: Path, seen: int) -> list[dict]:
    lines = out.read_text().splitlines() if out.exists() else []
    return [json.loads(line) for line in lines[seen:]]


def sweep(families: list[str], args) -> list[dict]:
    """Run the worker until every family has a result, printing each as it comes; a family
    the worker died in is recorded as crashed and the worker is started again after it."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        todo = list(families)
        while todo:
            out = Path(tmp) / f"results-{len(rows)}.jsonl"
            proc, done = _launch(todo, args, out), []
            while True:
                code = proc.poll()
                for row in _new_rows(out, len(done)):
                    done.append(row)
                    rows.append(row)
                    _print_row(row)
                if code is not None:
                    break
                time.sleep(1.0)
            todo = todo[len(done):]
            if todo and code != 0:
                row = {"family": todo[0], "build": f"worker crashed (exit code {code})"}
                rows.append(row)
                _print_row(row)
                todo = todo[1:]
            elif todo:
                raise RuntimeError(f"the coverage worker stopped before {todo[0]} without an "
                                   f"error")
    return rows


def _print_row(row: dict) -> None:
    cells = [f"{row['family']:<28}"]
    for check in CHECKS:
        value = row.get(check)
        shown = "-" if value in (None, NO_PLAN) else ("ok" if value == "ok" else "FAIL")
        cells.append(f"{check}={shown}")
    failure = next((row[c] for c in CHECKS if row.get(c) not in (None, "ok", NO_PLAN)), "")
    print(" ".join(cells) + (f"  {failure}" if failure else ""), flush=True)


def _of(rows: list[dict], source: str) -> list[dict]:
    return [r for r in rows if r.get("tp_plan_source") == source]


def _ok(rows: list[dict], source: str) -> list[dict]:
    return [r for r in _of(rows, source) if r.get("tp") == "ok"]


def failures(rows: list[dict], check: str) -> list[str]:
    """``family: reason`` of each family that runs and fails `check`."""
    return [f"  {r['family']}: {r[check]}" for r in rows
            if r.get("single") == "ok" and r.get(check) not in (None, "ok")]


def summarize(rows: list[dict], stages: int, tp: int) -> list[str]:
    """The summary lines: how many families build, run, split and shard at parity."""
    runs = [r for r in rows if r.get("single") == "ok"]
    ran_pp = any("pp" in r for r in runs) or not runs
    ran_tp = any("tp" in r for r in runs) or not runs
    builds = [r for r in rows if r.get("build") == "ok"]
    moe = [r for r in runs if r.get("moe")]

    def share(part, whole):
        return f"{len(part)}/{len(whole)} ({100 * len(part) / max(1, len(whole)):.0f}%)"

    lines = [f"families: {len(rows)}; build: {len(builds)}; single-process forward/backward: "
             f"{len(runs)}"]
    if stages > 1 and ran_pp:
        lines.append(f"pp={stages} parity: {share([r for r in runs if r.get('pp') == 'ok'], runs)}"
                     f" of the families that run")
    if tp > 1 and ran_tp:
        tried = [r for r in runs if "tp" in r]
        by = [f"{label} {share(_ok(tried, source), _of(tried, source))}" for source, label in (
            ("table", "Merak's table"), ("base_model_tp_plan", "the config's base_model_tp_plan"),
            ("inferred", "inferred from the blocks"))]
        lines.append(f"tp={tp} parity: {share([r for r in tried if r['tp'] == 'ok'], tried)} of "
                     f"the families that run (plans: {'; '.join(by)}; no plan: "
                     f"{sum(r['tp'].startswith(NO_PLAN) for r in tried)})")
        partial = [r for r in _ok(tried, "inferred") if r.get("tp_replicated")]
        if _of(tried, "inferred"):
            lines.append(f"inferred plans at parity that leave some linears replicated: "
                         f"{len(partial)} ({', '.join(r['family'] for r in partial)})")

    if stages > 1 and ran_pp:
        lines.append(f"MoE families at pp={stages} parity: "
                     f"{share([r for r in moe if r.get('pp') == 'ok'], moe)}")
    moe_ep = [r for r in moe if "ep" in r]
    if moe_ep:
        lines.append(f"MoE families at ep={tp} (dp={tp}) parity: "
                     f"{share([r for r in moe_ep if r['ep'] == 'ok'], moe_ep)}")
    loaded = [r for r in runs if "load" in r and not r["load"].startswith(HF_CANNOT_LOAD)]
    if loaded:
        loaded_moe = [r for r in loaded if r.get("moe")]
        lines.append(f"save_pretrained -> per-rank load (pp={stages}, tp={tp} where planned) "
                     f"parity: {share([r for r in loaded if r['load'] == 'ok'], loaded)}; MoE "
                     f"families: {share([r for r in loaded_moe if r['load'] == 'ok'], loaded_moe)}"
                     f" (of the families HF's from_pretrained loads back)")
    return lines


def run_coverage(args: argparse.Namespace) -> int:
    families = _families(args.families)
    unknown = sorted(set(args.checks.split(",")) - set(OPTIONAL))
    if unknown:
        raise InputError(f"--checks {unknown} unknown; choose from {', '.join(OPTIONAL)}")
    start = time.perf_counter()
    print(f"merak coverage: {len(families)} families, pp={args.stages}, tp={args.tp}", flush=True)
    rows = sweep(families, args) if families else []
    trainer_rows = []
    if args.trainer:
        from merak.coverage.trainer_check import check_trainer

        trainer_rows = check_trainer(_families(args.trainer))
    lines = summarize(rows, args.stages, args.tp)
    if args.tp > 1 and failures(rows, "tp"):
        lines += [f"tp={args.tp} failures:", *failures(rows, "tp")]
    if failures(rows, "ep"):
        lines += [f"ep={args.tp} failures:", *failures(rows, "ep")]
    for row in trainer_rows:
        lines.append(f"MerakTrainer dp=2 x tp=2 x pp=2 vs HF Trainer, {row['family']}: "
                     f"{row['result']}")
    print("\n".join(["", *lines, f"({time.perf_counter() - start:.0f} s)"]))
    if args.plans:
        for row in rows:
            if row.get("inferred_plan"):
                print(f"\n# {row['family']}: tp plan inferred from its blocks "
                      f"(tp={args.tp}: {row.get('tp')})\n{row['inferred_plan']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"stages": args.stages, "tp": args.tp,
                                               "summary": lines, "families": rows,
                                               "trainer": trainer_rows}, indent=1))
    return 0
