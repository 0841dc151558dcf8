"""The expert-parallel experts implementation, registered in transformers' experts interface
(``ALL_EXPERTS_FUNCTIONS``) under `IMPLEMENTATION`: a sharded experts module
(`merak.expert_parallel.shard`) runs it in place of the family's own.

For one layer's routed tokens (hidden ``[T, H]``, top-k indices and weights ``[T, K]``):

1. the T*K (token, expert) pairs are sorted by expert, which orders them by owning rank too
   (rank j owns experts ``[j*E/ep, (j+1)*E/ep)``);
2. each rank tells every other how many pairs it sends to each of its experts (an all-to-all
   of ``[ep, E/ep]`` counts), so both sides know the split sizes;
3. the tokens go to their owners (all-to-all with split sizes, differentiable);
4. the owner runs its local experts over what it received with the family's own
   implementation, with weight 1 per row: ``grouped_mm`` permutes the rows expert-major, runs
   each local expert on its run of rows and restores the order; ``batched_mm`` and eager
   index each row's expert;
5. the results go back (the reverse all-to-all), are put back in (token, k) order and
   combined with the router's weights, as transformers combines them.

Dropless: every pair is computed, however unbalanced the routing. The router, shared experts
and load-balancing loss run unchanged around it, on this rank's own rows.

With tensor parallelism every tp rank of a replica holds the same tokens and routing (with
sequence parallelism too: the MoE block runs whole on the gathered sequences,
`merak.tensor_parallel.layers.sequence`); tp rank t exchanges them with tp rank t of the other
replicas of its ep group, so each rank computes its tp slice of its experts (the
``moe_tp_experts`` style splits them along the intermediate dim) and the style's sum over the tp
ranks completes the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from merak.expert_parallel.exchange import all_to_all_rows, exchange_counts

IMPLEMENTATION = "merak_expert_parallel"


@dataclass
class ExpertShard:
    """What a sharded experts module needs at run time (``module.merak_ep``)."""

    group: dist.ProcessGroup
    ep: int
    ep_rank: int
    num_experts: int  # the layer's, over all ranks (the module's own is now its local count)
    inner: str  # the experts implementation the module ran before: runs the local experts

    @property
    def local(self) -> int:
        return self.num_experts // self.ep

    @property
    def first(self) -> int:
        return self.ep_rank * self.local


def _inner_forward(module: nn.Module, name: str):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    # the family's undecorated forward (the decorator keeps it as __wrapped__): "eager"; the
    # decorated class may sit under a tensor-parallel wrapper class (moe_tp_experts)
    decorated = next(c.__dict__["forward"] for c in type(module).__mro__
                     if hasattr(c.__dict__.get("forward"), "__wrapped__"))
    chosen = None if name in (None, "eager") else ALL_EXPERTS_FUNCTIONS.get_interface(name, None)
    # bound by `partial`, not `__get__`: dynamo (torch.compile of the blocks) traces a partial,
    # but reads a function's `__get__(module)` as an attribute of the module
    return partial(decorated.__wrapped__ if chosen is None else chosen, module)


def expert_parallel_forward(module: nn.Module, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            ) -> torch.Tensor:
    shard: ExpertShard | None = getattr(module, "merak_ep", None)
    if shard is None and hidden_states.is_meta:
        # a layer another pipeline stage holds, run on meta for its shapes (generation's
        # `StageView`): its output's shape, no exchange
        return torch.empty_like(hidden_states)
    if shard is None:
        raise RuntimeError(f"{type(module).__name__} asks for the {IMPLEMENTATION!r} experts "
                           f"implementation but was not sharded: call "
                           f"merak.expert_parallel.shard_experts(model, ctx)")
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    inner = _inner_forward(module, shard.inner)

    def local(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(local_ids.numel(), 1, dtype=rows.dtype, device=rows.device)
        return inner(rows, local_ids[:, None], ones)  # each row with weight 1

    pairs = run_routed(shard, top_k_index.reshape(-1),
                       lambda order: hidden_states[order // top_k], local)
    # (5) weighted by the router and summed over k, as transformers combines them
    combined = (pairs.view(tokens, top_k, hidden) * top_k_weights.unsqueeze(-1)).sum(dim=1)
    return combined.to(hidden_states.dtype)


def run_routed(shard: ExpertShard, ids: torch.Tensor,
               rows_in: Callable[[torch.Tensor], torch.Tensor],
               local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Steps (1)-(5) of the module's docstring for N (row, expert) pairs: `ids` ``[N]`` each
    pair's expert (of the layer's, 0..E-1); ``rows_in(order)`` the pairs' input rows in that
    order (``[N, H]``); ``local(rows, local_ids)`` runs this rank's experts over the rows that
    arrived (``local_ids``: each row's expert among this rank's). Returns each pair's output
    ``[N, H]`` in pair order."""
    # (1) pairs by expert, hence by owner; stable: a token's pairs keep their order
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=shard.num_experts).view(shard.ep, shard.local)
    # (2) row j of `received`: how many pairs rank j sends to each of this rank's experts
    received = exchange_counts(counts, shard.group)
    send_splits = counts.sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    # (3) to the owners
    arrived = all_to_all_rows(rows_in(order), recv_splits, send_splits, shard.group)
    # (4) the local experts, each arrived row with its local expert id
    local_ids = torch.arange(shard.local, device=ids.device).repeat(shard.ep)
    local_ids = local_ids.repeat_interleave(received.reshape(-1))
    computed = local(arrived, local_ids)
    # (5) back to the senders, in pair order
    returned = all_to_all_rows(computed, send_splits, recv_splits, shard.group)
    return returned[torch.argsort(order)]


def register() -> None:
    """Make `IMPLEMENTATION` an experts implementation transformers can dispatch to."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = expert_parallel_forward
