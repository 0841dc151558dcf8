"""TRL's SFTTrainer on plain text: the rows, the tiny Llama and the fields shared by
MerakSFTTrainer's runs (workers/trainer_subclasses.py) and the single-process SFTTrainer
reference (test_trainer_subclasses.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
ROWS, STEPS, MICROBATCHES, GLOBAL_MICRO_BATCH, SEED = 64, 4, 2, 4, 1234
# fields both trainers get (the reference: GLOBAL_MICRO_BATCH rows per micro-batch)
FIELDS = {"max_steps": STEPS, "learning_rate": 1e-2, "logging_steps": 1, "seed": SEED,
          "train_sampling_strategy": "sequential", "gradient_accumulation_steps": MICROBATCHES,
          "report_to": "none", "disable_tqdm": True, "use_cpu": True, "bf16": False,
          "gradient_checkpointing": False, "max_grad_norm": 1.0, "max_length": 40,
          "save_strategy": "no"}
LAYOUTS = {"sft-dp1tp2pp2": (1, 2, 2), "sft-dp2tp1pp2": (2, 1, 2)}
# TRL's loss_type variants: scenario -> (layout, the SFTConfig fields it changes)
LOSS_TYPES = {"sft-dft-dp2tp1pp2": ((2, 1, 2), {"loss_type": "dft"})}
# TRL's peft_config: per scenario, its layout and LoRA's target_modules
LORA_LAYOUTS = {"sft-lora-dp1tp2pp2": ((1, 2, 2), "all-linear"),
                "sft-lora-dp2tp1pp2": ((2, 1, 2), ("q_proj", "v_proj"))}
# MerakArguments.lora_config (adapters made right after set_seed(args.seed)) on 8 ranks
# (at (1,2,2) also greedy generation with the trained adapters, against HF generate)
LORA_CONFIG_LAYOUTS = {"sft-lora-config-dp2tp2pp2": ((2, 2, 2), ("q_proj", "v_proj", "o_proj",
                                                                 "up_proj", "down_proj")),
                       "sft-lora-config-dp1tp2pp2": ((1, 2, 2), ("q_proj", "v_proj"))}
GENERATE = {"sft-lora-config-dp1tp2pp2"}
NEW_TOKENS = 8


def prompts() -> list[list[int]]:
    """Two prompts of different lengths, as token ids, generated from one at a time."""
    tok = tokenizer()
    return [tok(text)["input_ids"] for text in ("The history of", "In the early years the")]
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


def texts() -> list[str]:
    """ROWS sentences of examples/data/train.txt: plain text rows of varying length."""
    text = (DATA / "train.txt").read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    return sentences[:ROWS]


def dataset(order: list[int] | None = None):
    import datasets

    rows = texts()
    return datasets.Dataset.from_dict({"text": [rows[i] for i in (order or range(len(rows)))]})


def tokenizer():
    return tf.AutoTokenizer.from_pretrained(DATA / "tokenizer")


def model():
    torch.manual_seed(SEED)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def lora_fields(targets: str | tuple[str, ...]) -> dict:
    return {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
            "target_modules": targets if isinstance(targets, str) else list(targets)}


def peft_config(targets: str | tuple[str, ...]):
    """The LoraConfig handed to SFTTrainer (a new one each time: TRL may edit it)."""
    from peft import LoraConfig

    return LoraConfig(**lora_fields(targets))


def reference_order(dp: int, rows: int = ROWS, micro_batch: int = GLOBAL_MICRO_BATCH,
                    microbatches: int = MICROBATCHES) -> list[int]:
    """The rows in the order that gives a single process's micro-batch i (of `micro_batch`
    rows, `microbatches` a step) the rows of every dp rank's micro-batch i (Merak gives dp rank
    r the r-th slice of each step, then cuts it into micro-batches; TRL's per-micro-batch
    metrics gather over the dp ranks)."""
    step_rows = micro_batch * microbatches
    per_rank, per_mb = step_rows // dp, micro_batch // dp
    order = []
    for start in range(0, rows, step_rows):
        for mb in range(microbatches):
            for rank in range(dp):
                first = start + rank * per_rank + mb * per_mb
                order += range(first, first + per_mb)
    return order


def logged(log_history: list[dict]) -> dict[str, list[float]]:
    """Each of `LOGGED` per training step, from a trainer's log history."""
    steps = [h for h in log_history if "loss" in h and "train_runtime" not in h]
    return {key: [h[key] for h in steps] for key in LOGGED}


def merak_classes(config_cls: type, trainer_cls: type) -> tuple[type, type]:
    """The two classes a user writes for a TRL trainer (docs/trainer.md): a config that is both
    Merak's and `config_cls`, and a trainer that is both MerakTrainer and `trainer_cls`."""
    import merak

    @dataclass
    class Config(merak.MerakArguments, config_cls):
        pass

    class Trainer(merak.MerakTrainer, trainer_cls):
        pass

    Trainer.__name__ = Trainer.__qualname__ = f"Merak{trainer_cls.__name__}"
    return Config, Trainer


def moe_model():
    """A tiny Qwen3-MoE of the tokenizer's vocabulary (4 experts, top-2): SFT with expert
    parallelism (workers/ep_trainer.py)."""
    torch.manual_seed(SEED)
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))
