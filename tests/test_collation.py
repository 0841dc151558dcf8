"""Collation per micro-batch: the data collator runs on each micro-batch's
rows, as HF Trainer collates each gradient-accumulation batch, so padding-free and packed
batches keep their structure and micro-batches of different shapes train through the pipeline.
The 4-rank runs (one pooled launch, workers/collation.py) are compared with single-process HF
Trainer / TRL SFTTrainer here; the unit tests below need no process group."""

from __future__ import annotations

import json

import collation_common as cc
import pytest
import sft_common as sft
import transformers as tf
from dist_harness import check

import merak
from merak.runtime.microbatches import shape_classes, step_microbatches
from merak.trainer.data import EvalBatches, StageBatches
from merak.trainer.token_counts import ITEMS, with_own_counts

trl = pytest.importorskip("trl")

WORKER = "collation.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4,)
_REFERENCES: dict[str, dict] = {}


def reference(kind: str) -> dict[str, list[float]]:
    """The single-process trainer of `kind`, GLOBAL_MICRO_BATCH rows per micro-batch."""
    if kind not in _REFERENCES:
        hf = cc.KINDS[kind][0] == "hf"
        config, trainer_cls = (tf.TrainingArguments, tf.Trainer) if hf else \
            (trl.SFTConfig, trl.SFTTrainer)
        args = config(output_dir="out", per_device_train_batch_size=cc.GLOBAL_MICRO_BATCH,
                      **cc.fields(kind))
        trainer = trainer_cls(model=sft.model(), args=args, **cc.trainer_inputs(kind))
        trainer.train()
        _REFERENCES[kind] = cc.logged(kind, trainer.state.log_history)
    return _REFERENCES[kind]


@pytest.mark.parametrize("scenario", list(cc.SCENARIOS))
def test_per_microbatch_collation_matches_single_process(launches, worker_pool, scenario):
    kind, (dp, _, _) = cc.SCENARIOS[scenario]
    results, output = launches(4)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    theirs = reference(kind)
    print(f"{scenario}: loss merak {ours['loss']} reference {theirs['loss']}")
    assert len(ours["loss"]) == len(theirs["loss"]) == cc.STEPS
    assert theirs["loss"][0] != theirs["loss"][-1]  # it trained: the check can fail
    # at dp 2 the micro-batches group the step's rows otherwise: TRL's per-micro-batch metrics
    # differ, the token-weighted loss and its gradient do not
    keys = list(ours) if dp == 1 else ["loss", "grad_norm"]
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key


def _recording_collator(calls: list[list[int]]):
    def collate(items):
        calls.append([item["i"] for item in items])
        return tf.DataCollatorWithFlattening()([{"input_ids": item["ids"]} for item in items])
    return collate


def test_each_microbatch_is_collated_from_its_own_rows():
    """StageBatches calls the collator once per micro-batch with that micro-batch's rows (dp rank
    1's share of each step), and yields each step as the list of its micro-batches: flattened
    rows of their own lengths."""
    rows = [{"i": i, "ids": list(range(1, 2 + i % 5))} for i in range(24)]
    calls: list[list[int]] = []
    data = StageBatches(rows, _recording_collator(calls), micro_batch_size=2, num_microbatches=3,
                        dp=2, dp_rank=1, strategy="sequential", seed=0, reads_data=True)
    steps = list(data.epoch(0))
    assert calls == [[6, 7], [8, 9], [10, 11], [18, 19], [20, 21], [22, 23]]
    assert len(steps) == 2 and all(len(step) == 3 for step in steps)
    first = steps[0][0]
    assert first["input_ids"].shape == (1, 2 + 3)  # rows 6 and 7: 2 and 3 tokens, one row
    assert first["position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    assert [mb["input_ids"].shape[1] for mb in steps[0]] == [5, 9, 3]  # shapes differ


def test_evaluation_refuses_a_flattening_collator_by_name():
    """Evaluation still collates a whole evaluation step and cuts it by row: a collator that
    flattens the rows is refused, not cut wrongly."""
    rows = [{"i": i, "ids": [1, 2, 3]} for i in range(4)]
    data = EvalBatches(rows, _recording_collator([]), micro_batch_size=2, num_microbatches=2,
                       dp=1, dp_rank=0, reads_data=True)
    with pytest.raises(merak.NotSupportedYetError, match=r"returned \{'input_ids': 1.*"
                                                         r"padding_free=False"):
        data.step(0)


def test_a_steps_microbatches_keep_their_shapes_and_counts():
    collate = tf.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    step = [collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]),
            collate([{"input_ids": [1, 2, 3, 4]}]),
            collate([{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}])]
    counted = with_own_counts(step, 3, shifted=True)
    # HF counts each micro-batch's labels past the first position that are not -100
    assert [int(mb[ITEMS]) for mb in counted] == [3, 3, 3]
    parts = step_microbatches(counted, 3, ["input_ids", "position_ids", "max_length_q", ITEMS])
    assert [p["input_ids"].shape[1] for p in parts] == [5, 4, 5]
    assert [p["max_length_q"] for p in parts] == [3, 4, 3]  # non-tensors reach the loss
    # shape classes: micro-batches 0 and 2 have equal shapes on every pipeline rank
    assert shape_classes([[11, 12, 11], [7, 7, 7]]) == [0, 1, 0]
    assert shape_classes([[11, 12, 11], [7, 8, 9]]) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"1 rows \(a padding-free batch flattens its rows into "
                                         r"one\).*pass the step's micro-batches"):
        step_microbatches(collate([{"input_ids": [1, 2]}, {"input_ids": [3]}]), 2, ["input_ids"])
    with pytest.raises(ValueError, match="the step has 3 micro-batches; the engine runs 2"):
        step_microbatches(step, 2, ["input_ids"])
    with pytest.raises(ValueError, match=r"micro-batch 0 lacks \['seq_idx'\]"):
        step_microbatches(step, 3, ["seq_idx"])


def test_flattened_microbatches_train_as_hf_trainer_single_process():
    """(1,1,1), 2 micro-batches of one flattened row each, of different lengths: every step's
    loss and grad norm as HF Trainer's."""
    fields = {**cc.HF_FIELDS, "gradient_accumulation_steps": 2}
    args = tf.TrainingArguments(output_dir="out", per_device_train_batch_size=2, **fields)
    want = cc.logged("flatten", _train(tf.Trainer, args, sft.model()))
    merak.init(dp=1, tp=1, pp=1)
    with merak.init_empty_weights():
        model = sft.model()
    args = merak.MerakArguments(output_dir="out", per_device_train_batch_size=2, **fields)
    got = cc.logged("flatten", _train(merak.MerakTrainer, args, model))
    assert len(got["loss"]) == cc.STEPS
    for key in got:
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


def _train(trainer_cls, args, model) -> list[dict]:
    trainer = trainer_cls(model=model, args=args, train_dataset=cc.flatten_rows(24),
                          data_collator=cc.flatten_collator())
    trainer.train()
    return trainer.state.log_history
