"""Expert parallelism: each MoE layer's experts split over ep of a stage's dp x cp replicas,
tokens exchanged by all-to-all (docs/expert-parallel.md)."""

from merak.expert_parallel.dispatch import IMPLEMENTATION, expert_parallel_forward
from merak.expert_parallel.shard import expert_parameters, experts_modules, shard_experts

__all__ = ["IMPLEMENTATION", "expert_parallel_forward", "expert_parameters", "experts_modules",
           "shard_experts"]
