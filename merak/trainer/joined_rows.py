"""Rows a Trainer subclass's ``compute_loss`` runs the model on in separate calls, run as rows of
one pipeline forward.

TRL's ``KTOTrainer`` (its default ``loss_type="kto"``) calls the model twice per batch: on the
rows' completions (``input_ids``, ``attention_mask``) and, without gradients, on mismatched
completions (``KL_input_ids``, ``KL_attention_mask``: each prompt with another row's completion),
whose log-probabilities estimate the KL term. A pipeline schedule runs one forward per
micro-batch, so `JoinedRows.join` makes the model inputs of a collated micro-batch the groups'
rows one after another (the completions first), each right-padded to the longest of them, and
keeps the first group's own values beside them (``ORIGINAL`` + name). On the last stage
`JoinedRows.split` gives ``compute_loss`` the micro-batch as the collator made it, and
`JoinedModel` answers each of its model calls from that group's rows of the logits, cut to the
group's width: right padding and causal attention leave a row's logits at its own positions
unchanged (its positions, and the keys its queries see, are those of the unpadded row).
The rows of a call made without gradients (KTO's KL completions) get none; their share of the
backward is zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from merak.trainer.arguments import NotSupportedYetError
from merak.trainer.subclasses import is_kto

ORIGINAL = "merak_first_rows."  # the first group's own values, beside the joined ones


@dataclass(frozen=True)
class JoinedRows:
    """groups: per call of the model, its model input name -> the batch key holding it (the
    first group's keys are the model input names); pad: the padding value per input name."""

    groups: tuple[dict[str, str], ...]
    pad: dict[str, int]

    @property
    def names(self) -> list[str]:
        """The model inputs the pipeline runs (joined)."""
        return list(self.groups[0])

    def join(self, batch: dict) -> dict:
        """The collated micro-batch with its model inputs joined (see the module doc)."""
        if any(key not in batch for group in self.groups for key in group.values()):
            return batch  # (a collation without the second group's rows: nothing to join)
        joined = dict(batch)
        for name in self.names:
            parts = [batch[group[name]] for group in self.groups]
            width = max(part.shape[1] for part in parts)
            joined[ORIGINAL + name] = batch[name]
            joined[name] = torch.cat([F.pad(part, (0, width - part.shape[1]),
                                            value=self.pad[name]) for part in parts])
        return joined

    def split(self, batch: dict) -> dict:
        """The micro-batch as the collator made it (the first group's own values back)."""
        if not any(k.startswith(ORIGINAL) for k in batch):
            return dict(batch)
        own = {k: v for k, v in batch.items() if not k.startswith(ORIGINAL)}
        own.update({name: batch[ORIGINAL + name] for name in self.names})
        return own

    def parts(self, batch: dict) -> list[tuple[slice, int, dict[str, torch.Tensor]]]:
        """Per group of a `split` micro-batch: its rows of the joined forward, its width, and its
        inputs by model input name."""
        made, start = [], 0
        for group in self.groups:
            values = {name: batch[key] for name, key in group.items()}
            rows, width = next(iter(values.values())).shape[:2]
            made.append((slice(start, start + rows), width, values))
            start += rows
        return made


class JoinedModel:
    """``compute_loss``'s model on the last stage for a joined micro-batch: each call answered by
    the `StageModel` of the group whose inputs it passes."""

    def __init__(self, models: Sequence):
        self.models = list(models)

    def __call__(self, *args, **kwargs):
        for model in self.models:
            if model.answers(kwargs):
                return model(*args, **kwargs)
        raise NotSupportedYetError(
            "compute_loss called the model on other inputs than any of the micro-batch's row "
            "groups (its completions and its KL completions): on the last pipeline stage the "
            "model's outputs exist only for the rows the pipeline ran")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.models[0], name)


def kto_rows(trainer) -> JoinedRows | None:
    """TRL's KTOTrainer with a KL term: its completions and KL completions joined; else None."""
    if not is_kto(type(trainer)) or not getattr(trainer, "calculate_KL", False):
        return None
    pad = trainer._tokenizer.pad_token_id
    return JoinedRows(({"input_ids": "input_ids", "attention_mask": "attention_mask"},
                       {"input_ids": "KL_input_ids", "attention_mask": "KL_attention_mask"}),
                      {"input_ids": pad, "attention_mask": 0})
