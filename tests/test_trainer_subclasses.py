"""HF Trainer subclasses through MerakTrainer: a subclass's compute_loss runs
on the last pipeline stage with HF's arguments and its result is back-propagated as HF's
training_step would; the metrics it records reach the logs; what a pipeline cannot run is
refused by name. TRL's SFTTrainer on plain text rows at (1,2,2) and (2,1,2) is one pooled
4-rank launch (workers/trainer_subclasses.py) against single-process SFTTrainer here."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from dataclasses import dataclass

import pytest
import sft_common as sft
import torch
import transformers as tf
from dist_harness import check

import merak
from merak import MerakArguments, NotSupportedYetError
from merak.trainer.stage_model import StageModel

trl = pytest.importorskip("trl")

WORKER = "trainer_subclasses.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4,)


def _single_process_sft(**fields) -> dict[str, list[float]]:
    """Plain single-process SFTTrainer; its micro-batches hold the rows of the dp ranks'
    micro-batch (`sft.reference_order`)."""
    args = trl.SFTConfig(output_dir="out", per_device_train_batch_size=sft.GLOBAL_MICRO_BATCH,
                         **{**sft.FIELDS, **fields})
    trainer = trl.SFTTrainer(model=sft.model(), args=args,
                             train_dataset=sft.dataset(sft.reference_order(2)),
                             processing_class=sft.tokenizer())
    trainer.train()
    return sft.logged(trainer.state.log_history)


@pytest.fixture(scope="module")
def reference():
    return _single_process_sft()


@pytest.mark.parametrize("scenario", [*sft.LAYOUTS, *sft.LOSS_TYPES])
def test_trl_sft_trainer_matches_single_process_sft(launches, worker_pool, reference, scenario):
    results, output = launches(4)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    if scenario in sft.LOSS_TYPES:  # TRL's other losses (loss_type="dft")
        reference = _single_process_sft(**sft.LOSS_TYPES[scenario][1])
    assert len(ours["loss"]) == len(reference["loss"]) == sft.STEPS
    assert reference["mean_token_accuracy"][-1] > 0.05  # the metric moved: the check can fail
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    assert ours["num_tokens"] == reference["num_tokens"]


class PenalizedTrainer(tf.Trainer):
    """A project's own subclass: HF's loss plus a term from the logits, and a metric recorded
    as TRL records its own (``self._metrics``, merged into the logs by ``log``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        penalty = outputs.logits.float().pow(2).mean()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["logit_sq"].append(penalty.item())
        loss = loss + 0.1 * penalty
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, start_time=None):
        mode = "train" if self.model.training else "eval"
        logs.update({k: sum(v) / len(v) for k, v in self._metrics[mode].items()})
        super().log(logs, start_time)
        self._metrics[mode].clear()


class MerakPenalizedTrainer(merak.MerakTrainer, PenalizedTrainer):
    pass


def _penalized_run(trainer_cls, args_cls, model):
    from trainer_common import padded_rows

    args = args_cls(output_dir="out", max_steps=3, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1,
                    report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
                    train_sampling_strategy="sequential", seed=7)
    trainer = trainer_cls(model=model, args=args, train_dataset=padded_rows(12, 5))
    trainer.train()
    return [(h["loss"], h["grad_norm"], h["logit_sq"]) for h in trainer.state.log_history
            if "loss" in h]


def test_a_subclass_loss_and_its_metric_match_hf_trainer():
    """The subclass's loss (with its extra term, summed over micro-batches as HF does for a
    token-counted loss) and its recorded metric, per step, as on plain HF Trainer."""
    from hf_models import FAMILIES

    torch.manual_seed(0)
    want = _penalized_run(PenalizedTrainer, tf.TrainingArguments, FAMILIES["llama"]())
    merak.init(dp=1, tp=1, pp=1)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = FAMILIES["llama"]()
    got = _penalized_run(MerakPenalizedTrainer, MerakArguments, model)
    assert len(got) == len(want) == 3
    for step, (ours, theirs) in enumerate(zip(got, want)):
        assert ours == pytest.approx(theirs, rel=1e-5), step
    assert want[0][2] != want[-1][2]  # the metric moved


def _llama_batch():
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(1, 64, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_the_stage_model_answers_as_the_whole_model():
    model, inputs = _llama_batch()
    count = torch.tensor(9.0)
    whole = model(**inputs, num_items_in_batch=count)
    stage = StageModel(whole.logits, inputs, model, training=True)
    torch.testing.assert_close(stage(**inputs, num_items_in_batch=count).loss, whole.loss)
    torch.testing.assert_close(stage(**inputs, use_cache=False).loss, model(**inputs).loss)
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    assert stage(**no_labels).loss is None
    other = {**inputs, "input_ids": inputs["input_ids"].flip(0)}
    with pytest.raises(NotSupportedYetError, match="'input_ids' other than the micro-batch"):
        stage(**other)
    with pytest.raises(NotSupportedYetError, match=r"without \['attention_mask'\]"):
        stage(input_ids=inputs["input_ids"])


def test_trls_fused_head_is_answered_from_the_logits():
    """TRL's patched forward (add_fused_lm_head) called with fused_lm_head=True, against the
    StageModel of the same logits: every field TRL's SFTTrainer reads, and the gradient of the
    loss with respect to the logits' producer."""
    from trl.trainer.utils import add_fused_lm_head

    model, inputs = _llama_batch()
    patched = copy.deepcopy(model)
    add_fused_lm_head(patched, outputs=("log_probs", "entropy", "is_top1"))
    count = torch.tensor(11.0)
    theirs = patched(**inputs, fused_lm_head=True, num_items_in_batch=count)
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    ours = StageModel(logits, inputs, patched, training=True)(**inputs, fused_lm_head=True,
                                                               num_items_in_batch=count)
    for name in ("loss", "log_probs", "entropy", "label_mask", "is_top1"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), msg=name)
    (ours.loss + ours.entropy.sum()).backward()
    (theirs.loss + theirs.entropy.sum()).backward()
    torch.testing.assert_close(model.lm_head.weight.grad, patched.lm_head.weight.grad)


def test_what_a_pipeline_cannot_run_is_refused_by_name():
    class OwnStep(merak.MerakTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    @dataclass
    class Config(MerakArguments, trl.SFTConfig):
        pass

    class MerakSFTTrainer(merak.MerakTrainer, trl.SFTTrainer):
        pass

    with pytest.raises(NotSupportedYetError, match=r"OwnStep.training_step overrides"):
        OwnStep(model=None, args=MerakArguments("out", use_cpu=True))
    with pytest.raises(NotSupportedYetError,
                       match=r"SFTTrainer.training_step cannot run .*activation_offloading"):
        MerakSFTTrainer(model=None, args=Config("out", use_cpu=True, activation_offloading=True))
