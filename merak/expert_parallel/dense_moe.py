"""Expert parallelism for MoE blocks written outside transformers' experts interface: Llama-4's
``Llama4TextMoe``.

Llama-4's block runs every expert on every token: expert e gets ``score[t, e] * x_t`` for each
token t, where the router's score is its sigmoid at the top-k experts and 0 elsewhere, and the
block sums the E outputs (plus its shared expert). Its experts have no bias, so an expert given
a zero row returns a zero row, and only the top-k (token, expert) pairs contribute. Under ep the
block's forward is replaced, on the instance, by the same sum over those pairs only: each pair's
scaled row goes to the rank that owns its expert (`dispatch.run_routed`), runs there, comes back
and the k results are summed. Its router and shared expert run unchanged on this rank's rows.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from merak.expert_parallel.dispatch import ExpertShard, run_routed

DENSE_MOE_BLOCKS = ("Llama4TextMoe",)  # class names: blocks with an ``experts`` module of E


def dense_moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: block}`` of every block of `model` that `DENSE_MOE_BLOCKS` names."""
    return {name: m for name, m in model.named_modules()
            if type(m).__name__ in DENSE_MOE_BLOCKS}


def route_block(block: nn.Module, shard: ExpertShard) -> None:
    """Run `block` (its experts already this rank's, ``block.experts.merak_ep`` = `shard`)
    over its routed pairs only, by all-to-all."""
    block.experts.merak_ep = shard
    block.forward = types.MethodType(_routed_forward, block)
    # called as a module, so what wraps it (ZeRO-2/3's FSDP2 unit: its experts gathered
    # before, resharded after) sees the call
    block.experts.forward = types.MethodType(_local_experts, block.experts)


def _local_experts(experts: nn.Module, rows: torch.Tensor, local_ids: torch.Tensor
                   ) -> torch.Tensor:
    """This rank's experts (``gate_up_proj [E/ep, H, 2I]``, ``down_proj [E/ep, I, H]``) each
    over the rows that arrived for it: the experts module's forward under ep."""
    out = rows.new_zeros(rows.shape[0], experts.down_proj.shape[-1])
    for e in range(experts.gate_up_proj.shape[0]):
        picked = (local_ids == e).nonzero().squeeze(1)
        gate, up = (rows.index_select(0, picked) @ experts.gate_up_proj[e]).chunk(2, dim=-1)
        out = out.index_add(0, picked, (up * experts.act_fn(gate)) @ experts.down_proj[e])
    return out


def _routed_forward(self: nn.Module, hidden_states: torch.Tensor):
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden)
    top = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own choice
    scaled = hidden[:, None, :] * router_scores.gather(1, top)[..., None]  # [T, K, H]
    pairs = run_routed(self.experts.merak_ep, top.reshape(-1),
                       lambda order: scaled.reshape(-1, self.hidden_dim)[order],
                       lambda rows, ids: self.experts(rows, ids))
    out = self.shared_expert(hidden)
    out.add_(pairs.view(*top.shape, -1).sum(dim=1))
    return out, router_logits
