"""LoRA through peft: what is checked before any work (the parity of LoRA on dp x tp x pp
layouts runs in test_tensor_parallel's launches, the MerakTrainer path in test_trainer's)."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES
from peft import LoraConfig, get_peft_model

import merak
from merak import lora


def test_target_modules_that_match_nothing_name_the_linear_layers():
    with pytest.raises(ValueError, match=r"match no module of LlamaForCausalLM; its linear "
                                         r"layers are named \[.*'q_proj'"):
        lora.wrap(FAMILIES["llama"](), LoraConfig(r=4, target_modules=["query"]))


def test_dora_and_double_wrapping_are_refused():
    with pytest.raises(ValueError, match="use_dora"):
        lora.wrap(FAMILIES["llama"](), LoraConfig(r=4, target_modules=["q_proj"],
                                                  use_dora=True))
    wrapped = get_peft_model(FAMILIES["llama"](), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already a peft model"):
        lora.wrap(wrapped, LoraConfig(r=4, target_modules=["q_proj"]))


def test_adapters_of_a_meta_model_initialize_as_eager_peft():
    """The adapters join the meta model's init record, so materializing gives the values
    single-process peft draws right after the model's own."""
    from merak.materialize.meta import materialize_

    config = LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights="gaussian")
    torch.manual_seed(5)
    with merak.init_empty_weights():
        model = FAMILIES["llama"]()
    model = lora.wrap(model, config)
    materialize_(model)
    torch.manual_seed(5)
    reference = get_peft_model(FAMILIES["llama"](), config)
    want = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name
        assert param.requires_grad == (".lora_" in name), name
