"""Energy planning (Perseus): per-instruction GPU clocks for a pipeline schedule: profile,
plan the time-energy frontier, deploy the plan, report the saving.

Sub-packages, top to bottom (each imports only from those below it): `training` (energy in the
training run) beside `cli` (``merak energy ...``), `service` (the Perseus server and client),
`planning` (the clock frontier, the plan file) beside `reporting` (figures, the report),
`profiling` (GPU clock control, the profiler and its CSV)."""
