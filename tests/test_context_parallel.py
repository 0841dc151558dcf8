"""Context parallelism (merak/context_parallel): cp=2 and cp=4, Ulysses and ring, on a tiny Llama
and Qwen2 (plus a Mistral's sliding window): loss and every gradient equal to the single-process
model in fp32 (pooled worker cp_parity.py, at world sizes 2 and 4); and in one process the
load-balanced split, its refusals, and the families whose attention cannot be wrapped."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from cp_parity import scenario_names
from dist_harness import check

import merak
from merak.context_parallel import rank_positions, shift_labels, split_batch, unsupported_reason

WORKER = "cp_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)])
def test_context_parallel_trains_like_the_model(launches, world_size, scenario):
    check(*launches(world_size), scenario)


def test_each_rank_holds_a_chunk_and_its_mirror():
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([rank_positions(24, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_loses_no_target_and_positions_follow_tokens(cp):
    ids = torch.arange(2 * 16).reshape(2, 16)
    labels = ids.clone()
    labels[0, 3] = -100
    shares = [split_batch({"input_ids": ids, "labels": labels,
                           "attention_mask": torch.ones_like(ids)}, cp, r) for r in range(cp)]
    shifted = shift_labels(labels)
    for rank, share in enumerate(shares):
        positions = rank_positions(16, cp, rank)
        assert torch.equal(share["position_ids"][0], positions)
        assert torch.equal(share["input_ids"], ids[:, positions])
        assert torch.equal(share["labels"], shifted[:, positions])
        assert torch.equal(share["shift_labels"], share["labels"])
    # every token's target (the next token), on whichever rank holds the token
    targets = sum(int(s["labels"].ne(-100).sum()) for s in shares)
    assert targets == int(labels[:, 1:].ne(-100).sum())


def test_a_length_not_divisible_by_2cp_is_refused():
    with pytest.raises(ValueError, match="not divisible by 8"):
        split_batch({"input_ids": torch.zeros(1, 20, dtype=torch.long)}, 4, 0)


def test_padding_and_packing_are_refused():
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with pytest.raises(ValueError, match="refuses padding"):
        split_batch({"input_ids": ids, "attention_mask": mask}, 2, 0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    with pytest.raises(ValueError, match="packed or padding-free"):
        split_batch({"input_ids": ids, "position_ids": packed}, 2, 0)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        split_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 8])}, 2, 0)


@pytest.mark.parametrize("model_type,reason", [
    ("bloom", "in its own code"),           # ALiBi, its own attention
    ("falcon", "in its own code"),
    ("mamba", "linear_attention layers"),   # a state-space mixer
    ("jamba", "linear_attention layers"),   # hybrid: mamba layers beside attention
])
def test_families_whose_attention_cannot_be_wrapped_are_named(model_type, reason):
    config = tf.AutoConfig.for_model(model_type)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            setattr(config, name, 2)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    message = unsupported_reason(model, "ring")
    assert message is not None and model_type in message and reason in message, message


def test_llama_and_qwen2_can_be_wrapped():
    for config in (tf.LlamaConfig(num_hidden_layers=1), tf.Qwen2Config(num_hidden_layers=1)):
        with merak.init_empty_weights():
            model = tf.AutoModelForCausalLM.from_config(config)
        assert unsupported_reason(model, "ulysses") is None
