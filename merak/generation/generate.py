"""Text generation with a pipelined (dp x tp x pp) model, through HF `generate` and a KV cache.

Every rank calls `generate` with the same prompts. The dp replicas split the prompts (contiguous
shares); in each replica every rank runs HF ``model.generate`` on its share inside a
`StageView`, so decoding (left padding, the cache, logits processors, stopping at
``eos_token_id``) is HF's own code, each stage keeping the keys and values of its own blocks and
a decode step sending one position per request from stage to stage. The results are gathered
over dp, so every rank returns every prompt's new tokens.

With expert parallelism (ep > 1) every MoE layer's forward is an all-to-all over the ep group,
whose ranks decode different prompts: they must run the same number of forwards. So every rank
decodes in lockstep (HF's ``synced_gpus``: each step all ranks say whether they are done, and a
rank whose prompts are finished keeps running forwards, its results discarded, until every rank
is), and a rank with no prompt of its own decodes a one-token placeholder that is finished at
once (`_Finished`), so it takes part in every step's all-to-all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import StoppingCriteria, StoppingCriteriaList

from merak.distributed.host_objects import all_gather_objects
from merak.distributed.parallel_context import ParallelContext, get_context
from merak.generation.stage_view import StageView

_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")


def as_prompts(prompts) -> list[list[int]]:
    """Token-id lists from a list of prompts or a 1-D / 2-D tensor (ValueError if empty)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"prompts: a tensor of token ids must be 1-D or 2-D (one row per "
                             f"prompt), got shape {list(prompts.shape)}")
        prompts = prompts.tolist()
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts: give at least one prompt, each of at least one token id")
    return prompts


def position_limit(config) -> int | None:
    """The longest sequence the model's position embeddings allow (None if it says none)."""
    for source in (config, getattr(config, "get_text_config", lambda: config)()):
        for name in _POSITION_LIMITS:
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def check_generation_args(config, prompts: list[list[int]], max_new_tokens: int,
                          do_sample: bool, temperature: float, top_k: int | None,
                          top_p: float | None) -> None:
    """Raise ValueError, before any work, for requests the model cannot serve."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature!r} (for greedy "
                         f"decoding set do_sample=False)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    vocab = getattr(config, "vocab_size", None)
    bad = [t for p in prompts for t in p if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise ValueError(f"prompts hold token ids outside the vocabulary 0..{vocab} "
                         f"(e.g. {bad[:3]})")
    limit = position_limit(config)
    longest = max(map(len, prompts))
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} "
                         f"exceeds the model's {limit} positions; shorten the prompt or "
                         f"generate fewer tokens")


def _share(n: int, parts: int, index: int) -> slice:
    return slice(index * n // parts, (index + 1) * n // parts)


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask): `prompts` left-padded with `pad` to the longest, as HF expects."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def new_tokens(row: torch.Tensor, eos: set[int]) -> list[int]:
    """A generated row up to and including its first token in `eos` (HF pads after it)."""
    out = []
    for token in row.tolist():
        out.append(token)
        if token in eos:
            break
    return out


class _Finished(StoppingCriteria):
    """Every row is done: a rank's placeholder prompt under lockstep decoding."""

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model: nn.Module, stage: nn.Module, prompts, *, ctx: ParallelContext | None = None,
             max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             seed: int = 0, prefix: str = "") -> list[list[int]]:
    """Generate from `prompts` with the pipelined model; call it on every rank.

    Args:
        model: the model given to `merak.parallelize` (its modules are shared with `stage`).
        stage: this rank's stage from `merak.parallelize`.
        prompts: token ids: a list of prompts (lists of ints, any lengths) or a 2-D tensor.
        max_new_tokens, do_sample, temperature, top_k, top_p: as in HF ``generate``
            (temperature, top_k and top_p apply when sampling).
        eos_token_id: stop a prompt at this token (default: the model's generation config).
        pad_token_id: left padding of shorter prompts (default: the model's pad, else eos,
            else 0); padded positions are masked out.
        seed: seeds sampling, identically on every rank of a pipeline.
        prefix: as for `StageView`. Every hidden-state wait ends after the process group's
            timeout (`merak.init(timeout=)`).

    Returns:
        For each prompt in order, the new token ids (up to and including the first
        ``eos_token_id``), the same on every rank.
    """
    ctx = ctx or get_context()
    prompts = as_prompts(prompts)
    config = model.config
    check_generation_args(config, prompts, max_new_tokens, do_sample, temperature, top_k, top_p)
    gen_config = getattr(model, "generation_config", None)
    if eos_token_id is None and gen_config is not None:
        eos_token_id = gen_config.eos_token_id
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    if pad_token_id is None:
        pad_token_id = next((t for t in (getattr(gen_config, "pad_token_id", None),
                                         getattr(config, "pad_token_id", None), *sorted(eos))
                             if t is not None), 0)
    mine = prompts[_share(len(prompts), ctx.dp, ctx.dp_rank)]
    lockstep = getattr(ctx, "ep", 1) > 1  # every MoE layer an all-to-all over the ep group
    rows: list[list[int]] = []
    if mine or lockstep:
        ids, mask = left_padded(mine or [[pad_token_id]], pad_token_id, ctx.device)
        options = {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                   "pad_token_id": pad_token_id, "eos_token_id": eos_token_id}
        if do_sample:
            options.update(temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0)
        if lockstep:
            options["synced_gpus"] = True
            if not mine:  # a placeholder, finished after its first step
                options["stopping_criteria"] = StoppingCriteriaList([_Finished()])
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with StageView(model, stage, ctx, prefix), \
                torch.random.fork_rng(devices=devices, device_type=ctx.device.type):
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
        rows = [new_tokens(row, eos) for row in out[:, ids.shape[1]:].cpu()] if mine else []
    if ctx.dp == 1:
        return rows
    shares = all_gather_objects(rows, ctx.host_group("dp"))
    return [row for share in shares for row in share]
