"""Sequence parallelism (Megatron-style) on the repeated blocks of a tensor-parallel model.

Between the first and the last block of each block list the residual stream is split along
the sequence across the TP ranks: norms, dropout and residual adds run on 1/tp of the tokens,
and pipeline boundaries carry 1/tp of the hidden state. Each `sp_gather` module (attention,
MLP) all-gathers its input sequence, and its row-parallel output layer reduce-scatters back
to sequence shards. The first block scatters its input, the last gathers its output, so the
glue around the blocks (embedding, final norm, LM head, loss) sees full sequences.

An `sp_gather` module holding a module whose output is summed over TP (`partial_sum`: the
experts of an MoE block, `moe_tp_experts`), or all-gathered (OLMoE's attention, whose q, k, v
are gathered for its norms), or no split module (DeepSeek-V3's attention), runs whole on every
TP rank instead (the TP layers inside it all-reduce, as without sequence parallelism): its input is
all-gathered with a backward that keeps this rank's slice, its output sliced to this rank's
shard with a backward that all-gathers. Inside it every TP rank then holds the same full
sequences, so the router, its load-balancing statistics and an expert-parallel all-to-all (tp
rank t with tp rank t of the other replicas) see the same tokens as without sequence
parallelism, and its inputs' and parameters' gradients are complete on every rank (the experts'
own all-reduces make them so), not per-rank parts.
"""

from __future__ import annotations

import torch
from torch import nn

from merak.stages.blocks import within
from merak.tensor_parallel.layers.collectives import (
    gather_from_tp,
    gather_sequence,
    scatter_to_tp,
    tracing,
)
from merak.tensor_parallel.plans.tp_plan import matches


def _with_first_tensor(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise ValueError("sequence parallelism needs the hidden states as the first argument or the "
                     "`hidden_states` keyword")


class _SequenceParallelBlock:
    """Mixin: the first block of a list scatters its input, the last gathers its output."""

    sp_scatter_input = False
    sp_gather_output = False

    def forward(self, *args, **kwargs):
        dim, group = self.sp_dim, self.sp_group
        if self.sp_scatter_input:
            args, kwargs = _with_first_tensor(args, kwargs,
                                              lambda x: _scatter_sequence(x, dim, group))
        out = super().forward(*args, **kwargs)
        if not self.sp_gather_output:
            return out
        gather = (lambda x: x) if tracing() else (lambda x: gather_from_tp(x, dim, group))
        if isinstance(out, torch.Tensor):
            return gather(out)
        return (gather(out[0]), *out[1:])


def _scatter_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    # while tracing, sequence shards keep the full length: every sequence-parallel collective
    # pairs up along the same dimension, so the traced shapes stay consistent
    return x if tracing() else scatter_to_tp(x, dim, group)


def _keep_whole(module: nn.Module, name: str, group, dim: int) -> None:
    """`module` runs on the full sequences on every TP rank (see the module docstring)."""
    stray = [f"{name}.{n}" for n, m in module.named_modules()
             if getattr(m, "sequence_parallel", False)]
    if stray:
        raise ValueError(f"sequence parallelism runs {name} whole on every TP rank (its TP "
                         f"split is summed or gathered inside it, or it has none), but {stray} "
                         f"reduce-scatter the sequence inside it; set sequence_parallel=False")
    module.register_forward_pre_hook(
        lambda mod, args, kwargs: _with_first_tensor(
            args, kwargs, lambda x: x if tracing() else gather_from_tp(x, dim, group)),
        with_kwargs=True)

    def shard(x: torch.Tensor) -> torch.Tensor:
        return x if tracing() else scatter_to_tp(x, dim, group)

    module.register_forward_hook(
        lambda mod, args, out: shard(out) if isinstance(out, torch.Tensor)
        else (shard(out[0]), *out[1:]))


def whole_modules(model: nn.Module, blocks: list[str], sp_gather: tuple[str, ...],
                  partial_sum: set[str], split: set[str] | None = None) -> list[str]:
    """The `sp_gather` modules in `blocks` that hold one of the modules `partial_sum` (summed
    over TP, or all-gathering their output: a split undone inside the module), or none of the
    modules `split` (TP left them replicated: nothing in them would reduce-scatter their
    output): sequence parallelism runs them whole on every TP rank."""
    def holds(name: str, names: set[str]) -> bool:
        return any(within(s, name) for s in names)
    return [name for name, _ in model.named_modules()
            if any(name.startswith(b + ".") for b in blocks)
            and any(matches(name, p) for p in sp_gather)
            and (holds(name, partial_sum) or (split is not None and not holds(name, split)))]


def enable_sequence_parallel(model: nn.Module, blocks: list[str], sp_gather: tuple[str, ...],
                             group, sequence_dim: int, whole: tuple[str, ...] = ()) -> None:
    lists: dict[str, list[str]] = {}
    for name in blocks:
        lists.setdefault(name.rsplit(".", 1)[0], []).append(name)
    classes: dict[type, type] = {}
    for names in lists.values():
        for i, name in enumerate(names):
            block = model.get_submodule(name)
            cls = type(block)
            if cls not in classes:
                classes[cls] = type(f"SequenceParallel{cls.__name__}",
                                    (_SequenceParallelBlock, cls), {})
            block.__class__ = classes[cls]
            block.sp_dim, block.sp_group = sequence_dim, group
            block.sp_scatter_input, block.sp_gather_output = i == 0, i == len(names) - 1
    gathered = 0
    for name, module in model.named_modules():
        if any(name.startswith(b + ".") for b in blocks) and any(matches(name, p)
                                                                 for p in sp_gather):
            gathered += 1
            if name in whole:
                _keep_whole(module, name, group, sequence_dim)
                continue
            module.register_forward_pre_hook(
                lambda mod, args, kwargs: _with_first_tensor(
                    args, kwargs, lambda x: x if tracing() else
                    gather_sequence(x, sequence_dim, group)),
                with_kwargs=True)
    if not gathered:
        raise ValueError(f"sequence parallelism found none of the modules {list(sp_gather)} in "
                         f"the blocks")
