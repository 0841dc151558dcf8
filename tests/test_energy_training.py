"""``energy_mode="auto"`` (profile, plan in the background, deploy at a step boundary, re-plan
on drift) through MerakTrainer on 4 ranks with simulated GPUs: 1F1B and interleaved 1F1B
(zero-bubble too with MERAK_TEST_MATRIX=full) in one pooled launch, and 1F1B on 2 pipeline
stages of 2 context-parallel ranks each (plans per pipeline rank at cp > 1)
(tests/workers/energy_auto.py returns what each run did; bench/energy_auto.py measures the
savings), and the pieces on their own."""

from __future__ import annotations

import pytest
from dist_harness import assert_like_reference, scenario_result
from energy_auto import SCHEDULE_NAMES

from merak.energy.training.auto import spread_clocks

# pooled: launches(world_size), see conftest.py
WORKER, WORLD_SIZES = "energy_auto.py", (4,)


@pytest.mark.parametrize("schedule", [*SCHEDULE_NAMES, "1f1b-cp2"])
def test_auto_mode_profiles_plans_and_deploys_in_the_run(launches, schedule):
    """A plan is deployed within the run, at the same step on every rank (1F1B with the drift:
    a second plan after a re-plan); the profile took at most 1 + PROFILE_CLOCKS steps per
    round; every planned step ran the whole plan; the metrics and files are there; clocks
    never change the losses."""
    results, output = launches(4)
    if schedule == "1f1b" and "energy auto (" in output:
        print("\n".join(output[output.find("energy auto ("):].splitlines()[:5]))
    figures = scenario_result(results, output, f"energy-auto-{schedule}")
    for rank, ours in enumerate(figures):
        where = f"rank {rank}: {ours}"
        assert ours["plans"] and ours["steps"] < ours["limit"], f"no plan deployed: {where}"
        events = ours["events"]
        if ours["drift"]:
            assert ours["plans"] == 2 and len(events) == 3 and events[1][1] == "re-plan", where
        else:
            assert ours["plans"] == 1 and len(events) == 1, where
        assert ours["same_plan_steps_on_every_rank"], where
        assert ours["profile_steps"] <= (1 + ours["profile_clocks"]) * ours["rounds"], where
        assert ours["profile_phase_steps"] == ours["profile_steps"], where
        consumed = ours["planned_consumed"]
        assert consumed and set(consumed) == {ours["plan_instructions"]}, where
        assert {"energy_saved", "energy_step_time_change", "energy_predicted_saved",
                "energy_profile_steps", "energy_plan_step"} <= set(ours["metrics"]), where
        assert ours.get("missing_files", []) == [], where
    assert assert_like_reference(figures, rtol=1e-6, atol=0.0, grad_atol_of_max=0.0) > 0


def test_profiled_clocks_spread_over_the_range():
    clocks = list(range(1410, 209, -15))  # an A100's 81 clocks
    picked = spread_clocks(clocks, 8)
    assert picked[0] == 1410 and picked[-1] == 210 and len(picked) == 8
    assert picked == sorted(picked, reverse=True)
    assert spread_clocks([1410, 1320, 1230], 8) == [1410, 1320, 1230]
