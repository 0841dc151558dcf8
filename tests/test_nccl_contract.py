"""The test backend with NCCL's point-to-point contract (tests/nccl_contract), which every
distributed test of the suite runs under: each property NCCL has and gloo lacks, shown on 2
ranks (workers/nccl_contract_check.py)."""

from __future__ import annotations

from dist_harness import launch, scenario_result

WORKER = "nccl_contract_check.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2,)



def _seen(results_output, scenario: str) -> list[dict]:
    figures = scenario_result(*results_output, scenario)
    assert len(figures) == 2, figures
    return figures


def test_the_suite_runs_under_the_contract(launches):
    for rank, seen in enumerate(_seen(launches(2), "installed")):
        assert seen["installed"] and seen["batch_isend_irecv_is_the_contracts"], \
            f"rank {rank}: the suite's processes must run under the NCCL contract"


def test_one_work_per_group(launches):
    for rank, seen in enumerate(_seen(launches(2), "one-work-per-group")):
        assert seen["works"] == 1, f"rank {rank}: NCCL returns one Work per group: {seen}"
        assert seen["received"] == [float(seen["peer"])] * 3, f"rank {rank}: {seen}"


def test_tags_are_ignored_messages_pair_in_posting_order(launches):
    _, receiver = _seen(launches(2), "tags-ignored")
    assert receiver["received_in_order"] == [1.0, 2.0], receiver


def test_a_receive_is_unfilled_until_its_work_is_waited(launches):
    _, receiver = _seen(launches(2), "unfilled-until-waited")
    assert receiver["all_nan_before_wait"], "read before the wait must not see data"
    assert receiver["after_wait"] == [1.0] * 4, receiver


def test_a_send_completes_only_at_the_rendezvous(launches):
    sender, receiver = _seen(launches(2), "rendezvous-send")
    assert not sender["completed_before_the_receive"], \
        "a send completed before its receive was posted"
    assert sender["completed_after"] and receiver["received"] == [1.0, 1.0], (sender, receiver)


def test_groups_complete_in_posting_order(launches):
    _, receiver = _seen(launches(2), "groups-in-order")
    assert receiver["first_done_with_the_second"], "the second group completed before the first"
    assert receiver["received"] == [2.0, 1.0], receiver


def test_gloo_collectives_and_subgroups_are_untouched(launches):
    for rank, seen in enumerate(_seen(launches(2), "collectives-and-subgroups")):
        assert seen == {"all_reduced": 3.0, "all_gathered": [0.0, 1.0]}, f"rank {rank}: {seen}"


def test_head_to_head_sends_deadlock_as_on_nccl(tmp_path):
    """Each rank sends first, then receives, in separate groups: both time out here (gloo
    alone completes it; NCCL waits forever)."""
    scenario = "head-to-head-sends-deadlock"
    timed_out = 0
    for rank, seen in enumerate(_seen(launch(WORKER, 2, tmp_path, args=["--only", scenario],
                                             timeout_s=120), scenario)):
        assert not seen["completed"], f"rank {rank}: a head-to-head send/send pair completed"
        error = seen["error"]
        # the first rank to time out ends its process; its peer may then see the connection
        # close before its own timeout: at least one rank must have timed out
        timed_out += "did not complete" in error or "timed out" in error.lower()
        assert timed_out or "closed by peer" in error, error
        assert not seen["send_succeeded"], f"rank {rank}: {seen}"
    assert timed_out >= 1, "no rank timed out"
