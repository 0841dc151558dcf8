"""Fine-tuning as HF Trainer does it, in one process: the token count HF divides the
step's loss by, inputs that reach a model through ``**kwargs`` traced into the split, configs
combining MerakArguments with TRL's SFTConfig (Trainer subclasses: test_trainer_subclasses.py).
The multi-rank parity on padded rows against HF Trainer is in test_trainer.py and
test_trainer_matrix.py (their runs train on `fine_tuning_set`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import transformers as tf

import merak
from merak import MerakArguments
from merak.materialize.meta import materialize_
from merak.partition.auto import auto_split
from merak.trainer.config_bases import keep_declared_defaults
from merak.trainer.subclasses import trainer_keywords
from merak.trainer.token_counts import ITEMS, takes_item_count, target_counts, with_own_counts


def _llama():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))


def _padded(rows: int = 4, seq: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 96, (rows, seq), generator=g)
    lengths = torch.tensor([8, 3, 5, 6])[:rows]
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": (ids * mask).masked_fill(mask == 0, -100)}


def test_target_counts_follow_hf_rules():
    batch = _padded()
    # shifted (a causal LM's loss): position 0 of each row is never a target
    assert target_counts(batch, 2, shifted=True).tolist() == [7 + 2, 4 + 5]
    assert target_counts(batch, 1, shifted=False).tolist() == [8 + 3 + 5 + 6]
    shift = batch["labels"].clone()
    shift[:, :2] = -100
    assert target_counts({**batch, "shift_labels": shift}, 2, True).tolist() == [6 + 1, 3 + 4]
    with pytest.raises(ValueError, match="do not split into 3 equal micro-batches"):
        target_counts(batch, 3, shifted=True)


def test_loss_functions_that_take_the_count():
    assert takes_item_count(lambda outputs, labels, num_items_in_batch=None: 0)
    assert takes_item_count(lambda outputs, labels, **kwargs: 0)
    assert not takes_item_count(lambda outputs, labels: 0)


def test_a_count_through_the_models_kwargs_is_traced_into_the_split():
    """HF's causal LMs take ``num_items_in_batch`` through ``**kwargs``; torch.export cannot
    be given dynamic shapes for such inputs, so the split exports a forward that names them.
    The split's loss is the sum of token losses over the count, as the model's."""
    batch = with_own_counts(_padded(), 1, shifted=True)
    reference = _llama()
    want = reference(**batch).loss
    with merak.init_empty_weights():
        model = _llama()
    split = auto_split(model, batch, 2)
    materialize_(split.container)
    assert ITEMS in split.pieces[-1].inputs
    got = split(**batch).loss
    torch.testing.assert_close(got, want)
    # a different count divides the same summed loss
    doubled = {**batch, ITEMS: batch[ITEMS] * 2}
    torch.testing.assert_close(split(**doubled).loss, want / 2)
    assert "forward" not in vars(model)  # the named forward lived only while exporting


def test_combined_configs_keep_each_classs_defaults():
    trl = pytest.importorskip("trl")

    @dataclass
    class MerakFirst(MerakArguments, trl.SFTConfig):
        pass

    @dataclass
    class SFTFirst(trl.SFTConfig, MerakArguments):
        pass

    reference = trl.SFTConfig("out", use_cpu=True)
    for config in (MerakFirst, SFTFirst):
        made = config("out", use_cpu=True)
        differing = [f.name for f in dataclasses.fields(trl.SFTConfig)
                     if f.init and getattr(made, f.name) != getattr(reference, f.name)]
        assert differing == [], (config.__name__, differing)
        assert made.learning_rate == reference.learning_rate != tf.TrainingArguments(
            "out").learning_rate
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        assert defaults["zero_stage"] == 0 and defaults["activation_checkpointing"] is False
        assert defaults["logging_steps"] == reference.logging_steps


def test_redeclaring_only_what_the_bases_lose():
    @dataclass
    class Base(tf.TrainingArguments):
        learning_rate: float = 0.5

    @dataclass
    class Both(MerakArguments, Base):  # __init_subclass__ redeclared it before @dataclass
        pass

    assert list(Both.__annotations__) == ["learning_rate"]
    assert Both("out", use_cpu=True).learning_rate == 0.5
    assert keep_declared_defaults(Both) == []  # nothing left to redeclare


def test_trainer_arguments_pass_by_name():
    """DPOTrainer takes ref_model second: MerakTrainer hands HF Trainer's positional
    parameters on by name."""
    assert trainer_keywords(("collate", "data"), {"eval_dataset": "e"}) == {
        "data_collator": "collate", "train_dataset": "data", "eval_dataset": "e"}
    with pytest.raises(TypeError, match="both by position and by name"):
        trainer_keywords(("collate",), {"data_collator": "c"})
