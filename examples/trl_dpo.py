#!/usr/bin/env python
"""Preference tuning with TRL's `DPOTrainer`, trained by Merak with dp x tp x pp.

As for SFT (examples/trl_sft.py), two classes: a config that is both Merak's and TRL's
(`DPOConfig`'s fields are command-line flags) and a trainer that is both. The policy is built on
the meta device (`merak.init_empty_weights()`: each rank materializes only its shard) in one of
three setups, `--setup`:

- `precomputed` (the default): `precompute_ref_log_probs=True`; the reference log-probabilities
  are the initial policy's, from a gradient-free pass through the pipeline before training;
- `lora`: LoRA adapters through DPOTrainer's `peft_config` (rank `--lora_r`, every linear layer);
  the reference is the model with its adapters off;
- `defaults`: DPOConfig's defaults (no precomputing): the policy is loaded with `from_pretrained`
  from a directory (`--model_name_or_path`; without one, the seeded initial model is first saved
  to `<output_dir>/initial-policy`), where TRL would load a second, frozen copy as the reference;
  Merak computes the same reference log-probabilities by the pass above instead.

A separate `ref_model` (run as a frozen replica split as the policy, with or without
`sync_ref_model`) is not one of this script's setups (docs/preference-tuning.md). The degrees
come from DP, TP and PP (default 1 x 1 x 2). Preference rows made from examples/data/train.txt
(prompt: a sentence's first words; chosen: its rest; rejected: the second half of a sentence
further on), 4 CPU ranks at dp=1 x tp=2 x pp=2:

    DP=1 TP=2 PP=2 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 \\
        examples/trl_dpo.py --setup lora --output_dir runs/trl_dpo --max_steps 10 \\
        --learning_rate 1e-2 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 \\
        --max_length 48 --logging_steps 1 --use_cpu --report_to none --bf16 false

`--reference` trains with plain TRL on one process, the same setup on real weights (give it
`--per_device_train_batch_size` times dp); tests/test_trl_example.py runs the script both ways,
tests/test_dpo.py shows the two log the same loss and rewards to 1e-5 per step.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch.distributed as dist
import transformers as tf
import trl

import merak

DATA = Path(__file__).resolve().parent / "data"
SETUPS = ("precomputed", "lora", "defaults")


@dataclass
class ScriptArguments:
    setup: str = field(default="precomputed", metadata={
        "help": "the reference: precomputed, lora (adapters off) or defaults (DPOConfig's)",
        "choices": SETUPS})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "a save_pretrained directory to tune (default: build from --config_name)"})
    config_name: str = field(default=str(DATA / "tiny-llama"))
    tokenizer_name: str = field(default=str(DATA / "tokenizer"))
    train_file: str = field(default=str(DATA / "train.txt"))
    rows: int = field(default=128, metadata={"help": "how many preference rows"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank of --setup lora"})
    reference: bool = field(default=False, metadata={
        "help": "train with plain TRL on one process instead (the reference run)"})


@dataclass
class Config(merak.MerakArguments, trl.DPOConfig):
    """TRL's DPO fields with their TRL defaults, and Merak's."""


class MerakDPOTrainer(merak.MerakTrainer, trl.DPOTrainer):
    """TRL's DPO loss and metrics; Merak's pipeline, tensor and data parallelism."""


def preference_rows(path: str, rows: int) -> datasets.Dataset:
    text = Path(path).read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)
                 if len(s.split()) >= 4]
    prompts, chosen, rejected = [], [], []
    for i in range(min(rows, len(sentences))):
        words, other = sentences[i].split(), sentences[(i + 7) % len(sentences)].split()
        cut = max(2, len(words) // 3)
        prompts.append(" ".join(words[:cut]))
        chosen.append(" " + " ".join(words[cut:]))
        rejected.append(" " + " ".join(other[len(other) // 2:]))
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen,
                                       "rejected": rejected})


def policy_path(script: ScriptArguments, config: Config, distributed: bool) -> str | None:
    """Where the policy is loaded from: --model_name_or_path, or for `defaults` without one the
    seeded initial model saved first (TRL loads its reference copy from the policy's path)."""
    if script.model_name_or_path or script.setup != "defaults":
        return script.model_name_or_path
    path = Path(config.output_dir) / "initial-policy"
    if not distributed or dist.get_rank() == 0:
        tf.set_seed(config.seed)
        build_model(script, None).save_pretrained(path)
    if distributed:
        dist.barrier()
    return str(path)


def build_model(script: ScriptArguments, path: str | None):
    if path:
        return tf.AutoModelForCausalLM.from_pretrained(path)
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(script.config_name))


def main() -> None:
    script, config = tf.HfArgumentParser((ScriptArguments, Config)).parse_args_into_dataclasses()
    if script.setup == "precomputed":
        config.precompute_ref_log_probs = True
    elif script.setup == "defaults":
        config.precompute_ref_log_probs = False
    peft_config = None
    if script.setup == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r,
                                 lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    data = preference_rows(script.train_file, script.rows)
    tokenizer = tf.AutoTokenizer.from_pretrained(script.tokenizer_name)
    if script.reference:
        path = policy_path(script, config, distributed=False)
        tf.set_seed(config.seed)  # the same initial weights in both runs
        names = {f.name for f in trl.DPOConfig.__dataclass_fields__.values() if f.init}
        trainer = trl.DPOTrainer(model=build_model(script, path), processing_class=tokenizer,
                                 args=trl.DPOConfig(**{n: getattr(config, n) for n in names}),
                                 train_dataset=data, peft_config=peft_config)
    else:
        merak.init(dp=int(os.getenv("DP", 1)), tp=int(os.getenv("TP", 1)),
                   pp=int(os.getenv("PP", 2)))
        path = policy_path(script, config, distributed=True)
        tf.set_seed(config.seed)
        with merak.init_empty_weights():  # no rank holds the whole model
            model = build_model(script, path)
        trainer = MerakDPOTrainer(model=model, args=config, train_dataset=data,
                                  processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
