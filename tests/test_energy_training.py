"""``energy_mode="auto"`` (profile, plan in the background, deploy at a step boundary, re-plan
on drift) through MerakTrainer on 4 ranks with simulated GPUs: 1F1B and interleaved 1F1B
(zero-bubble too with MERAK_TEST_MATRIX=full) in one pooled launch, and 1F1B on 2 pipeline
stages of 2 context-parallel ranks each (plans per pipeline rank at cp > 1)
(tests/workers/energy_auto.py says what each asserts; bench/energy_auto.py the measured
figures), and the pieces on their own."""

from __future__ import annotations

import pytest
from dist_harness import check
from energy_auto import SCHEDULE_NAMES

from merak.energy.training.auto import spread_clocks

# pooled: launches(world_size), see conftest.py
WORKER, WORLD_SIZES = "energy_auto.py", (4,)


@pytest.mark.parametrize("schedule", [*SCHEDULE_NAMES, "1f1b-cp2"])
def test_auto_mode_profiles_plans_and_deploys_in_the_run(launches, schedule):
    results, output = launches(4)
    if schedule == "1f1b" and "energy auto (" in output:
        print("\n".join(output[output.find("energy auto ("):].splitlines()[:5]))
    check(results, output, f"energy-auto-{schedule}")


def test_profiled_clocks_spread_over_the_range():
    clocks = list(range(1410, 209, -15))  # an A100's 81 clocks
    picked = spread_clocks(clocks, 8)
    assert picked[0] == 1410 and picked[-1] == 210 and len(picked) == 8
    assert picked == sorted(picked, reverse=True)
    assert spread_clocks([1410, 1320, 1230], 8) == [1410, 1320, 1230]
