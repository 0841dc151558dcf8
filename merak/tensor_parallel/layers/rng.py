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

from merak.tensor_parallel.layers.collectives import tracing

_OFFSET = 2718


def _cuda_in_use() -> bool:
    """Whether this process has a CUDA generator in play (a CPU-only process has none; one that
    never touched CUDA gets its generators seeded when it first does)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get() -> tuple:
    """The CPU generator's state and the current CUDA device's (None without CUDA in use).

    Both, whatever device the module at hand lives on: a module shadowed on the meta device
    (generation: a layer another pipeline stage holds) still runs this code, and the seeding
    below moves the CUDA generator too, so saving only the CPU state would leave that rank's
    sampling stream apart from its pipeline peers'."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda_in_use() else None


def _set(states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _seed(seed: int) -> None:
    """Seed the generators `_get` saves and no other (`torch.manual_seed` would also queue a
    seed for every CUDA device, applied whenever CUDA starts)."""
    torch.default_generator.manual_seed(seed)
    if _cuda_in_use():
        torch.cuda.manual_seed(seed)


class TPRandomState:
    """Switches the default generators (CPU, and the current CUDA device's) between the shared
    stream and this rank's own."""

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self.own: tuple | None = None
        self.shared: tuple | None = None

    def enter(self) -> None:
        if self.shared is not None or tracing():
            return
        self.shared = _get()
        seed = torch.initial_seed() + _OFFSET + self.tp_rank
        if self.own is None:
            _seed(seed)
            return
        _set(self.own)
        if self.own[1] is None and self.shared[1] is not None:  # CUDA started since: its own
            torch.cuda.manual_seed(seed)                         # stream starts from the seed

    def leave(self) -> None:
        if self.shared is None:
            return
        self.own = _get()
        _set(self.shared)
        self.shared = None


def install_tp_rng(model: nn.Module, column: list[nn.Module], row: list[nn.Module],
                   blocks: list[nn.Module], tp_rank: int, sequence_parallel: bool) -> None:
    """Hooks that enter this rank's stream after column-parallel layers and leave it before
    row-parallel ones (or, with sequence parallelism, around each whole block)."""
    state = TPRandomState(tp_rank)
    model.merak_tp_rng = state
    if sequence_parallel:
        for block in blocks:
            block.register_forward_pre_hook(lambda m, a: state.enter())
            block.register_forward_hook(lambda m, a, o: state.leave())
        return
    for module in column:
        module.register_forward_hook(lambda m, a, o: state.enter())
    for module in row:
        module.register_forward_pre_hook(lambda m, a: state.leave())
