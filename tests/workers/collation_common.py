"""Collation per micro-batch: the runs shared by the pooled 4-rank worker
(workers/collation.py) and their single-process references (test_collation.py).

Each run trains the tiny Llama of `sft_common` for STEPS steps of 2 micro-batches:
- ``flatten``: HF Trainer with `DataCollatorWithFlattening` (position_ids and the FlashAttention
  keywords ``cu_seq_lens_*``, ``max_length_*``) on rows of varying length, so each micro-batch is
  one flattened row of its own length;
- ``packing``: TRL's SFTTrainer with ``packing=True`` (BFD packing, padding-free batches);
- ``padding-free``: SFTTrainer with ``padding_free=True`` on unpacked rows;
- ``prompt-completion``: SFTTrainer on prompt-completion rows (loss on the completion only).

The reference trains GLOBAL_MICRO_BATCH rows per micro-batch in one process; a step holds the
same rows in both, and HF's token-weighted loss (the step's summed token losses over its label
tokens) does not depend on how they are shared among micro-batches and dp ranks. At dp 1 the
micro-batches are the reference's too, so TRL's per-micro-batch metrics are compared as well.
"""

from __future__ import annotations

import sft_common as sft
import torch
import transformers as tf

STEPS = 3
GLOBAL_MICRO_BATCH = sft.GLOBAL_MICRO_BATCH
FIELDS = {**sft.FIELDS, "max_steps": STEPS}
HF_FIELDS = {k: v for k, v in FIELDS.items() if k != "max_length"}
# kind -> (the trainer: "hf" or "sft", SFTConfig fields)
KINDS = {"flatten": ("hf", {}),
         "packing": ("sft", {"packing": True}),
         "padding-free": ("sft", {"padding_free": True, "max_length": None}),
         "prompt-completion": ("sft", {})}
LAYOUTS = {"dp1tp2pp2": (1, 2, 2), "dp2tp1pp2": (2, 1, 2)}
SCENARIOS = {f"{kind}-{name}": (kind, layout) for kind in KINDS for name, layout in LAYOUTS.items()
             if kind != "padding-free" or layout[0] == 2}


def flatten_rows(n: int = sft.ROWS, seed: int = 7) -> list[dict]:
    """Token rows of 4..24 tokens (unpadded: the collator flattens them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 512, (int(torch.randint(4, 25, (1,), generator=g)),),
                            generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def flatten_collator() -> tf.DataCollatorWithFlattening:
    return tf.DataCollatorWithFlattening(return_flash_attn_kwargs=True)


def prompt_completion():
    """sft_common's sentences, each cut into a prompt (its first half of words) and a
    completion (the rest)."""
    import datasets

    prompts, completions = [], []
    for text in sft.texts():
        words = text.split()
        half = max(1, len(words) // 2)
        prompts.append(" ".join(words[:half]))
        completions.append(" " + " ".join(words[half:]))
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})


def train_set(kind: str):
    if kind == "flatten":
        return flatten_rows()
    return prompt_completion() if kind == "prompt-completion" else sft.dataset()


def trainer_inputs(kind: str) -> dict:
    """What a trainer of `kind` takes besides model and args."""
    if kind == "flatten":
        return {"train_dataset": train_set(kind), "data_collator": flatten_collator()}
    return {"train_dataset": train_set(kind), "processing_class": sft.tokenizer()}


def fields(kind: str) -> dict:
    trainer, extra = KINDS[kind]
    return HF_FIELDS if trainer == "hf" else {**FIELDS, **extra}


def logged(kind: str, log_history: list[dict]) -> dict[str, list[float]]:
    steps = [h for h in log_history if "loss" in h and "train_runtime" not in h]
    keys = ("loss", "grad_norm") if KINDS[kind][0] == "hf" else sft.LOGGED
    return {key: [h[key] for h in steps] for key in keys}
