"""Activation recomputation: blocks whose activations are dropped and rerun as a schedule action,
the activation meter, and the stage-aware choice of how many blocks each stage recomputes."""
