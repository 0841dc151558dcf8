"""`*ForSequenceClassification` models and TRL's RewardTrainer through MerakTrainer, against
single-process HF Trainer / RewardTrainer (workers/seq_classification.py, pooled at 2 and 4
ranks; seq_classification_common holds the runs).

The automatic split traces HF's forward, pooling included (the logits at each row's last token
that is not ``config.pad_token_id``), so the last stage makes HF's pooled logits
``[rows, num_labels]`` and HF's loss (MSE for ``num_labels=1`` with float labels, cross-entropy
for int labels). RewardTrainer's compute_loss runs on the last stage from those logits."""

from __future__ import annotations

import pytest
import seq_classification_common as common
import torch
import transformers as tf
from dist_harness import scenario_result
from transformers.loss.loss_utils import ForSequenceClassificationLoss

import merak
from merak import NotSupportedYetError
from merak.trainer.stage_model import StageModel

WORKER = "seq_classification.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)

_REFERENCES: dict[str, dict] = {}


def _reference(run: str) -> dict:
    """Single-process HF Trainer (or TRL RewardTrainer) on the same rows, made once per run."""
    if run not in _REFERENCES:
        if run in common.REWARD_RUNS:
            trl = pytest.importorskip("trl")
            _REFERENCES[run] = common.train_reward(trl.RewardTrainer, trl.RewardConfig, run)
        else:
            _REFERENCES[run] = common.train_and_evaluate(tf.Trainer, tf.TrainingArguments, run)
    return _REFERENCES[run]


def _close(ours: list[float], theirs: list[float], what: str) -> float:
    """Asserts ``ours == theirs`` to 1e-5 relative (1e-7 absolute); the largest relative
    difference."""
    assert len(ours) == len(theirs) == common.STEPS, what
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7), what
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("run, world_size", [(run, common.world_size(layout))
                                             for run, (*_, layout) in common.RUNS.items()])
