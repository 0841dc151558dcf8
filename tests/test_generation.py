"""Pipelined generation: what is refused before any work, in one process. Greedy parity with HF
`generate` (Llama, Qwen2, GPT-2 at dp2 x pp2, tp2 x pp2 and dp2 x tp2 x pp2), the KV cache and
seeded sampling run in test_tensor_parallel's 4- and 8-rank launches
(workers/generation_parity.py); through MerakTrainer (text_generation, trainer.generate) and
`merak generate` in test_trainer's (workers/trainer_fields.py, lora-trainer)."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES

import merak
from merak.generation.generate import check_generation_args, position_limit


@pytest.fixture(scope="module")
def llama():
    return FAMILIES["llama"]().config


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
    ({"do_sample": True, "temperature": 0.0}, "sampling needs temperature > 0"),
    ({"do_sample": True, "temperature": -1.0}, "sampling needs temperature > 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"prompts": [[1, 2, 500]]}, "outside the vocabulary"),
    ({"max_new_tokens": 2040}, "exceeds the model's 2048 positions"),
])
def test_bad_requests_are_refused_before_any_work(llama, kwargs, message):
    request = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8, 9]], "max_new_tokens": 4, "do_sample": False,
               "temperature": 1.0, "top_k": None, "top_p": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        check_generation_args(llama, **request)


def test_greedy_decoding_needs_no_temperature(llama):
    check_generation_args(llama, [[1, 2]], 4, False, 0.0, None, None)


def test_position_limits_of_the_common_families():
    assert position_limit(FAMILIES["llama"]().config) == 2048
    assert position_limit(FAMILIES["gpt2"]().config) == 1024


@pytest.mark.parametrize("prompts,message", [
    ([], "at least one prompt"), ([[1], []], "at least one"),
    (torch.zeros(2, 2, 2), "must be 1-D or 2-D")])
def test_prompts_must_be_token_lists(prompts, message):
    from merak.generation.generate import as_prompts

    with pytest.raises(ValueError, match=message):
        as_prompts(prompts)


def test_a_manual_split_has_no_model_forward_to_generate_with():
    from merak.models.gpt import GPT, GPTConfig, gpt_pieces

    ctx = merak.init(dp=1, tp=1, pp=1)
    model = GPT(GPTConfig())
    split = merak.manual_split(model, gpt_pieces(model), num_stages=1)
    stage = merak.PipelineStage(model, split, 0)
    with pytest.raises(ValueError, match="needs a pipeline built by merak.parallelize"):
        merak.generate(model, stage, [[1, 2]], ctx=ctx)
