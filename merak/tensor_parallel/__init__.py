"""Tensor parallelism: Megatron-style layers, per-family plans, sequence parallelism.

Sub-packages, top to bottom (each imports only from those below it): `apply` (a model's plan
chosen, inferred, converted in), `tracing` (blocks traced op by op, shard layouts followed, plans
proven) beside `overlap` (all-reduces behind compute), `layers` (the tensor-parallel modules),
`plans` (what a plan says)."""
