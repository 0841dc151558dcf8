"""The Perseus protocol through real HTTP on 127.0.0.1 (our client, our `merak energy serve`),
MerakTrainer's energy modes on 2 gloo ranks (profile, plan from a file, plan from the server,
malformed plans refused before the first step), and `merak energy report`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from dist_harness import assert_like_reference, launch, scenario_result

from merak.energy.profiling.gpu import SyntheticGPUModel
from merak.energy.reporting.report import report, summarize
from merak.energy.service.pfo_client import PFOClient, PFOError
from merak.energy.service.pfo_protocol import JobInfo, ProfilingResult, RankInfo
from merak.energy.service.pfo_server import PlanRegistry, ServerThread

CLOCKS = SyntheticGPUModel().clocks()


def _plan(ranks: int = 2, stages: int = 2) -> dict:
    schedules = [{"rank": r, "frequencies": [["forward", 1410], ["backward", 1215]]}
                 for r in range(ranks)]
    return {"predicted": {"time_s": 1.0, "energy_j": 90.0},
            "baseline": {"time_s": 1.0, "energy_j": 100.0},
            "meta": {"stages": stages}, "schedules": schedules}


def _rank(rank: int, clocks=CLOCKS) -> RankInfo:
    return RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=clocks)


def test_client_and_server_speak_the_protocol_over_http(tmp_path):
    registry = PlanRegistry([_plan()], results_dir=tmp_path)
    with ServerThread(registry) as server:
        client = PFOClient(server.url)
        job = client.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2,
                                          job_metadata="test"))
        assert "+pp2+" in job and job.endswith("+test")
        for rank in range(2):
            client.register_rank(job, _rank(rank))
        schedule = client.schedule(job, 1)
        assert schedule.rank == 1
        assert schedule.frequencies == [("forward", 1410), ("backward", 1215)]
        client.report(job, ProfilingResult(rank=1, iter_time=[1.0, 1.1],
                                           iter_energy=[90.0, 91.0]))
        assert registry.jobs[job].results[0].iter_energy == [90.0, 91.0]
        lines = (tmp_path / f"{job}.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["iter_time"] == [1.0, 1.1]
        info = json.loads(__import__("urllib.request").request.urlopen(server.url + "/info")
                          .read())
        assert info["jobs"] == [job] and info["plans"][0]["ranks"] == 2


def test_server_refuses_what_does_not_fit_with_clear_errors():
    with ServerThread(PlanRegistry([_plan()])) as server:
        client = PFOClient(server.url)
        with pytest.raises(PFOError, match=r"no served plan fits a job of 4 ranks"):
            client.register_job(JobInfo(pp_degree=4, dp_degree=1, tp_degree=1, world_size=4))
        job = client.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        with pytest.raises(PFOError, match=r"HTTP 404.*unknown job 'nope'"):
            client.register_rank("nope", _rank(0))
        with pytest.raises(PFOError, match=r"rank 5 is outside job"):
            client.register_rank(job, _rank(5))
        with pytest.raises(PFOError, match=r"1215\] MHz, which its GPU does not support"):
            client.register_rank(job, _rank(0, clocks=[1410, 1395]))
        with pytest.raises(PFOError, match=r"rank 1 of job .* is not registered"):
            client.schedule(job, 1)
    with pytest.raises(ValueError, match=r"world_size 3 is not pp x dp x tp"):
        JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=3)


def test_client_names_an_unreachable_server():
    with ServerThread(PlanRegistry([_plan()])) as server:
        url = server.url
    with pytest.raises(PFOError, match=r"cannot reach the Perseus server at .*merak energy serve"):
        PFOClient(url, timeout_s=5).register_job(
            JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
    with pytest.raises(ValueError, match="must be an http"):
        PFOClient("127.0.0.1:7787")


def test_report_against_a_measured_or_predicted_baseline(tmp_path):
    def steps(name, rows):
        path = tmp_path / name
        path.write_text("step,time_s,energy_j,clocks\n" + "".join(
            f"{i + 1},{t},{e},x\n" for i, (t, e) in enumerate(rows)))
        return path

    run = summarize(steps("run.csv", [(9.0, 999.0), (1.01, 90.0), (1.0, 91.0), (1.02, 89.0)]))
    assert (run.steps, run.time_s, run.energy_j) == (3, 1.01, 90.0)  # warm-up step left out
    base = summarize(steps("base.csv", [(9.0, 999.0), (1.0, 100.0), (1.0, 100.0)]))
    text = "\n".join(report(run, base, _plan()))
    assert "10.00% energy saved, +1.00% time" in text
    assert "measured vs predicted: time +1.00%, energy +0.00%" in text
    assert "all-max (predicted)" in "\n".join(report(run, None, _plan()))
    with pytest.raises(ValueError, match="nothing to compare with"):
        report(run, None, None)
    cli = subprocess.run([sys.executable, "-m", "merak", "energy", "report",
                          str(tmp_path / "run.csv"), "--baseline", str(tmp_path / "base.csv")],
                         capture_output=True, text=True, check=False)
    assert cli.returncode == 0 and "10.00% energy saved" in cli.stdout, cli.stderr


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer-energy")
    return out, *launch("trainer_energy.py", 2, out)


def _seen(trainer_runs, scenario: str) -> list[dict]:
    _, results, output = trainer_runs
    figures = scenario_result(results, output, scenario)
    assert len(figures) == 2 and all(figures), figures
    return figures


def test_trainer_profiles_plans_and_trains_with_the_plan_from_a_file(trainer_runs):
    """profile -> `merak energy plan` -> train with the plan: every step ran every instruction
    at its planned clock (the all-max run at the highest), the plan lowers some clocks, and
    clocks never change the numbers (the losses of the run without them)."""
    figures = _seen(trainer_runs, "profile-then-plan-from-a-file")
    first = figures[0]
    assert first["profile_stages"] == [0, 1], first
    assert first["profile_instructions"] == ["backward", "forward", "p2p"], first
    assert first["plan_returncode"] == 0 and first["plan_written"], first["plan_stderr"]
    for rank, ours in enumerate(figures):
        where = f"rank {rank}: {ours}"
        assert ours["all_max_logs_energy"] and ours["profiled_clocks"] >= 3, where
        assert ours["steps_in_file"] == [1, 2, 3, 4, 5, 6], where
        assert ours["ran_as_planned"] and ours["all_max_clocks"] == [1410], where
        assert min(ours["plan_clocks"]) < 1410, where
    assert assert_like_reference(figures, rtol=1e-6, atol=0.0, grad_atol_of_max=0.0) == 24


def test_trainer_takes_its_plan_from_a_server(trainer_runs):
    """`pfo_server_url`: both ranks register, report 3 windows of 2 steps' energies, and train
    to the losses of the run without clocks."""
    figures = _seen(trainer_runs, "plan-from-a-server")
    first = figures[0]
    assert first["jobs"] == 1 and first["job_ranks"] == [0, 1], first
    assert first["result_ranks"] == [0, 0, 0, 1, 1, 1], first
    assert first["energies_per_result"] == [2] * 6, first
    assert assert_like_reference(figures, rtol=1e-6, atol=0.0, grad_atol_of_max=0.0) == 6


@pytest.mark.parametrize("plan,message", [
    ("ranks", r"meta.stages must be a pipeline degree dividing its 1 ranks"),  # when read
    ("ranks-no-meta", r"schedules for ranks \[0\], this job has 2 ranks"),  # against the job
    ("order", r"instruction order differs from the schedule at position 0"),
    ("clock", r"clocks \[1400\] MHz are not supported"),
    ("served-order", r"instruction order differs")])
def test_malformed_plans_stop_before_training(trainer_runs, plan, message):
    for rank, ours in enumerate(_seen(trainer_runs, "malformed-plans-stop-before-training")):
        run = ours[plan]
        assert run["error"] and re.search(message, run["error"]), f"rank {rank}: {run}"
        assert run["steps"] == 0 and not run["steps_file"], f"rank {rank}: {run}"


def test_the_plan_follows_every_instruction_kind(trainer_runs):
    """Zero-bubble with recomputation: the trainer prints the plan command with its schedule;
    the profile and the plan hold recompute, backward_input and backward_weight; each step
    consumed the whole plan in the interpreter's order."""
    figures = _seen(trainer_runs, "every-instruction-kind")
    first = figures[0]
    assert first["profile_instructions"] == ["backward_input", "backward_weight", "forward",
                                             "p2p", "recompute"], first
    assert first["plan_returncode"] == 0, first["plan_stderr"]
    for rank, ours in enumerate(figures):
        command, expected = ours["command"], ours["schedule_actions"]
        assert command == ["merak", "energy", "plan", ours["profile"], "--schedule",
                           "zero_bubble", "--stages", "2", "--microbatches", "2",
                           "--recompute"], f"rank {rank}: {command}"
        assert ours["planned_actions"] == expected, f"rank {rank}: {ours}"
        assert ours["consumed"] == [len(expected)] * 6, f"rank {rank}: {ours}"
        assert {"recompute", "backward_input", "backward_weight"} <= set(expected), expected


def test_energy_gpu_choices_are_checked():
    from merak import MerakArguments
    from merak.energy.training.session import make_gpu

    gpu = make_gpu("simulated", '{"forward_s": 0.01, "clock_step": 90}', num_ranks=2)
    assert gpu.supported_clocks()[:2] == [1410, 1320] and gpu.model.forward_s == 0.01
    assert make_gpu("simulated", None, 4, chunks=2).chunks == 2
    for schedule in ("zero_bubble", "interleaved_1f1b", "shifted_critical_path"):  # every one
        MerakArguments(output_dir="out", energy_gpu="simulated", train_schedule=schedule,
                       activation_checkpointing=schedule == "shifted_critical_path")
    with pytest.raises(ValueError, match="simulated_gpu is not JSON"):
        make_gpu("simulated", "{forward_s: 1}", 2)
    with pytest.raises(ValueError, match=r"unknown fields \['speed'\]"):
        make_gpu("simulated", '{"speed": 2}', 2)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        make_gpu("nvml", None, 2)
