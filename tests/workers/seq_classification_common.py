"""Sequence-classification heads and TRL's RewardTrainer through MerakTrainer: the models, rows,
fields and runs shared by the pipelined runs (workers/seq_classification.py) and their
single-process references (test_sequence_classification.py).

Rows are random token ids (never the pad id 0) of 3..10 tokens, padded per micro-batch to its
longest row (right, or left), with an attention mask; regression rows carry a float label
(``num_labels=1``: HF's MSE), classification rows an int label of 3 classes (cross-entropy).
Preference rows are pairs of such rows (TRL's ``chosen_ids`` / ``rejected_ids``), optionally
with a margin.
"""

from __future__ import annotations

import sft_common as sft
import torch
import transformers as tf

VOCAB, PAD, SEED, ROWS, EVAL_ROWS = 96, 0, 1234, 32, 8
STEPS, MICROBATCHES, GLOBAL_MICRO_BATCH = 4, 2, 4
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2}
FAMILIES = ("llama", "qwen2", "gpt2")
# HF fields both trainers get (the reference: GLOBAL_MICRO_BATCH rows per micro-batch). The
# model's own loss ignores HF's count of the step (its forward takes **kwargs, so HF passes
# one): HF then sums the micro-batch means without dividing by the accumulation steps, and
# with average_tokens_across_devices multiplies by the processes; off, dp ranks average.
FIELDS = {"max_steps": STEPS, "learning_rate": 1e-2, "logging_steps": 1, "seed": SEED,
          "train_sampling_strategy": "sequential", "gradient_accumulation_steps": MICROBATCHES,
          "report_to": "none", "disable_tqdm": True, "use_cpu": True, "max_grad_norm": 1.0,
          "save_strategy": "no", "average_tokens_across_devices": False}
# run -> (family, num_labels, padding side, layout (dp, tp, pp))
RUNS = {"llama-regression-right-dp1pp2": ("llama", 1, "right", (1, 1, 2)),
        "llama-classes-left-dp1pp2": ("llama", 3, "left", (1, 1, 2)),
        "qwen2-classes-right-dp1pp2": ("qwen2", 3, "right", (1, 1, 2)),
        "gpt2-regression-right-dp1pp2": ("gpt2", 1, "right", (1, 1, 2)),
        "llama-classes-right-dp2pp2": ("llama", 3, "right", (2, 1, 2)),
        "qwen2-regression-right-dp2pp1": ("qwen2", 1, "right", (2, 1, 1)),
        "llama-classes-right-tp2pp2": ("llama", 3, "right", (1, 2, 2))}
# runs with average_tokens_across_devices on (HF's default) -> the run they repeat: HF's rule
# multiplies the loss by the processes (the model ignores the count), so at dp 2 the loss, grad
# norm and evaluation loss are twice the single-process ones (as under HF DDP)
AVERAGED = {"qwen2-regression-right-dp2pp1-averaged": "qwen2-regression-right-dp2pp1"}
# TRL RewardTrainer runs -> (layout, RewardConfig fields, with margins)
REWARD_RUNS = {"reward-dp1pp2": ((1, 1, 2), {}, False),
               "reward-center-margin-dp1pp2": ((1, 1, 2), {"center_rewards_coefficient": 0.01},
                                               True),
               "reward-dp2pp1": ((2, 1, 1), {}, False),
               "reward-center-dp2pp2": ((2, 1, 2), {"center_rewards_coefficient": 0.01}, False),
               "reward-margin-tp2pp2": ((1, 2, 2), {}, True)}
# RewardTrainer runs that also evaluate after training, EVAL_ROWS held-out pairs: evaluate() on
# its eval_dataset, and evaluate(set) on a set given then (each micro-batch collated on its own
# pairs, as in training)
REWARD_EVALUATED = ("reward-margin-tp2pp2",)
REWARD_LOGGED = ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward",
                 "max_reward", "num_tokens")


def world_size(layout: tuple[int, int, int]) -> int:
    return layout[0] * layout[1] * layout[2]


def model(family: str, num_labels: int):
    """A small `*ForSequenceClassification` (its weights from SEED) with `config.pad_token_id`."""
    torch.manual_seed(SEED)
    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=1, eos_token_id=1, pad_token_id=PAD,
                               num_labels=num_labels)
    else:
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[family]
        config = cls(vocab_size=VOCAB, bos_token_id=1, eos_token_id=1, pad_token_id=PAD,
                     num_labels=num_labels, **SIZES)
    return tf.AutoModelForSequenceClassification.from_config(config)


def _ids(g: torch.Generator) -> list[int]:
    n = int(torch.randint(3, 11, (1,), generator=g))
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def rows(n: int, num_labels: int, seed: int = SEED, order: list[int] | None = None
         ) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(n):
        ids = _ids(g)
        label = float(torch.rand((), generator=g)) * 2 - 1 if num_labels == 1 \
            else int(torch.randint(0, num_labels, (), generator=g))
        made.append({"input_ids": ids, "labels": label})
    return [made[i] for i in (order or range(n))]


