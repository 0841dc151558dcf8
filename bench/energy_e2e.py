"""Profile -> plan -> deploy on 4 gloo ranks with simulated GPUs: measured against predicted.

One torchrun launch (this file, `--worker`) runs, per schedule (1F1B, zero-bubble, interleaved
1F1B with 2 chunks per rank, shifted critical path with recomputation), a small MLP's engine
built by `build_engine` (bench/_common.py) through `energy_turns.profile_plan_measure`: the clock
profiler over its training steps, rank 0's plan over the engine's own schedule, then the plan
and all max clocks taking turns step by step (the minimum over the measured steps of each),
and prints per schedule: the all-max and planned iteration (predicted and measured), the
planned and measured energy saving, the saving next to 1F1B's, and measured vs predicted time
and energy, checked against TARGET: within 10% for every schedule (run it on an idle machine).
tests/test_energy_planning.py runs the same procedure with shorter instructions and asserts
what a loaded machine's noise cannot break.

    python bench/energy_e2e.py [--forward-s 0.1] [--microbatches 8] [--rounds 4]
                               [--schedules 1f1b,zero_bubble,interleaved_1f1b,shifted_critical_path]
    python bench/energy_e2e.py --forward-s 0.01 --microbatches 4 --rounds 1 --schedules 1f1b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import RESULTS, build, launch_self
from energy_turns import profile_plan_measure

TARGET = 0.10  # |measured / predicted - 1|, time and energy, all-max and planned steps
RANKS, CHUNKS = 4, 2  # pipeline ranks; model chunks per rank of the interleaved schedule


def _rows(rows: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, 6, 12, generator=g),
            "labels": torch.randint(0, 7, (rows, 6), generator=g)}


def _model():
    """A small MLP (8 blocks, a classifier and its loss) on the meta device."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import merak

    class Block(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

        def forward(self, h):
            return h + F.gelu(self.fc(self.norm(h)))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.head = nn.Linear(12, 32), nn.Linear(32, 7)
            self.blocks = nn.ModuleList([Block(32) for _ in range(8)])

        def forward(self, x, labels):
            hidden = self.proj(x)
            for block in self.blocks:
                hidden = block(hidden)
            logits = self.head(hidden)
            return F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))

    torch.manual_seed(0)
    with merak.init_empty_weights():
        return MLP()


def _run_schedule(name: str, cli) -> dict | None:
    """Every rank: one schedule's profile, plan and measurement (`energy_turns`); rank 0
    returns its figures."""
    import torch

    import merak
    from merak.energy.profiling.gpu import SimulatedGPU, SyntheticGPUModel

    ctx = merak.init(dp=1, tp=1, pp=RANKS)
    info = merak.SCHEDULES[name]
    engine = build(_model(), _rows(1, 0), ctx, lambda s: torch.optim.SGD(s.parameters(), lr=0.01),
                   schedule=name, num_microbatches=cli.microbatches,
                   num_model_chunks=CHUNKS if info.several_stages_per_rank else 1,
                   recompute_ratio=1.0 if info.needs_recompute else 0.0).interpreter
    gpu = SimulatedGPU(SyntheticGPUModel(clock_step=90, forward_s=cli.forward_s),
                       num_ranks=RANKS, chunks=engine.schedule.stages_per_rank)
    seed = iter(range(1, 10**6))
    turns = profile_plan_measure(
        engine, gpu, ctx, lambda: engine.train_step(_rows(cli.microbatches, next(seed))),
        rounds=cli.rounds, unit_time=cli.unit_time or cli.forward_s / 40)
    engine.remove_recomputation()
    return {"schedule": name, **turns.report} if ctx.rank == 0 else None


def worker(cli) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report = {}
    for name in cli.schedules.split(","):
        figures = _run_schedule(name, cli)
        if figures is not None:
            report[name] = figures
    if dist.get_rank() == 0:
        Path(cli.out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-s", type=float, default=0.1,
                        help="simulated forward of one micro-batch at the highest clock")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="measured steps per plan")
    parser.add_argument("--unit-time", type=float, default=None,
                        help="the planner's time quantum (default: forward / 40)")
    parser.add_argument("--schedules",
                        default="1f1b,zero_bubble,interleaved_1f1b,shifted_critical_path")
    parser.add_argument("--save", default=str(RESULTS / "energy_e2e.json"),
                        help="where the figures go (JSON; default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    report, took = launch_self(__file__, RANKS)
    print(f"4 ranks, {args.microbatches} micro-batches, forward {args.forward_s * 1e3:.0f} ms "
          f"at the highest clock, minimum of {args.rounds} steps per plan; {took:.0f} s")
    print(f"{'schedule':24}{'all-max pred':>16}{'measured':>16}{'plan pred':>16}{'measured':>16}"
          f"{'saving pred':>12}{'measured':>10}{'vs 1f1b':>9}{'time err':>10}{'energy err':>11}"
          f"{'planner':>9}")
    reference = report.get("1f1b", {}).get("planned_saving")
    worst = 0.0
    for name, r in report.items():
        cell = lambda v: f"{v[0]:7.4f}s {v[1]:6.1f}J"
        errors = [r["measured_" + w][i] / r["predicted_" + w][i] - 1
                  for w in ("base", "plan") for i in (0, 1)]
        worst = max(worst, *map(abs, errors))
        versus = f"{r['planned_saving'] - reference:+.2%}" if reference is not None else "-"
        label = name + (f" (v={r['chunks']})" if r["chunks"] > 1 else "")
        print(f"{label:24}{cell(r['predicted_base']):>16}{cell(r['measured_base']):>16}"
              f"{cell(r['predicted_plan']):>16}{cell(r['measured_plan']):>16}"
              f"{r['planned_saving']:12.2%}{r['measured_saving']:10.2%}{versus:>9}"
              f"{max(errors[0], errors[2], key=abs):+10.2%}"
              f"{max(errors[1], errors[3], key=abs):+11.2%}{r['planner_s']:8.1f}s")
    print(f"measured vs predicted within {TARGET:.0%} (time and energy, every schedule): "
          f"{'met' if worst <= TARGET else 'MISSED'} (worst {worst:.2%})")
    Path(args.save).write_text(json.dumps({"arguments": vars(args), "report": report}, indent=1))
    print(f"figures written to {args.save}")


if __name__ == "__main__":
    main()
