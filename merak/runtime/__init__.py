"""The pipeline runtime: the split and its stages, one runner per local stage, the one
interpreter that walks a rank's program, point-to-point transfers under NCCL's rules, and the
per-step tail (tied and data-parallel gradient reduction, optimizer step)."""