class Collator:
    """Pads a micro-batch's rows to its longest with PAD on `side`; the mask; the labels."""

    def __init__(self, side: str):
        self.side = side

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(x["input_ids"]) for x in items)
        ids, mask = [], []
        for x in items:
            pad = [PAD] * (longest - len(x["input_ids"]))
            zeros, ones = [0] * len(pad), [1] * len(x["input_ids"])
            ids.append(x["input_ids"] + pad if self.side == "right" else pad + x["input_ids"])
            mask.append(ones + zeros if self.side == "right" else zeros + ones)
        labels = [x["labels"] for x in items]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
                "labels": torch.tensor(labels, dtype=torch.float if isinstance(labels[0], float)
                                       else torch.long)}


def reference_order(dp: int, n: int = ROWS) -> list[int]:
    """`sft_common.reference_order` for this module's steps."""
    return sft.reference_order(dp, n, GLOBAL_MICRO_BATCH, MICROBATCHES)


def logged(log_history: list[dict], keys=("loss", "grad_norm")) -> dict[str, list[float]]:
    steps = [h for h in log_history if "loss" in h and "train_runtime" not in h]
    return {key: [h[key] for h in steps] for key in keys}


def preference_rows(n: int = ROWS, margins: bool = False, order: list[int] | None = None,
                    seed: int = SEED + 1):
    """TRL's tokenized preference rows (``chosen_ids``, ``rejected_ids``, ``margin``)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    made = {"chosen_ids": [], "rejected_ids": [], "margin": []}
    for _ in range(n):
        made["chosen_ids"].append(_ids(g))
        made["rejected_ids"].append(_ids(g))
        made["margin"].append(float(torch.rand((), generator=g)))
    if not margins:
        del made["margin"]
    order = order or list(range(n))
    return datasets.Dataset.from_dict({k: [v[i] for i in order] for k, v in made.items()})


def tokenizer():
    """A word-level tokenizer over the ids (RewardTrainer reads its pad and eos tokens)."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": PAD, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", eos_token="</s>")


def train_and_evaluate(trainer_cls, args_cls, run: str, model_=None, output_dir: str = "out",
                       ) -> dict:
    """One run of RUNS with `trainer_cls` (HF Trainer, or MerakTrainer with Merak's layout
    already set): each step's loss and grad norm, the evaluation loss, and predict's logits
    (on the dp ranks' share of each step at dp > 1, the reference's order otherwise)."""
    family, num_labels, side, (dp, _, _) = RUNS[AVERAGED.get(run, run)]
    single = trainer_cls is tf.Trainer
    order = reference_order(dp) if single else None
    args = args_cls(output_dir=output_dir, per_device_eval_batch_size=GLOBAL_MICRO_BATCH // dp
                    if not single else GLOBAL_MICRO_BATCH,
                    per_device_train_batch_size=GLOBAL_MICRO_BATCH // (1 if single else dp),
                    **{**FIELDS, "average_tokens_across_devices": run in AVERAGED})
    trainer = trainer_cls(model=model_ if model_ is not None else model(family, num_labels),
                          args=args, train_dataset=rows(ROWS, num_labels, order=order),
                          data_collator=Collator(side))
    trainer.train()
    held_out = rows(EVAL_ROWS, num_labels, seed=SEED + 7)
    metrics = trainer.evaluate(held_out)
    predicted = trainer.predict(held_out)
    return {**logged(trainer.state.log_history), "eval_loss": metrics["eval_loss"],
            "logits": predicted.predictions.tolist(),
            "label_ids": predicted.label_ids.tolist()}


def train_reward(trainer_cls, args_cls, run: str, model_=None, output_dir: str = "out") -> dict:
    """One run of REWARD_RUNS with TRL's RewardTrainer (or MerakTrainer mixed with it): what it
    logged per step (`REWARD_LOGGED`); for REWARD_EVALUATED, also what ``evaluate()`` returns
    after training ("eval": loss and TRL's metrics) and the loss of ``evaluate(set)`` on the
    same pairs given then ("given_loss")."""
    (dp, _, _), fields, margins = REWARD_RUNS[run]
    single = model_ is None
    evaluated = run in REWARD_EVALUATED
    held_out = preference_rows(EVAL_ROWS, margins, seed=SEED + 9) if evaluated else None
    args = args_cls(output_dir=output_dir,
                    per_device_train_batch_size=GLOBAL_MICRO_BATCH // (1 if single else dp),
                    per_device_eval_batch_size=GLOBAL_MICRO_BATCH // (1 if single else dp),
                    **{**FIELDS, "average_tokens_across_devices": True, "bf16": False},
                    **fields)
    data = preference_rows(margins=margins, order=reference_order(dp) if single else None)
    trainer = trainer_cls(model=model_ if model_ is not None else model("llama", 1), args=args,
                          train_dataset=data, eval_dataset=held_out,
                          processing_class=tokenizer())
    trainer.train()
    figures = logged(trainer.state.log_history, REWARD_LOGGED)
    if evaluated:
        figures["eval"] = {k: v for k, v in trainer.evaluate().items()
                           if not k.endswith(("_runtime", "_per_second", "epoch"))}
        given = preference_rows(EVAL_ROWS, margins, seed=SEED + 9)
        figures["given_loss"] = trainer.evaluate(given, metric_key_prefix="test")["test_loss"]
    return figures
