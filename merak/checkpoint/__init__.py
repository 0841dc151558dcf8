"""Merak checkpoints: weights and optimizer state on torch.distributed.checkpoint, their
directories, validation and HF-format export."""
