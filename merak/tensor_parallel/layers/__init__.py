"""The tensor-parallel modules: Megatron-style layers and collectives, wrappers for other modules,
sequence parallelism, dropout randomness, LoRA adapters sharded like their layer."""
