"""Giving a meta-built stage real storage: exact initialization replay, or its shard of an HF safetensors checkpoint."""
