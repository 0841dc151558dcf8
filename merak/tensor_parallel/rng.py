"""Dropout randomness across tensor-parallel ranks.

Every TP rank starts from the same seed and runs the same replicated operations, so dropout on
replicated activations (e.g. after a row-parallel layer) draws the same mask on every rank, as
it must. Dropout on sharded activations must differ between ranks: between a column-parallel
layer's output and the next row-parallel layer's input (attention probabilities of this rank's
heads, a sharded MLP hidden state) and, with sequence parallelism, anywhere inside a block. There
the draws come from a per-rank generator state, forked from the job's seed
(``initial_seed + 2718 + tp_rank``, Megatron's convention) and swapped in only while inside the
region, so the shared stream is never advanced by them.
"""

from __future__ import annotations

import torch
from torch import nn

from merak.tensor_parallel.collectives import tracing

_OFFSET = 2718


def _get(cuda: bool) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def _set(states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


class TPRandomState:
    """Switches the default generators between the shared stream and this rank's own."""

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self.own: tuple | None = None
        self.shared: tuple | None = None

    def enter(self, cuda: bool = False) -> None:
        if self.shared is not None or tracing():
            return
        self.shared = _get(cuda)
        if self.own is None:
            torch.manual_seed(torch.initial_seed() + _OFFSET + self.tp_rank)
        else:
            _set(self.own)

    def leave(self) -> None:
        if self.shared is None:
            return
        self.own = _get(self.shared[1] is not None)
        _set(self.shared)
        self.shared = None


def install_tp_rng(model: nn.Module, column: list[nn.Module], row: list[nn.Module],
                   blocks: list[nn.Module], tp_rank: int, sequence_parallel: bool) -> None:
    """Hooks that enter this rank's stream after column-parallel layers and leave it before
    row-parallel ones (or, with sequence parallelism, around each whole block)."""
    state = TPRandomState(tp_rank)
    model.merak_tp_rng = state

    def cuda_of(mod) -> bool:
        param = next(mod.parameters(), None)
        return param is not None and param.is_cuda

    if sequence_parallel:
        for block in blocks:
            block.register_forward_pre_hook(lambda m, a: state.enter(cuda_of(m)))
            block.register_forward_hook(lambda m, a, o: state.leave())
        return
    for module in column:
        module.register_forward_hook(lambda m, a, o: state.enter(cuda_of(m)))
    for module in row:
        module.register_forward_pre_hook(lambda m, a: state.leave())