def test_sequence_classification_matches_hf_trainer(launches, run, world_size):
    """Every step's loss and grad norm, the evaluation loss and predict's logits
    ``[rows, num_labels]`` equal single-process HF Trainer's (to 1e-5)."""
    figures = scenario_result(*launches(world_size), run)[0]
    reference = _reference(run)
    for key in ("loss", "grad_norm"):
        _close(figures[key], reference[key], key)
    assert reference["loss"][0] != reference["loss"][-1]  # it trained: the check can fail
    assert figures["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    logits, want = torch.tensor(figures["logits"]), torch.tensor(reference["logits"])
    num_labels = common.RUNS[run][1]
    assert logits.shape == want.shape == (common.EVAL_ROWS, num_labels)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
    assert figures["label_ids"] == reference["label_ids"]


@pytest.mark.parametrize("run, world_size", [(run, common.world_size(common.RUNS[base][3]))
                                             for run, base in common.AVERAGED.items()])
def test_hf_rule_with_average_tokens_across_devices(launches, run, world_size):
    """HF's default average_tokens_across_devices: the loss the model computes ignores HF's
    count, and HF multiplies it by the processes; so does Merak, so at dp 2 the loss, grad norm
    and evaluation loss are twice single-process HF Trainer's, the logits the same."""
    figures = scenario_result(*launches(world_size), run)[0]
    reference = _reference(common.AVERAGED[run])
    dp = common.RUNS[common.AVERAGED[run]][3][0]
    for key in ("loss", "grad_norm"):
        _close([x / dp for x in figures[key]], reference[key], key)
    assert figures["eval_loss"] / dp == pytest.approx(reference["eval_loss"], rel=1e-5)
    torch.testing.assert_close(torch.tensor(figures["logits"]), torch.tensor(reference["logits"]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run, world_size", [(run, common.world_size(layout))
                                             for run, (layout, *_) in common.REWARD_RUNS.items()])
def test_trl_reward_trainer_matches_single_process(launches, run, world_size):
    """MerakTrainer mixed with TRL's RewardTrainer: every step's loss, grad norm and TRL's
    metrics (accuracy, margin, min/mean/max reward, token count) equal single-process
    RewardTrainer's, with center_rewards_coefficient and margins in some runs."""
    pytest.importorskip("trl")
    figures = scenario_result(*launches(world_size), run)[0]
    reference = _reference(run)
    for key in common.REWARD_LOGGED:
        _close(figures[key], reference[key], key)
    assert reference["loss"][0] != reference["loss"][-1]
    assert len(set(reference["accuracy"])) > 1  # the metric moved
    if run not in common.REWARD_EVALUATED:
        return
    # evaluate() after training: each evaluation micro-batch collated on its own pairs (a
    # chosen row never parted from its rejected row), the loss and TRL's metrics as
    # single-process RewardTrainer.evaluate's; evaluate(set) on the same pairs given then
    theirs, mine = reference["eval"], figures["eval"]
    assert set(theirs) <= set(mine) and "eval_loss" in theirs, (sorted(theirs), sorted(mine))
    assert theirs["eval_margin"] != 0  # the pairs score apart: the check can fail
    gaps = {}
    for key, value in theirs.items():
        assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        gaps[key] = abs(mine[key] - value) / max(abs(value), 1e-12)
    assert figures["given_loss"] == pytest.approx(reference["given_loss"], rel=1e-5)
    assert figures["given_loss"] == pytest.approx(mine["eval_loss"], rel=1e-6)
    print(f"{run}: merak {mine} reference {theirs}")
    print(f"{run} largest relative gaps: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))


@pytest.mark.parametrize("num_labels, labels", [(1, torch.tensor([0.5, -1.0, 2.0])),
                                                (3, torch.tensor([2, 0, 1]))])
def test_stage_model_answers_as_a_sequence_classifier(num_labels, labels):
    """The model a subclass's compute_loss gets on the last stage: HF's output class, the
    pooled logits, and HF's loss of them (its problem_type rules)."""
    model = common.model("llama", num_labels)
    ids = torch.tensor([[5, 6, 7], [8, 9, 0], [10, 0, 0]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    with torch.no_grad():
        want = model(**inputs, labels=labels)
    stage = StageModel(want.logits, inputs, model, training=False)
    got = stage(**inputs, labels=labels, use_cache=False)
    assert isinstance(got, type(want))
    assert got.logits is want.logits
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.loss, ForSequenceClassificationLoss(labels, want.logits,
                                                                       model.config))
    assert stage(**inputs).loss is None


def test_a_subclass_loss_on_a_model_that_neither_generates_nor_classifies_is_refused():
    class Subclass(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    class MerakSubclass(merak.MerakTrainer, Subclass):
        pass

    merak.init(dp=1, tp=1, pp=1)
    model = tf.BertForMaskedLM(tf.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32))
    with pytest.raises(NotSupportedYetError, match="causal language models and sequence "
                                                   "classifiers; BertForMaskedLM is neither"):
        MerakSubclass(model=model, args=merak.MerakArguments("out", use_cpu=True))


def test_reward_trainer_predict_is_refused_by_name():
    """predict(): the logits of a chosen row and its rejected row would need pairing; refused
    before the pipeline is built."""
    trl = pytest.importorskip("trl")
    from sft_common import merak_classes

    Config, MerakRewardTrainer = merak_classes(trl.RewardConfig, trl.RewardTrainer)
    merak.init(dp=1, tp=1, pp=1)
    rows = common.preference_rows(4)
    with merak.init_empty_weights():
        model = common.model("llama", 1)
    trainer = MerakRewardTrainer(model=model, train_dataset=rows, eval_dataset=rows,
                                 args=Config("out", use_cpu=True, bf16=False,
                                             per_device_train_batch_size=2,
                                             per_device_eval_batch_size=2, report_to="none"),
                                 processing_class=common.tokenizer())
    with pytest.raises(NotSupportedYetError, match=r"MerakRewardTrainer: predict\(\) and "
                                                   r"compute_metrics.*pairing"):
        trainer.predict(rows)
    assert trainer.engine is None  # nothing was built
