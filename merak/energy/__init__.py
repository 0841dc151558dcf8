"""Energy planning (Perseus): per-instruction GPU clocks for a pipeline schedule: profile,
plan the time-energy frontier, deploy the plan, report the saving."""
