"""`merak energy serve` under hostile clients: a concurrent mix of well-formed and malformed
requests against a server in its own process (bench/energy_server_load.py's, smaller), and the
bounds of its state (results per job and in all, on disk, jobs, reporting ranks, plans)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from merak.energy.planning.plan_file import ClockPlanError, load_clock_plan
from merak.energy.service.pfo_limits import ResultStore
from merak.energy.service.pfo_protocol import JobInfo, ProfilingResult, RankInfo
from merak.energy.service.pfo_server import PlanRegistry

_SPEC = importlib.util.spec_from_file_location(
    "energy_server_load", Path(__file__).resolve().parents[1] / "bench" / "energy_server_load.py")
load = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(load)


def test_a_flood_of_good_and_bad_requests_gets_2xx_or_4xx_in_bounded_memory(tmp_path):
    server = load.Server(tmp_path, "--body-timeout", "3")
    try:
        result = load.run_load(server, 300, stall_s=4.0)
    finally:
        server.stop()
    assert sum(result["status"].values()) == 300
    assert all(status[:1] in "24" for status in result["status"]), result["status"]
    kinds = result["by_kind"]
    assert kinds["20MB declared"] == {"413": 22} and set(kinds["20MB chunked"]) == {"413"}
    assert set(kinds["NaN"]) == {"422"} and set(kinds["rank not registered"]) == {"400"}
    assert kinds["stalled body"] == {"408": 8} and set(kinds["report"]) == {"200"}
    assert result["above_idle_mib"] < 200, result
    escaped = [p for p in tmp_path.rglob("*") if "etc" in p.name or p.name.startswith("x")]
    assert not escaped  # job metadata never leaves the results directory


def _plan(ranks: int = 2) -> dict:
    return {"predicted": {"time_s": 1.0, "energy_j": 9.0}, "meta": {"stages": ranks},
            "schedules": [{"rank": r, "frequencies": [["forward", 1410]]}
                          for r in range(ranks)]}


def test_results_are_bounded_per_job_in_all_and_on_disk(tmp_path):
    store = ResultStore(per_job=3, max_bytes=100, directory=tmp_path, file_bytes=40,
                        disk_bytes=120)
    for i in range(5):
        store.add("a", b"%018d" % i)  # 18 bytes each
    assert store.results("a") == [b"%018d" % i for i in (2, 3, 4)]
    for i in range(5):
        store.add("b", b"%018d" % (10 + i))
    assert store.bytes == 90 and len(store.results("b")) == 3
    assert store.results("a") == [b"%018d" % 3, b"%018d" % 4]  # the oldest first, in all
    files = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert all(size <= 40 for size in files.values()) and "a.jsonl.1" in files
    assert store.written <= 120 and store.not_written == 4
    store.drop_job("b")
    assert store.results("b") == [] and store.bytes == 36


def test_the_registry_checks_ranks_forgets_idle_jobs_and_refuses_nan(tmp_path):
    registry = PlanRegistry([_plan()], tmp_path, max_jobs=2)
    info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2,
                   job_metadata="../../x y")
    first = registry.register_job(info)
    assert first.endswith("+_.._x_y")  # a file name inside the results directory
    registry.register_rank(first, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                                           available_frequencies=[1410]))
    with pytest.raises(ValueError, match="rank 1 reports for job .* not one of its registered"):
        registry.report(first, ProfilingResult(rank=1, iter_time=[1.0], iter_energy=[2.0]))
    registry.report(first, ProfilingResult(rank=0, iter_time=[1.0], iter_energy=[2.0]))
    assert registry.jobs[first].results[0].iter_energy == [2.0]
    registry.register_job(info), registry.register_job(info)
    assert first not in registry.jobs and registry.forgotten == 1
    assert registry.store.results(first) == []
    for bad in ({"iter_time": [float("nan")], "iter_energy": [1.0]},
                {"iter_time": [1.0], "iter_energy": [1.0, 2.0]},
                {"iter_time": [-1.0], "iter_energy": [1.0]}):
        with pytest.raises(ValueError):
            ProfilingResult(rank=0, **bad)


@pytest.mark.parametrize("change,message", [
    (lambda p: p.pop("schedules"), "non-empty 'schedules' list"),
    (lambda p: p["schedules"][1].pop("rank"), "schedule 1 must be"),
    (lambda p: p["schedules"][1].update(rank=5), r"for ranks \[0, 5\], not each of 0..1"),
    (lambda p: p["schedules"][0].update(frequencies=[["forward", -3]]), "MHz > 0"),
    (lambda p: p["meta"].update(stages=3), "meta.stages must be a pipeline degree"),
    (lambda p: p["predicted"].update(time_s=float("nan")), "predicted must hold finite"),
])
def test_malformed_plans_are_refused_when_loaded(tmp_path, change, message):
    plan = _plan()
    change(plan)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(ClockPlanError, match=message):
        load_clock_plan(path)
    with pytest.raises(ClockPlanError, match=message):
        PlanRegistry([plan])
