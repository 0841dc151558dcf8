"""Activation recomputation: checkpointed blocks rerun as a schedule action, the activation
meter, and the stage-aware planner that chooses how many blocks each stage recomputes."""
