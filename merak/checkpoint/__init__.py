"""Merak checkpoints: per-rank shard files, directories, validation and HF-format export."""
