"""HF Trainer fields through MerakTrainer at dp1 x tp1 x pp2, in the trainer's 2-rank launch
(workers/trainer_fields.py): push_to_hub, ignore_data_skip, dataloader workers, compute_metrics'
inputs and auto_find_batch_size. Each scenario returns what it saw; these tests assert it."""

from __future__ import annotations

import pytest
from dist_harness import assert_like_reference, scenario_result


def _seen(two_ranks, scenario: str) -> list[dict]:
    figures = scenario_result(*two_ranks[1:], scenario)
    assert len(figures) == 2 and all(figures), figures
    return figures


def test_lora_config_trains_like_peft_exports_and_generates(two_ranks):
    """`lora_config` at pp=2: single-process peft's losses (rtol 1e-4), only the adapters
    train and the base weights stay; greedy generation after training, `trainer.generate` and
    `merak generate` give HF generate's tokens on the trained peft model; `save_model`,
    `merak export` and `--merge` load back to its logits."""
    figures = _seen(two_ranks, "lora-trainer")
    for rank, ours in enumerate(figures):
        where = f"rank {rank}: {ours}"
        assert ours["materialized_outside_the_stage"] == [], where
        assert ours["trainable"] and all(".lora_" in n for n in ours["trainable"]), where
        assert ours["frozen_changed"] == [], where
        want = ours["hf_generated"]
        assert ours["text_generation"] == want, where
        assert ours["generate"] == [want[0][:3]], where
    first = figures[0]
    assert first["cli_lines"] == first["cli_expected"], first
    assert first["generations_file"] == first["hf_generated"], first
    assert assert_like_reference(figures, rtol=1e-4, atol=1e-5, grad_atol_of_max=0.0) == 2 + 3


def test_push_to_hub_uploads_the_gathered_model_and_checkpoints(two_ranks):
    """HF's own push code uploads from rank 0 only: the model gathered from the shards at each
    save, each checkpoint folder (Merak's DCP format) and the final model with its card; the
    pushed weights are the trained ones."""
    figures = _seen(two_ranks, "push-to-hub")
    first, other = figures
    assert other["repos"] == [] and other["uploads"] == [], "only rank 0 talks to the Hub"
    assert first["repos"] == [["me/tiny", True]], first["repos"]
    assert first["uploads"] == [
        ["Training in progress, step 2", None],
        ["Training in progress, step 2, checkpoint", "checkpoint-2"],
        ["Training in progress, step 4", None],
        ["Training in progress, step 4, checkpoint", "checkpoint-4"],
        ["End of training", None]], first["uploads"]
    assert first["checkpoint_in_dcp"] and first["model_card"], first
    assert first["pushed_names"] == first["full_names"], first
    assert assert_like_reference(figures, rtol=1.3e-6, atol=1e-5, grad_atol_of_max=0.0) \
        == len(first["full_names"]) > 0


def test_ignore_data_skip_restarts_the_resumed_epoch(two_ranks):
    """Resumed at step 2 of a 4-step epoch (4 rows a step), step 3 reads rows 8-11; with
    ignore_data_skip the epoch's first rows again. (The first stage reads the inputs.)"""
    first = _seen(two_ranks, "ignore-data-skip")[0]
    assert first["read_skipping"][-4:] == [8, 9, 10, 11], first
    assert first["read_ignoring"][-4:] == [0, 1, 2, 3], first


def test_dataloader_workers_collate_the_same_batches(two_ranks):
    for rank, ours in enumerate(_seen(two_ranks, "dataloader-workers")):
        assert ours["losses_with_workers"] == ours["losses_without_workers"], f"rank {rank}"
        assert ours["other_processes_collated"] > 0, f"rank {rank}: no worker collated"


def test_compute_metrics_per_step_with_inputs_and_losses(two_ranks):
    """eval_do_concat_batches=False gives per-step arrays (the last one partial);
    include_for_metrics gives the inputs in dataset order and each row's loss, whose mean is
    eval_loss; batch_eval_metrics calls once per step, compute_result on the last, to the
    whole-set accuracy."""
    for rank, ours in enumerate(_seen(two_ranks, "eval-metrics-inputs")):
        whole, split, per_step = ours["whole"], ours["split"], ours["per_step"]
        where = f"rank {rank}: {ours}"
        assert ours["split_batches"] == [4, 4, 2], where
        assert split["eval_accuracy"] == whole["eval_accuracy"], where
        assert ours["inputs_are_the_items"], where
        assert ours["losses_shape"] == [10], where
        assert ours["losses_mean"] == pytest.approx(split["eval_loss"], abs=1e-6), where
        assert ours["metric_calls"] == [[4, False], [4, False], [2, True]], where
        assert per_step["eval_accuracy"] == pytest.approx(whole["eval_accuracy"], abs=1e-12)
        assert per_step["eval_loss"] == whole["eval_loss"], where


def test_auto_find_batch_size_halves_until_every_rank_fits(two_ranks):
    """8-row micro-batches "run out of memory" on the last stage only: both ranks halve twice
    and train as a run with 2-row micro-batches does."""
    for rank, ours in enumerate(_seen(two_ranks, "auto-find-batch-size")):
        auto, fixed = ours["auto=True"], ours["auto=False"]
        assert auto["rows"] == 8 and auto["train_batch_size"] == 2, f"rank {rank}: {ours}"
        assert fixed["train_batch_size"] == 2, f"rank {rank}: {ours}"
        assert auto["losses"] == fixed["losses"], f"rank {rank}: {ours}"
