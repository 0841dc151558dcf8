#!/usr/bin/env python
"""Preference tuning with TRL's `DPOTrainer`, trained by Merak with dp x tp x pp.

As for SFT (examples/trl_sft.py), two classes: a config that is both Merak's and TRL's
(`DPOConfig`'s fields are command-line flags) and a trainer that is both. Merak runs DPO with
the reference log-probabilities computed once before training (`precompute_ref_log_probs`, set
here: the initial policy's, by a gradient-free pass through the pipeline); a separate
`ref_model` is refused with the reason (docs/trainer.md, which also runs DPO with LoRA through
`peft_config` and on models built on the meta device). The degrees come from DP, TP and PP
(default 1 x 1 x 2). Preference rows made from examples/data/train.txt (prompt: a sentence's
first words; chosen: its rest; rejected: the second half of a sentence further on), 4 CPU
ranks at dp=1 x tp=2 x pp=2:

    DP=1 TP=2 PP=2 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 \\
        examples/trl_dpo.py --output_dir runs/trl_dpo --max_steps 10 --learning_rate 1e-2 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --max_length 48 \\
        --logging_steps 1 --use_cpu --report_to none --bf16 false

`--reference` trains with plain TRL on one process (give it `--per_device_train_batch_size`
times dp); tests/test_dpo.py shows the two log the same loss and rewards to 1e-5 per step.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import transformers as tf
import trl

import merak

DATA = Path(__file__).resolve().parent / "data"


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "a save_pretrained directory to tune (default: build from --config_name)"})
    config_name: str = field(default=str(DATA / "tiny-llama"))
    tokenizer_name: str = field(default=str(DATA / "tokenizer"))
    train_file: str = field(default=str(DATA / "train.txt"))
    rows: int = field(default=128, metadata={"help": "how many preference rows"})
    reference: bool = field(default=False, metadata={
        "help": "train with plain TRL on one process instead (the reference run)"})


@dataclass
class Config(merak.MerakArguments, trl.DPOConfig):
    """TRL's DPO fields with their TRL defaults, and Merak's."""

    precompute_ref_log_probs: bool = True


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


def build_model(script: ScriptArguments):
    if script.model_name_or_path:
        return tf.AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(script.config_name))


def main() -> None:
    script, config = tf.HfArgumentParser((ScriptArguments, Config)).parse_args_into_dataclasses()
    data = preference_rows(script.train_file, script.rows)
    tokenizer = tf.AutoTokenizer.from_pretrained(script.tokenizer_name)
    tf.set_seed(config.seed)  # the same initial weights in both runs
    if script.reference:
        names = {f.name for f in trl.DPOConfig.__dataclass_fields__.values() if f.init}
        trainer = trl.DPOTrainer(model=build_model(script), processing_class=tokenizer,
                                 args=trl.DPOConfig(**{n: getattr(config, n) for n in names}),
                                 train_dataset=data)
    else:
        merak.init(dp=int(os.getenv("DP", 1)), tp=int(os.getenv("TP", 1)),
                   pp=int(os.getenv("PP", 2)))
        # real weights, not init_empty_weights(): TRL reads the model's weights in __init__
        trainer = MerakDPOTrainer(model=build_model(script), args=config, train_dataset=data,
                                  processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
