#!/usr/bin/env python
"""Causal language modelling on local text files, in the style of Hugging Face's
`examples/pytorch/language-modeling/run_clm.py`, in two copies that differ by five lines:

- `examples/hf_run_clm_reference.py`: the plain HF `Trainer` script a user starts from;
- `examples/hf_run_clm.py`: the same script trained by `MerakTrainer` with dp x tp x pp. Its
  five lines each name merak (`tests/test_hf_example.py` checks that): `import merak`,
  `merak.init(...)` with the degrees from the environment variables DP, TP and PP (default 1;
  their product is the number of processes), `@merak.init_empty_weights()` on the function that
  builds the model (on the meta device: each rank materializes only its own shard),
  `merak.MerakArguments` for `TrainingArguments` and `merak.MerakTrainer` for `Trainer`.

A tiny Llama (examples/data: its config, a 512-token byte-level BPE tokenizer and plain English
text) on 4 CPU ranks, dp=1 x tp=2 x pp=2, evaluated and saved every 10 steps, the best
checkpoint loaded back at the end:

    DP=1 TP=2 PP=2 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 \\
        examples/hf_run_clm.py --config_name examples/data/tiny-llama \\
        --tokenizer_name examples/data/tokenizer --train_file examples/data/train.txt \\
        --validation_file examples/data/validation.txt --block_size 64 \\
        --do_train --do_eval --eval_strategy steps --eval_steps 10 --save_strategy steps \\
        --save_steps 10 --load_best_model_at_end --metric_for_best_model loss \\
        --max_steps 30 --learning_rate 3e-3 --per_device_train_batch_size 2 \\
        --gradient_accumulation_steps 2 --per_device_eval_batch_size 4 \\
        --train_sampling_strategy sequential --logging_steps 5 --use_cpu --report_to none \\
        --disable_tqdm true --output_dir runs/hf_clm_1x2x2

With `DP=2 TP=1 PP=2` the same 4 ranks run dp=2 x tp=1 x pp=2 (a step then reads 2 dp x 2
micro-batches x 2 = 8 blocks). The HF version, in one process, reads the same global batch
with `--per_device_train_batch_size` multiplied by dp (the same arguments otherwise):

    .venv/bin/python examples/hf_run_clm_reference.py <the same arguments> \\
        --per_device_train_batch_size 4 --output_dir runs/hf_clm_reference   # dp=2 runs

Both write to --output_dir the HF model directory (`save_model`: config.json,
model.safetensors, the tokenizer), train/eval/all_results.json (eval_loss, perplexity =
exp(eval_loss), eval_accuracy), trainer_state.json and the model card (README.md).
`--model_name_or_path DIR` fine-tunes a saved model instead of building one from --config_name.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import merak
import numpy as np
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model and tokenizer to train."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "a saved model directory to fine-tune; leave unset to train from scratch "
                "(--config_name)"})
    config_name: str | None = field(default=None, metadata={
        "help": "a config directory or config JSON file (default: --model_name_or_path's)"})
    config_overrides: str | None = field(default=None, metadata={
        "help": "config values to override when training from scratch, e.g. "
                "'num_hidden_layers=2,hidden_size=32'"})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "a tokenizer directory (default: --model_name_or_path)"})


@dataclass
class DataTrainingArguments:
    """Which text to train and evaluate on, and how to cut it into blocks."""

    train_file: str | None = field(default=None, metadata={"help": "a text file to train on"})
    validation_file: str | None = field(default=None, metadata={
        "help": "a text file to evaluate on (default: the last "
                "--validation_split_percentage of --train_file)"})
    validation_split_percentage: int = field(default=5, metadata={
        "help": "percent of the training text held out when there is no --validation_file"})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "use at most this many training blocks"})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "use at most this many evaluation blocks"})
    block_size: int | None = field(default=None, metadata={
        "help": "tokens per training sequence (default: the least of 1024, the tokenizer's "
                "model_max_length and the model's max_position_embeddings)"})
    keep_linebreaks: bool = field(default=True, metadata={
        "help": "keep the line breaks of the text files"})
    preprocessing_num_workers: int | None = field(default=None, metadata={
        "help": "processes for the tokenization"})
    overwrite_cache: bool = field(default=False, metadata={
        "help": "tokenize again instead of reading the datasets cache"})

    def __post_init__(self):
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and path.rsplit(".", 1)[-1] not in ("txt", "text"):
                raise ValueError(f"--{name} should be a .txt file, got {path}")


@merak.init_empty_weights()
def build_model(model_args: ModelArguments, config) -> transformers.PreTrainedModel:
    """The saved model at --model_name_or_path, or a fresh one from the config."""
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config)
    return AutoModelForCausalLM.from_config(config)


def main():
    parser = HfArgumentParser(
        (ModelArguments, DataTrainingArguments, merak.MerakArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    merak.init(dp=int(os.getenv("DP", 1)), tp=int(os.getenv("TP", 1)), pp=int(os.getenv("PP", 1)))

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(f"Process rank: {training_args.process_index} of {training_args.world_size}")
    logger.info(f"Training/evaluation parameters {training_args}")

    set_seed(training_args.seed)  # before the model is built: its initial weights follow it

    # ---- the text: one example per line of the files
    data_files = {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = datasets.load_dataset("text", data_files=data_files,
                                         keep_linebreaks=data_args.keep_linebreaks)
    if "validation" not in raw_datasets and training_args.do_eval:
        held_out = raw_datasets["train"].train_test_split(
            test_size=data_args.validation_split_percentage / 100, shuffle=False)
        raw_datasets["train"], raw_datasets["validation"] = held_out["train"], held_out["test"]

    # ---- config, tokenizer and model
    config_source = model_args.config_name or model_args.model_name_or_path
    if config_source is None:
        raise ValueError("give --config_name (train from scratch) or --model_name_or_path")
    config = AutoConfig.from_pretrained(config_source)
    if model_args.config_overrides is not None:
        logger.info(f"Overriding config: {model_args.config_overrides}")
        config.update_from_string(model_args.config_overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name
                                              or model_args.model_name_or_path)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                         f"{config.vocab_size}: add --config_overrides "
                         f"vocab_size={len(tokenizer)}")
    model = build_model(model_args, config)

    # ---- tokenize, then cut the token stream into blocks of block_size
    column_names = list(raw_datasets["train" if training_args.do_train
                                     else "validation"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(
            tokenize_function, batched=True, num_proc=data_args.preprocessing_num_workers,
            remove_columns=column_names, load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset")

    block_size = data_args.block_size
    if block_size is None:
        block_size = min(1024, tokenizer.model_max_length, config.max_position_embeddings)
    elif block_size > tokenizer.model_max_length:
        logger.warning(f"--block_size {block_size} is larger than the tokenizer's maximum "
                       f"({tokenizer.model_max_length}); using {tokenizer.model_max_length}")
        block_size = tokenizer.model_max_length

    def group_texts(examples):
        """Concatenate every text of the batch and cut the result into blocks (the remainder
        shorter than a block is dropped); the labels are the inputs (the model shifts them)."""
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated["input_ids"]) // block_size * block_size
        result = {k: [t[i:i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(
            group_texts, batched=True, num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping texts in chunks of {block_size}")

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(
                range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(
                range(min(len(eval_dataset), data_args.max_eval_samples)))

    def preprocess_logits_for_metrics(logits, labels):
        """Keep only each position's most likely token (the logits would fill the memory)."""
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        """Next-token accuracy: the prediction at position i is scored against label i + 1."""
        preds, labels = eval_preds
        preds, labels = preds[:, :-1].reshape(-1), labels[:, 1:].reshape(-1)
        scored = labels != -100
        return {"accuracy": float(np.mean(preds[scored] == labels[scored]))}

    trainer = merak.MerakTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics
        if training_args.do_eval else None,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()  # the model and the tokenizer, as an HF model directory
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    kwargs = {"tasks": "text-generation", "dataset": data_args.train_file}
    if model_args.model_name_or_path is not None:
        kwargs["finetuned_from"] = model_args.model_name_or_path
    trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
