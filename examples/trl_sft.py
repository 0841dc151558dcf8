#!/usr/bin/env python
"""Supervised fine-tuning with TRL's `SFTTrainer`, trained by Merak with dp x tp x pp.

Two classes are all it takes (docs/trainer.md, "Trainer subclasses and TRL"): a config that is
both Merak's and TRL's, and a trainer that is both; everything of `SFTConfig` (max_length,
packing, loss_type, completion_only_loss, ...) is a command-line flag, as in TRL's own scripts.
The degrees come from the environment variables DP, TP and PP (default 1 x 1 x 2; their product
is the number of processes). A tiny Llama built from examples/data/tiny-llama on the sentences
of examples/data/train.txt, 4 CPU ranks at dp=1 x tp=2 x pp=2:

    DP=1 TP=2 PP=2 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 \\
        examples/trl_sft.py --output_dir runs/trl_sft --max_steps 20 --learning_rate 3e-3 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --max_length 64 \\
        --logging_steps 1 --use_cpu --report_to none --bf16 false

`--model_name_or_path DIR` fine-tunes a `save_pretrained` directory (each rank loads only its
shard); `--lora_r 8` trains LoRA adapters through TRL's own `peft_config`. The same run on one
process with plain TRL is `--reference` (no torchrun; give it `--per_device_train_batch_size`
times dp to read the same rows a step): its losses equal Merak's (tests/test_trainer_subclasses.py
shows it to 1e-5 per step).
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
        "help": "a save_pretrained directory to fine-tune (default: build from --config_name)"})
    config_name: str = field(default=str(DATA / "tiny-llama"))
    tokenizer_name: str = field(default=str(DATA / "tokenizer"))
    train_file: str = field(default=str(DATA / "train.txt"), metadata={
        "help": "plain text; each sentence becomes one training row"})
    rows: int = field(default=256, metadata={"help": "how many sentences to train on"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank through TRL's peft_config (0: "
                                                     "full fine-tuning)"})
    reference: bool = field(default=False, metadata={
        "help": "train with plain TRL on one process instead (the reference run)"})


@dataclass
class Config(merak.MerakArguments, trl.SFTConfig):
    """TRL's SFT fields with their TRL defaults, and Merak's."""


class MerakSFTTrainer(merak.MerakTrainer, trl.SFTTrainer):
    """TRL's SFT step; Merak's pipeline, tensor and data parallelism."""


def text_rows(path: str, rows: int) -> datasets.Dataset:
    text = Path(path).read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    return datasets.Dataset.from_dict({"text": sentences[:rows]})


def build_model(script: ScriptArguments):
    if script.model_name_or_path:
        return tf.AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(script.config_name))


def main() -> None:
    parser = tf.HfArgumentParser((ScriptArguments, Config))
    script, config = parser.parse_args_into_dataclasses()
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r,
                                 lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    data = text_rows(script.train_file, script.rows)
    tokenizer = tf.AutoTokenizer.from_pretrained(script.tokenizer_name)
    tf.set_seed(config.seed)  # the model's initialization, on every rank as on one process
    if script.reference:
        trainer = trl.SFTTrainer(model=build_model(script),
                                 args=trl.SFTConfig(**_sft_fields(config)), train_dataset=data,
                                 processing_class=tokenizer, peft_config=peft_config)
    else:
        merak.init(dp=int(os.getenv("DP", 1)), tp=int(os.getenv("TP", 1)),
                   pp=int(os.getenv("PP", 2)))
        with merak.init_empty_weights():
            model = build_model(script)
        trainer = MerakSFTTrainer(model=model, args=config, train_dataset=data,
                                  processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_model()  # the HF model directory (each rank's shard gathered)
    trainer.save_state()  # trainer_state.json: the logged losses and metrics


def _sft_fields(config: Config) -> dict:
    """The SFTConfig fields of `config` (the reference run takes plain TRL's config)."""
    names = {f.name for f in trl.SFTConfig.__dataclass_fields__.values() if f.init}
    return {name: getattr(config, name) for name in names}


if __name__ == "__main__":
    main()
