"""Context parallelism through MerakTrainer: (dp, tp, pp, cp) = (1,1,2,2), (1,2,1,2) (Ulysses
repeating the one key/value head of each TP rank, ring with sequence parallelism) and (2,1,1,2)
(Ulysses with recomputation, ring under ZeRO-2: gradients reduced over dp x cp) in the 4-rank
launch (pooled worker cp_trainer.py; MERAK_TEST_MATRIX=full adds the 8-rank (2,1,2,2) and
(1,4,1,2) runs); every step's loss, grad norm and learning rate over 5 steps, and the eval loss,
equal single-process HF Trainer's on the same rows. Plus the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from cp_trainer import CP_RUNS, RESUMES, SAVED, family, reference_fields
from dist_harness import check
from trainer_common import DP, MICRO_BATCH, build, eval_set, train_set

from merak import MerakArguments, NotSupportedYetError, rules
from merak.checkpoint.files import check_files
from merak.checkpoint.io import full_tensors

WORKER = "cp_trainer.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = tuple(CP_RUNS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(family)``: single-process HF Trainer on the same rows, init and fields."""
    made = {}

    def of(family: str) -> dict:
        if family not in made:
            made[family] = _hf_run(family, tmp_path_factory.mktemp(f"cp-reference-{family}"))
        return made[family]
    return of


def _hf_run(family: str, output_dir) -> dict:
    torch.set_num_threads(1)
    args = tf.TrainingArguments(output_dir=str(output_dir),
                                per_device_train_batch_size=MICRO_BATCH * DP,
                                per_device_eval_batch_size=MICRO_BATCH * DP,
                                save_strategy="no", **reference_fields())
    eval_rows = [{**row, "attention_mask": torch.ones_like(row["input_ids"])}
                 for row in eval_set()]
    trainer = tf.Trainer(model=build(family), args=args, train_dataset=train_set(),
                         eval_dataset=eval_rows)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs],
            "eval_loss": trainer.evaluate()["eval_loss"]}


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in CP_RUNS[w]])
def test_context_parallel_trains_like_hf_trainer(launches, worker_pool, reference, world_size,
                                                 scenario):
    check(*launches(world_size), scenario)
    reference = reference(family(scenario))
    ours = json.loads((worker_pool.out_dir(WORKER, world_size)
                       / f"merak-{scenario}.json").read_text())
    assert len(ours["loss"]) == len(reference["loss"]) == 5
    for key in ("loss", "grad_norm", "learning_rate"):
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    if CP_RUNS[world_size][scenario][2].get("save_steps"):
        saved = worker_pool.out_dir(WORKER, world_size) / scenario / f"checkpoint-{SAVED}"
        layout = check_files(saved)  # every file its layout implies
        assert (layout.dp, layout.tp, layout.pp, layout.cp) == (1, 1, 2, 2)
        weights = full_tensors(saved)  # whole tensors, as cp=1 writes them
        assert {n: t.shape for n, t in weights.items()} == {
            n: p.shape for n, p in build("llama-deep").named_parameters()}


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("scenario", list(RESUMES[4]))
def test_a_cp_checkpoint_resumes(world_size, launches, worker_pool, reference, scenario):
    """The (1,1,2,2) ring run's step-3 checkpoint, resumed in its layout and at cp=1 (dp2 x
    pp2, the optimizer state resharded): steps 4 and 5 and the eval loss are HF Trainer's."""
    check(*launches(world_size), scenario)
    reference = reference("llama-deep")
    found = worker_pool.out_dir(WORKER, world_size) / f"merak-{scenario}.json"
    ours = json.loads(found.read_text())
    assert len(ours["loss"]) == len(reference["loss"])  # (steps 1-3: the checkpoint's history)
    for key in ("loss", "grad_norm", "learning_rate"):
        steps = slice(SAVED, None)
        assert ours[key][steps] == pytest.approx(reference[key][steps], rel=1e-5, abs=1e-6), key
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)


def test_the_rules_refuse_what_context_parallelism_runs_without():
    def refused(match: str, **fields):
        found = rules.refusal(rules.Choices(cp=2, **fields))
        assert found is not None and match in found.message, found

    refused("a decode step has one position", text_generation=True)
    refused("one sequence per row", packing=True)
    refused("not supported yet", tp_overlapping_level=1)
    refused("torch_compile with context parallelism", torch_compile=True)
    assert rules.refusal(rules.Choices(cp=2, zero_stage=3)) is None
    assert rules.refusal(rules.Choices(cp=1, text_generation=True)) is None
    with pytest.raises(ValueError, match="cp_mode must be 'ring' or 'ulysses'"):
        MerakArguments(output_dir="out", cp_mode="stripes")


def test_generation_is_refused_with_context_parallelism():
    with pytest.raises(ValueError, match="generate in a job without cp"):
        rules.check(rules.Choices.from_arguments(
            MerakArguments(output_dir="out", text_generation=True), cp=2))
    assert isinstance(rules.refusal(rules.Choices(cp=2, lora=True)).error(), NotSupportedYetError)
