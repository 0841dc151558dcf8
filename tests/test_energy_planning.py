"""Perseus energy planning: the clock frontier on the reference synthetic GPU
(SyntheticGPUModel), its DAG against the simulator for every registered schedule, plan-file
validation, and profile -> plan -> deploy end to end on 4 gloo ranks with simulated GPUs for
1F1B, zero-bubble, interleaved 1F1B and Merak's shifted critical path; the frontier also plans
ZB-V and DualPipeV (2 stages per rank in a V). (The precise measured-vs-predicted figures of the
end-to-end run: bench/energy_e2e.py; the GPU backends: test_energy_profiling.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest
from dist_harness import scenario_result

from merak.energy.planning.frontier import ClockFrontier
from merak.energy.planning.plan_file import ClockPlanError, check_clock_plan, expected_instructions
from merak.energy.profiling.gpu import SyntheticGPUModel
from merak.energy.profiling.profile_data import (
    aggregate,
    clean,
    read_profile,
    synthetic_profile,
    write_profile,
)
from merak.schedule.actions import ActionKind
from merak.schedule.registry import SCHEDULES, make_schedule

SMALL = SyntheticGPUModel(clock_step=90)  # 6 clocks: frontiers in a second


def _schedule(name: str, ranks: int = 4, microbatches: int = 4):
    info = SCHEDULES[name]
    return make_schedule(name, ranks, microbatches,
                         stages_per_rank=2 if info.several_stages_per_rank else 1,
                         recompute=info.needs_recompute)


def _planner(schedule, model=SMALL, gpus_per_rank: int = 1, unit_time=None) -> ClockFrontier:
    profiles, p2p = aggregate(synthetic_profile(model, schedule.num_ranks, gpus_per_rank,
                                                chunks=schedule.stages_per_rank))
    return ClockFrontier(schedule, profiles, p2p, unit_time=unit_time)


@pytest.fixture(scope="module")
def reference():
    profiles, p2p = aggregate(synthetic_profile(SyntheticGPUModel(), 4))
    planner = ClockFrontier(make_schedule("1f1b", 4, 8), profiles, p2p)
    base = planner.evaluate(planner.max_clock_plan())
    return planner, base, planner.frontier()


def test_reference_all_max_clocks(reference):
    _, (time_s, energy_j), _ = reference
    assert time_s == pytest.approx(1.4640, abs=5e-5)
    assert energy_j == pytest.approx(1734.0, abs=0.05)


def test_reference_default_plan_saves_energy_at_no_slowdown(reference):
    planner, (base_time, base_energy), points = reference
    chosen = planner.choose(points, base_time)
    assert chosen.time_s <= base_time * (1 + 1e-9)
    assert 1 - chosen.energy_j / base_energy >= 0.085
    lowest = min(points, key=lambda p: p.energy_j)
    assert 1 - lowest.energy_j / base_energy == pytest.approx(0.1274, abs=1e-3)


def test_slowdown_cap_and_target_time(reference):
    planner, (base_time, _base_energy), points = reference
    capped = planner.choose(points, base_time, max_slowdown=0.05)
    assert base_time < capped.time_s <= base_time * 1.05 + 1e-9
    assert capped.energy_j < planner.choose(points, base_time).energy_j
    straggler = planner.choose(points, base_time, target_time=1.8)
    assert straggler.time_s <= 1.8 and straggler.energy_j <= capped.energy_j
    with pytest.raises(ValueError, match="no plan finishes"):
        planner.choose(points, base_time, target_time=1.0)


def test_planner_times_equal_the_simulator(reference):
    planner, _, points = reference
    for point in points[:: max(1, len(points) // 12)]:
        assert point.time_s == pytest.approx(planner.simulated(point.plan), rel=1e-12)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_planner_dag_replays_the_simulator_for_every_schedule(name):
    """Every compute action of every rank's program is an instruction (recompute and the split
    backward halves included); the DAG's longest path is the simulated iteration exactly, for
    any clocks."""
    schedule = _schedule(name, microbatches=8)
    planner = _planner(schedule)
    assert planner.compute == [(r, a) for r in range(4) for a in schedule.compute_actions(r)]
    kinds = {a.kind for _, a in planner.compute}
    assert (ActionKind.RECOMPUTE in kinds) == SCHEDULES[name].needs_recompute
    assert (ActionKind.BACKWARD_WEIGHT in kinds) == SCHEDULES[name].splits_backward
    rnd = random.Random(name)
    for _ in range(4):
        plan = {key: rnd.choice(list(planner.clocks(*key))) for key in planner.compute}
        assert planner.evaluate(plan)[0] == pytest.approx(planner.simulated(plan), rel=1e-12)


@pytest.mark.parametrize("name", ["zero_bubble", "interleaved_1f1b", "shifted_critical_path",
                                  "zbv", "dualpipev"])
def test_every_schedule_gets_a_plan_in_its_program_order(name):
    schedule = _schedule(name)
    planner = _planner(schedule, gpus_per_rank=2, unit_time=2e-3)
    base_time, base_energy = planner.evaluate(planner.max_clock_plan())
    chosen = planner.choose(planner.frontier(), base_time)
    assert chosen.time_s <= base_time * (1 + 1e-9) and chosen.energy_j < base_energy * 0.97
    schedules = planner.schedules(chosen.plan)
    assert [s["rank"] for s in schedules] == list(range(8))
    for entry in schedules:
        names = [n for n, _ in entry["frequencies"]]
        assert names == expected_instructions(schedule, entry["rank"] // 2)
    assert len(check_clock_plan(schedules, 8, lambda r: r // 2, schedule, SMALL.clocks())) == 8
    with pytest.raises(ClockPlanError, match="instruction order differs"):
        check_clock_plan(schedules, 8, lambda r: r // 2, make_schedule("1f1b", 4, 4),
                         SMALL.clocks())


def test_planner_names_instructions_the_profile_lacks():
    profiles, p2p = aggregate(synthetic_profile(SMALL, 2, instructions=("forward", "backward")))
    with pytest.raises(ValueError, match=r"rank 0 runs \['backward_input', 'backward_weight'\] "
                                         r"instructions, which the profile lacks"):
        ClockFrontier(make_schedule("zero_bubble", 2, 4), profiles, p2p)
    with pytest.raises(ValueError, match="the profile has 2 pipeline ranks, the schedule 4"):
        ClockFrontier(make_schedule("1f1b", 4, 4), profiles, p2p)


def test_noisy_profiles_still_plan():
    """Measured energies need not be convex in time (a loaded machine's noise); where lowtime's
    exponential fit fails the planner fits the options' lower convex hull instead."""
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption

    from merak.energy.planning.frontier import ConvexHullModel

    options = CandidateExecutionOptions(options=[
        ExecutionOption(real_time=t, unit_time=1.0, cost=c, knob=k)
        for k, (t, c) in enumerate([(10, 9.0), (11, 8.5), (12, 6.0), (13, 5.9), (14, 7.0)])])
    model = ConvexHullModel(options)
    assert model.points == [(10, 9.0), (12, 6.0), (13, 5.9)]
    assert model(11) == pytest.approx(7.5) and model(9) == pytest.approx(10.5)
    rows = synthetic_profile(SMALL, 4)
    noisy = [r if r.instruction == "p2p" else
             dataclasses.replace(r, energy=r.energy * (1 + 0.05 * (-1) ** (r.frequency // 90)))
             for r in rows]
    profiles, p2p = aggregate(noisy)
    planner = ClockFrontier(make_schedule("zero_bubble", 4, 4), profiles, p2p, unit_time=2e-3)
    base_time, base_energy = planner.evaluate(planner.max_clock_plan())
    chosen = planner.choose(planner.frontier(), base_time)
    assert chosen.time_s <= base_time * (1 + 1e-9) and chosen.energy_j < base_energy


def test_coarse_to_fine_keeps_the_default_plan(reference):
    planner, (base_time, base_energy), points = reference
    fine = planner.choose(points, base_time)
    quick = planner.choose(planner.frontier(coarse=4, window=6), base_time)
    assert quick.time_s <= base_time * (1 + 1e-9)
    assert 1 - quick.energy_j / base_energy >= 1 - fine.energy_j / base_energy - 5e-4
    assert planner.coarse_factor(100) == 4  # 40 ms forwards span >= 10 units of 1 ms


def test_profile_round_trip_and_cleaning(tmp_path):
    rows = synthetic_profile(SyntheticGPUModel(clock_step=90), 2, gpus_per_rank=2)
    path = write_profile(rows, tmp_path / "p.csv")
    profiles, p2p = aggregate(read_profile(path))
    assert p2p == pytest.approx(75.0) and [p.ranks for p in profiles] == [[0, 1], [2, 3]]
    t, e = profiles[0].options["forward"][1410]
    assert t == pytest.approx(0.04) and e == pytest.approx(2 * 0.04 * 400)  # energy: sum
    noisy = {1410: (1.0, 5.0), 1320: (0.9, 4.0), 1230: (1.2, 3.0)}
    assert clean(noisy) == {1410: (1.0, 5.0), 1320: (1.0, 4.0), 1230: (1.2, 3.0)}
    (tmp_path / "bad.csv").write_text("rank,stage\n0,0\n")
    with pytest.raises(ValueError, match="lacks columns"):
        read_profile(tmp_path / "bad.csv")


def _plan(reference):
    planner, (base_time, _), points = reference
    return planner.schedules(planner.choose(points, base_time).plan)


def test_plan_is_checked_before_training(reference):
    schedule, clocks = make_schedule("1f1b", 4, 8), SyntheticGPUModel().clocks()
    schedules = _plan(reference)
    assert len(check_clock_plan(schedules, 4, lambda r: r, schedule, clocks)) == 4
    with pytest.raises(ClockPlanError, match="ranks \\[0, 1, 2, 3\\], this job has 8"):
        check_clock_plan(schedules, 8, lambda r: r // 2, schedule, clocks)
    swapped = json.loads(json.dumps(schedules))
    swapped[1]["frequencies"][0][0] = "backward"
    with pytest.raises(ClockPlanError, match="rank 1: the plan's instruction order differs"):
        check_clock_plan(swapped, 4, lambda r: r, schedule, clocks)
    with pytest.raises(ClockPlanError, match="rank 0: the plan's instruction order"):
        check_clock_plan(schedules, 4, lambda r: r, make_schedule("1f1b", 4, 4), clocks)
    odd = json.loads(json.dumps(schedules))
    odd[2]["frequencies"][3][1] = 1234
    with pytest.raises(ClockPlanError, match="rank 2: clocks \\[1234\\] MHz are not supported"):
        check_clock_plan(odd, 4, lambda r: r, schedule, clocks)


def test_plan_command_writes_plan_and_picture(tmp_path):
    profile = write_profile(synthetic_profile(SMALL, 2), tmp_path / "p.csv")
    out = subprocess.run([sys.executable, "-m", "merak", "energy", "plan", str(profile),
                          "--stages", "2", "--microbatches", "4", "--max-slowdown", "0.05",
                          "--out", str(tmp_path / "plan.json")], capture_output=True, text=True,
                         check=True).stdout
    assert "energy saved" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["predicted"]["energy_j"] < plan["baseline"]["energy_j"]
    assert [s["rank"] for s in plan["schedules"]] == [0, 1]
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_plan_command_interleave_and_recompute(tmp_path, capsys):
    from merak.cli import main

    profile = write_profile(synthetic_profile(SMALL, 2, chunks=2), tmp_path / "p.csv")
    out = tmp_path / "plan.json"
    assert main(["energy", "plan", str(profile), "--schedule", "interleaved_1f1b",
                 "--interleave", "2", "--stages", "2", "--microbatches", "4",
                 "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert [n for n, _ in plan["schedules"][1]["frequencies"]] == expected_instructions(
        make_schedule("interleaved_1f1b", 2, 4, stages_per_rank=2), 1)
    assert plan["meta"]["interleave"] == 2 and "energy saved" in capsys.readouterr().out
    assert main(["energy", "plan", str(profile), "--schedule", "shifted_critical_path",
                 "--stages", "2", "--microbatches", "4", "--out", str(out)]) == 2
    assert "turn on activation checkpointing" in capsys.readouterr().err
    assert main(["energy", "plan", str(profile), "--schedule", "shifted_critical_path",
                 "--recompute", "1,0", "--stages", "2", "--microbatches", "4",
                 "--out", str(out)]) == 0
    names = {n for s in json.loads(out.read_text())["schedules"] for n, _ in s["frequencies"]}
    assert names == {"forward", "recompute", "backward"}
    for name in ("zbv", "dualpipev"):  # 2 stages per rank in a V, without --interleave
        assert main(["energy", "plan", str(profile), "--schedule", name, "--stages", "2",
                     "--microbatches", "4", "--out", str(out)]) == 0
        plan = json.loads(out.read_text())
        assert [n for n, _ in plan["schedules"][0]["frequencies"]] == expected_instructions(
            make_schedule(name, 2, 4, stages_per_rank=2), 0)


def test_the_planner_process_plans_the_programs_it_is_given(tmp_path):
    """``python -m merak.energy plan --programs FILE`` (energy_mode="auto"'s background
    planner): the schedule as JSON, planned exactly as the same schedule given by options, in a
    process that imports neither transformers nor torch.distributed's pipelining."""
    profile = write_profile(synthetic_profile(SMALL, 2), tmp_path / "p.csv")
    schedule = make_schedule("1f1b", 2, 4, recompute=[True, False])
    programs = tmp_path / "schedule.json"
    programs.write_text(json.dumps(schedule.to_json()))
    watch = ("import runpy, sys; sys.argv = ['merak.energy', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('merak.energy', run_name='__main__')\n"
             "finally:\n    print('loaded', *sorted(m for m in sys.modules if m in "
             "('transformers', 'torch.distributed.pipelining', 'peft')))\n")
    run = subprocess.run([sys.executable, "-c", watch, "plan", str(profile), "--programs",
                          str(programs), "--out", str(tmp_path / "a.json")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "loaded"  # none of them
    from merak.cli import main

    assert main(["energy", "plan", str(profile), "--schedule", "1f1b", "--recompute", "1,0",
                 "--stages", "2", "--microbatches", "4", "--out", str(tmp_path / "b.json")]) == 0
    given, named = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert given["schedules"] == named["schedules"] and given["meta"] == named["meta"]
    for r in (0, 1):
        assert [n for n, _ in given["schedules"][r]["frequencies"]] == \
            expected_instructions(schedule, r)
    programs.write_text("{not json")
    bad = subprocess.run([sys.executable, "-m", "merak.energy", "plan", str(profile),
                          "--programs", str(programs)], capture_output=True, text=True)
    assert bad.returncode == 2 and f"cannot read the schedule {programs}" in bad.stderr
    assert main(["energy", "plan", str(profile), "--stages", "2"]) == 2  # (no micro-batches)


def test_plan_arguments_rebuild_the_interpreters_schedule():
    """`TrainerEnergy.plan_command`'s options: the CLI rebuilds exactly the programs it ran."""
    from merak.energy.cli import recompute_flags
    from merak.energy.training.session import plan_arguments

    for schedule in (_schedule("interleaved_1f1b"), _schedule("shifted_critical_path"),
                     _schedule("zbv"), _schedule("dualpipev"),
                     make_schedule("1f1b", 4, 4, recompute=[True, False, True, False]),
                     make_schedule("zero_bubble", 2, 3)):
        args = plan_arguments(schedule)
        flags = recompute_flags(args[args.index("--recompute") + 1] if "--recompute" in args[:-1]
                                else "all" if "--recompute" in args else None)
        rebuilt = make_schedule(args[1], int(args[3]), int(args[5]), recompute=flags,
                                stages_per_rank=int(args[7]) if "--interleave" in args else 1)
        assert rebuilt.programs == schedule.programs, args
    assert plan_arguments(_schedule("shifted_critical_path"))[-1] == "--recompute"
    assert plan_arguments(make_schedule("1f1b", 2, 2, recompute=[False, True]))[-2:] == \
        ["--recompute", "0,1"]
    assert "--interleave" in plan_arguments(_schedule("interleaved_1f1b"))


# pooled: launches(world_size), see conftest.py
WORKER, WORLD_SIZES = "energy_e2e.py", (4,)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b",
                                      "shifted_critical_path"])
def test_profile_plan_deploy_end_to_end(launches, schedule):
    """One launch, every schedule: the plan's instruction order is consumed exactly, at its clocks,
    and it saves energy by its prediction (measured against predicted, and the saving as measured:
    bench/energy_e2e.py). The worker prints the per-schedule table (-s)."""
    results, output = launches(4)
    if schedule == "1f1b" and "energy end to end" in output:
        print("\n".join(output[output.find("energy end to end"):].splitlines()[:6]))
    lowered = []
    for rank, ours in enumerate(scenario_result(results, output,
                                                f"energy-end-to-end-{schedule}")):
        where = f"rank {rank}: {ours}"
        assert ours["profiled_kinds"] == ours["scheduled_kinds"], where
        assert ours["plan_follows_the_program"], where
        assert ours["consumed"] and all(consumed == [ours["instructions"]] * ours["steps"]
                                        for consumed in ours["consumed"].values()), where
        report = ours["report"]
        assert report["planned_saving"] >= 0.03, where
        # the plan was deployed: every step ran each instruction at the clock planned for it
        # (the baseline at the top clock). The energy it saves as measured is a wall-clock figure,
        # which the other pool's load on a 2-core machine swings by tens of percent:
        # bench/energy_e2e.py measures it on its own
        planned = Counter(tuple(clock) for clock in ours["mine"])
        ran = {name: Counter({(n, mhz): count for n, mhz, count in counts})
               for name, counts in report["clocks_ran"].items()}
        assert ran["plan"] == Counter({key: n * ours["steps"] for key, n in planned.items()}), \
            where
        assert {mhz for _, mhz in ran["all-max"]} == {ours["max_clock"]}, where
        assert ran["all-max"].total() == ours["instructions"] * ours["steps"], where
        lowered.extend(mhz < ours["max_clock"] for _, mhz in planned)
    assert any(lowered), "no rank's plan lowers a clock"


_FRONTIER = """
import json, sys
if sys.argv[1] == "python":
    sys.modules["lowtime._lowtime_rs"] = None  # as if the compiled part were missing
from merak.energy.profiling.gpu import SyntheticGPUModel
from merak.energy.planning.frontier import ClockFrontier
from merak.energy.profiling.profile_data import aggregate, synthetic_profile
from merak.schedule.registry import make_schedule
profiles, p2p = aggregate(synthetic_profile(SyntheticGPUModel(clock_step=90), 2))
planner = ClockFrontier(make_schedule("1f1b", 2, 3), profiles, p2p)
planner.fast = sys.argv[1] != "lowtime"  # lowtime's own PhillipsDessouky.run
points = planner.frontier()
import lowtime.solver
print(json.dumps([lowtime.solver._lowtime_rs.PhillipsDessouky.__module__,
                  [[p.time_s, p.energy_j] for p in points]]))
"""


def test_fallbacks_and_the_fast_solver_give_the_same_frontier():
    run = lambda mode: json.loads(subprocess.run(
        [sys.executable, "-c", _FRONTIER, mode], capture_output=True, text=True, check=True,
        env={**os.environ, "MERAK_ENERGY_CHECK_CUTS": "1"}).stdout)
    (compiled_kind, compiled), (python_kind, python) = run("compiled"), run("python")
    assert python_kind == "merak.energy.planning.solver" != compiled_kind
    assert python == compiled and len(python) > 10
    _, lowtime_own = run("lowtime")  # our walk changes the speed, not the frontier
    assert lowtime_own == compiled


def _bounded_flow_problem(rnd: random.Random):
    """A layered DAG from node 0 to the sink with flow bounds around a feasible flow (lowtime's
    units, 1e-6): unbounded edges, tight ones, and one- and two-unit slacks (the ties)."""
    layers = [list(range(i * 3 + 1, i * 3 + 4)) for i in range(rnd.randint(2, 5))]
    sink = layers[-1][-1] + 1
    flow: dict[tuple[int, int], int] = {}
    for _ in range(rnd.randint(2, 6)):
        path = [0] + [rnd.choice(layer) for layer in layers] + [sink]
        amount = rnd.choice([2, 3, 5, 8]) * 1000
        for edge in zip(path, path[1:]):
            flow[edge] = flow.get(edge, 0) + amount
    edges = list(flow) + [(u, v) for upper, lower in zip(layers, layers[1:]) for u in upper
                          for v in lower if (u, v) not in flow and rnd.random() < 0.3]
    bounds = []
    for edge in edges:
        f = flow.get(edge, 0)
        if rnd.random() < 0.25:
            bounds.append((0.0, 10000.0))
        else:
            bounds.append((max(0, f - rnd.choice([0, 0, 1, 500, 3000])) * 1e-6 // 1e-6 * 1e-6,
                           (f + rnd.choice([0, 1, 2, 700, 4000])) * 1e-6 // 1e-6 * 1e-6))
    return edges, bounds, sink


def test_exact_min_cuts_are_lowtimes():
    """Where `minimal_min_cut` answers, its cut is lowtime's compiled min cut exactly; where
    lowtime's floating point could break a one-unit tie either way, it declines."""
    lowtime_solver = pytest.importorskip("lowtime.solver")
    import numpy as np

    from merak.energy.planning.min_cut import minimal_min_cut

    rnd = random.Random(7)
    answered = declined = 0
    for _ in range(150):
        edges, bounds, sink = _bounded_flow_problem(rnd)
        nodes = sorted({n for e in edges for n in e})
        index = {n: i for i, n in enumerate(nodes)}
        lb, ub = (np.array(column) for column in zip(*bounds))
        cut = minimal_min_cut(len(nodes), index[0], index[sink],
                              np.array([index[u] for u, _ in edges]),
                              np.array([index[v] for _, v in edges]), lb, ub, 1e-6, 10000.0)
        if cut is None:
            declined += 1
            continue
        runner = lowtime_solver._lowtime_rs.PhillipsDessouky(
            1e-6, nodes, 0, sink, [(e, (0, 0, b, a)) for e, (a, b) in zip(edges, bounds)])
        s_set, _ = runner.find_min_cut()
        assert {n for n, inside in zip(nodes, cut) if inside} == s_set
        answered += 1
    assert answered >= 20 and declined >= 20, (answered, declined)
