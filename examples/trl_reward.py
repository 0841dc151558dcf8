#!/usr/bin/env python
"""Reward modelling with TRL's `RewardTrainer`, trained by Merak with dp x tp x pp, exported as
an HF model directory and scored by HF's `AutoModelForSequenceClassification`.

Two classes, as for SFT and DPO (docs/trainer.md, "Sequence classification and TRL's
RewardTrainer"): a config that is both Merak's and TRL's (`RewardConfig`'s fields are flags) and
a trainer that is both. The reward model is a `*ForSequenceClassification` with one label built
on the meta device from examples/data/tiny-llama (`merak.init_empty_weights()`: each rank
materializes only its shard); each row's reward is the score at its last token. Preference pairs
from examples/data/train.txt (chosen: a sentence; rejected: the same words in reverse order).
The degrees come from DP, TP and PP (default 1 x 1 x 2), 4 CPU ranks at dp=1 x tp=2 x pp=2:

    DP=1 TP=2 PP=2 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 \\
        examples/trl_reward.py --output_dir runs/trl_reward --max_steps 10 \\
        --learning_rate 1e-3 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 \\
        --max_length 48 --logging_steps 1 --use_cpu --report_to none --bf16 false

After training, `save_model` writes the HF directory (every rank's shard gathered) to
`--output_dir`; rank 0 loads it with `AutoModelForSequenceClassification.from_pretrained`
(refusing missing or unexpected weights), scores `--eval_rows` held-out pairs of
examples/data/validation.txt and writes the rewards to `<output_dir>/scores.json`. `--reference`
trains with plain TRL on one process and exports and scores the same way (give it
`--per_device_train_batch_size` times dp); tests/test_trl_example.py checks that both log the same
losses and that the two exports score the held-out pairs the same.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers as tf
import trl

import merak

DATA = Path(__file__).resolve().parent / "data"


@dataclass
class ScriptArguments:
    config_name: str = field(default=str(DATA / "tiny-llama"))
    tokenizer_name: str = field(default=str(DATA / "tokenizer"))
    train_file: str = field(default=str(DATA / "train.txt"))
    eval_file: str = field(default=str(DATA / "validation.txt"))
    rows: int = field(default=128, metadata={"help": "how many preference pairs to train on"})
    eval_rows: int = field(default=8, metadata={"help": "held-out pairs the export scores"})
    reference: bool = field(default=False, metadata={
        "help": "train with plain TRL on one process instead (the reference run)"})


@dataclass
class Config(merak.MerakArguments, trl.RewardConfig):
    """TRL's reward-modelling fields with their TRL defaults, and Merak's."""


class MerakRewardTrainer(merak.MerakTrainer, trl.RewardTrainer):
    """TRL's pairwise loss and metrics; Merak's pipeline, tensor and data parallelism."""


def preference_pairs(path: str, rows: int) -> datasets.Dataset:
    """Chosen: a sentence of `path`; rejected: its words in reverse order."""
    text = Path(path).read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 4]
    sentences = sentences[:rows]
    return datasets.Dataset.from_dict({"chosen": sentences,
                                       "rejected": [" ".join(s.split()[::-1])
                                                    for s in sentences]})


def build_model(script: ScriptArguments, tokenizer):
    config = tf.AutoConfig.from_pretrained(script.config_name, num_labels=1,
                                           pad_token_id=tokenizer.pad_token_id)
    return tf.AutoModelForSequenceClassification.from_config(config)


@torch.no_grad()
def score_export(directory: str, tokenizer, pairs: datasets.Dataset) -> dict[str, list[float]]:
    """The rewards HF's own class gives the held-out pairs from the exported directory."""
    model, info = tf.AutoModelForSequenceClassification.from_pretrained(
        directory, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys")}
    if bad:
        raise RuntimeError(f"the export at {directory} does not load whole in HF: {bad}")
    model.eval()
    scores = {}
    for column in ("chosen", "rejected"):
        texts = [t + tokenizer.eos_token for t in pairs[column]]  # as RewardTrainer's rows
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        scores[column] = model(**batch).logits[:, 0].tolist()
    scores["accuracy"] = sum(c > r for c, r in zip(scores["chosen"], scores["rejected"])) \
        / len(pairs)
    return scores


def main() -> None:
    script, config = tf.HfArgumentParser((ScriptArguments, Config)).parse_args_into_dataclasses()
    data = preference_pairs(script.train_file, script.rows)
    tokenizer = tf.AutoTokenizer.from_pretrained(script.tokenizer_name)
    tf.set_seed(config.seed)  # the same initial weights in both runs
    if script.reference:
        names = {f.name for f in trl.RewardConfig.__dataclass_fields__.values() if f.init}
        trainer = trl.RewardTrainer(model=build_model(script, tokenizer),
                                    args=trl.RewardConfig(**{n: getattr(config, n)
                                                             for n in names}),
                                    train_dataset=data, processing_class=tokenizer)
    else:
        merak.init(dp=int(os.getenv("DP", 1)), tp=int(os.getenv("TP", 1)),
                   pp=int(os.getenv("PP", 2)))
        with merak.init_empty_weights():  # no rank holds the whole model
            model = build_model(script, tokenizer)
        trainer = MerakRewardTrainer(model=model, args=config, train_dataset=data,
                                     processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # the HF directory: config, weights, tokenizer
    trainer.save_state()
    if trainer.is_world_process_zero():
        held_out = preference_pairs(script.eval_file, script.eval_rows)
        scores = score_export(config.output_dir, tokenizer, held_out)
        Path(config.output_dir, "scores.json").write_text(json.dumps(scores))
        print(f"export scored by HF: accuracy {scores['accuracy']:.3f}, chosen "
              f"{[round(s, 4) for s in scores['chosen']]}")


if __name__ == "__main__":
    main()
