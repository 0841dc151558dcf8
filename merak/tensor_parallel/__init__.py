"""Tensor parallelism: Megatron-style layers, per-family plans, sequence parallelism."""
